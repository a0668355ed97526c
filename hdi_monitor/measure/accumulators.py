"""`Accumulator`: named state tensors with a reduce kind, and one packed collective for all of them.

The measured step keeps its per-layer statistics in accumulators (the head-output covariance,
`hdi_monitor.measure.covariance`; the kernel statistics, `hdi_monitor.measure.kernel`). Each one
declares its state once, as named tensors with the kind of reduction that combines two states
(as torchmetrics' ``add_state(name, default, dist_reduce_fx=...)``):

* ``"sum"``: counts and sums; two states add;
* ``"max"``: running maxima; two states take the elementwise maximum;
* ``"centred"``: centred cross sums (``M2``) that need the states' means to combine (Chan et al.):
  the class that declares one implements `Accumulator._merge_centred` and
  `Accumulator._centred_for_sync`.

The base class owns everything else: allocation (lazily, on the device of the first data),
`merge`, `reset`, `state_dict` / `load_state_dict` with shape checks, and the multi-rank sum
`sync_accumulators`, which combines **any number of accumulators of any kinds in at most three
collectives**: one ``all_reduce(SUM)`` of every ``"sum"`` state packed into one float64 buffer, one
``all_reduce(MAX)`` of every ``"max"`` state, then, where ``"centred"`` states exist, one
``all_reduce(SUM)`` of the cross sums re-centred on the global means (exact; one raw-moment sum
loses precision when the mean dwarfs the spread). A layer costs its state's size in each
collective, whatever the batch or sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["Accumulator", "Reduce", "StateSpec", "sync_accumulators"]

#: How two states of one name combine (see the module docstring).
Reduce = Literal["sum", "max", "centred"]

_F64 = torch.float64


@dataclass(frozen=True)
class StateSpec:
    """One named state tensor of an accumulator.

    Attributes:
        shape: its shape.
        dtype: its dtype (int64 counts, float64 sums).
        reduce: how two states combine (`Reduce`).
        fill: its value before any data (``-inf`` for a running maximum).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    reduce: Reduce
    fill: float = 0.0


