"""`History`: the bounded, columnar store of every measured step's scalars.

One column per typed series key (`hdi_monitor.monitor._tags.Series`), one row per kept measured
step, in a preallocated ``(columns, budget)`` float64 tensor: memory, the checkpoint
(`History.state_dict`) and the diversity map's columns are bounded by ``budget`` whatever the run
length (8 bytes per series per row, plus 16 bytes per row for the steps and the measurement
numbers; see `MonitorConfig.history_budget`).

Which rows are kept, after ``n`` measurements (measurement ``i = 0, 1, ...``, of age ``n - 1 - i``):

* the newest ``budget // 2`` measurements, every one;
* the older ones on an even grid: measurement ``i`` is kept when ``i`` is a multiple of ``s``, the
  smallest power of two that fits the ``n - budget // 2`` older measurements into `older_rows`
  rows (``budget // 2 - max(1, budget // 16)``: the rest is room for the appends between two
  compactions), and the younger part of them at ``s / 2``, as far back as the same rows allow. So
  the first measurement is always kept, the spacing never shrinks with age (1 in the newest window,
  then ``s / 2``, then ``s``), and no gap is wider than ``s``, which is less than twice the even
  spacing ``(n - budget // 2) / older_rows(budget)``: 64 measurements after 10,000 with a budget
  of 512 (even spacing 43.5), 512 after 100,000 (445).

A row, once dropped, is never needed again (the grids are nested and only coarsen), so a
compaction (when an append finds the store full) drops rows and never averages: a point of the map
or of `History.column` is the value measured at that step. Rows read as ``{"step": s, tag: value,
...}`` mappings (``history[-1]["hdi/key/mean"]``), made on demand from the columns, for readers that
want tags; absent values (a layer not measured at that step) are left out of the row.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import Tensor

from hdi_monitor.config import DEFAULT_HISTORY_BUDGET, MAX_HISTORY_BUDGET
from hdi_monitor.measure.measurement import Series
from hdi_monitor.models.base import PROJECTIONS

__all__ = ["History", "older_rows"]

_STATE_VERSION = 3
_PER_LAYER = ("effective_heads", "head_correlation")


def older_rows(budget: int) -> int:
    """Rows the measurements older than the newest ``budget // 2`` fill after a compaction."""
    return budget - budget // 2 - max(1, budget // 16)


