"""Head/dimension allocation under a fixed attention width ``D = H * d_k``.

This is the project's own, explicit model of the tradeoff (the preprint's closed forms are not
public). Multi-head attention is read as an ensemble of ``H`` Nadaraya-Watson (NW) estimators,
each smoothing in its own ``d_k``-dimensional projection of the key space, and the expected test
loss of a split ``(H, d_k)`` trained on ``N`` examples is modelled as

    L(H, d_k, N) = sigma2                                   irreducible noise
                 + a * d_k^(-alpha)                          approximation (projection onto d_k dims)
                 + c * N^(-2 beta / (2 beta + d_k))          NW estimation error of one head
                     * (rho + (1 - rho) / H)                 ensemble variance factor

* the approximation term is the part of the target a head cannot see through a ``d_k``-dimensional
  projection; it falls as ``d_k`` grows (a power law, as for a target whose variance is spread over
  directions with power-law decaying weights);
* the estimation term is the classical NW rate for a ``beta``-smooth target in ``d_k`` dimensions.
  ``d_k`` is the nominal head width while the data a head smooths over usually has a lower intrinsic
  dimension, so the fitted ``beta`` is an *effective* smoothness (``beta * d_k / d_intrinsic``);
* averaging ``H`` estimators whose errors have equal variance and mean pairwise correlation ``rho``
  multiplies their variance by ``rho + (1 - rho) / H``. This is ``1 / H_eff``, with ``H_eff`` the
  effective number of heads of the head-output covariance (DESIGN.md, item 7), so a measured mean
  head correlation can be plugged in per run.

Averaging reduces variance, not bias, so only the estimation term carries the ensemble factor.
With ``H = D / d_k`` the law trades the approximation term (wants wide heads) against the
estimation term (wants narrow heads, whose NW rate is faster) and the ensemble factor (wants many
heads). Minimising over ``d_k`` gives ``d_k* ~ 2 beta ln N / (alpha ln ln N)``: the optimal head
width grows like ``log N`` up to a ``log log N`` factor, and ``H* = D / d_k*`` is close to linear in
``D`` once ``(1 - rho) d_k / D`` is small next to ``rho``. See the README section "Allocation law".

Public API:

* :class:`AllocationLaw` -- the parameters, :meth:`AllocationLaw.predict` and the term breakdown;
* :func:`optimal_head_dim` -- the continuous optimum ``d_k*`` (a real number);
* :func:`recommend_allocation` -- the best divisor split of ``D``, with a table of every feasible split;
* :class:`AllocationRun`, :func:`load_sweep`, :func:`load_sweep_csv` -- sweep records;
* :func:`fit_allocation_law` -- least squares in log space (Levenberg-Marquardt, numpy float64),
  returning an :class:`AllocationFit` with per-run residuals;
* :func:`plot_allocation` -- a matplotlib figure of a recommendation (Agg backend).

Everything here is plain float64 numpy: no torch tensors, no Lightning.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

__all__ = [
    "PARAMETER_NAMES",
    "AllocationLaw",
    "AllocationRun",
    "AllocationFit",
    "AllocationOption",
    "AllocationRecommendation",
    "load_sweep",
    "load_sweep_csv",
    "fit_allocation_law",
    "optimal_head_dim",
    "feasible_head_dims",
    "recommend_allocation",
    "plot_allocation",
]

PARAMETER_NAMES: tuple[str, ...] = ("sigma2", "a", "alpha", "c", "beta", "rho")

# Bounds on the internal (log / logit) parameters, to keep the fit away from overflow.
_THETA_BOUNDS: dict[str, tuple[float, float]] = {
    "sigma2": (math.log(1e-12), math.log(1e6)),
    "a": (math.log(1e-12), math.log(1e6)),
    "alpha": (math.log(1e-3), math.log(20.0)),
    "c": (math.log(1e-12), math.log(1e6)),
    "beta": (math.log(1e-3), math.log(1e5)),
    "rho": (-20.0, 20.0),
}


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        v = int(value)
    elif isinstance(value, (float, np.floating)) and float(value).is_integer():
        v = int(value)
    else:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


@dataclass(frozen=True)
class AllocationLaw:
    """Parameters of the allocation law (see the module docstring for the formula).

    Args:
        sigma2: irreducible loss (noise floor), ``>= 0``.
        a: scale of the approximation term ``a * d_k^(-alpha)``, ``> 0``.
        alpha: decay exponent of the approximation term, ``> 0``.
        c: scale of the Nadaraya-Watson estimation term, ``> 0``.
        beta: effective smoothness in the NW rate ``N^(-2 beta / (2 beta + d_k))``, ``> 0``.
        rho: mean correlation between the heads' errors, in ``[0, 1]``; the ensemble factor is
            ``rho + (1 - rho) / H``. A measured value (mean off-diagonal head-output correlation)
            can replace it per run or per recommendation.

    The defaults are an illustrative calibration, not a measurement: they reproduce the common
    convention ``d_k = 64`` at ``D = 768`` and ``N = 1e6`` training examples, and put the loss on a
    unit scale. Fit the law to your own sweep (:func:`fit_allocation_law`) before trusting numbers.
    """

    sigma2: float = 0.0
    a: float = 1.0
    alpha: float = 1.0
    c: float = 1.0
    beta: float = 13.7
    rho: float = 0.25

    def __post_init__(self) -> None:
        _check_positive("sigma2", self.sigma2, allow_zero=True)
        for name in ("a", "alpha", "c", "beta"):
            _check_positive(name, getattr(self, name))
        r = float(self.rho)
        if not (0.0 <= r <= 1.0):
            raise ValueError(f"rho must be in [0, 1], got {self.rho!r}")

    # -- evaluation -------------------------------------------------------------------------
    def as_dict(self) -> dict[str, float]:
        """The parameters as ``{name: value}`` in :data:`PARAMETER_NAMES` order."""
        return {name: float(getattr(self, name)) for name in PARAMETER_NAMES}

    def replace(self, **changes: float) -> AllocationLaw:
        """A copy with some parameters changed, e.g. ``law.replace(rho=measured)``."""
        unknown = set(changes) - set(PARAMETER_NAMES)
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; expected some of {PARAMETER_NAMES}")
        return dataclasses.replace(self, **changes)

    def ensemble_factor(self, num_heads: Any, correlation: Any = None) -> np.ndarray:
        """``rho + (1 - rho) / H``, with ``rho`` the law's own or a given (measured) correlation."""
        h = np.asarray(num_heads, dtype=np.float64)
        rho = self.rho if correlation is None else np.asarray(correlation, dtype=np.float64)
        return rho + (1.0 - rho) / h

    def terms(self, num_heads: Any, head_dim: Any, n_train: Any, correlation: Any = None) -> dict[str, np.ndarray]:
        """The law's terms, broadcast over the inputs.

        Returns ``{"noise", "approximation", "estimation", "ensemble_factor", "loss"}``, where
        ``estimation`` is one head's NW error (before the ensemble factor) and
        ``loss = noise + approximation + estimation * ensemble_factor``.
        """
        h = np.asarray(num_heads, dtype=np.float64)
        d = np.asarray(head_dim, dtype=np.float64)
        n = np.asarray(n_train, dtype=np.float64)
        if np.any(h < 1 - 1e-9) or np.any(d <= 0) or np.any(n < 1):
            raise ValueError("need num_heads >= 1, head_dim > 0 and n_train >= 1")
        approx = self.a * d ** (-self.alpha)
        estim = self.c * np.exp(-np.log(n) * (2.0 * self.beta) / (2.0 * self.beta + d))
        factor = self.ensemble_factor(h, correlation)
        noise = np.broadcast_to(np.float64(self.sigma2), np.broadcast(h, d, n).shape)
        return {
            "noise": noise,
            "approximation": approx,
            "estimation": estim,
            "ensemble_factor": factor,
            "loss": self.sigma2 + approx + estim * factor,
        }

    def predict(self, num_heads: Any, head_dim: Any, n_train: Any, correlation: Any = None) -> Any:
        """Predicted loss of ``num_heads`` heads of width ``head_dim`` trained on ``n_train`` examples.

        Broadcasts over array inputs; returns a float for scalar inputs. ``correlation`` (optional)
        replaces ``rho`` in the ensemble factor.
        """
        loss = self.terms(num_heads, head_dim, n_train, correlation)["loss"]
        return float(loss) if np.ndim(loss) == 0 else loss

    def formula(self) -> str:
        """The law as one line of text with its parameter values."""
        p = self.as_dict()
        return (
            f"L = {p['sigma2']:.4g} + {p['a']:.4g}*d^-{p['alpha']:.4g}"
            f" + {p['c']:.4g}*N^(-2*{p['beta']:.4g}/(2*{p['beta']:.4g}+d))"
            f"*({p['rho']:.4g} + (1-{p['rho']:.4g})/H)"
        )


