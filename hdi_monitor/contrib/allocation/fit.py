"""Fitting the allocation law to a sweep: bounded least squares on ``ln(loss)`` with scipy."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hdi_monitor.contrib.allocation.law import PARAMETER_NAMES, AllocationLaw, _check_law, _scipy_optimize
from hdi_monitor.contrib.allocation.sweep import AllocationRun, SweepInput, load_sweep

RhoSource = Literal["fitted", "fixed", "measured"]

# Internal fit coordinates: sigma2 and rho as they are, the other four as logarithms. The ranges
# keep the fit away from overflow; a parameter that ends on one is reported (AllocationFit.at_bound).
_LOG_PARAMS = frozenset({"a", "alpha", "c", "beta"})
_RANGES: dict[str, tuple[float, float]] = {
    "sigma2": (0.0, 1e6),
    "a": (1e-12, 1e6),
    "alpha": (1e-3, 20.0),
    "c": (1e-12, 1e6),
    "beta": (1e-3, 1e5),
    "rho": (0.0, 1.0),
}


def _to_internal(law: AllocationLaw) -> np.ndarray:
    return np.array([math.log(v) if n in _LOG_PARAMS else v for n, v in law.as_dict().items()])


def _from_internal(theta: np.ndarray) -> AllocationLaw:
    vals = {n: math.exp(t) if n in _LOG_PARAMS else float(t) for n, t in zip(PARAMETER_NAMES, theta, strict=True)}
    return AllocationLaw(**vals)


def _internal_range() -> tuple[np.ndarray, np.ndarray]:
    lo, hi = zip(*(_RANGES[n] for n in PARAMETER_NAMES), strict=True)
    conv = [math.log if n in _LOG_PARAMS else float for n in PARAMETER_NAMES]
    return np.array([f(v) for f, v in zip(conv, lo, strict=True)]), np.array(
        [f(v) for f, v in zip(conv, hi, strict=True)]
    )


def _sweep_arrays(runs: Sequence[AllocationRun]) -> tuple[np.ndarray, ...]:
    """``(H, d_k, ln N, ln loss, has a correlation, correlation or 0)`` as float64 / bool arrays."""
    get = lambda field: np.array([getattr(r, field) for r in runs], dtype=np.float64)  # noqa: E731
    corr = np.array([np.nan if r.correlation is None else r.correlation for r in runs], dtype=np.float64)
    return (
        get("num_heads"),
        get("head_dim"),
        np.log(get("n_train")),
        np.log(get("loss")),
        ~np.isnan(corr),
        np.nan_to_num(corr),
    )


def _log_residuals(theta: np.ndarray, sweep: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``ln L(theta) - ln loss`` per run, and its Jacobian in the internal coordinates."""
    H, d, log_n, log_y, has_corr, corr = sweep
    s, rho = theta[0], theta[5]
    a, alpha, c, beta = np.exp(theta[1:5])
    approx = a * d**-alpha
    estim = c * np.exp(-log_n * 2.0 * beta / (2.0 * beta + d))
    r = np.where(has_corr, corr, rho)
    eg = estim * (r + (1.0 - r) / H)
    pred = s + approx + eg
    jac = np.stack(
        [
            np.ones_like(pred),
            approx,
            -approx * alpha * np.log(d),
            eg,
            -eg * log_n * 2.0 * beta * d / (2.0 * beta + d) ** 2,
            np.where(has_corr, 0.0, estim * (1.0 - 1.0 / H)),
        ],
        axis=1,
    )
    return np.log(pred) - log_y, jac / pred[:, None]


