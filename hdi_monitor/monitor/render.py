"""The dashboard pictures, encoded straight from the tensors: no figure, no matplotlib.

Every picture is a grid of coloured cells with a few labels:

* **Colour.** A value ``v`` on the fixed scale ``[vmin, vmax]`` is entry
  ``round(255 * (v - vmin) / (vmax - vmin))`` (clipped to 0..255, ties to even) of a 256-entry uint8
  colour table (`colour_table`: matplotlib's ``viridis`` for overlaps on [0, 1], ``RdBu_r`` for
  correlations on [-1, 1]; kept as data in `hdi_monitor.monitor._colormaps`). The diversity map is
  diverging around the chance level ``c`` (white): ``v <= c`` is entry ``round(127.5 * v / c)`` of
  ``RdBu`` (red below chance), ``v > c`` entry ``round(127.5 + 127.5 * (v - c) / (1 - c))`` (blue
  above it). The scale never follows the data, so pictures of different steps and runs compare.
* **NaN** cells (an invalid head's row and column; a layer not measured at a step) are mid grey
  `NAN_RGB`, a colour that neither table holds (every table entry is at least 80 apart from it in
  RGB), and each picture's legend says so.
* **Cells** are upscaled by whole pixels (nearest neighbour), with a 1-pixel white line between cells
  when they are 6 pixels or more; tiles (one per layer) have a thin grey border.
* **Labels** (title, layer, head indices, measured steps, colour bar and its scale) are pasted from
  glyphs of Pillow's default font rendered once and cached, so a picture costs array copies and one
  PNG encoding (Pillow, a palette PNG with exactly the colours used, fast zlib level): milliseconds
  per image, not a matplotlib figure's hundreds (`benchmarks/bench_dashboard.py` measures it).

Sizes: TensorBoard's Images tab shows every image at the width of its card, `CARD_PX` = 350 px
(tensorboard 2.21: the card is 350 px wide and its image ``width: 100%`` with ``image-rendering:
pixelated``), whatever the image's own size; "Show actual image size" shows every pixel. A wider
image is shrunk there by dropping rows and columns of pixels, which garbles 11-13 px text and makes
cell borders uneven. So the pictures are drawn 350 px wide whenever their content fits, and show pixel for
pixel at the default card size; within that width a tiled image's matrices grow to fill it (an
about square grid of tiles, cells of a whole number of pixels, up to `MAX_CELL_PX`): two layers of
4 heads give 35 px cells, one layer 64 px cells. Every picture is at least `MIN_SIDE_PX` = 256 px
on its short side. The PNGs carry no data payload: what a picture shows is in the measurement
record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hdi_monitor.monitor._canvas import (
    _BLACK,
    _BORDER,
    FONT_PX,
    NAN_RGB,
    SMALL_PX,
    _bar,
    _blocks,
    _Canvas,
    _cells,
    _fit,
    _line_height,
    _nan_legend,
    _number,
    _text_width,
    _tick_positions,
    _wrap,
    layer_labels,
)
from hdi_monitor.monitor._colormaps import TABLES

__all__ = [
    "CARD_PX",
    "MIN_SIDE_PX",
    "MAX_CELL_PX",
    "NAN_RGB",
    "colour_table",
    "colour_indices",
    "colorbar_lut",
    "heatmap",
    "diversity_map",
    "tiled_heatmaps",
    "layer_labels",
    "ImageJob",
    "MapPanel",
    "TilePanel",
    "render_job",
    "Renderer",
]

#: Width of a picture whose content fits: TensorBoard's Images-tab card (tensorboard 2.21's
#: ``tf-image-loader`` is 350 px wide and draws its image at ``width: 100%``, pixelated), so that a
#: picture shows there pixel for pixel.
CARD_PX = 350
#: Shortest side of a dashboard picture, in pixels.
MIN_SIDE_PX = 256
#: Largest cell of a tiled matrix, in pixels (a lone matrix of 4 heads is then 259 px).
MAX_CELL_PX = 64
#: Most tiles per row of a tiled image by default (the grid is about square up to 16 tiles).
_DEFAULT_COLUMNS = 4


# ---------------------------------------------------------------- colour


@lru_cache(maxsize=8)
def colour_table(name: str) -> np.ndarray:
    """A ``(256, 3)`` uint8 colour table (read-only): ``"viridis"``, ``"RdBu"`` or ``"RdBu_r"``
    (``RdBu`` reversed: red for high values)."""
    base = name[:-2] if name.endswith("_r") else name
    if base not in TABLES:
        known = sorted([*TABLES, *(f"{n}_r" for n in TABLES)])
        raise ValueError(f"unknown colour table {name!r}; known: {', '.join(known)}")
    table = np.frombuffer(bytes.fromhex(TABLES[base]), dtype=np.uint8).reshape(256, 3)
    table = table[::-1].copy() if base != name else table.copy()
    table.setflags(write=False)
    return table


def colorbar_lut(cmap: str = "viridis") -> Tensor:
    """`colour_table` as a ``(256, 3)`` uint8 tensor."""
    return torch.from_numpy(colour_table(cmap).copy())


def colour_indices(values: Any, *, vmin: float, vmax: float, centre: float | None = None) -> np.ndarray:
    """Table entries of ``values`` (int16, -1 where NaN) on the fixed scale ``[vmin, vmax]``.

    Args:
        values: numbers (a tensor or an array of any shape).
        vmin, vmax: the scale; values outside it take the end colours.
        centre: for a diverging table, the value that takes the middle of the table (127.5):
            ``[vmin, centre]`` spans its lower half and ``[centre, vmax]`` its upper half.
    """
    if not vmax > vmin:
        raise ValueError(f"vmax must exceed vmin, got vmin={vmin}, vmax={vmax}")
    if centre is not None and not vmin < centre < vmax:
        raise ValueError(f"centre must lie strictly between vmin and vmax, got {centre}")
    x = values.detach().to("cpu", torch.float64).numpy() if isinstance(values, Tensor) else np.asarray(values, float)
    with np.errstate(invalid="ignore"):
        if centre is None:
            t = (x - vmin) / (vmax - vmin)
        else:
            t = np.where(x <= centre, 0.5 * (x - vmin) / (centre - vmin), 0.5 + 0.5 * (x - centre) / (vmax - centre))
    index = np.rint(np.clip(t, 0.0, 1.0) * 255.0)
    return np.where(np.isnan(x), -1, np.nan_to_num(index)).astype(np.int16)


def heatmap(
    matrix: Tensor,
    *,
    vmin: float = 0.0,
    vmax: float = 1.0,
    cmap: str = "viridis",
    cell: int | None = None,
    geometry: dict[str, Any] | None = None,
) -> Tensor:
    """One ``(n, m)`` matrix as an RGB image with its row and column indices (the HTML report's pictures).

    Args:
        matrix: 2-D real tensor (any device; copied to the CPU).
        vmin, vmax: the fixed colour scale (see the module docstring); values are clipped to it.
        cmap: a `colour_table` name (``"viridis"`` for overlaps in [0, 1], ``"RdBu_r"`` for
            correlations in [-1, 1]).
        cell: pixels per cell; default about 256 px for the whole matrix (at least 4 per cell).
        geometry: if given, filled with ``left``, ``top`` (the first cell's top-left pixel) and
            ``pitch`` (cell ``(i, j)`` starts at ``(left + j * pitch, top + i * pitch)``).

    Returns:
        ``(3, height, width)`` uint8 tensor (CHW, what ``SummaryWriter.add_image`` expects).
    """
    if not isinstance(matrix, Tensor) or matrix.ndim != 2:
        raise ValueError(f"matrix must be a 2-D tensor, got {getattr(matrix, 'shape', type(matrix))}")
    n, m = matrix.shape
    if cell is None:
        cell = max(4, 256 // max(n, m, 1))
    gap = 1 if cell >= 6 else 0
    body = _blocks(_cells(colour_indices(matrix, vmin=vmin, vmax=vmax)), cell, cell, gap, gap)
    pitch = cell + gap
    left = _text_width(str(max(n - 1, 0)), SMALL_PX) + 3
    top = _line_height(SMALL_PX)
    canvas = _Canvas(left + body.shape[1] + 2, top + body.shape[0] + 2, colour_table(cmap))
    canvas.paste(left + 1, top + 1, body)
    rows = _tick_positions(n, slots=max(2, n * pitch // (_line_height(SMALL_PX) + 2)))
    cols = _tick_positions(m, slots=max(2, m * pitch // (_text_width(str(m - 1), SMALL_PX) + 4)))
    for i in rows:
        canvas.text(left - 2, top + 1 + i * pitch + cell // 2, str(i), size=SMALL_PX, align="right", middle=True)
    for j in cols:
        canvas.text(left + 1 + j * pitch + cell // 2, 0, str(j), size=SMALL_PX, align="centre")
    if geometry is not None:
        geometry.update(left=left + 1, top=top + 1, pitch=pitch, cell=cell)
    return torch.from_numpy(canvas.rgb()).permute(2, 0, 1).contiguous()


def diversity_map(
    values: Tensor,
    *,
    layers: Sequence[str],
    steps: Sequence[int],
    chance: float,
    title: str,
    geometry: dict[str, Any] | None = None,
) -> bytes:
    """HDI by layer (rows) and measured step (columns) as a PNG, on the fixed scale [0, 1].

    The colour scale is diverging around the chance level (white): red below chance (heads more
    alike than random ones), blue above it (see the module docstring); it does not follow the data,
    so maps of different runs and steps compare. Missing values (a layer not measured at a step)
    are grey. Rows are labelled with the layers' short names (the common part is in the subtitle),
    thinned at many layers; columns with measured steps, thinned too.

    Args:
        values: ``(layers, steps)`` HDI values, NaN where missing.
        layers: row names, top to bottom.
        steps: column steps, left to right.
        chance: the chance level (white), in (0, 1).
        title: the picture's title.
        geometry: if given, filled with ``body_px`` (left, top, right, bottom: the pixel box of the
            map's cells) and ``pitch`` (column and row pitch in pixels; cell ``(i, j)`` starts at
            ``(left + j * pitch[0], top + i * pitch[1])``) and ``cell`` (its width and height).

    Returns:
        PNG bytes.
    """
    values = values.detach().to("cpu", torch.float64)
    if values.ndim != 2 or values.shape != (len(layers), len(steps)):
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({len(layers)}, {len(steps)})")
    if not 0.0 < chance < 1.0:
        raise ValueError(f"chance must lie in (0, 1), got {chance}")
    if not layers or not steps:
        raise ValueError("a diversity map needs at least one layer and one measured step")
    n_rows, n_cols = values.shape
    row_h = min(40, max(3, 320 // max(n_rows, 1)))
    row_gap = int(row_h >= 8)
    body_h = n_rows * row_h - row_gap
    line = _line_height(FONT_PX)
    labels, pattern = layer_labels(list(layers))
    shown_rows = _tick_positions(n_rows, slots=max(2, body_h // (line + 1)))
    row_text = {i: _fit(labels[i], 160) for i in shown_rows}
    left = 8 + max(_text_width(t) for t in row_text.values()) + 6
    bar_labels = [("1", 0), (f"chance {chance:.3f}", 0.5), ("0", 1)]
    beside = 16 + 14 + 4 + max(_text_width(t) for t, _ in bar_labels) + 8  # the colour bar and its labels
    # columns of whole pixels that fill the card's width (at least 1 px: many steps make it wider)
    col_w = min(96, max(1, (CARD_PX - left - beside) // n_cols))
    col_gap = int(col_w >= 8)
    cells = _cells(colour_indices(values, vmin=0.0, vmax=1.0, centre=chance))
    body = _blocks(cells, row_h - row_gap, col_w - col_gap, row_gap, col_gap)
    body_w = body.shape[1]
    bar_x = left + body_w + 16
    width = max(left + body_w + beside, CARD_PX)
    heading = _wrap(title, width - 16) + ([f"rows: {pattern}"] if pattern else [])
    top = 6 + line * len(heading) + 8
    below = 6 + line + 2 + line + 6 + SMALL_PX + 8  # step labels, axis title, NaN legend
    bar_h = max(body_h, 120, MIN_SIDE_PX - top - below)
    height = top + max(body_h, bar_h) + below
    canvas = _Canvas(width, height, colour_table("RdBu"))
    for k, text in enumerate(heading):
        canvas.text(8, 6 + k * line, text)
    canvas.paste(left, top, body)
    canvas.box(left, top, body_w, body_h)
    pitch_x, pitch_y = col_w, row_h
    for i, text in row_text.items():
        canvas.text(left - 6, top + i * pitch_y + (row_h - row_gap) // 2, text, align="right", middle=True)
    axis_y = top + body_h + 4
    step_slots = max(2, body_w // max(_text_width(str(max(steps, default=0))) + 12, 1))
    for j in _tick_positions(n_cols, slots=step_slots):
        x = left + j * pitch_x + (col_w - col_gap) // 2
        canvas.index[top + body_h + 1 : axis_y, x] = _BORDER
        canvas.text(x, axis_y, str(steps[j]), align="centre")
    canvas.text(left + body_w // 2, axis_y + line + 2, "measured step", align="centre")
    # the colour bar: table entries 255 (top) to 0 (bottom), chance in the middle
    canvas.paste(bar_x, top, np.repeat(_bar(bar_h)[::-1, None], 14, axis=1))
    canvas.box(bar_x, top, 14, bar_h)
    for text, where in bar_labels:
        y = top + round(where * (bar_h - 1))
        canvas.index[y, bar_x + 14 : bar_x + 18] = _BLACK
        canvas.text(bar_x + 20, y, text, middle=True)
    _nan_legend(canvas, 8, height - SMALL_PX - 8, "not measured at that step")
    if geometry is not None:
        geometry["body_px"] = [left, top, left + body_w, top + body_h]
        geometry["pitch"] = (pitch_x, pitch_y)
        geometry["cell"] = (col_w - col_gap, row_h - row_gap)
    return canvas.png()


def tiled_heatmaps(
    matrices: Sequence[Tensor],
    *,
    titles: Sequence[str],
    vmin: float,
    vmax: float,
    cmap: str,
    title: str,
    colorbar_label: str,
    max_columns: int | None = None,
    width: int = CARD_PX,
    geometry: dict[str, Any] | None = None,
) -> bytes:
    """Several matrices (one per layer) in one PNG: a grid of tiles with one colour bar.

    Every tile has a caption (the first line of its title, the layer, shortened to what differs
    between the layers, the common part in the subtitle; then the rest, e.g. its HDI) and head
    indices along its edges; the colour scale is fixed (``vmin``/``vmax`` do not follow the data),
    NaN cells (invalid heads) are grey. The tiles fill ``width``: every cell is a block of the same
    whole number of pixels (nearest neighbour, 2 to `MAX_CELL_PX`), the largest that fits, so
    few layers of few heads are drawn large (2 layers of 4 heads: 35 px cells at 350 px) and many
    are drawn small; tiles that do not fit at 2 px per head make the picture wider. The picture is
    at least `MIN_SIDE_PX` high.

    Args:
        matrices: ``(H, H)`` matrices; sizes may differ between tiles.
        titles: one title per tile: the layer name, then (after a newline) what to say about it.
        vmin, vmax: the colour scale.
        cmap: a `colour_table` name.
        title: the picture's title.
        colorbar_label: what the colours mean (under the colour bar).
        max_columns: tiles per row; default: an about square grid (``ceil(sqrt(n))`` columns for
            ``n`` tiles), at most 4 to a row.
        width: the picture's width in pixels when the tiles fit (default `CARD_PX`, TensorBoard's
            Images-tab card).
        geometry: if given, filled with ``tiles``: per tile, the pixel ``(left, top)`` of its first
            cell, the cell ``pitch`` and ``cell`` size (cell ``(i, j)`` starts at
            ``(left + j * pitch, top + i * pitch)``).

    Returns:
        PNG bytes.
    """
    if not matrices:
        raise ValueError("tiled_heatmaps needs at least one matrix")
    if len(titles) != len(matrices):
        raise ValueError(f"{len(titles)} titles for {len(matrices)} matrices")
    if any(m.ndim != 2 for m in matrices):
        raise ValueError("every matrix must be 2-D")
    if max_columns is not None and max_columns < 1:
        raise ValueError(f"max_columns must be a positive integer, got {max_columns}")
    table = colour_table(cmap)
    indices = [_cells(colour_indices(m, vmin=vmin, vmax=vmax)) for m in matrices]
    heads = max(max(m.shape) for m in matrices)
    line, small = _line_height(FONT_PX), _line_height(SMALL_PX)
    index_w = _text_width(str(heads - 1), SMALL_PX) + 4
    n = len(matrices)
    ncols = min(n, max_columns if max_columns is not None else min(_DEFAULT_COLUMNS, math.ceil(math.sqrt(n))))
    nrows = math.ceil(n / ncols)
    col_gap, row_gap, margin = 12, 10, 8
    slot_w = (width - 2 * margin - (ncols - 1) * col_gap) // ncols
    cell = _cell_size(heads, slot_w - index_w - 2)
    gap = int(cell >= 6)
    pitch = cell + gap
    body = heads * pitch - gap
    slot_w = max(slot_w, index_w + body + 2)
    names = [t.split("\n", 1)[0] for t in titles]
    notes = [t.split("\n", 1)[1].replace("\n", " ") if "\n" in t else "" for t in titles]
    labels, pattern = layer_labels(names)
    captions = [[_fit(f"layer {lab}" if pattern else lab, slot_w + col_gap - 2)] for lab in labels]
    for caption, note in zip(captions, notes, strict=True):
        if note and _text_width(note) > slot_w + col_gap - 2 and note.endswith(")") and " (" in note:
            note = note[: note.rindex(" (")]  # the change since the last image step, when it does not fit
        if note:
            caption.append(_fit(note, slot_w + col_gap - 2, keep_end=False))
    caption_h = line * max(len(c) for c in captions)
    slot_h = caption_h + small + body + 2
    grid_w = ncols * slot_w + (ncols - 1) * col_gap
    width = max(margin * 2 + grid_w, width)
    heading = _wrap(title, width - 2 * margin) + ([f"tiles: {pattern}"] if pattern else [])
    top = margin + line * len(heading) + 6
    legend_h = 12 + 10 + 2 + small + 2 + line + 4 + small + margin
    height = max(top + nrows * slot_h + (nrows - 1) * row_gap + legend_h, MIN_SIDE_PX)
    canvas = _Canvas(width, height, table)
    for k, text in enumerate(heading):
        canvas.text(margin, margin + k * line, text)
    tiles = []
    for k, (index, caption) in enumerate(zip(indices, captions, strict=True)):
        x = margin + (k % ncols) * (slot_w + col_gap)
        y = top + (k // ncols) * (slot_h + row_gap)
        for j, text in enumerate(caption):
            canvas.text(x, y + j * line, text)
        rows, cols = index.shape
        x0, y0 = x + index_w + 1, y + caption_h + small + 1
        canvas.paste(x0, y0, _blocks(index, cell, cell, gap, gap))
        canvas.box(x0, y0, cols * pitch - gap, rows * pitch - gap)
        for i in _tick_positions(rows, slots=max(2, (rows * pitch) // (small + 1))):
            canvas.text(x0 - 3, y0 + i * pitch + cell // 2, str(i), size=SMALL_PX, align="right", middle=True)
        for j in _tick_positions(cols, slots=max(2, (cols * pitch) // (index_w - 1))):
            canvas.text(x0 + j * pitch + cell // 2, y0 - 1 - small, str(j), size=SMALL_PX, align="centre")
        tiles.append({"left": x0, "top": y0, "pitch": pitch, "cell": cell})
    # the colour bar under the grid: every table entry, left to right, and the scale
    bar_y = height - legend_h + 12
    bar_w = min(256, width - 2 * margin - 40)
    canvas.paste(margin + 20, bar_y, np.repeat(_bar(bar_w)[None], 10, axis=0))
    canvas.box(margin + 20, bar_y, bar_w, 10)
    for value, where in ((vmin, 0.0), ((vmin + vmax) / 2, 0.5), (vmax, 1.0)):
        x = margin + 20 + round(where * (bar_w - 1))
        canvas.index[bar_y + 11 : bar_y + 13, x] = _BLACK
        canvas.text(x, bar_y + 13, _number(value), size=SMALL_PX, align="centre")
    canvas.text(margin + 20, bar_y + 13 + small + 2, colorbar_label)
    _nan_legend(canvas, margin + 20, bar_y + 13 + small + 2 + line + 4, "invalid head (all-zero or non-finite)")
    if geometry is not None:
        geometry["tiles"] = tiles
    return canvas.png()


def _cell_size(heads: int, room: int) -> int:
    """The largest cell (whole pixels, 2 to `MAX_CELL_PX`) whose ``heads x heads`` block, with the
    1-pixel lines drawn between cells of 6 px or more, is at most ``room`` pixels wide; 2 when even
    that does not fit."""
    cell = min(MAX_CELL_PX, (room + 1) // heads - 1)  # with lines: heads * (cell + 1) - 1 <= room
    if cell < 6:
        cell = min(5, room // heads)  # without lines: heads * cell <= room
    return max(2, cell)


# ---------------------------------------------------------------- image jobs (drawn off the training step)


@dataclass(frozen=True)
class MapPanel:
    """A diversity map to draw (see `diversity_map`): CPU copies, owned by the job."""

    tag: str
    values: Tensor
    layers: tuple[str, ...]
    steps: tuple[int, ...]
    chance: float
    title: str


@dataclass(frozen=True)
class TilePanel:
    """A tiled heatmap image to draw (see `tiled_heatmaps`): CPU copies, owned by the job."""

    tag: str
    matrices: tuple[Tensor, ...]
    titles: tuple[str, ...]
    vmin: float
    vmax: float
    cmap: str
    title: str
    colorbar_label: str


@dataclass(frozen=True)
class ImageJob:
    """Everything the pictures of one image step need, copied on the training step (small
    tensors: ``H x H`` matrices, the map's ``layers x budget`` values, the angles) so that the
    drawing can run on another thread while training goes on.

    Attributes:
        step: the measured step.
        maps: diversity maps.
        tiles: tiled overlap and correlation images.
        histograms: principal-angle histograms, tag -> angles in degrees.
        late_histograms: histograms whose angles are still to be computed (from a CPU copy of
            the weights taken on the step, see `hdi_monitor.report.AngleWork`), computed on the
            worker; None when there are none.
    """

    step: int
    maps: tuple[MapPanel, ...] = ()
    tiles: tuple[TilePanel, ...] = ()
    histograms: Mapping[str, Tensor] = field(default_factory=dict)
    late_histograms: Callable[[], Mapping[str, Tensor]] | None = None

    @property
    def tags(self) -> list[str]:
        """The image tags this job draws."""
        return [m.tag for m in self.maps] + [t.tag for t in self.tiles]


#: A renderer: draws a job's images, tag -> PNG bytes (the default is `render_job`).
Renderer = Callable[[ImageJob], Mapping[str, bytes]]


def render_job(job: ImageJob) -> dict[str, bytes]:
    """The PNG images of a job (array copies and Pillow's encoder; thread-safe, no matplotlib)."""
    images: dict[str, bytes] = {}
    for m in job.maps:
        images[m.tag] = diversity_map(m.values, layers=m.layers, steps=m.steps, chance=m.chance, title=m.title)
    for t in job.tiles:
        images[t.tag] = tiled_heatmaps(
            t.matrices,
            titles=t.titles,
            vmin=t.vmin,
            vmax=t.vmax,
            cmap=t.cmap,
            title=t.title,
            colorbar_label=t.colorbar_label,
        )
    return images