# ------------------------------------------------------------------------------------------
# Optima
# ------------------------------------------------------------------------------------------


def optimal_head_dim(
    total_dim: float,
    n_train: float,
    law: AllocationLaw | None = None,
    *,
    bounds: tuple[float, float] | None = None,
    correlation: float | None = None,
) -> float:
    """The continuous optimum ``d_k*`` (a real number) of ``law`` at width ``total_dim``.

    Minimises ``L(total_dim / d, d, n_train)`` over real ``d`` in ``bounds`` (default
    ``[1, total_dim]``, i.e. ``H >= 1``): a log-spaced grid, then golden-section refinement around
    the best grid point. ``H* = total_dim / d_k*`` is the matching real head count.
    """
    law = AllocationLaw() if law is None else law
    D = _check_positive("total_dim", total_dim)
    N = _check_positive("n_train", n_train)
    if N < 1:
        raise ValueError(f"n_train must be >= 1, got {n_train!r}")
    lo, hi = (1.0, D) if bounds is None else (float(bounds[0]), float(bounds[1]))
    if not (0 < lo <= hi <= D):
        raise ValueError(f"bounds must satisfy 0 < low <= high <= total_dim={D:g}, got {bounds!r}")
    if lo == hi:
        return lo

    def f(logd: np.ndarray) -> np.ndarray:
        d = np.exp(logd)
        return law.terms(D / d, d, N, correlation)["loss"]

    grid = np.linspace(math.log(lo), math.log(hi), 513)
    vals = f(grid)
    i = int(np.argmin(vals))
    left, right = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = right - g * (right - left), left + g * (right - left)
    f1, f2 = float(f(np.float64(x1))), float(f(np.float64(x2)))
    for _ in range(80):
        if f1 <= f2:
            right, x2, f2 = x2, x1, f1
            x1 = right - g * (right - left)
            f1 = float(f(np.float64(x1)))
        else:
            left, x1, f1 = x1, x2, f2
            x2 = left + g * (right - left)
            f2 = float(f(np.float64(x2)))
        if right - left < 1e-12:
            break
    best = 0.5 * (left + right)
    # the endpoints of the bracket may be the grid's own bounds: keep the better of the three
    cands = np.array([best, grid[i]])
    return float(np.exp(cands[int(np.argmin(f(cands)))]))


