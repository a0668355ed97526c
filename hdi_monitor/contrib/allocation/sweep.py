"""Sweep records for the allocation law: `AllocationRun`, and reading them from CSV or mappings."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hdi_monitor._validation import check_real
from hdi_monitor.contrib.allocation.law import _integer


@dataclass(frozen=True)
class AllocationRun:
    """One run of a sweep: ``num_heads`` heads of width ``head_dim``, trained on ``n_train`` examples.

    ``loss`` is the measured held-out loss (``> 0``; it is fitted in log space). ``correlation`` is
    an optional measured mean correlation between the heads (e.g. the mean off-diagonal head-output
    correlation of the covariance monitor); when given it replaces the law's ``rho`` for this run.
    """

    num_heads: int
    head_dim: int
    n_train: float
    loss: float
    correlation: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_heads", _integer("num_heads", self.num_heads))
        object.__setattr__(self, "head_dim", _integer("head_dim", self.head_dim))
        object.__setattr__(self, "n_train", check_real("n_train", self.n_train, low=1.0))
        object.__setattr__(self, "loss", check_real("loss", self.loss, low=0.0, low_open=True))
        if self.correlation is not None:
            r = check_real("correlation", self.correlation, low=-1.0, high=1.0)
            if r + (1.0 - r) / self.num_heads <= 0:
                raise ValueError(
                    f"correlation={r} with num_heads={self.num_heads} gives a non-positive ensemble factor"
                    " rho + (1 - rho)/H; the mean correlation of H heads is at least -1/(H-1)"
                )
            object.__setattr__(self, "correlation", r)

    @property
    def total_dim(self) -> int:
        """``num_heads * head_dim``."""
        return self.num_heads * self.head_dim


# Accepted column / key names (lower-cased) for each field.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_heads": ("num_heads", "h", "heads", "n_heads"),
    "head_dim": ("head_dim", "d_k", "dk", "d", "head_width"),
    "n_train": ("n_train", "n", "train_size", "n_samples"),
    "loss": ("loss", "test_loss", "val_loss", "mse"),
    "correlation": ("correlation", "rho", "mean_correlation", "head_correlation"),
    "total_dim": ("total_dim", "budget"),
}
_REQUIRED = ("num_heads", "head_dim", "n_train", "loss")
_BLANK = ("", "nan", "none")


def _resolve_columns(keys: Iterable[str], where: str) -> dict[str, str | None]:
    lowered = {k.strip().lower(): k for k in keys if k is not None}
    found: dict[str, str | None] = {}
    for name, aliases in _ALIASES.items():
        hits = [lowered[a] for a in aliases if a in lowered]
        if len(hits) > 1:
            raise ValueError(f"{where}: columns {hits} all name the field {name!r}; keep only one")
        found[name] = hits[0] if hits else None
    missing = [n for n in _REQUIRED if found[n] is None]
    if missing:
        wanted = "; ".join(f"{n}: one of {list(_ALIASES[n])}" for n in missing)
        raise ValueError(f"{where}: missing required column(s) ({wanted}); found {sorted(lowered)}")
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


def _record_to_run(record: Mapping[str, Any], cols: Mapping[str, str | None], where: str) -> AllocationRun:
    vals: dict[str, Any] = {}
    for name in (*_REQUIRED, "correlation", "total_dim"):
        col = cols[name]
        raw = record.get(col) if col is not None else None
        if name in _REQUIRED or (raw is not None and str(raw).strip().lower() not in _BLANK):
            vals[name] = _parse_number(raw, str(col), where)
    for name in ("num_heads", "head_dim"):
        if not vals[name].is_integer():
            raise ValueError(f"{where}: column {cols[name]!r} is {vals[name]!r}, not an integer")
    total = vals.pop("total_dim", None)
    try:
        run = AllocationRun(**vals)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    if total is not None and total != run.total_dim:
        raise ValueError(
            f"{where}: {cols['total_dim']}={total:g} but num_heads*head_dim"
            f"={run.num_heads}*{run.head_dim}={run.total_dim}"
        )
    return run


def load_sweep_csv(path: str | os.PathLike[str]) -> list[AllocationRun]:
    """Read a sweep from a CSV file with a header row.

    Required columns (case-insensitive; aliases in brackets): ``num_heads`` [``H``, ``heads``],
    ``head_dim`` [``d_k``, ``dk``, ``d``], ``n_train`` [``N``, ``train_size``], ``loss``
    [``test_loss``, ``val_loss``, ``mse``]. Optional: ``correlation`` [``rho``,
    ``mean_correlation``] (blank where not measured) and ``total_dim`` [``budget``], checked
    against ``H * d_k``. Other columns are ignored; blank lines and lines starting with ``#`` are
    skipped.

    Raises:
        ValueError: naming the file and line of the first bad value.
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
    try:
        rows = list(csv.reader([ln for _, ln in lines]))
    except csv.Error as err:
        raise ValueError(f"{p}: not a valid CSV file ({err})") from None
    names = [h.strip() for h in rows[0]]
    where = f"{p}: line {lines[0][0]}"
    if len({n.lower() for n in names}) != len(names):
        raise ValueError(f"{where}: duplicate column names in header {names}")
    cols = _resolve_columns(names, where)
    runs = []
    for (lineno, _), row in zip(lines[1:], rows[1:], strict=True):
        if len(row) != len(names):
            raise ValueError(f"{p}: line {lineno}: {len(row)} fields, but the header has {len(names)}")
        runs.append(_record_to_run(dict(zip(names, row, strict=True)), cols, f"{p}: line {lineno}"))
    if not runs:
        raise ValueError(f"{p}: header only, no runs")
    return runs


SweepInput = str | os.PathLike[str] | Sequence[AllocationRun | Mapping[str, Any]]


def load_sweep(runs: SweepInput) -> list[AllocationRun]:
    """Normalise a sweep given as a CSV path, `AllocationRun` objects or mappings.

    Mappings use the keys (and aliases) of the CSV columns of `load_sweep_csv`.
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
            out.append(_record_to_run(rec, _resolve_columns(rec.keys(), f"run {i}"), f"run {i}"))
        else:
            raise TypeError(f"run {i} is a {type(rec).__name__}; expected an AllocationRun or a mapping")
    if not out:
        raise ValueError("the sweep is empty")
    return out