@dataclass(frozen=True)
class AllocationFit:
    """The result of `fit_allocation_law`.

    ``residuals[i] = ln(predicted_i) - ln(measured_i)`` for ``runs[i]`` (positive: the law predicts
    a higher loss than measured). ``stderr`` holds approximate standard errors from the
    Gauss-Newton covariance ``s^2 (J^T J)^-1``: of ``ln(value)`` (a relative error) for ``a``,
    ``alpha``, ``c``, ``beta``, of the value itself for ``sigma2`` and ``rho``; ``nan`` where a
    parameter is fixed, ended on the edge of its range (listed in ``at_bound``, e.g. ``rho`` driven
    to 1 or ``sigma2`` to 0: the sweep prefers the edge of the model) or is not determined by the
    sweep. ``iterations`` counts the residual evaluations of the best start; ``rho_source`` says
    whether ``rho`` was fitted, fixed, or set to the mean of the runs' measured correlations.
    """

    law: AllocationLaw
    runs: tuple[AllocationRun, ...]
    predicted: np.ndarray
    residuals: np.ndarray
    rms_log_residual: float
    max_abs_log_residual: float
    fitted: tuple[str, ...]
    at_bound: tuple[str, ...]
    stderr: dict[str, float]
    converged: bool
    iterations: int
    rho_source: RhoSource

    def residual_table(self, limit: int | None = None) -> str:
        """Per-run measured and predicted loss with the log residual, as aligned text.

        With ``limit``, only the ``limit`` runs with the largest absolute residual are listed.
        """
        order = list(range(len(self.runs)))
        if limit is not None and len(order) > limit:
            order = sorted(sorted(order, key=lambda i: -abs(self.residuals[i]))[:limit])
        lines = [f"{'H':>5} {'d_k':>5} {'N':>10} {'measured':>12} {'predicted':>12} {'log_resid':>10}"]
        for i in order:
            r = self.runs[i]
            lines.append(
                f"{r.num_heads:>5d} {r.head_dim:>5d} {r.n_train:>10.4g} {r.loss:>12.6g}"
                f" {self.predicted[i]:>12.6g} {self.residuals[i]:>+10.4f}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        """Parameters (with standard errors where fitted) and the residual statistics, as text."""
        parts = []
        for name in PARAMETER_NAMES:
            v, se = getattr(self.law, name), self.stderr[name]
            if name == "rho" and self.rho_source == "measured":
                note = "measured: mean of the runs' correlations"
            elif name not in self.fitted:
                note = "fixed"
            elif name in self.at_bound:
                note = "at the bound of its range"
            elif not math.isfinite(se):
                note = "undetermined"
            else:
                note = f"x/ exp({se:.2g})" if name in _LOG_PARAMS else f"+-{se:.2g}"
            parts.append(f"{name}={v:.4g} ({note})")
        status = "converged" if self.converged else "NOT converged"
        return (
            f"fitted to {len(self.runs)} runs ({status}, {self.iterations} iterations):"
            f" RMS log residual {self.rms_log_residual:.4f}, max |log residual| {self.max_abs_log_residual:.4f}\n  "
            + ", ".join(parts)
        )


def fit_allocation_law(
    runs: SweepInput,
    *,
    init: AllocationLaw | None = None,
    fixed: Mapping[str, float] | Iterable[str] | None = None,
    restarts: bool = True,
    max_iter: int = 300,
    tol: float = 1e-12,
) -> AllocationFit:
    """Fit the allocation law to a sweep by least squares on ``ln(loss)``.

    Minimises ``sum_i (ln L(H_i, d_i, N_i) - ln loss_i)^2`` over the free parameters with
    `scipy.optimize.least_squares` (trust-region reflective, bounded, analytic Jacobian, float64);
    ``a``, ``alpha``, ``c`` and ``beta`` are fitted as logarithms, ``sigma2 >= 0`` and
    ``rho`` in ``[0, 1]`` as they are. With ``restarts`` it also starts from a grid of ``alpha``,
    ``beta`` and ``sigma2`` values scaled to the data, and keeps the lowest cost.

    Args:
        runs: a CSV path or a sequence of `AllocationRun` / mappings (see `load_sweep`).
        init: starting parameters (default `AllocationLaw()`).
        fixed: parameters held at their ``init`` value: a mapping ``{name: value}`` (which also sets
            the value) or an iterable of names, e.g. ``fixed={"sigma2": noise_var}``. When every
            run with more than one head carries a measured ``correlation``, ``rho`` is not fitted:
            it is set to the mean measured correlation (used for unmeasured splits).
        restarts: try several starting points and keep the lowest cost.
        max_iter: most residual evaluations per start.
        tol: ``ftol``, ``xtol`` and ``gtol`` of the solver.

    Returns:
        An `AllocationFit` with the fitted law and per-run log residuals.

    Raises:
        ValueError: for an empty or invalid sweep, unknown parameter names, or fewer runs than free
            parameters.
    """
    optimize = _scipy_optimize()
    data = load_sweep(runs)
    law0 = _check_law(init)
    if fixed is None:
        fixed_map: dict[str, float | None] = {}
    elif isinstance(fixed, Mapping):
        fixed_map = {str(k): float(v) for k, v in fixed.items()}
    else:
        fixed_map = {str(k): None for k in ([fixed] if isinstance(fixed, str) else fixed)}
    unknown = set(fixed_map) - set(PARAMETER_NAMES)
    if unknown:
        raise ValueError(f"unknown parameter(s) in fixed: {sorted(unknown)}; expected some of {PARAMETER_NAMES}")
    law0 = law0.replace(**{k: v for k, v in fixed_map.items() if v is not None})

    rho_source: RhoSource = "fixed" if "rho" in fixed_map else "fitted"
    # a one-head run's ensemble factor is 1 whatever rho is, so it needs no measurement
    measured = [r.correlation for r in data if r.correlation is not None]
    if measured and all(r.correlation is not None or r.num_heads == 1 for r in data) and "rho" not in fixed_map:
        law0 = law0.replace(rho=float(np.clip(np.mean(measured), 0.0, 1.0)))
        fixed_map["rho"], rho_source = None, "measured"
    free = np.array([n not in fixed_map for n in PARAMETER_NAMES])
    k = int(free.sum())
    if k == 0:
        raise ValueError("every parameter is fixed; nothing to fit")
    if len(data) < k:
        raise ValueError(
            f"{len(data)} runs cannot determine {k} free parameters {[n for n, f in zip(PARAMETER_NAMES, free, strict=True) if f]};"
            " add runs or fix some parameters (e.g. fixed={'sigma2': 0.0})"
        )

    lo, hi = _internal_range()
    theta0 = np.clip(_to_internal(law0), lo, hi)
    starts = [theta0]
    if restarts:
        losses = np.array([r.loss for r in data])
        ymin, ymed = float(losses.min()), float(np.median(losses))
        for alpha in (0.5, 1.0, 2.0):
            for beta in (0.5, 2.0, 8.0, 32.0):
                for s in (1e-6 * ymin, 0.5 * ymin):
                    t = theta0.copy()
                    start = (s, math.log(ymed), math.log(alpha), math.log(ymed), math.log(beta))
                    t[:5] = np.where(free[:5], start, t[:5])
                    starts.append(np.clip(t, lo, hi))

    sweep = _sweep_arrays(data)

    def full(x: np.ndarray) -> np.ndarray:
        t = theta0.copy()
        t[free] = x
        return t

    best = None
    for t0 in starts:
        res = optimize.least_squares(
            lambda x: _log_residuals(full(x), sweep)[0],
            t0[free],
            jac=lambda x: _log_residuals(full(x), sweep)[1][:, free],
            bounds=(lo[free], hi[free]),
            method="trf",
            x_scale="jac",
            ftol=tol,
            xtol=tol,
            gtol=tol,
            max_nfev=max_iter,
        )
        if best is None or res.cost < best.cost - 1e-15:
            best = res
    assert best is not None
    theta = full(best.x)
    # the solver keeps its iterates strictly inside the ranges: a value within `edge` of one is on it
    edge = np.full(theta.shape, 1e-6)
    edge[0] = 1e-6 * math.exp(float(sweep[3].min()))  # sigma2, on the scale of the smallest loss
    at_low, at_high = free & (theta - lo < edge), free & (hi - theta < edge)
    on_bound = at_low | at_high
    theta = np.where(at_low, lo, np.where(at_high, hi, theta))  # report the edge itself: sigma2 = 0, rho = 1
    law = _from_internal(theta).replace(**{n: getattr(law0, n) for n in fixed_map})  # fixed values exactly
    res_log, jac = _log_residuals(_to_internal(law), sweep)
    n = len(data)
    inner = free & ~on_bound
    stderr = {name: float("nan") for name in PARAMETER_NAMES}
    if inner.any() and n > k:
        A = jac[:, inner].T @ jac[:, inner]
        if np.linalg.cond(A) < 1e12:
            var = float(res_log @ res_log) / (n - k) * np.diag(np.linalg.inv(A))
            for name, v in zip((p for p, f in zip(PARAMETER_NAMES, inner, strict=True) if f), var, strict=True):
                stderr[name] = math.sqrt(max(float(v), 0.0))
    return AllocationFit(
        law=law,
        runs=tuple(data),
        predicted=np.exp(res_log + sweep[3]),
        residuals=res_log,
        rms_log_residual=float(np.sqrt(np.mean(res_log**2))),
        max_abs_log_residual=float(np.max(np.abs(res_log))),
        fitted=tuple(p for p, f in zip(PARAMETER_NAMES, free, strict=True) if f),
        at_bound=tuple(p for p, f in zip(PARAMETER_NAMES, on_bound, strict=True) if f),
        stderr=stderr,
        converged=bool(best.status > 0),
        iterations=int(best.nfev),
        rho_source=rho_source,
    )
