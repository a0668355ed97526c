"""The allocation law, its continuous optimum and the divisor advisor (see the package docstring)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from hdi_monitor._validation import check_index, check_int, check_real

PARAMETER_NAMES: tuple[str, ...] = ("sigma2", "a", "alpha", "c", "beta", "rho")


def _scipy_optimize() -> ModuleType:
    try:
        import scipy.optimize
    except ImportError as err:
        raise ImportError(
            "the allocation advisor needs scipy: pip install scipy (the advisor extra: pip install -e '.[advisor]' "
            "in a checkout of hdi-monitor, pip install 'hdi-monitor[advisor]' once it is on a package index)"
        ) from err
    return scipy.optimize


def _integer(name: str, value: Any, *, low: int = 1) -> int:
    """``value`` as an int ``>= low``; integral floats are accepted (CSV columns are read as floats)."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    return check_int(name, check_index(name, value), low=low)


def _check_law(law: Any) -> AllocationLaw:
    if law is None:
        return AllocationLaw()
    if not isinstance(law, AllocationLaw):
        raise TypeError(f"law must be an AllocationLaw, got {type(law).__name__}")
    return law


@dataclass(frozen=True)
class AllocationLaw:
    """Parameters of the allocation law (formula in the module docstring).

    Args:
        sigma2: irreducible loss (noise floor), ``>= 0``.
        a: scale of the approximation term ``a * d_k^(-alpha)``, ``> 0``.
        alpha: decay exponent of the approximation term, ``> 0``.
        c: scale of the Nadaraya-Watson estimation term, ``> 0``.
        beta: effective smoothness in the NW rate ``N^(-2 beta / (2 beta + d_k))``, ``> 0``.
        rho: mean correlation of the heads' errors in ``[0, 1]``; the ensemble factor is
            ``rho + (1 - rho) / H``. A measured value can replace it (``correlation=``).

    The defaults are an illustrative calibration, not a measurement: they put ``d_k* = 64`` at
    ``D = 768`` and ``N = 1e6``, the common convention. Fit your own sweep before trusting numbers.
    """

    sigma2: float = 0.0
    a: float = 1.0
    alpha: float = 1.0
    c: float = 1.0
    beta: float = 13.7
    rho: float = 0.25

    def __post_init__(self) -> None:
        check_real("sigma2", self.sigma2, low=0.0)
        for name in ("a", "alpha", "c", "beta"):
            check_real(name, getattr(self, name), low=0.0, low_open=True)
        check_real("rho", self.rho, low=0.0, high=1.0)

    def as_dict(self) -> dict[str, float]:
        """The parameters as ``{name: value}`` in `PARAMETER_NAMES` order."""
        return {name: float(getattr(self, name)) for name in PARAMETER_NAMES}

    def replace(self, **changes: float) -> AllocationLaw:
        """A copy with some parameters changed, e.g. ``law.replace(rho=measured)``."""
        unknown = set(changes) - set(PARAMETER_NAMES)
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; expected some of {PARAMETER_NAMES}")
        return dataclasses.replace(self, **changes)

    def terms(self, num_heads: Any, head_dim: Any, n_train: Any, *, correlation: Any = None) -> dict[str, np.ndarray]:
        """The law's terms, broadcast over array inputs.

        Returns ``{"noise", "approximation", "estimation", "ensemble_factor", "loss"}``, where
        ``estimation`` is one head's NW error (before the ensemble factor) and
        ``loss = noise + approximation + estimation * ensemble_factor``. ``correlation`` replaces
        ``rho`` in the ensemble factor.
        """
        h, d, n = (np.asarray(v, dtype=np.float64) for v in (num_heads, head_dim, n_train))
        if np.any(h < 1 - 1e-9) or np.any(d <= 0) or np.any(n < 1):
            raise ValueError("need num_heads >= 1, head_dim > 0 and n_train >= 1")
        rho = self.rho if correlation is None else np.asarray(correlation, dtype=np.float64)
        approx = self.a * d ** (-self.alpha)
        estim = self.c * np.exp(-np.log(n) * (2.0 * self.beta) / (2.0 * self.beta + d))
        factor = rho + (1.0 - rho) / h
        return {
            "noise": np.broadcast_to(np.float64(self.sigma2), np.broadcast(h, d, n).shape),
            "approximation": approx,
            "estimation": estim,
            "ensemble_factor": factor,
            "loss": self.sigma2 + approx + estim * factor,
        }

    def predict(self, num_heads: Any, head_dim: Any, n_train: Any, *, correlation: Any = None) -> Any:
        """Predicted loss of ``num_heads`` heads of width ``head_dim`` trained on ``n_train`` examples.

        Broadcasts over array inputs; returns a float for scalar inputs.
        """
        loss = self.terms(num_heads, head_dim, n_train, correlation=correlation)["loss"]
        return float(loss) if np.ndim(loss) == 0 else loss

    def formula(self) -> str:
        """The law as one line of text with its parameter values."""
        p = {k: f"{v:.4g}" for k, v in self.as_dict().items()}
        return (
            f"L = {p['sigma2']} + {p['a']}*d^-{p['alpha']} + {p['c']}*N^(-2*{p['beta']}/(2*{p['beta']}+d))"
            f"*({p['rho']} + (1-{p['rho']})/H)"
        )


