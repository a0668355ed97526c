"""Render matrices as small RGB heatmaps for TensorBoard, without a figure per call.

A heatmap is an ``(3, height, width)`` uint8 tensor: every matrix cell is a ``cell x cell`` block
coloured through a fixed colour scale (``vmin``/``vmax`` do not follow the data, so images from
different steps compare), with head indices drawn in a 3x5 pixel font along the top and left edges.
NaN cells (invalid heads) are grey. The work is a handful of tensor ops on the CPU; cost is about
that of a few H x H copies, so it is cheap enough to run every time images are logged.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["heatmap", "colorbar_lut"]

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
