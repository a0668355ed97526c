"""Render matrices as pictures: small RGB heatmaps (no figure per call) and dashboard figures.

A heatmap is an ``(3, height, width)`` uint8 tensor: every matrix cell is a ``cell x cell`` block
coloured through a fixed colour scale (``vmin``/``vmax`` do not follow the data, so images from
different steps compare), with head indices drawn in a 3x5 pixel font along the top and left edges.
NaN cells (invalid heads) are grey. The work is a handful of tensor ops on the CPU; cost is about
that of a few H x H copies, so it is cheap enough to run every time images are logged.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "heatmap",
    "colorbar_lut",
    "diversity_map",
    "tiled_heatmaps",
    "ImageJob",
    "MapPanel",
    "TilePanel",
    "render_job",
    "Renderer",
]

# 3x5 bitmaps for the digits 0-9, one row per string, '#' = ink.
_DIGITS = (
    ("###", "#.#", "#.#", "#.#", "###"),
    (".#.", "##.", ".#.", ".#.", "###"),
    ("###", "..#", "###", "#..", "###"),
    ("###", "..#", "###", "..#", "###"),
    ("#.#", "#.#", "###", "..#", "..#"),
    ("###", "#..", "###", "..#", "###"),
    ("###", "#..", "###", "#.#", "###"),
    ("###", "..#", ".#.", ".#.", ".#."),
    ("###", "#.#", "###", "#.#", "###"),
    ("###", "#.#", "###", "..#", "###"),
)
_NAN_RGB = (128, 128, 128)
_BACKGROUND = 255


@lru_cache(maxsize=8)
def colorbar_lut(cmap: str = "viridis", size: int = 256) -> Tensor:
    """``(size, 3)`` uint8 lookup table of a matplotlib colour map (computed once per name)."""
    import matplotlib

    colors = matplotlib.colormaps[cmap](torch.linspace(0, 1, size).numpy())[:, :3]
    return torch.from_numpy((colors * 255).round()).to(torch.uint8)


@lru_cache(maxsize=1)
def _glyphs() -> Tensor:
    rows = [[[c == "#" for c in row] for row in digit] for digit in _DIGITS]
    return torch.tensor(rows, dtype=torch.bool)  # (10, 5, 3)


def _label(number: int) -> Tensor:
    """Bool ink mask ``(5, 4 * ndigits - 1)`` for a non-negative integer."""
    glyphs = _glyphs()
    parts = []
    for i, ch in enumerate(str(number)):
        if i:
            parts.append(torch.zeros(5, 1, dtype=torch.bool))
        parts.append(glyphs[int(ch)])
    return torch.cat(parts, dim=1)


def heatmap(
    matrix: Tensor,
    *,
    vmin: float = 0.0,
    vmax: float = 1.0,
    cmap: str = "viridis",
    cell: int | None = None,
) -> Tensor:
    """Render an ``(n, m)`` matrix as an RGB heatmap with row/column indices.

    Args:
        matrix: 2-D real tensor (any device; copied to CPU float32).
        vmin, vmax: the fixed colour scale; values are clipped to it.
        cmap: a matplotlib colour map name (``"viridis"`` for overlaps in [0, 1], ``"RdBu_r"`` for
            correlations in [-1, 1]).
        cell: pixels per cell; default grows for small matrices so labels fit (at least 8).

    Returns:
        ``(3, height, width)`` uint8 tensor (CHW, what ``SummaryWriter.add_image`` expects).
    """
    if not isinstance(matrix, Tensor) or matrix.ndim != 2:
        raise ValueError(f"matrix must be a 2-D tensor, got {getattr(matrix, 'shape', type(matrix))}")
    if not vmax > vmin:
        raise ValueError(f"vmax must exceed vmin, got vmin={vmin}, vmax={vmax}")
    n, m = matrix.shape
    label_width = 4 * len(str(max(n, m) - 1)) - 1
    if cell is None:
        cell = max(8, label_width + 2, 256 // max(n, m, 1))
    x = matrix.detach().to("cpu", torch.float32)
    lut = colorbar_lut(cmap)
    scaled = ((x - vmin) / (vmax - vmin)).clamp(0, 1).nan_to_num(0.0)
    idx = (scaled * (lut.shape[0] - 1)).round().long()
    rgb = lut[idx]  # (n, m, 3)
    rgb[torch.isnan(x)] = torch.tensor(_NAN_RGB, dtype=torch.uint8)
    body = rgb.repeat_interleave(cell, 0).repeat_interleave(cell, 1)  # (n*cell, m*cell, 3)

    margin = label_width + 3
    canvas = torch.full((margin + n * cell, margin + m * cell, 3), _BACKGROUND, dtype=torch.uint8)
    canvas[margin:, margin:] = body
    for j in range(m):  # column indices along the top
        ink = _label(j)
        x0 = margin + j * cell + (cell - ink.shape[1]) // 2
        y0 = (margin - 5) // 2
        canvas[y0 : y0 + 5, x0 : x0 + ink.shape[1]][ink] = 0
    for i in range(n):  # row indices along the left
        ink = _label(i)
        y0 = margin + i * cell + (cell - 5) // 2
        x0 = margin - 2 - ink.shape[1]
        canvas[y0 : y0 + 5, x0 : x0 + ink.shape[1]][ink] = 0
    return canvas.permute(2, 0, 1).contiguous()


# ---------------------------------------------------------------- dashboard figures (matplotlib, Agg)

#: Text size of every dashboard figure, in pixels at the figures' 100 dpi (10 pt = 13.9 px).
FONT_PT = 10.0
_DPI = 100


def _figure(width_in: float, height_in: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=_DPI)
    fig.patch.set_facecolor("white")
    return fig


def _png(fig: Any) -> bytes:
    """The figure as PNG bytes (Agg, no pyplot state), with no data payload: the bytes depend on
    the picture only, so they do not grow with the run.

    The picture is stored with a 256-colour palette: about 3.5 times smaller than RGBA for these
    figures (measured: 29 KiB -> 8 KiB for a diversity map), and event files keep every image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    picture = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    buffer = io.BytesIO()
    picture.quantize(256, method=Image.Quantize.FASTOCTREE).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _tick_positions(count: int, *, slots: int) -> list[int]:
    """About ``slots`` evenly spread indices of ``range(count)``: the first, and the last unless it crowds."""
    if count <= slots:
        return list(range(count))
    step = math.ceil((count - 1) / (slots - 1))
    picks = list(range(0, count, step))
    if count - 1 - picks[-1] >= step / 2:  # the last index too, unless it would crowd its neighbour
        picks.append(count - 1)
    return picks


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
    alike than random ones), blue above it; it does not follow the data, so maps of different runs
    and steps compare. Missing values (a layer not measured at a step) are grey. The PNG carries
    no data payload (its values are the record's, see `hdi_monitor.measure.measurement`).

    Args:
        values: ``(layers, steps)`` HDI values, NaN where missing.
        layers: row names, top to bottom.
        steps: column steps, left to right.
        chance: the chance level marked on the colour bar (white).
        title: the figure title.
        geometry: if given, filled with ``body_px``: the pixel box of the map body in the PNG
            (left, top, right, bottom), for tools that read pixels back.

    Returns:
        PNG bytes.
    """
    from matplotlib.colors import TwoSlopeNorm

    values = values.detach().to("cpu", torch.float64)
    if values.shape != (len(layers), len(steps)):
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({len(layers)}, {len(steps)})")
    if not 0.0 < chance < 1.0:
        raise ValueError(f"chance must lie in (0, 1), got {chance}")
    n_rows, n_cols = values.shape
    label_chars = max((len(n) for n in layers), default=1)
    left = min(0.09 * label_chars + 0.4, 3.2)  # inches for the row labels
    row_in = max(0.16, min(0.4, 4.0 / max(n_rows, 1)))  # each row at least 16 px high
    body_w = max(6.0, min(10.0, 0.12 * n_cols))
    width, height = left + body_w + 1.3, 1.2 + row_in * n_rows
    fig = _figure(width, height)
    ax = fig.add_axes((left / width, 0.75 / height, body_w / width, row_in * n_rows / height))
    cmap = matplotlib_cmap("RdBu").with_extremes(bad=tuple(c / 255 for c in _NAN_RGB))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=chance, vmax=1.0)
    image = ax.imshow(values.numpy(), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    rows = _tick_positions(n_rows, slots=max(2, int(row_in * n_rows * _DPI / 15)))
    ax.set_yticks(rows, [layers[i] for i in rows], fontsize=FONT_PT)
    cols = _tick_positions(n_cols, slots=max(2, int(body_w * 1.6)))
    ax.set_xticks(cols, [str(steps[j]) for j in cols], fontsize=FONT_PT)
    ax.set_xlabel("measured step", fontsize=FONT_PT)
    ax.set_title(title, fontsize=FONT_PT + 1, loc="left")
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, ticks=[0.0, chance, 1.0])
    bar.ax.set_yticklabels(["0", f"chance {chance:.2f}", "1"], fontsize=FONT_PT)
    bar.ax.axhline(chance, color="black", linewidth=1.0)
    if geometry is not None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig).draw()  # lay out first, so that the body's pixel box is final
        box = ax.get_window_extent()
        height_px = fig.bbox.height
        geometry["body_px"] = [box.x0, height_px - box.y1, box.x1, height_px - box.y0]
    return _png(fig)


def matplotlib_cmap(name: str) -> Any:
    """A matplotlib colour map by name."""
    import matplotlib

    return matplotlib.colormaps[name]


def tiled_heatmaps(
    matrices: Sequence[Tensor],
    *,
    titles: Sequence[str],
    vmin: float,
    vmax: float,
    cmap: str,
    title: str,
    colorbar_label: str,
    max_columns: int = 4,
) -> bytes:
    """Several square matrices (one per layer) in one PNG: a grid of tiles with a shared colour bar.

    Every tile has its own title and head indices along its edges; the colour scale is fixed
    (``vmin``/``vmax`` do not follow the data), NaN cells (dead heads) are grey. Text is 10 pt
    (14 px at the figure's 100 dpi) whatever the number of tiles.

    Args:
        matrices: ``(H, H)`` matrices; sizes may differ between tiles.
        titles: one title per tile (the layer name and its HDI, say).
        vmin, vmax: the colour scale.
        cmap: a matplotlib colour map name.
        title: the figure title.
        colorbar_label: the colour bar's label.
        max_columns: tiles per row.

    Returns:
        PNG bytes.
    """
    if not matrices:
        raise ValueError("tiled_heatmaps needs at least one matrix")
    if len(titles) != len(matrices):
        raise ValueError(f"{len(titles)} titles for {len(matrices)} matrices")
    if not vmax > vmin:
        raise ValueError(f"vmax must exceed vmin, got vmin={vmin}, vmax={vmax}")
    n = len(matrices)
    ncols = min(max_columns, n)
    nrows = math.ceil(n / ncols)
    tile = 2.6
    width, height = ncols * tile + 1.2, nrows * (tile + 0.35) + 0.6
    fig = _figure(width, height)
    grid = fig.add_gridspec(
        nrows,
        ncols,
        left=0.45 / width,
        right=1 - 1.15 / width,
        bottom=0.35 / height,
        top=1 - 0.6 / height,
        wspace=0.3,
        hspace=0.45,
    )
    colours = matplotlib_cmap(cmap).with_extremes(bad=tuple(c / 255 for c in _NAN_RGB))
    image = None
    for k, (matrix, name) in enumerate(zip(matrices, titles, strict=True)):
        ax = fig.add_subplot(grid[k // ncols, k % ncols])
        m = matrix.detach().to("cpu", torch.float64).numpy()
        image = ax.imshow(m, cmap=colours, vmin=vmin, vmax=vmax, interpolation="nearest")
        h = m.shape[0]
        ticks = _tick_positions(h, slots=8)
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=FONT_PT)
        ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=FONT_PT)
        ax.tick_params(length=2, pad=1)
        ax.set_title(name, fontsize=FONT_PT)
    fig.suptitle(title, fontsize=FONT_PT + 1, x=0.45 / width, ha="left")
    bar_ax = fig.add_axes((1 - 0.95 / width, 0.35 / height, 0.18 / width, 1 - 1.1 / height))
    bar = fig.colorbar(image, cax=bar_ax)
    bar.ax.tick_params(labelsize=FONT_PT)
    bar.set_label(colorbar_label, fontsize=FONT_PT)
    return _png(fig)


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
    """The PNG images of a job (matplotlib, Agg; thread-safe: no pyplot state)."""
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
