"""Bias-variance-covariance decomposition of an averaging ensemble (Ueda and Nakano, 1996).

An add-on for controlled experiments (see `examples/nw_theory.py`): it needs a known target, so the
monitor never calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bias_variance_covariance"]

_F64 = torch.float64


def bias_variance_covariance(predictions: Tensor, target: Tensor) -> dict[str, float]:
    """Exact bias-variance-covariance split of an averaging ensemble's squared error.

    With ``f_m`` the ``M`` members, ``f_bar = mean_m f_m`` the ensemble, and expectations taken
    over the ``R`` realisations (data resamples) with population (``1/R``) moments, per point:

    * ``bias_bar = mean_m E[f_m] - y``;
    * ``var_bar = mean_m Var(f_m)``;
    * ``covar_bar = mean_{m != m'} Cov(f_m, f_m')``;

    and ``E[(f_bar - y)^2] = bias_bar^2 + var_bar / M + (1 - 1/M) covar_bar`` exactly. Every term
    is then averaged over the ``N`` points.

    Args:
        predictions: ``(R, M, N)`` member predictions for each realisation and point.
        target: ``(N,)`` true values.

    Returns:
        ``{"bias2", "variance", "covariance", "mse"}`` as floats (computed in float64), with ``mse``
        the ensemble mean's error, so that
        ``mse == bias2 + variance / M + (1 - 1/M) * covariance`` to rounding. ``covariance`` is NaN
        for ``M = 1`` (no pairs; its weight ``1 - 1/M`` is then 0).
    """
    if not isinstance(predictions, Tensor) or not isinstance(target, Tensor):
        raise TypeError("predictions and target must be torch.Tensors")
    if predictions.ndim != 3:
        raise ValueError(
            f"predictions must have shape (R realisations, M members, N points), got {tuple(predictions.shape)}"
        )
    if target.ndim != 1 or target.shape[0] != predictions.shape[2]:
        raise ValueError(
            f"target must have shape (N,) = ({predictions.shape[2]},) to match predictions "
            f"{tuple(predictions.shape)}, got {tuple(target.shape)}"
        )
    if predictions.is_complex() or target.is_complex():
        raise TypeError("predictions and target must be real")
    r, m, n = predictions.shape
    if r < 1 or m < 1 or n < 1:
        raise ValueError(f"predictions needs R, M, N >= 1, got {tuple(predictions.shape)}")
    f = predictions.detach().to(_F64)
    y = target.detach().to(device=f.device, dtype=_F64)

    member_mean = f.mean(dim=0)  # (M, N): E[f_m]
    fc = f - member_mean  # (R, M, N) fluctuations
    bias = member_mean.mean(dim=0) - y  # (N,)
    var_m = fc.square().mean(dim=0)  # (M, N): Var(f_m)
    total = fc.sum(dim=1)  # (R, N): sum_m fluctuations
    # sum_{m != m'} Cov(f_m, f_m') = E[(sum_m fc)^2] - sum_m E[fc^2]
    cross = total.square().mean(dim=0) - var_m.sum(dim=0)  # (N,)
    ens = f.mean(dim=1)  # (R, N)
    mse = (ens - y).square().mean()
    covariance = (cross / (m * (m - 1))).mean().item() if m > 1 else float("nan")
    return {
        "bias2": bias.square().mean().item(),
        "variance": var_m.mean().item(),
        "covariance": covariance,
        "mse": mse.item(),
    }