def _kept(ordinals: Tensor, count: int, budget: int) -> Tensor:
    """Which of the rows numbered ``ordinals`` the rule of the module docstring keeps after ``count``
    measurements (a bool mask)."""
    older = count - budget // 2  # measurements 0 .. older - 1 are past the newest window
    cap = older_rows(budget)
    if older <= cap:
        return torch.ones_like(ordinals, dtype=torch.bool)
    s = 2
    while -(-older // s) > cap:
        s *= 2
    half = s // 2
    # measurements [0, start) on the grid of s, [start, older) on the grid of s / 2: ceil(older / half)
    # - start / s rows (start a multiple of s), the fewest start that fits them in cap
    start = min(older, s * max(0, -(-older // half) - cap))
    return (ordinals >= older) | (ordinals % s == 0) | ((ordinals >= start) & (ordinals % half == 0))


class History(Sequence[Mapping[str, float]]):
    """Bounded columnar history (see the module docstring for which rows are kept).

    Args:
        budget: the most measured steps kept (an integer in ``[4, MAX_HISTORY_BUDGET]``).
    """

    def __init__(self, budget: int = DEFAULT_HISTORY_BUDGET) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 4 <= budget <= MAX_HISTORY_BUDGET:
            raise ValueError(f"history budget must be an integer in [4, {MAX_HISTORY_BUDGET}], got {budget!r}")
        self.budget = budget
        self._steps = torch.zeros(budget, dtype=torch.int64)
        self._ordinals = torch.zeros(budget, dtype=torch.int64)  # which measurement each row is
        self._values = torch.empty(0, budget, dtype=torch.float64)
        self._index: dict[Series, int] = {}
        self._n = 0
        self._count = 0  # measurements appended so far (kept or not)

    # ------------------------------------------------------------------ writing
    def append(self, step: int, values: Mapping[Series, float]) -> None:
        """Add one measured step (``values``: series -> value); downsamples first if full."""
        if self._n >= self.budget:
            self._compact()
        new = [key for key in values if key not in self._index]
        if new:
            for key in new:
                self._index[key] = len(self._index)
            pad = torch.full((len(new), self.budget), float("nan"), dtype=torch.float64)
            self._values = torch.cat([self._values, pad])
        column = self._values[:, self._n]
        column.fill_(float("nan"))
        if values:
            rows = torch.tensor([self._index[k] for k in values], dtype=torch.int64)
            column[rows] = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
        self._steps[self._n] = int(step)
        self._ordinals[self._n] = self._count
        self._n += 1
        self._count += 1

    def drop(self, predicate: Callable[[Series], bool]) -> int:
        """Remove every series for which ``predicate(key)`` is true (a projection no longer
        measured after a resume, say); returns how many measured values went with them."""
        gone = [k for k in self._index if predicate(k)]
        if not gone:
            return 0
        rows = [self._index[k] for k in gone]
        dropped = int((~torch.isnan(self._values[rows, : self._n])).sum())
        keep = [k for k in self._index if k not in set(gone)]
        self._values = self._values[[self._index[k] for k in keep]].clone()
        self._index = {k: i for i, k in enumerate(keep)}
        return dropped

    def _compact(self) -> None:
        """Drop the rows the rule of the module docstring no longer keeps (at least
        ``max(1, budget // 16)`` of a full store): kept rows stay in order, never averaged."""
        n = self._n
        keep = torch.nonzero(_kept(self._ordinals[:n], self._count, self.budget)).flatten()
        m = keep.numel()
        self._steps[:m] = self._steps[keep].clone()
        self._ordinals[:m] = self._ordinals[keep].clone()
        self._values[:, :m] = self._values[:, keep].clone()
        self._values[:, m:] = float("nan")
        self._n = m

    # ------------------------------------------------------------------ reading
    @property
    def steps(self) -> list[int]:
        """The kept measured steps, oldest first."""
        return self._steps[: self._n].tolist()

    def keys(self) -> list[Series]:
        """Every series seen, in the order first seen."""
        return list(self._index)

    def column(self, key: Series) -> Tensor:
        """The kept values of one series (float64, NaN where it was not measured)."""
        if key not in self._index:
            return torch.full((self._n,), float("nan"), dtype=torch.float64)
        return self._values[self._index[key], : self._n].clone()

    def layer_matrix(self, family: str, projection: str | None = None) -> tuple[list[str], Tensor, list[int]]:
        """Per-layer series of one family (and projection): the layer names (in the order first
        seen, so layers measured earlier but not now stay as rows), a ``(layers, steps)`` float64
        copy (NaN where a layer was not measured), and the steps."""
        keys = [k for k in self._index if k.family == family and k.projection == projection and k.layer is not None]
        rows = torch.tensor([self._index[k] for k in keys], dtype=torch.int64)
        values = self._values[rows, : self._n].clone() if keys else torch.empty(0, self._n, dtype=torch.float64)
        return [k.layer for k in keys if k.layer is not None], values, self.steps

    @property
    def nbytes(self) -> int:
        """Bytes held by the store's tensors (fixed once every series has appeared)."""
        return self._values.numel() * self._values.element_size() + (self._steps.numel() + self._ordinals.numel()) * 8

    def __len__(self) -> int:
        return self._n

    def _row(self, i: int) -> dict[str, float]:
        values = self._values[:, i].tolist()
        row = {"step": float(self._steps[i])}
        row.update({key.tag: v for key, v in zip(self._index, values, strict=True) if v == v})
        return row

    @overload
    def __getitem__(self, index: int) -> Mapping[str, float]: ...

    @overload
    def __getitem__(self, index: slice) -> list[Mapping[str, float]]: ...

    def __getitem__(self, index: int | slice) -> Mapping[str, float] | list[Mapping[str, float]]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(self._n)[index]]
        if not -self._n <= index < self._n:
            raise IndexError(f"history index {index} out of range ({self._n} rows)")
        return self._row(index % self._n)

    def __iter__(self) -> Iterator[Mapping[str, float]]:
        return (self._row(i) for i in range(self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"History({self._n} of {self.budget} rows, {len(self._index)} series, {self._count} measurements)"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain Python state (JSON-ready; loadable with ``torch.load(..., weights_only=True)``):
        the kept steps, which measurement each one is, how many were made, and each series' key
        with its values as base64 float64 bytes. Its size is bounded by the budget."""
        values = self._values[:, : self._n].contiguous()
        return {
            "version": _STATE_VERSION,
            "budget": self.budget,
            "steps": self.steps,
            "ordinals": self._ordinals[: self._n].tolist(),
            "count": self._count,
            "columns": [
                [k.family, k.projection, k.layer, k.stat, base64.b64encode(values[i].numpy().tobytes()).decode("ascii")]
                for k, i in self._index.items()
            ],
        }

    @classmethod
    def from_state(cls, state: Any, budget: int = DEFAULT_HISTORY_BUDGET) -> History:
        """A new store of ``budget`` rows holding ``state`` (see `load_state_dict`)."""
        history = cls(budget)
        history.load_state_dict(state)
        return history

    def load_state_dict(self, state: Any) -> None:
        """Restore from `state_dict`, or convert an older state: version 2 (before the measurement
        numbers were saved) or the history of hdi-monitor 0.2 (a list of tag dicts), whose rows are
        taken as consecutive measurements. A history longer than this store's budget is
        downsampled to fit, by the rule of the module docstring.

        Raises:
            ValueError: a state that is none of these, or a malformed one.
        """
        if isinstance(state, list):
            self._load_rows(state)
        elif isinstance(state, Mapping) and state.get("version") in (2, _STATE_VERSION):
            steps = [int(s) for s in state["steps"]]
            n = len(steps)
            columns: dict[Series, Tensor] = {}
            for family, projection, layer, stat, raw in state["columns"]:
                data = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.float64)
                if data.numel() != n:
                    raise ValueError(f"malformed history state: a column of {data.numel()} values for {n} steps")
                columns[Series(family, projection, layer, stat)] = data
            if state["version"] == 2:
                self._fill(steps, columns)
                return
            ordinals, count = state.get("ordinals"), state.get("count")
            if not isinstance(ordinals, list) or not all(isinstance(i, int) for i in ordinals):
                raise ValueError("malformed history state: 'ordinals' must be a list of integers")
            if not isinstance(count, int) or isinstance(count, bool):
                raise ValueError(f"malformed history state: 'count' must be an integer, got {count!r}")
            self._fill(steps, columns, ordinals, count)
        else:
            version = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"unsupported history state ({version!r}): expected the state of History.state_dict() "
                f"(version {_STATE_VERSION}) or the list of dicts of hdi-monitor 0.2"
            )

    def _load_rows(self, rows: list[Any]) -> None:
        """Convert the 0.2 format (``[{"step": s, tag: value, ...}, ...]``): tags are read back to
        series keys once, here, for old checkpoints only."""
        keys: dict[str, Series] = {}
        for row in rows:
            if not isinstance(row, Mapping) or "step" not in row:
                raise ValueError("unsupported history state: a 0.2 history row without a 'step'")
            for tag in row:
                if tag != "step" and tag not in keys:
                    keys[tag] = _legacy_series(tag)
        steps = [int(row["step"]) for row in rows]
        columns = {
            key: torch.tensor([float(row.get(tag, float("nan"))) for row in rows], dtype=torch.float64)
            for tag, key in keys.items()
        }
        self._fill(steps, columns)

    def _fill(
        self,
        steps: list[int],
        columns: Mapping[Series, Tensor],
        ordinals: list[int] | None = None,
        count: int | None = None,
    ) -> None:
        n = len(steps)
        if ordinals is None:  # an older state: its rows as consecutive measurements
            ordinals, count = list(range(n)), n
        assert count is not None
        if len(ordinals) != n or any(b <= a for a, b in zip(ordinals, ordinals[1:], strict=False)):
            raise ValueError(
                f"malformed history state: {len(ordinals)} increasing measurement numbers expected for {n} steps"
            )
        if n and not 0 <= ordinals[0] <= ordinals[-1] < count:
            raise ValueError(f"malformed history state: measurement numbers outside [0, {count})")
        data = torch.stack(list(columns.values())) if columns else torch.empty(0, n, dtype=torch.float64)
        rows = torch.tensor(ordinals, dtype=torch.int64)
        if n > self.budget:  # a longer history (another budget): the rule at this store's budget
            keep = _kept(rows, count, self.budget)
            rows, data, steps = rows[keep], data[:, keep], [s for s, k in zip(steps, keep.tolist(), strict=True) if k]
            n = len(steps)
        self._index = {key: i for i, key in enumerate(columns)}
        self._values = torch.full((len(columns), self.budget), float("nan"), dtype=torch.float64)
        self._values[:, :n] = data
        self._steps[:n] = torch.tensor(steps, dtype=torch.int64)
        self._ordinals[:n] = rows
        self._n, self._count = n, count


def _legacy_series(tag: str) -> Series:
    parts = tag.split("/")
    if len(parts) >= 3 and parts[0] in ("hdi", "invalid_heads") and parts[1] in PROJECTIONS:
        rest = "/".join(parts[2:])
        if rest == "mean" and parts[0] == "hdi":
            return Series("hdi", parts[1], stat="mean")
        if rest not in ("min", "max"):
            return Series(parts[0], parts[1], rest)
    if len(parts) == 2 and parts[0] in ("hdi_chance", "hdi_max") and parts[1] in PROJECTIONS:
        return Series(parts[0], parts[1])
    if len(parts) >= 2 and parts[0] in _PER_LAYER:
        rest = "/".join(parts[1:])
        if rest == "mean":
            return Series(parts[0], stat="mean")
        if rest not in ("min", "max"):
            return Series(parts[0], layer=rest)
    return Series(tag)