def feasible_head_dims(total_dim: int, min_head_dim: int = 8, max_head_dim: int = 256) -> list[int]:
    """Divisors ``d`` of ``total_dim`` with ``min_head_dim <= d <= max_head_dim``, ascending."""
    D = _check_int("total_dim", total_dim)
    lo = _check_int("min_head_dim", min_head_dim)
    hi = _check_int("max_head_dim", max_head_dim)
    if lo > hi:
        raise ValueError(f"min_head_dim={lo} is larger than max_head_dim={hi}")
    return [d for d in range(lo, min(hi, D) + 1) if D % d == 0]


@dataclass(frozen=True)
class AllocationOption:
    """One split of the budget: ``num_heads * head_dim == total_dim``."""

    num_heads: int
    head_dim: int
    predicted_loss: float
    relative_to_best: float  # predicted_loss / best predicted loss - 1
    is_best: bool = False
    is_current: bool = False
    in_range: bool = True  # head_dim within [min_head_dim, max_head_dim]


@dataclass(frozen=True)
class AllocationRecommendation:
    """The advisor's answer: the best split, every feasible split, and the continuous optimum."""

    total_dim: int
    n_train: float
    num_heads: int
    head_dim: int
    predicted_loss: float
    continuous_head_dim: float  # d_k* minimising the law over real d in [min_head_dim, max_head_dim]
    table: tuple[AllocationOption, ...]
    law: AllocationLaw
    current: AllocationOption | None = None
    correlation: float | None = None
    min_head_dim: int = 8
    max_head_dim: int = 256

    @property
    def continuous_num_heads(self) -> float:
        """``total_dim / continuous_head_dim``: the real-valued head count of the continuous optimum."""
        return self.total_dim / self.continuous_head_dim

    def format_table(self) -> str:
        """The table of splits as aligned text, best and current marked."""
        lines = [f"{'H':>6} {'d_k':>6} {'predicted_loss':>15} {'vs_best':>9}"]
        for opt in self.table:
            marks = []
            if opt.is_best:
                marks.append("best")
            if opt.is_current:
                marks.append("current")
            if not opt.in_range:
                marks.append("outside d_k range")
            mark = f"  <- {', '.join(marks)}" if marks else ""
            lines.append(
                f"{opt.num_heads:>6d} {opt.head_dim:>6d} {opt.predicted_loss:>15.6g} {100 * opt.relative_to_best:>+8.2f}%{mark}"
            )
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The table of splits as a markdown table."""
        rows = ["| H | d_k | predicted loss | vs best | note |", "|---:|---:|---:|---:|---|"]
        for opt in self.table:
            note = ", ".join(
                n for n, on in (("best", opt.is_best), ("current", opt.is_current), ("outside range", not opt.in_range)) if on
            )
            rows.append(
                f"| {opt.num_heads} | {opt.head_dim} | {opt.predicted_loss:.6g} | {100 * opt.relative_to_best:+.2f}% | {note} |"
            )
        return "\n".join(rows)

    def summary(self) -> str:
        """A few lines: the recommendation, the continuous optimum and the current split if given."""
        lines = [
            f"Budget D={self.total_dim}, N={self.n_train:g}",
            f"Recommended: H={self.num_heads} heads x d_k={self.head_dim} (predicted loss {self.predicted_loss:.6g})",
            f"Continuous optimum: d_k*={self.continuous_head_dim:.4g}, H*={self.continuous_num_heads:.4g}",
        ]
        if self.current is not None:
            lines.append(
                f"Current: H={self.current.num_heads} x d_k={self.current.head_dim}"
                f" (predicted loss {self.current.predicted_loss:.6g}, {100 * self.current.relative_to_best:+.2f}% vs recommended)"
            )
        return "\n".join(lines)


def recommend_allocation(
    total_dim: int,
    n_train: float,
    law: AllocationLaw | None = None,
    *,
    current_heads: int | None = None,
    min_head_dim: int = 8,
    max_head_dim: int = 256,
    correlation: float | None = None,
) -> AllocationRecommendation:
    """Recommend ``(num_heads, head_dim)`` with ``num_heads * head_dim == total_dim``.

    Args:
        total_dim: the attention width ``D`` to split.
        n_train: training-set size ``N``, in the units of the sweep the law was fitted to.
        law: the allocation law; default :class:`AllocationLaw` ``()`` (illustrative defaults).
        current_heads: the head count in use now; its split is marked in the table (and listed even
            when its width falls outside ``[min_head_dim, max_head_dim]``).
        min_head_dim, max_head_dim: the sensible range of head widths; candidates are the divisors
            of ``total_dim`` in this range.
        correlation: a measured mean head correlation to use instead of ``law.rho``.

    Returns:
        An :class:`AllocationRecommendation`; its ``table`` lists every candidate split by
        ascending ``head_dim`` with the predicted loss.
    """
    law = AllocationLaw() if law is None else law
    if not isinstance(law, AllocationLaw):
        raise TypeError(f"law must be an AllocationLaw, got {type(law).__name__}")
    D = _check_int("total_dim", total_dim)
    N = _check_positive("n_train", n_train)
    if N < 1:
        raise ValueError(f"n_train must be >= 1, got {n_train!r}")
    if correlation is not None:
        correlation = float(correlation)
        if not (0.0 <= correlation <= 1.0):
            raise ValueError(f"correlation must be in [0, 1], got {correlation!r}")
    dims = feasible_head_dims(D, min_head_dim, max_head_dim)
    if not dims:
        raise ValueError(
            f"no divisor of total_dim={D} lies in [min_head_dim={min_head_dim}, max_head_dim={max_head_dim}];"
            " widen the range or choose a budget with such a divisor"
        )
    current_dim = None
    if current_heads is not None:
        hc = _check_int("current_heads", current_heads)
        if D % hc:
            raise ValueError(f"current_heads={hc} does not divide total_dim={D}")
        current_dim = D // hc
    all_dims = sorted(set(dims) | ({current_dim} if current_dim is not None else set()))
    d_arr = np.asarray(all_dims, dtype=np.float64)
    losses = np.asarray(law.predict(D / d_arr, d_arr, N, correlation), dtype=np.float64)
    in_range = np.asarray([d in dims for d in all_dims])
    masked = np.where(in_range, losses, np.inf)
    ib = int(np.argmin(masked))
    best_loss = float(losses[ib])
    table = tuple(
        AllocationOption(
            num_heads=D // d,
            head_dim=d,
            predicted_loss=float(loss),
            relative_to_best=float(loss / best_loss - 1.0),
            is_best=(k == ib),
            is_current=(d == current_dim),
            in_range=bool(ok),
        )
        for k, (d, loss, ok) in enumerate(zip(all_dims, losses, in_range))
    )
    current = next((o for o in table if o.is_current), None)
    # dims is non-empty, so min_head_dim <= D: the continuous search range is never empty
    cont = optimal_head_dim(D, N, law, bounds=(float(min_head_dim), float(min(D, max_head_dim))), correlation=correlation)
    return AllocationRecommendation(
        total_dim=D,
        n_train=N,
        num_heads=table[ib].num_heads,
        head_dim=table[ib].head_dim,
        predicted_loss=best_loss,
        continuous_head_dim=cont,
        table=table,
        law=law,
        current=current,
        correlation=correlation,
        min_head_dim=int(min_head_dim),
        max_head_dim=int(max_head_dim),
    )


# ------------------------------------------------------------------------------------------
# Sweep records
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocationRun:
    """One run of a sweep: ``num_heads`` heads of width ``head_dim``, trained on ``n_train`` examples.

    ``loss`` is the measured held-out loss (must be ``> 0``; it is fitted in log space).
    ``correlation`` is an optional measured mean correlation between heads (e.g. the mean
    off-diagonal head-output correlation from the covariance monitor); when given it replaces the
    law's ``rho`` for this run.
    """

    num_heads: int
    head_dim: int
    n_train: float
    loss: float
    correlation: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_heads", _check_int("num_heads", self.num_heads))
        object.__setattr__(self, "head_dim", _check_int("head_dim", self.head_dim))
        n = _check_positive("n_train", self.n_train)
        if n < 1:
            raise ValueError(f"n_train must be >= 1, got {self.n_train!r}")
        object.__setattr__(self, "n_train", n)
        object.__setattr__(self, "loss", _check_positive("loss", self.loss))
        if self.correlation is not None:
            r = float(self.correlation)
            if not math.isfinite(r) or not (-1.0 <= r <= 1.0):
                raise ValueError(f"correlation must be in [-1, 1], got {self.correlation!r}")
            if r + (1.0 - r) / self.num_heads <= 0:
                raise ValueError(
                    f"correlation={r} with num_heads={self.num_heads} gives a non-positive ensemble factor"
                    f" rho + (1 - rho)/H; the mean correlation of H heads is at least -1/(H-1)"
                )
            object.__setattr__(self, "correlation", r)

    @property
    def total_dim(self) -> int:
        return self.num_heads * self.head_dim


# Accepted column / key names (lower-cased) for each field.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_heads": ("num_heads", "h", "heads", "n_heads"),
    "head_dim": ("head_dim", "d_k", "dk", "d", "head_width"),
    "n_train": ("n_train", "n", "train_size", "n_samples"),
    "loss": ("loss", "test_loss", "val_loss", "mse"),
    "correlation": ("correlation", "rho", "mean_correlation", "head_correlation"),
}
_TOTAL_ALIASES = ("total_dim", "budget")


def _resolve_columns(keys: Iterable[str], where: str) -> dict[str, str | None]:
    lowered = {k.strip().lower(): k for k in keys if k is not None}
    found: dict[str, str | None] = {}
    for name, aliases in _ALIASES.items():
        hits = [lowered[a] for a in aliases if a in lowered]
        if len(hits) > 1:
            raise ValueError(f"{where}: columns {hits} all name the field {name!r}; keep only one")
        found[name] = hits[0] if hits else None
    missing = [n for n in ("num_heads", "head_dim", "n_train", "loss") if found[n] is None]
    if missing:
        wanted = "; ".join(f"{n}: one of {list(_ALIASES[n])}" for n in missing)
        raise ValueError(f"{where}: missing required column(s) ({wanted}); found {sorted(lowered)}")
    total = [lowered[a] for a in _TOTAL_ALIASES if a in lowered]
    found["total_dim"] = total[0] if total else None
    return found


def _parse_number(value: Any, column: str, where: str) -> float:
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        v = float(value)
    else:
        text = "" if value is None else str(value).strip()
        if not text:
            raise ValueError(f"{where}: column {column!r} is empty")
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"{where}: column {column!r} is {text!r}, not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{where}: column {column!r} is {v}, not a finite number")
    return v


def _record_to_run(record: Mapping[str, Any], cols: dict[str, str | None], where: str) -> AllocationRun:
    vals: dict[str, Any] = {}
    for name in ("num_heads", "head_dim", "n_train", "loss"):
        col = cols[name]
        assert col is not None
        vals[name] = _parse_number(record.get(col), col, where)
    for name in ("num_heads", "head_dim"):
        if not float(vals[name]).is_integer():
            raise ValueError(f"{where}: column {cols[name]!r} is {vals[name]!r}, not an integer")
    corr_col = cols["correlation"]
    corr_raw = record.get(corr_col) if corr_col is not None else None
    if corr_raw is not None and str(corr_raw).strip() not in ("", "nan", "NaN", "none", "None"):
        vals["correlation"] = _parse_number(corr_raw, corr_col, where)  # type: ignore[arg-type]
    try:
        run = AllocationRun(**vals)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    tcol = cols["total_dim"]
    if tcol is not None and record.get(tcol) not in (None, ""):
        total = _parse_number(record.get(tcol), tcol, where)
        if total != run.total_dim:
            raise ValueError(
                f"{where}: {tcol}={total:g} but num_heads*head_dim={run.num_heads}*{run.head_dim}={run.total_dim}"
            )
    return run


def load_sweep_csv(path: str | os.PathLike[str]) -> list[AllocationRun]:
    """Read a sweep from a CSV file with a header row.

    Required columns (case-insensitive; aliases in brackets): ``num_heads`` [``H``, ``heads``],
    ``head_dim`` [``d_k``, ``dk``, ``d``], ``n_train`` [``N``, ``train_size``], ``loss``
    [``test_loss``, ``val_loss``, ``mse``]. Optional: ``correlation`` [``rho``,
    ``mean_correlation``] (blank for runs without a measurement) and ``total_dim`` [``budget``],
    checked against ``H * d_k``. Other columns are ignored; lines starting with ``#`` and blank lines
    are skipped. Raises :class:`ValueError` naming the file and line of the first bad value.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sweep file {str(p)!r} does not exist or is not a file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a UTF-8 text CSV file") from None
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{p}: empty file; expected a header row such as 'H,d_k,N,loss'")
    header_line, header = lines[0]
    try:
        reader = csv.reader([ln for _, ln in lines])
        rows = list(reader)
    except csv.Error as err:
        raise ValueError(f"{p}: not a valid CSV file ({err})") from None
    names = [h.strip() for h in rows[0]]
    if len(set(n.lower() for n in names)) != len(names):
        raise ValueError(f"{p}: line {header_line}: duplicate column names in header {names}")
    cols = _resolve_columns(names, f"{p}: line {header_line}")
    runs = []
    for (lineno, _), row in zip(lines[1:], rows[1:]):
        where = f"{p}: line {lineno}"
        if len(row) != len(names):
            raise ValueError(f"{where}: {len(row)} fields, but the header has {len(names)}")
        runs.append(_record_to_run(dict(zip(names, row)), cols, where))
    if not runs:
        raise ValueError(f"{p}: header only, no runs")
    return runs