class Accumulator:
    """Base of the measured step's accumulators: named states, merge, reset, state dict, sync.

    A subclass names its states in `STATE_NAMES` and declares them in `_specs` (called when the state is first allocated, so a
    size known only from the first data, such as the model width of the covariance's sums, can be
    used) and updates them through `_allocate` and `states`. After `sync_accumulators` an
    accumulator holds the all-rank total and refuses further data until `reset` (a second sync
    would count the other ranks twice).
    """

    #: The state tensors' names, in the order of `_specs`.
    STATE_NAMES: tuple[str, ...] = ()

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self._states: dict[str, Tensor] | None = None
        self._synced = False

    # ---------------------------------------------------------------- declared by subclasses
    def _specs(self) -> dict[str, StateSpec]:
        """The state tensors, by name, in a fixed order (the order of the packed collectives)."""
        raise NotImplementedError

    def _compatible(self) -> tuple[Any, ...]:
        """What two accumulators must share to be merged (and a state to be loaded)."""
        return ()

    def _merge_centred(self, mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
        """Merge ``theirs`` into ``mine`` for the ``"centred"`` states (with the ``"sum"`` states
        they depend on still holding ``mine``'s values); only for classes that declare one."""
        raise NotImplementedError(f"{type(self).__name__} declares a centred state but no merge for it")

    def _centred_for_sync(self, local: dict[str, Tensor], totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's contribution to the all-rank ``"centred"`` states, given its ``local`` states
        and the all-rank ``totals`` of the ``"sum"`` and ``"max"`` states; summed over the ranks."""
        raise NotImplementedError(f"{type(self).__name__} declares a centred state but no sync for it")

    # ---------------------------------------------------------------- state
    @property
    def device(self) -> torch.device | None:
        """Where the state lives (None before the first data when no device was given)."""
        if self._states is not None:
            return next(iter(self._states.values())).device
        return self._device

    @property
    def allocated(self) -> bool:
        """True once the state exists (after the first data, a merge, a load or a sync)."""
        return self._states is not None

    @property
    def synced(self) -> bool:
        """True after `sync_accumulators`: the state is the all-rank total."""
        return self._synced

    def states(self) -> dict[str, Tensor]:
        """The state tensors by name (allocated: call `_allocate` first)."""
        if self._states is None:
            raise RuntimeError(f"{type(self).__name__}: the state is used before it was allocated")
        return self._states

    def _allocate(self, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """The state, allocated on ``device`` (default: the accumulator's) if it does not exist yet."""
        if self._states is None:
            where = self._device if self._device is not None else torch.device(device or "cpu")
            self._states = {
                name: torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=where)
                for name, spec in self._specs().items()
            }
        return self._states

    def _check_open(self) -> None:
        if self._synced:
            raise RuntimeError(
                f"this {type(self).__name__} holds a synced all-rank total; call reset() before adding data to it"
            )

    def reset(self) -> None:
        """Forget every datum (the state is freed; settings and the device choice are kept)."""
        self._states = None
        self._synced = False

    @torch.no_grad()
    def merge(self, other: Accumulator) -> None:
        """Add ``other``'s data to this accumulator (exact); ``other`` is unchanged."""
        if type(other) is not type(self):
            raise TypeError(f"other must be a {type(self).__name__}, got {type(other).__name__}")
        if other._compatible() != self._compatible():
            raise ValueError(f"cannot merge an accumulator of {other._describe()} into one of {self._describe()}")
        self._check_open()
        if other._states is None:
            return
        theirs = other.states()
        mine = self._allocate(self._device if self._device is not None else next(iter(theirs.values())).device)
        dev = next(iter(mine.values())).device
        theirs = {name: t.to(dev) for name, t in theirs.items()}
        for name, t in mine.items():
            if t.shape != theirs[name].shape:
                raise ValueError(
                    f"cannot merge state {name!r} of shape {tuple(theirs[name].shape)} into {tuple(t.shape)}"
                )
        specs = self._specs()
        if any(spec.reduce == "centred" for spec in specs.values()):
            self._merge_centred(mine, theirs)  # reads the sums before they change
        for name, spec in specs.items():
            if spec.reduce == "sum":
                mine[name].add_(theirs[name])
            elif spec.reduce == "max":
                torch.maximum(mine[name], theirs[name], out=mine[name])

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict state: the settings that must match (`_compatible`, by name), ``synced``,
        and a copy of every state tensor by name (None before the first datum)."""
        return {
            **self._compatible_dict(),
            "synced": self._synced,
            **{name: None if self._states is None else self._states[name].clone() for name in self.STATE_NAMES},
        }

    def _compatible_dict(self) -> dict[str, Any]:
        """`_compatible` by name (the keys of `state_dict` that a loaded state must match)."""
        return {}

    def _describe(self) -> str:
        """The settings that must match, for messages."""
        return ", ".join(f"{k}={v}" for k, v in self._compatible_dict().items()) or "the same kind"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (tensors go to this accumulator's ``device`` if one was set).

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: it lacks a state, belongs to an accumulator of other settings, or a tensor
                has the wrong shape.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from {type(self).__name__}.state_dict(), got {type(state).__name__}")
        names = list(self.STATE_NAMES)
        mine = self._compatible_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"state is missing keys {missing}")
        if any(state[k] != v for k, v in mine.items()):
            theirs = ", ".join(f"{k}={state[k]}" for k in mine)
            ours = ", ".join(f"{k}={v}" for k, v in mine.items())
            raise ValueError(f"state is for a {type(self).__name__} of {theirs}; this one has {ours}")
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"state is missing keys {missing}")
        if all(state[n] is None for n in names):
            self.reset()
            return
        tensors = {n: torch.as_tensor(state[n]) for n in names}
        self._load_sizes(tensors)
        specs = self._specs()
        dev = self._device if self._device is not None else next(iter(tensors.values())).device
        for name, spec in specs.items():
            if tuple(tensors[name].shape) != spec.shape:
                raise ValueError(f"state tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {spec.shape}")
        self._states = {name: tensors[name].to(device=dev, dtype=spec.dtype).clone() for name, spec in specs.items()}
        self._synced = bool(state.get("synced", False))

    def _load_sizes(self, tensors: dict[str, Tensor]) -> None:
        """Learn sizes known only from data (e.g. the model width) from loaded tensors."""

    def sync(self, group: Any = None) -> None:
        """Combine the state over the ranks of ``group``: ``sync_accumulators([self], group)`` (a collective)."""
        sync_accumulators([self], group)


def _collective_device(accs: Sequence[Accumulator], group: Any) -> torch.device:
    import torch.distributed as dist

    for acc in accs:
        if acc.device is not None:
            return acc.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(parts: list[Tensor], device: torch.device) -> Tensor:
    return (
        torch.cat([t.to(device=device, dtype=_F64).reshape(-1) for t in parts])
        if parts
        else torch.zeros(0, device=device)
    )


@torch.no_grad()
def sync_accumulators(accumulators: Sequence[Accumulator], group: Any = None) -> None:
    """Combine many accumulators over the ranks of ``group`` in at most three collectives.

    A collective: call it on **every** rank with the same accumulators (same kinds, shapes and
    order). No-op when ``torch.distributed`` is unavailable, not initialised, or the group has one
    rank. Accumulators that saw no data take part with their empty state. Afterwards every rank
    holds the all-rank state; synced accumulators are skipped by a repeated sync, and further data
    or merges raise until `Accumulator.reset`.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    todo = [acc for acc in accumulators if not acc.synced]
    if not todo:
        return
    device = _collective_device(todo, group)
    for acc in todo:
        acc._allocate(acc._device if acc._device is not None else device)
    kinds = [acc._specs() for acc in todo]
    local = [{name: t.clone() for name, t in acc.states().items()} for acc in todo]
    totals: list[dict[str, Tensor]] = [{} for _ in todo]
    for reduce, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        members = [(i, name) for i, specs in enumerate(kinds) for name, spec in specs.items() if spec.reduce == reduce]
        if not members:
            continue
        packed = _pack([local[i][name] for i, name in members], device)
        dist.all_reduce(packed, op=op, group=group)
        pos = 0
        for i, name in members:
            size = local[i][name].numel()
            totals[i][name] = packed[pos : pos + size].view(local[i][name].shape)
            pos += size
    centred = [i for i, specs in enumerate(kinds) if any(s.reduce == "centred" for s in specs.values())]
    if centred:
        parts = {i: todo[i]._centred_for_sync(local[i], totals[i]) for i in centred}
        members = [(i, name) for i in centred for name in parts[i]]
        packed = _pack([parts[i][name] for i, name in members], device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        pos = 0
        for i, name in members:
            size = parts[i][name].numel()
            totals[i][name] = packed[pos : pos + size].view(parts[i][name].shape)
            pos += size
    for acc, specs, total in zip(todo, kinds, totals, strict=True):
        states = acc.states()
        for name, spec in specs.items():
            value = total[name]
            if not spec.dtype.is_floating_point:
                value = value.round()
            states[name].copy_(value.to(device=states[name].device, dtype=spec.dtype))
        acc._synced = True
