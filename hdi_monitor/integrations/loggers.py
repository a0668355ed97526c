"""Sinks for Lightning's loggers: the pictures reach W&B, MLflow and Comet too, not only TensorBoard.

Lightning's base ``Logger`` has no image API (Lightning issues #6720, #12183): through
``log_metrics`` a logger receives numbers only. Each logger that can hold pictures gets a sink that
uses its own API (the `hdi_monitor.monitor.sinks.Sink` protocol):

| logger | scalars | heatmaps (PNG) | principal-angle histograms | event texts |
|---|---|---|---|---|
| ``TensorBoardLogger`` | ``add_scalar`` | ``add_image`` | ``add_histogram`` | ``add_text`` |
| ``WandbLogger`` | ``log_metrics`` | ``log_image(key, images, step)`` | ``wandb.Histogram`` | ``log_text`` (a table, ``<tag>_text``) |
| ``MLFlowLogger`` | ``log_metrics`` | ``experiment.log_image(run_id, image, key=, step=)`` | JSON artifact per step | text artifact per step |
| ``CometLogger`` | ``log_metrics`` | ``experiment.log_image`` | ``experiment.log_histogram_3d`` | ``experiment.log_text`` |
| any other (CSV, ...) | ``log_metrics`` | - | - | - |

Loggers that take scalars only get a one-time `MonitoringWarning` naming what they miss. The Custom
Scalars layout is TensorBoard's alone. Every sink here is used on rank 0 only, like the loggers.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.monitor._warnings import warn
from hdi_monitor.monitor.sinks import Image, LoggerSink, Sink, TensorBoardSink

__all__ = ["CometSink", "MLflowSink", "WandbSink", "sink_for_logger", "sinks_for_loggers"]

_noted: set[str] = set()  # logger classes already told that they take scalars only


def _pil(image: Image) -> Any:
    """A PIL image from PNG bytes or a ``(3, H, W)`` uint8 tensor."""
    from PIL import Image as PILImage

    if isinstance(image, bytes):
        with PILImage.open(io.BytesIO(image)) as picture:
            picture.load()
            return picture.copy()
    array = image.detach().cpu().permute(1, 2, 0).contiguous().numpy()
    return PILImage.fromarray(array)


class _MetricsSink(LoggerSink):
    """Scalars through the logger's ``log_metrics`` (`LoggerSink`); the subclasses add the pictures."""

    takes_pictures = True


class WandbSink(_MetricsSink):
    """Write to a Lightning ``WandbLogger``: images with ``log_image``, histograms as
    ``wandb.Histogram``, texts as a one-row table (columns ``step``, ``message``) under
    ``<tag>_text`` (``diversity_events/collapse_text``: W&B keeps one type per key, and
    ``diversity_events/collapse`` is the event count).

    Args:
        logger: a ``lightning.pytorch.loggers.WandbLogger``.
    """

    def log_images(self, images: dict[str, Image], step: int) -> None:
        for tag, image in images.items():
            self.logger.log_image(key=tag, images=[_pil(image)], step=step)

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        import wandb

        histograms = {
            tag: wandb.Histogram(v.detach().double().cpu().tolist()) for tag, v in values.items() if v.numel()
        }
        if histograms:
            self.logger.log_metrics(histograms, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.logger.log_text(key=f"{tag}_text", columns=["step", "message"], data=[[str(step), text]], step=step)


class MLflowSink(_MetricsSink):
    """Write to a Lightning ``MLFlowLogger``: images with ``MlflowClient.log_image(run_id, image,
    key=tag, step=step)`` (MLflow's stepped images), histograms as JSON artifacts
    ``histograms/<tag>/step_<step>.json`` (the angles in degrees; MLflow has no histogram type), event
    texts as ``text/<tag>/step_<step>.md``.

    Args:
        logger: a ``lightning.pytorch.loggers.MLFlowLogger``.
    """

    def log_images(self, images: dict[str, Image], step: int) -> None:
        client, run_id = self.logger.experiment, self.logger.run_id
        for tag, image in images.items():
            client.log_image(run_id, _pil(image), key=tag, step=step)

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        client, run_id = self.logger.experiment, self.logger.run_id
        for tag, value in values.items():
            if value.numel():
                data = {"step": step, "unit": "degrees", "values": value.detach().double().cpu().tolist()}
                client.log_dict(run_id, data, f"histograms/{tag}/step_{step:08d}.json")

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.logger.experiment.log_text(self.logger.run_id, text, f"text/{tag}/step_{step:08d}.md")


class CometSink(_MetricsSink):
    """Write to a Lightning ``CometLogger``: ``experiment.log_image``, ``log_histogram_3d`` and
    ``log_text`` (with the tag in the metadata).

    Args:
        logger: a ``lightning.pytorch.loggers.CometLogger``.
    """

    def log_images(self, images: dict[str, Image], step: int) -> None:
        for tag, image in images.items():
            self.logger.experiment.log_image(_pil(image), name=tag, step=step)

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        for tag, value in values.items():
            if value.numel():
                self.logger.experiment.log_histogram_3d(value.detach().double().cpu().numpy(), name=tag, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.logger.experiment.log_text(text, step=step, metadata={"tag": tag})


def sink_for_logger(logger: Any) -> Sink | None:
    """The sink that writes everything ``logger`` can hold: `TensorBoardSink` for a
    ``TensorBoardLogger`` (its ``experiment``), `WandbSink`, `MLflowSink`, `CometSink`, and
    `LoggerSink` (scalars only, with a one-time `MonitoringWarning` per logger class) for any other
    logger with ``log_metrics``. None for Lightning's ``DummyLogger`` (``fast_dev_run``), which
    writes nothing."""
    from lightning.pytorch.loggers import CometLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    from lightning.pytorch.loggers.logger import DummyLogger

    if isinstance(logger, DummyLogger):
        return None
    if isinstance(logger, TensorBoardLogger):
        return TensorBoardSink(logger.experiment)
    if isinstance(logger, WandbLogger):
        return WandbSink(logger)
    if isinstance(logger, MLFlowLogger):
        return MLflowSink(logger)
    if isinstance(logger, CometLogger):
        return CometSink(logger)
    name = type(logger).__name__
    if name not in _noted:
        _noted.add(name)
        warn(
            f"hdi-monitor: {name} takes scalars only; the heatmaps, principal-angle histograms and event texts "
            "go to TensorBoard, W&B, MLflow or Comet loggers (add one to the Trainer's loggers to get them).",
            MonitoringWarning,
            rank_zero_only=True,
        )
    return LoggerSink(logger)


def sinks_for_loggers(loggers: Iterable[Any]) -> list[Sink]:
    """One sink per logger (see `sink_for_logger`)."""
    return [sink for logger in loggers if (sink := sink_for_logger(logger)) is not None]