# ------------------------------------------------------------------------------------ optima


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
    ``[1, total_dim]``, i.e. ``H >= 1``): a 513-point log-spaced grid picks the basin, then
    `scipy.optimize.minimize_scalar` (bounded Brent) refines it. ``total_dim / d_k*`` is the
    matching real head count.
    """
    optimize = _scipy_optimize()
    law = _check_law(law)
    D = check_real("total_dim", total_dim, low=0.0, low_open=True)
    N = check_real("n_train", n_train, low=1.0)
    lo, hi = (1.0, D) if bounds is None else (float(bounds[0]), float(bounds[1]))
    if not (0 < lo <= hi <= D):
        raise ValueError(f"bounds must satisfy 0 < low <= high <= total_dim={D:g}, got {bounds!r}")
    if lo == hi:
        return lo

    def loss(log_d: Any) -> Any:
        d = np.exp(log_d)
        return law.predict(D / d, d, N, correlation=correlation)

    grid = np.linspace(math.log(lo), math.log(hi), 513)
    i = int(np.argmin(loss(grid)))
    bracket = (grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)])
    res = optimize.minimize_scalar(loss, bounds=bracket, method="bounded", options={"xatol": 1e-10})
    best = float(res.x) if res.fun <= loss(grid[i]) else float(grid[i])
    return math.exp(best)


def feasible_head_dims(total_dim: int, *, min_head_dim: int = 8, max_head_dim: int = 256) -> list[int]:
    """Divisors ``d`` of ``total_dim`` with ``min_head_dim <= d <= max_head_dim``, ascending."""
    D = _integer("total_dim", total_dim)
    lo = _integer("min_head_dim", min_head_dim)
    hi = _integer("max_head_dim", max_head_dim)
    if lo > hi:
        raise ValueError(f"min_head_dim={lo} is larger than max_head_dim={hi}")
    return [d for d in range(lo, min(hi, D) + 1) if D % d == 0]


@dataclass(frozen=True)
class AllocationOption:
    """One split of the budget, ``num_heads * head_dim == total_dim``.

    ``relative_to_best`` is ``predicted_loss / best - 1``; ``in_range`` says whether ``head_dim``
    lies in ``[min_head_dim, max_head_dim]`` (only the current split can lie outside).
    """

    num_heads: int
    head_dim: int
    predicted_loss: float
    relative_to_best: float
    is_best: bool = False
    is_current: bool = False
    in_range: bool = True

    def notes(self) -> list[str]:
        """``best``, ``current`` and ``outside d_k range``, where they apply."""
        marks = (("best", self.is_best), ("current", self.is_current), ("outside d_k range", not self.in_range))
        return [text for text, on in marks if on]


@dataclass(frozen=True)
class AllocationRecommendation:
    """The advisor's answer: the best split, every candidate split, and the continuous optimum.

    ``continuous_head_dim`` minimises the law over real ``d`` in ``[min_head_dim, max_head_dim]``.
    ``table`` lists the candidates by ascending ``head_dim``.
    """

    total_dim: int
    n_train: float
    num_heads: int
    head_dim: int
    predicted_loss: float
    continuous_head_dim: float
    table: tuple[AllocationOption, ...]
    law: AllocationLaw
    current: AllocationOption | None = None
    correlation: float | None = None
    min_head_dim: int = 8
    max_head_dim: int = 256

    @property
    def continuous_num_heads(self) -> float:
        """``total_dim / continuous_head_dim``: the real head count of the continuous optimum."""
        return self.total_dim / self.continuous_head_dim

    def format_table(self) -> str:
        """The table of splits as aligned text, best and current marked."""
        lines = [f"{'H':>6} {'d_k':>6} {'predicted_loss':>15} {'vs_best':>9}"]
        for o in self.table:
            mark = f"  <- {', '.join(o.notes())}" if o.notes() else ""
            lines.append(
                f"{o.num_heads:>6d} {o.head_dim:>6d} {o.predicted_loss:>15.6g} {100 * o.relative_to_best:>+8.2f}%{mark}"
            )
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The table of splits as a Markdown table."""
        rows = ["| H | d_k | predicted loss | vs best | note |", "|---:|---:|---:|---:|---|"]
        for o in self.table:
            rows.append(
                f"| {o.num_heads} | {o.head_dim} | {o.predicted_loss:.6g} | {100 * o.relative_to_best:+.2f}%"
                f" | {', '.join(o.notes())} |"
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
            cur = self.current
            lines.append(
                f"Current: H={cur.num_heads} x d_k={cur.head_dim} (predicted loss {cur.predicted_loss:.6g},"
                f" {100 * cur.relative_to_best:+.2f}% vs recommended)"
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
        law: the allocation law; default `AllocationLaw()` (illustrative defaults).
        current_heads: the head count in use now; its split is marked in the table (and listed even
            when its width falls outside ``[min_head_dim, max_head_dim]``).
        min_head_dim: smallest head width considered.
        max_head_dim: largest head width considered; candidates are the divisors of ``total_dim``
            in ``[min_head_dim, max_head_dim]``.
        correlation: a measured mean head correlation in ``[0, 1]`` to use instead of ``law.rho``.

    Returns:
        An `AllocationRecommendation`.

    Raises:
        ValueError: no divisor of ``total_dim`` in the range, a ``current_heads`` that does not
            divide it, or an out-of-range number.
    """
    law = _check_law(law)
    D = _integer("total_dim", total_dim)
    N = check_real("n_train", n_train, low=1.0)
    if correlation is not None:
        correlation = check_real("correlation", correlation, low=0.0, high=1.0)
    dims = feasible_head_dims(D, min_head_dim=min_head_dim, max_head_dim=max_head_dim)
    if not dims:
        raise ValueError(
            f"no divisor of total_dim={D} lies in [min_head_dim={min_head_dim}, max_head_dim={max_head_dim}];"
            " widen the range or choose a budget with such a divisor"
        )
    current_dim = None
    if current_heads is not None:
        hc = _integer("current_heads", current_heads)
        if D % hc:
            raise ValueError(f"current_heads={hc} does not divide total_dim={D}")
        current_dim = D // hc
    all_dims = sorted(set(dims) | ({current_dim} if current_dim is not None else set()))
    d_arr = np.asarray(all_dims, dtype=np.float64)
    losses = np.asarray(law.predict(D / d_arr, d_arr, N, correlation=correlation), dtype=np.float64)
    in_range = np.isin(d_arr, dims)
    ib = int(np.argmin(np.where(in_range, losses, np.inf)))
    table = tuple(
        AllocationOption(
            num_heads=D // d,
            head_dim=d,
            predicted_loss=float(loss),
            relative_to_best=float(loss / losses[ib] - 1.0),
            is_best=k == ib,
            is_current=d == current_dim,
            in_range=bool(ok),
        )
        for k, (d, loss, ok) in enumerate(zip(all_dims, losses, in_range, strict=True))
    )
    cont = optimal_head_dim(
        D, N, law, bounds=(float(min_head_dim), float(min(D, max_head_dim))), correlation=correlation
    )
    return AllocationRecommendation(
        total_dim=D,
        n_train=N,
        num_heads=table[ib].num_heads,
        head_dim=table[ib].head_dim,
        predicted_loss=float(losses[ib]),
        continuous_head_dim=cont,
        table=table,
        law=law,
        current=next((o for o in table if o.is_current), None),
        correlation=correlation,
        min_head_dim=int(min_head_dim),
        max_head_dim=int(max_head_dim),
    )
