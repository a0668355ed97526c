"""A matplotlib picture of an allocation recommendation (and of a fit)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hdi_monitor.contrib.allocation.fit import AllocationFit
from hdi_monitor.contrib.allocation.law import AllocationRecommendation, optimal_head_dim, recommend_allocation


def plot_allocation(
    recommendation: AllocationRecommendation,
    path: str | os.PathLike[str] | None = None,
    *,
    fit: AllocationFit | None = None,
    n_range: tuple[float, float] | None = None,
) -> Any:
    """Draw a recommendation: predicted loss per split, and ``d_k*`` against ``N``.

    With ``fit``, a third panel shows predicted against measured loss for the sweep. Builds a
    ``matplotlib.figure.Figure`` directly (no pyplot, so the caller's backend is left alone) and
    writes it to ``path`` when given. Returns the figure.
    """
    from matplotlib.figure import Figure

    rec = recommendation
    ncols = 3 if fit is not None else 2
    fig = Figure(figsize=(5.0 * ncols, 4.0), layout="constrained")
    axes = fig.subplots(1, ncols)
    ax = axes[0]
    ax.plot(
        [o.head_dim for o in rec.table],
        [o.predicted_loss for o in rec.table],
        "o-",
        color="tab:blue",
        label="feasible splits",
    )
    best = {"marker": "*", "ms": 16, "color": "tab:green", "linestyle": "none"}
    ax.plot([rec.head_dim], [rec.predicted_loss], label=f"best: H={rec.num_heads}, d_k={rec.head_dim}", **best)
    if rec.current is not None:
        cur = rec.current
        current = {"marker": "s", "ms": 10, "mfc": "none", "mec": "tab:red", "mew": 2, "linestyle": "none"}
        ax.plot(
            [cur.head_dim], [cur.predicted_loss], label=f"current: H={cur.num_heads}, d_k={cur.head_dim}", **current
        )
    ax.axvline(rec.continuous_head_dim, color="gray", ls=":", label=f"continuous d_k*={rec.continuous_head_dim:.3g}")
    ax.set(
        xscale="log",
        xlabel="head width d_k  (H = D / d_k)",
        ylabel="predicted loss",
        title=f"D={rec.total_dim}, N={rec.n_train:.3g}",
    )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)

    ax = axes[1]
    lo, hi = n_range if n_range is not None else (max(1.0, rec.n_train / 1e3), rec.n_train * 1e3)
    ns = np.geomspace(lo, hi, 40)
    bounds = (float(rec.min_head_dim), float(min(rec.total_dim, rec.max_head_dim)))
    options = {"min_head_dim": rec.min_head_dim, "max_head_dim": rec.max_head_dim, "correlation": rec.correlation}
    cont = [optimal_head_dim(rec.total_dim, n, rec.law, bounds=bounds, correlation=rec.correlation) for n in ns]
    disc = [recommend_allocation(rec.total_dim, n, rec.law, **options).head_dim for n in ns]  # type: ignore[arg-type]
    ax.plot(ns, cont, "-", color="gray", label="continuous d_k*")
    ax.step(ns, disc, where="mid", color="tab:green", label="best divisor d_k")
    ax.axvline(rec.n_train, color="tab:red", ls=":", label="this N")
    ax.set(xscale="log", xlabel="training-set size N", ylabel="optimal head width d_k*", title="d_k* against N (law)")
    ax.legend(fontsize=8)

    if fit is not None:
        ax = axes[2]
        meas = np.array([r.loss for r in fit.runs])
        ax.loglog(meas, fit.predicted, "o", color="tab:purple")
        lim = [min(meas.min(), fit.predicted.min()) * 0.9, max(meas.max(), fit.predicted.max()) * 1.1]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set(
            xlabel="measured loss", ylabel="predicted loss", title=f"fit: RMS log residual {fit.rms_log_residual:.3f}"
        )
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig
