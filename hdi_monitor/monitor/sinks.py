"""Sinks turn measurement results into scalars, images, histograms and text.

A sink only writes; it computes nothing. `TensorBoardSink` wraps a
``torch.utils.tensorboard.SummaryWriter`` (or a Lightning ``TensorBoardLogger``'s ``experiment``)
and writes everything. `LoggerSink` wraps any Lightning logger (CSV, W&B, MLflow, ...) and
receives the scalars through ``log_metrics``. `MemorySink` keeps everything in lists, for
tests and notebooks.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from hdi_monitor.monitor._dashboard import Layout

__all__ = ["Sink", "TensorBoardSink", "LoggerSink", "MemorySink", "layout_proto", "Image", "takes_pictures"]

#: An image: a ``(3, height, width)`` uint8 tensor (CHW) or encoded PNG bytes.
Image = Tensor | bytes


@runtime_checkable
class Sink(Protocol):
    """What the tracker writes to. Every method may be a no-op."""

    def log_scalars(self, scalars: dict[str, float], step: int) -> None: ...

    def log_images(self, images: dict[str, Image], step: int) -> None: ...

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None: ...

    def log_text(self, tag: str, text: str, step: int) -> None: ...

    def log_layout(self, layout: Layout) -> None: ...

    def flush(self) -> None: ...


def layout_proto(layout: Layout) -> Any:
    """A `Layout` (plain data) as TensorBoard's Custom Scalars ``Layout`` protocol buffer.

    ``SummaryWriter.add_custom_scalars`` takes one series per margin chart and no collapsed
    categories; this builds the buffer directly, with both.
    """
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for category in layout["categories"]:
        charts = []
        for chart in category["charts"]:
            if "margin" in chart:
                series = [
                    layout_pb2.MarginChartContent.Series(value=v, lower=lo, upper=hi) for v, lo, hi in chart["margin"]
                ]
                charts.append(
                    layout_pb2.Chart(title=chart["title"], margin=layout_pb2.MarginChartContent(series=series))
                )
            else:
                content = layout_pb2.MultilineChartContent(tag=list(chart["multiline"]))
                charts.append(layout_pb2.Chart(title=chart["title"], multiline=content))
        categories.append(layout_pb2.Category(title=category["title"], chart=charts, closed=category["closed"]))
    return layout_pb2.Layout(category=categories)


def _layout_summary(layout: Layout) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    tensor = TensorProto(
        dtype="DT_STRING", string_val=[layout_proto(layout).SerializeToString()], tensor_shape=TensorShapeProto()
    )
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    return Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor, metadata=metadata)])


def _image_summary(tag: str, png: bytes) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = struct.unpack(">II", png[16:24])  # the PNG header chunk: size, then colour type
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(png[25], 3)
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=png)
    return Summary(value=[Summary.Value(tag=tag, image=image)])


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

    def log_images(self, images: dict[str, Image], step: int) -> None:
        for tag, image in images.items():
            if isinstance(image, bytes):
                file_writer = getattr(self.writer, "_get_file_writer", None)
                if callable(file_writer):  # torch's SummaryWriter: write the PNG as it is
                    file_writer().add_summary(_image_summary(tag, image), global_step=step)
                    continue
                image = _decode_png(image)
            self.writer.add_image(tag, image, global_step=step, dataformats="CHW")

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        for tag, value in values.items():
            if value.numel():
                self.writer.add_histogram(tag, value, global_step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def log_layout(self, layout: Layout) -> None:
        if self._layout_written:  # once per writer: TensorBoard keeps only one layout
            return
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if not callable(file_writer):
            raise TypeError(
                f"{type(self.writer).__name__} has no _get_file_writer(); the Custom Scalars layout needs "
                "torch.utils.tensorboard.SummaryWriter"
            )
        file_writer().add_summary(_layout_summary(layout))
        self._layout_written = True

    def flush(self) -> None:
        self.writer.flush()


def _decode_png(png: bytes) -> Tensor:
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(png)) as picture:
        rgb = torch.frombuffer(bytearray(picture.convert("RGB").tobytes()), dtype=torch.uint8)
        return rgb.reshape(picture.height, picture.width, 3).permute(2, 0, 1).contiguous()


class LoggerSink:
    """Send scalars to a Lightning logger through ``log_metrics`` (CSV, W&B, MLflow, ...).

    Images, histograms and layouts are left to `TensorBoardSink`; text events become no
    scalars here (the warning itself still reaches the user). It takes no pictures
    (``takes_pictures = False``), so the picture worker never calls it: every call to the logger,
    ``save()`` included, is made on the training thread, as Lightning's own (a ``CSVLogger``
    rewritten from two threads at once corrupts its file).
    """

    #: Whether the picture worker writes to this sink (the subclasses that draw set True).
    takes_pictures = False

    def __init__(self, logger: Any) -> None:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(f"logger must have a log_metrics(metrics, step) method, got {type(logger).__name__}")
        self.logger = logger

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if scalars:
            self.logger.log_metrics(dict(scalars), step=step)

    def log_images(self, images: dict[str, Image], step: int) -> None:
        pass

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def log_layout(self, layout: Layout) -> None:
        pass

    def flush(self) -> None:
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


def takes_pictures(sink: Any) -> bool:
    """Whether the picture worker writes a job's images and histograms to ``sink`` (True unless the
    sink says ``takes_pictures = False``)."""
    return bool(getattr(sink, "takes_pictures", True))


class MemorySink:
    """Keep everything written, in lists of ``(step, tag, value)``; for tests and notebooks."""

    def __init__(self) -> None:
        self.scalars: list[tuple[int, str, float]] = []
        self.images: list[tuple[int, str, Image]] = []
        self.histograms: list[tuple[int, str, Tensor]] = []
        self.texts: list[tuple[int, str, str]] = []
        self.layouts: list[Layout] = []

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.scalars.extend((step, tag, value) for tag, value in scalars.items())

    def log_images(self, images: dict[str, Image], step: int) -> None:
        self.images.extend((step, tag, value) for tag, value in images.items())

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        self.histograms.extend((step, tag, value) for tag, value in values.items())

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((step, tag, text))

    def log_layout(self, layout: Layout) -> None:
        self.layouts.append(layout)

    def flush(self) -> None:
        pass
