"""Robust trend and redundant head pairs: the pure math under the saturation detector.

* `theil_sen_slope`: the Theil-Sen slope of a short series (the saturation rule's robust gain).
* `redundant_pairs`: the head pairs of an ``(H, H)`` overlap or correlation matrix at or above a
  threshold (one host transfer, whatever ``H``).

No state, no collectives; `hdi_monitor.monitor.detector` uses both.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import Tensor

from hdi_monitor._validation import check_real

__all__ = ["check_pairwise", "redundant_pairs", "theil_sen_slope"]


def theil_sen_slope(x: list[float], y: list[float]) -> float:
    """Theil-Sen estimate: the median of ``(y_j - y_i) / (x_j - x_i)`` over pairs with ``x_i < x_j``.

    Robust to outliers (breakdown point about 29%) and unbiased for a linear trend under symmetric
    noise. Matches ``scipy.stats.theilslopes(y, x)[0]``.

    Raises:
        ValueError: when the lengths differ or no pair has distinct ``x``.
    """
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(len(x)) if x[i] < x[j]]
    if not slopes:
        raise ValueError("theil_sen_slope needs at least two points with distinct x")
    return statistics.median(slopes)


def redundant_pairs(pairwise: Tensor, threshold: float) -> list[tuple[int, int, float]]:
    """Head pairs whose overlap (or correlation) is at least ``threshold``.

    Args:
        pairwise: ``(H, H)`` overlap or correlation matrix; only the strict upper triangle
            (``i < j``) is read and NaN entries (invalid heads) never count.
        threshold: a pair is redundant when ``pairwise[i, j] >= threshold``, compared in the
            matrix's precision (float32 or float64; half precision is upcast to float32).

    Returns:
        ``(i, j, value)`` for every redundant pair with ``i < j``, in row-major order. One host
        transfer, whatever ``H``.
    """
    check_pairwise(pairwise)
    threshold = check_real("threshold", threshold)
    h = pairwise.shape[0]
    if h < 2:
        return []
    if pairwise.dtype not in (torch.float32, torch.float64):
        pairwise = pairwise.to(torch.float32)  # half precision and integers: upcast
    iu = torch.triu_indices(h, h, offset=1, device=pairwise.device)
    vals = pairwise[iu[0], iu[1]]
    keep = vals >= threshold  # in the matrix's own precision (a float32 0.9 meets 0.9); NaN is False
    rows = torch.stack([iu[0][keep], iu[1][keep], vals[keep]], dim=1).to(torch.float64)
    return [(int(i), int(j), float(v)) for i, j, v in rows.cpu().tolist()]


def check_pairwise(pairwise: Any) -> None:
    """Raise a TypeError or ValueError unless ``pairwise`` is a real square ``(H, H)`` tensor."""
    if not isinstance(pairwise, Tensor):
        raise TypeError(f"pairwise must be a torch.Tensor of shape (H, H), got {type(pairwise).__name__}")
    if pairwise.ndim != 2 or pairwise.shape[0] != pairwise.shape[1]:
        raise ValueError(f"pairwise must be a square (H, H) matrix, got shape {tuple(pairwise.shape)}")
    if pairwise.is_complex() or pairwise.dtype == torch.bool:
        raise TypeError(f"pairwise must hold real numbers, got {pairwise.dtype}")