SweepInput = Union[str, os.PathLike, Sequence[Union[AllocationRun, Mapping[str, Any]]]]


def load_sweep(runs: SweepInput) -> list[AllocationRun]:
    """Normalise a sweep given as a CSV path, :class:`AllocationRun` objects or mappings.

    Mappings use the same keys (and aliases) as the CSV columns of :func:`load_sweep_csv`.
    """
    if isinstance(runs, (str, os.PathLike)):
        return load_sweep_csv(runs)
    if isinstance(runs, Mapping) or not isinstance(runs, Iterable):
        raise TypeError("runs must be a CSV path or a sequence of AllocationRun objects / mappings")
    out: list[AllocationRun] = []
    for i, rec in enumerate(runs):
        if isinstance(rec, AllocationRun):
            out.append(rec)
        elif isinstance(rec, Mapping):
            where = f"run {i}"
            out.append(_record_to_run(rec, _resolve_columns(rec.keys(), where), where))
        else:
            raise TypeError(f"run {i} is a {type(rec).__name__}; expected an AllocationRun or a mapping")
    if not out:
        raise ValueError("the sweep is empty")
    return out


# ------------------------------------------------------------------------------------------
# Fitting
# ------------------------------------------------------------------------------------------


def _to_theta(law: AllocationLaw) -> np.ndarray:
    p = law.as_dict()
    rho = min(max(p["rho"], 1e-9), 1 - 1e-9)
    theta = np.array(
        [
            math.log(max(p["sigma2"], math.exp(_THETA_BOUNDS["sigma2"][0]))),
            math.log(p["a"]),
            math.log(p["alpha"]),
            math.log(p["c"]),
            math.log(p["beta"]),
            math.log(rho / (1 - rho)),
        ]
    )
    return _clip_theta(theta)


