"""Head/width allocation at a fixed attention width ``D = H * d_k``: the law, its fit, the advisor.

This is the project's own, explicit model of the tradeoff (the preprint's closed forms are not
public). Multi-head attention is read as an ensemble of ``H`` Nadaraya-Watson (NW) estimators, each
smoothing in its own ``d_k``-dimensional projection, and the test loss of a split ``(H, d_k)``
trained on ``N`` examples is modelled as

    L(H, d_k, N) = sigma2                                  irreducible noise
                 + a * d_k^(-alpha)                         approximation (what d_k dims cannot see)
                 + c * N^(-2 beta / (2 beta + d_k))         NW estimation error of one head
                     * (rho + (1 - rho) / H)                ensemble variance factor (= 1 / H_eff)

Only the estimation term carries the ensemble factor (averaging reduces variance, not bias). With
``H = D / d_k`` the minimiser grows like ``d_k* ~ (2 beta / alpha) ln N / ln ln N``: the optimal head
width grows like ``log N`` up to a ``log log N`` factor. docs/allocation.md derives it and states
the assumptions.

Modules: `law` (`AllocationLaw`, `optimal_head_dim`, `recommend_allocation`), `sweep`
(`AllocationRun`, `load_sweep`, `load_sweep_csv`), `fit` (`fit_allocation_law`, bounded least
squares on ``ln(loss)``) and `plot` (`plot_allocation`, imported on first use). The law is plain
float64 numpy; the optimum and the fit use scipy, the ``advisor`` extra
(from a checkout: ``pip install -e '.[advisor]'``), imported only when they run.
"""

from __future__ import annotations

from typing import Any

from hdi_monitor.contrib.allocation.fit import AllocationFit, fit_allocation_law
from hdi_monitor.contrib.allocation.law import (
    PARAMETER_NAMES,
    AllocationLaw,
    AllocationOption,
    AllocationRecommendation,
    feasible_head_dims,
    optimal_head_dim,
    recommend_allocation,
)
from hdi_monitor.contrib.allocation.sweep import AllocationRun, load_sweep, load_sweep_csv

__all__ = [
    "PARAMETER_NAMES",
    "AllocationFit",
    "AllocationLaw",
    "AllocationOption",
    "AllocationRecommendation",
    "AllocationRun",
    "feasible_head_dims",
    "fit_allocation_law",
    "load_sweep",
    "load_sweep_csv",
    "optimal_head_dim",
    "plot_allocation",
    "recommend_allocation",
]


def __getattr__(name: str) -> Any:
    if name == "plot_allocation":  # matplotlib is imported only by whoever draws
        from hdi_monitor.contrib.allocation.plot import plot_allocation

        return plot_allocation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
