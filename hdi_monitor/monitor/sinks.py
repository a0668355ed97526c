"""Sinks turn measurement results into scalars, images, histograms and text.

A sink only writes; it computes nothing. `TensorBoardSink` wraps a
``torch.utils.tensorboard.SummaryWriter`` (or a Lightning ``TensorBoardLogger``'s ``experiment``)
and writes everything. `LoggerSink` wraps any Lightning logger (CSV, W&B, MLflow, ...) and
receives the scalars through ``log_metrics``. `MemorySink` keeps everything in lists, for
tests and notebooks.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Sink", "TensorBoardSink", "LoggerSink", "MemorySink", "custom_scalars_layout"]


@runtime_checkable
class Sink(Protocol):
    """What the tracker writes to. Every method may be a no-op."""

    def log_scalars(self, scalars: dict[str, float], step: int) -> None: ...

    def log_images(self, images: dict[str, Tensor], step: int) -> None: ...

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None: ...

    def log_text(self, tag: str, text: str, step: int) -> None: ...

    def log_layout(self, layout: dict[str, dict[str, list[Any]]]) -> None: ...

    def flush(self) -> None: ...


def custom_scalars_layout(
    layer_names: dict[str, list[str]], *, activations: bool
) -> dict[str, dict[str, list[Any]]]:
    """TensorBoard Custom Scalars layout: one chart per projection with every layer and the chance level.

    Args:
        layer_names: projection -> names of the layers measured for it.
        activations: add the effective-heads and head-correlation charts.

    Tags in a layout are regular expressions, so layer names are escaped.
    """
    hdi: dict[str, list[Any]] = {}
    for projection, names in layer_names.items():
        layers = "|".join(re.escape(n) for n in names) or "$^"
        hdi[f"HDI ({projection})"] = [
            "Multiline",
            [
                f"^hdi/{re.escape(projection)}/({layers})$",
                f"^hdi/{re.escape(projection)}/mean$",
                f"^hdi_chance/{re.escape(projection)}$",
            ],
        ]
    layout: dict[str, dict[str, list[Any]]] = {"HDI per layer": hdi}
    if activations:
        layout["Head outputs"] = {
            "effective heads": ["Multiline", [r"^effective_heads/.*"]],
            "mean head correlation": ["Multiline", [r"^head_correlation/.*"]],
        }
    layout["Diversity events"] = {"events": ["Multiline", [r"^diversity_events/.*"]]}
    # dead or non-finite heads per projection and layer (0 on every measured step when healthy)
    layout["Head health"] = {
        f"invalid heads ({projection})": ["Multiline", [f"^invalid_heads/{re.escape(projection)}/.*"]]
        for projection in layer_names
    }
    return layout


class TensorBoardSink:
    """Write to a TensorBoard ``SummaryWriter``.

    Args:
        writer: a ``SummaryWriter`` (``TensorBoardLogger.experiment`` is one).
    """

    def __init__(self, writer: Any) -> None:
        for method in ("add_scalar", "add_image", "add_histogram", "add_text", "add_custom_scalars"):
            if not callable(getattr(writer, method, None)):
                raise TypeError(f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}")
        self.writer = writer
        self._layout_written = False

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def log_images(self, images: dict[str, Tensor], step: int) -> None:
        for tag, image in images.items():
            self.writer.add_image(tag, image, global_step=step, dataformats="CHW")

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        for tag, value in values.items():
            if value.numel():
                self.writer.add_histogram(tag, value, global_step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def log_layout(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        if not self._layout_written:  # once per writer: TensorBoard keeps only one layout
            self.writer.add_custom_scalars(layout)
            self._layout_written = True

    def flush(self) -> None:
        self.writer.flush()


class LoggerSink:
    """Send scalars to a Lightning logger through ``log_metrics`` (CSV, W&B, MLflow, ...).

    Images, histograms and layouts are left to `TensorBoardSink`; text events become no
    scalars here (the warning itself still reaches the user).
    """

    def __init__(self, logger: Any) -> None:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(f"logger must have a log_metrics(metrics, step) method, got {type(logger).__name__}")
        self.logger = logger

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self.logger.log_metrics(dict(scalars), step=step)

    def log_images(self, images: dict[str, Tensor], step: int) -> None:
        pass

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def log_layout(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        pass

    def flush(self) -> None:
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


class MemorySink:
    """Keep everything written, in lists of ``(step, tag, value)``; for tests and notebooks."""

    def __init__(self) -> None:
        self.scalars: list[tuple[int, str, float]] = []
        self.images: list[tuple[int, str, Tensor]] = []
        self.histograms: list[tuple[int, str, Tensor]] = []
        self.texts: list[tuple[int, str, str]] = []
        self.layouts: list[dict[str, dict[str, list[Any]]]] = []

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.scalars.extend((step, tag, value) for tag, value in scalars.items())

    def log_images(self, images: dict[str, Tensor], step: int) -> None:
        self.images.extend((step, tag, value) for tag, value in images.items())

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        self.histograms.extend((step, tag, value) for tag, value in values.items())

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((step, tag, text))

    def log_layout(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        self.layouts.append(layout)

    def flush(self) -> None:
        pass