def _clip_theta(theta: np.ndarray) -> np.ndarray:
    lo = np.array([_THETA_BOUNDS[n][0] for n in PARAMETER_NAMES])
    hi = np.array([_THETA_BOUNDS[n][1] for n in PARAMETER_NAMES])
    return np.clip(theta, lo, hi)


def _from_theta(theta: np.ndarray) -> AllocationLaw:
    s, la, lal, lc, lb, lr = (float(t) for t in theta)
    return AllocationLaw(
        sigma2=math.exp(s), a=math.exp(la), alpha=math.exp(lal), c=math.exp(lc), beta=math.exp(lb),
        rho=1.0 / (1.0 + math.exp(-lr)),
    )


class _Problem:
    """Residuals ``ln L(theta) - ln loss`` and their analytic Jacobian in the internal parameters."""

    def __init__(self, runs: Sequence[AllocationRun]):
        self.H = np.array([r.num_heads for r in runs], dtype=np.float64)
        self.d = np.array([r.head_dim for r in runs], dtype=np.float64)
        self.logN = np.log(np.array([r.n_train for r in runs], dtype=np.float64))
        self.logy = np.log(np.array([r.loss for r in runs], dtype=np.float64))
        self.has_corr = np.array([r.correlation is not None for r in runs])
        self.corr = np.array([r.correlation if r.correlation is not None else 0.0 for r in runs], dtype=np.float64)

    def evaluate(self, theta: np.ndarray, jacobian: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        s, a, alpha, c, beta = np.exp(theta[:5])
        rho = 1.0 / (1.0 + np.exp(-theta[5]))
        logd = np.log(self.d)
        approx = a * np.exp(-alpha * logd)
        expo = 2.0 * beta / (2.0 * beta + self.d)
        estim = c * np.exp(-expo * self.logN)
        r_eff = np.where(self.has_corr, self.corr, rho)
        g = r_eff + (1.0 - r_eff) / self.H
        pred = s + approx + estim * g
        res = np.log(pred) - self.logy
        if not jacobian:
            return res, None
        eg = estim * g
        dexpo_dtb = beta * 2.0 * self.d / (2.0 * beta + self.d) ** 2
        cols = [
            np.full_like(pred, s),
            approx,
            approx * (-logd) * alpha,
            eg,
            eg * (-self.logN) * dexpo_dtb,
            np.where(self.has_corr, 0.0, estim * (1.0 - 1.0 / self.H) * rho * (1.0 - rho)),
        ]
        J = np.stack(cols, axis=1) / pred[:, None]
        return res, J


def _levenberg_marquardt(
    prob: _Problem, theta0: np.ndarray, free: np.ndarray, max_iter: int, tol: float
) -> tuple[np.ndarray, float, int, bool]:
    theta = _clip_theta(theta0.copy())
    res, J = prob.evaluate(theta)
    cost = 0.5 * float(res @ res)
    lam = 1e-3
    converged = False
    it = 0
    lo = np.array([_THETA_BOUNDS[n][0] for n in PARAMETER_NAMES])
    hi = np.array([_THETA_BOUNDS[n][1] for n in PARAMETER_NAMES])
    for it in range(1, max_iter + 1):
        grad = J.T @ res  # type: ignore[union-attr]
        # projected step: a parameter on a bound whose gradient points out of the range stays put
        blocked = ((theta <= lo + 1e-12) & (grad > 0)) | ((theta >= hi - 1e-12) & (grad < 0))
        act = free & ~blocked
        if not act.any():
            converged = True
            break
        Jf = J[:, act]  # type: ignore[index]
        A = Jf.T @ Jf
        g = grad[act]
        if float(np.max(np.abs(g), initial=0.0)) < tol * 1e-3:
            converged = True
            break
        improved = False
        while lam < 1e12:
            M = A + lam * np.diag(np.diag(A) + 1e-12)
            try:
                step = np.linalg.solve(M, -g)
            except np.linalg.LinAlgError:
                lam *= 10.0
                continue
            trial = theta.copy()
            trial[act] += step
            trial = _clip_theta(trial)
            r_new, _ = prob.evaluate(trial, jacobian=False)
            c_new = 0.5 * float(r_new @ r_new)
            if np.isfinite(c_new) and c_new < cost:
                rel = (cost - c_new) / max(cost, 1e-300)
                theta, cost = trial, c_new
                res, J = prob.evaluate(theta)
                lam = max(lam / 3.0, 1e-12)
                improved = True
                if rel < tol or float(np.max(np.abs(step))) < tol:
                    converged = True
                break
            lam *= 4.0
        if not improved:
            converged = True  # no descent direction left at machine precision
            break
        if converged:
            break
    return theta, cost, it, converged


@dataclass(frozen=True)
class AllocationFit:
    """The result of :func:`fit_allocation_law`.

    ``residuals[i] = ln(predicted_i) - ln(measured_i)`` for ``runs[i]`` (positive: the law predicts
    a higher loss than measured); ``rms_log_residual`` is their root mean square. ``stderr`` holds an
    approximate standard error for each fitted parameter from the Gauss-Newton covariance
    ``s^2 (J^T J)^-1`` (for positive parameters, the standard error of ``ln(value)``, i.e. a relative
    error; for ``rho``, of ``rho`` itself); ``nan`` where a parameter is fixed, ended on a bound of
    its range (listed in ``at_bound``: e.g. ``rho`` driven to 1 or ``sigma2`` to 0, which says the
    sweep prefers the edge of the model) or is not determined by the sweep (a singular ``J^T J``,
    or as many parameters as runs).
    """

    law: AllocationLaw
    runs: tuple[AllocationRun, ...]
    predicted: np.ndarray
    residuals: np.ndarray
    rms_log_residual: float
    max_abs_log_residual: float
    fitted: tuple[str, ...]
    at_bound: tuple[str, ...]  # fitted parameters that ended on the edge of their search range
    stderr: dict[str, float]
    converged: bool
    iterations: int
    rho_source: str  # "fitted", "fixed" or "measured (mean of the runs' correlations)"

    def residual_table(self, limit: int | None = None) -> str:
        """Per-run measured and predicted loss with the log residual, as aligned text.

        With ``limit``, only the ``limit`` runs with the largest absolute residual are listed.
        """
        order = list(range(len(self.runs)))
        if limit is not None and len(order) > limit:
            order = sorted(order, key=lambda i: -abs(self.residuals[i]))[:limit]
            order.sort()
        lines = [f"{'H':>5} {'d_k':>5} {'N':>10} {'measured':>12} {'predicted':>12} {'log_resid':>10}"]
        for i in order:
            r = self.runs[i]
            lines.append(
                f"{r.num_heads:>5d} {r.head_dim:>5d} {r.n_train:>10.4g} {r.loss:>12.6g} {self.predicted[i]:>12.6g} {self.residuals[i]:>+10.4f}"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        """Parameters (with standard errors where fitted) and the residual statistics, as text."""
        parts = []
        for name in PARAMETER_NAMES:
            v = getattr(self.law, name)
            if name in self.fitted:
                se = self.stderr.get(name, float("nan"))
                unc = f" (+-{se:.2g})" if name == "rho" else f" (x/ exp({se:.2g}))"
                if name in self.at_bound:
                    unc = " (at the bound of its range)"
                elif not math.isfinite(se):
                    unc = " (undetermined)"
                parts.append(f"{name}={v:.4g}{unc}")
            else:
                parts.append(f"{name}={v:.4g} (fixed)" if not (name == "rho" and self.rho_source.startswith("measured")) else f"rho={v:.4g} ({self.rho_source})")
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

    Minimises ``sum_i (ln L(H_i, d_i, N_i) - ln loss_i)^2`` over the free parameters, with positive
    parameters in log space and ``rho`` through a logit (so bounds hold), by Levenberg-Marquardt with
    the analytic Jacobian in float64. With ``restarts`` (default) it also starts from a small grid of
    ``alpha``, ``beta`` and ``sigma2`` values scaled to the data, and keeps the best fit.

    Args:
        runs: a CSV path or a sequence of :class:`AllocationRun` / mappings (see :func:`load_sweep`).
        init: starting parameters (default :class:`AllocationLaw` ``()``).
        fixed: parameters held at their ``init`` value: a mapping ``{name: value}`` (which also sets
            the value) or an iterable of names. For example ``fixed={"sigma2": noise_var}`` when the
            noise level is known. When every run carries a measured ``correlation``, ``rho`` cannot
            be fitted; it is set to the mean measured correlation (used for unmeasured splits).
        restarts: try several starting points and keep the lowest cost.
        max_iter, tol: Levenberg-Marquardt limits.

    Returns:
        An :class:`AllocationFit` with the fitted law and per-run log residuals.

    Raises:
        ValueError: for an empty or invalid sweep, unknown parameter names, or fewer runs than free
            parameters.
    """
    data = load_sweep(runs)
    law0 = AllocationLaw() if init is None else init
    if not isinstance(law0, AllocationLaw):
        raise TypeError(f"init must be an AllocationLaw, got {type(law0).__name__}")
    if fixed is None:
        fixed_map: dict[str, float | None] = {}
    elif isinstance(fixed, Mapping):
        fixed_map = {str(k): float(v) for k, v in fixed.items()}
    elif isinstance(fixed, str):
        fixed_map = {fixed: None}
    else:
        fixed_map = {str(k): None for k in fixed}
    unknown = set(fixed_map) - set(PARAMETER_NAMES)
    if unknown:
        raise ValueError(f"unknown parameter(s) in fixed: {sorted(unknown)}; expected some of {PARAMETER_NAMES}")
    law0 = law0.replace(**{k: v for k, v in fixed_map.items() if v is not None})

    rho_source = "fitted"
    # a one-head run's ensemble factor is 1 whatever rho is, so it needs no measurement
    measured = [r.correlation for r in data if r.correlation is not None]
    if measured and all(r.correlation is not None or r.num_heads == 1 for r in data):
        if "rho" not in fixed_map:
            law0 = law0.replace(rho=float(np.clip(np.mean(measured), 0.0, 1.0)))
            rho_source = "measured (mean of the runs' correlations)"
        fixed_map.setdefault("rho", None)
    if "rho" in fixed_map and rho_source == "fitted":
        rho_source = "fixed"
    free = np.array([n not in fixed_map for n in PARAMETER_NAMES])
    k = int(free.sum())
    if k == 0:
        raise ValueError("every parameter is fixed; nothing to fit")
    if len(data) < k:
        raise ValueError(
            f"{len(data)} runs cannot determine {k} free parameters {[n for n, f in zip(PARAMETER_NAMES, free) if f]};"
            " add runs or fix some parameters (e.g. fixed={'sigma2': 0.0})"
        )

    prob = _Problem(data)
    theta0 = _to_theta(law0)
    starts = [theta0]
    if restarts:
        ymin = float(np.exp(prob.logy.min()))
        ymed = float(np.exp(np.median(prob.logy)))
        for alpha in (0.5, 1.0, 2.0):
            for beta in (0.5, 2.0, 8.0, 32.0):
                for s in (1e-6 * ymin, 0.5 * ymin):
                    t = theta0.copy()
                    vals = {"sigma2": s, "a": ymed, "alpha": alpha, "c": ymed, "beta": beta}
                    for j, name in enumerate(PARAMETER_NAMES[:5]):
                        if free[j]:
                            t[j] = math.log(vals[name])
                    starts.append(_clip_theta(t))
    best: tuple[np.ndarray, float, int, bool] | None = None
    for t0 in starts:
        out = _levenberg_marquardt(prob, t0, free, max_iter, tol)
        if best is None or out[1] < best[1] - 1e-15:
            best = out
    assert best is not None
    theta, cost, iters, converged = best
    law = _from_theta(theta)
    # exact values for fixed parameters (the internal clip/logit round trip is not exact)
    law = law.replace(**{n: getattr(law0, n) for n in PARAMETER_NAMES if n in fixed_map})
    if "sigma2" not in fixed_map and law.sigma2 <= math.exp(_THETA_BOUNDS["sigma2"][0]) * 1.001:
        law = law.replace(sigma2=0.0)  # the noise floor went to its lower bound: report it as 0
    theta = _to_theta(law)
    res, J = prob.evaluate(theta)
    assert J is not None
    n = len(data)
    # free parameters that ended on a bound of their search range (e.g. rho -> 1, sigma2 -> 0)
    lo = np.array([_THETA_BOUNDS[p][0] for p in PARAMETER_NAMES])
    hi = np.array([_THETA_BOUNDS[p][1] for p in PARAMETER_NAMES])
    on_bound = free & ((theta - lo < 1e-3) | (hi - theta < 1e-3))
    inner = free & ~on_bound
    stderr = {name: float("nan") for name in PARAMETER_NAMES}
    k_inner = int(inner.sum())
    if k_inner and n > k:
        Ji = J[:, inner]
        s2 = float(res @ res) / (n - k)
        A = Ji.T @ Ji
        if np.linalg.cond(A) < 1e12:
            cov = s2 * np.linalg.inv(A)
            se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
            for j, name in enumerate(p for p, f in zip(PARAMETER_NAMES, inner) if f):
                stderr[name] = float(se[j] * law.rho * (1 - law.rho)) if name == "rho" else float(se[j])
    pred = np.exp(res + prob.logy)
    return AllocationFit(
        law=law,
        runs=tuple(data),
        predicted=pred,
        residuals=res,
        rms_log_residual=float(np.sqrt(np.mean(res**2))),
        max_abs_log_residual=float(np.max(np.abs(res))),
        fitted=tuple(n for n, f in zip(PARAMETER_NAMES, free) if f),
        at_bound=tuple(n for n, f in zip(PARAMETER_NAMES, on_bound) if f),
        stderr=stderr,
        converged=converged,
        iterations=iters,
        rho_source=rho_source,
    )


# ------------------------------------------------------------------------------------------
# Plot
# ------------------------------------------------------------------------------------------


def plot_allocation(
    recommendation: AllocationRecommendation,
    path: str | os.PathLike[str] | None = None,
    *,
    fit: AllocationFit | None = None,
    n_range: tuple[float, float] | None = None,
):
    """Draw a recommendation: predicted loss per split, and ``d_k*`` against ``N``.

    With ``fit``, a third panel shows predicted against measured loss for the sweep. Builds a
    ``matplotlib.figure.Figure`` directly (no pyplot, so the caller's backend is left alone; saving
    uses Agg); writes it to ``path`` when given. Returns the figure.
    """
    from matplotlib.figure import Figure

    rec = recommendation
    ncols = 3 if fit is not None else 2
    fig = Figure(figsize=(5.0 * ncols, 4.0), layout="constrained")
    axes = fig.subplots(1, ncols)
    ax = axes[0]
    dims = np.array([o.head_dim for o in rec.table], dtype=float)
    losses = np.array([o.predicted_loss for o in rec.table])
    ax.plot(dims, losses, "o-", color="tab:blue", label="feasible splits")
    best = next(o for o in rec.table if o.is_best)
    ax.plot([best.head_dim], [best.predicted_loss], "*", ms=16, color="tab:green", label=f"best: H={best.num_heads}, d_k={best.head_dim}")
    if rec.current is not None:
        ax.plot([rec.current.head_dim], [rec.current.predicted_loss], "s", ms=10, mfc="none", mec="tab:red", mew=2,
                label=f"current: H={rec.current.num_heads}, d_k={rec.current.head_dim}")
    ax.axvline(rec.continuous_head_dim, color="gray", ls=":", label=f"continuous d_k*={rec.continuous_head_dim:.3g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head width d_k  (H = D / d_k)")
    ax.set_ylabel("predicted loss")
    ax.set_title(f"D={rec.total_dim}, N={rec.n_train:.3g}")
    ax.legend(fontsize=8)

    ax = axes[1]
    lo, hi = n_range if n_range is not None else (max(1.0, rec.n_train / 1e3), rec.n_train * 1e3)
    ns = np.logspace(math.log10(lo), math.log10(hi), 40)
    bounds = (float(rec.min_head_dim), float(min(rec.total_dim, rec.max_head_dim)))
    cont = [optimal_head_dim(rec.total_dim, n, rec.law, bounds=bounds, correlation=rec.correlation) for n in ns]
    disc = [recommend_allocation(rec.total_dim, n, rec.law, min_head_dim=rec.min_head_dim, max_head_dim=rec.max_head_dim,
                                 correlation=rec.correlation).head_dim for n in ns]
    ax.plot(ns, cont, "-", color="gray", label="continuous d_k*")
    ax.step(ns, disc, where="mid", color="tab:green", label="best divisor d_k")
    ax.axvline(rec.n_train, color="tab:red", ls=":", label="this N")
    ax.set_xscale("log")
    ax.set_xlabel("training-set size N")
    ax.set_ylabel("optimal head width d_k*")
    ax.set_title("d_k* against N (law)")
    ax.legend(fontsize=8)

    if fit is not None:
        ax = axes[2]
        meas = np.array([r.loss for r in fit.runs])
        ax.loglog(meas, fit.predicted, "o", color="tab:purple")
        lim = [min(meas.min(), fit.predicted.min()) * 0.9, max(meas.max(), fit.predicted.max()) * 1.1]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set_xlabel("measured loss")
        ax.set_ylabel("predicted loss")
        ax.set_title(f"fit: RMS log residual {fit.rms_log_residual:.3f}")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=110)
    return fig
