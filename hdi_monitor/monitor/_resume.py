"""Resuming with changed settings: say what changed, keep what still fits.

A tracker's state records the settings its history was measured with (`settings`). When a run
resumes with a different ``every_n_steps`` or ``projections``, `reconcile` keeps every measured
point (each is a measurement at its own step, whatever the schedule), drops the series of
projections that are no longer measured, and returns one message naming each change, so the
history is neither restarted in silence nor mixed with series that no longer continue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hdi_monitor.monitor.history import History

__all__ = ["check_state", "generator_state", "reconcile", "restore_generator", "settings"]

#: Scalar tag prefixes that belong to one projection: ``<prefix>/<projection>...``.
_PROJECTION_PREFIXES = ("hdi", "hdi_chance", "hdi_max", "invalid_heads")


def settings(every_n_steps: int, projections: Sequence[str]) -> dict[str, Any]:
    """The settings saved with a tracker's state (plain Python types)."""
    return {"every_n_steps": int(every_n_steps), "projections": list(projections)}


def _projection_of(tag: str) -> str | None:
    parts = tag.split("/")
    if len(parts) >= 2 and parts[0] in _PROJECTION_PREFIXES:
        return parts[1]
    return None


def reconcile(saved: Mapping[str, Any] | None, current: Mapping[str, Any], history: History) -> str | None:
    """Fit a restored ``history`` to the ``current`` settings; the message to give (None when
    nothing changed).

    Args:
        saved: the settings stored in the state (None for a state from an older version: nothing
            can be compared, everything is kept in silence).
        current: this tracker's `settings`.
        history: the restored history; the series of projections no longer measured are dropped
            from it (every measured point is kept).
    """
    if not saved:
        return None
    changes = []
    old_every, new_every = saved.get("every_n_steps"), current["every_n_steps"]
    if old_every is not None and old_every != new_every:
        changes.append(
            f"every_n_steps {old_every} -> {new_every} (the points measured so far are kept; new points come every "
            f"{new_every} steps, and the early-warning patience counts measured points, so it now spans a different "
            "number of steps)"
        )
    old_proj = list(saved.get("projections") or [])
    new_proj = list(current["projections"])
    if old_proj and old_proj != new_proj:
        gone = [p for p in old_proj if p not in new_proj]
        added = [p for p in new_proj if p not in old_proj]
        detail = []
        if gone:
            dropped = history.drop(lambda key: _projection_of(key.tag) in gone)
            detail.append(f"{', '.join(gone)} no longer measured: its {dropped} saved scalar(s) dropped")
        if added:
            detail.append(f"{', '.join(added)} measured from now on (no history before this resume)")
        if not detail:
            detail.append("same projections in another order")
        changes.append(f"projections {tuple(old_proj)} -> {tuple(new_proj)}: " + "; ".join(detail))
    if not changes:
        return None
    return (
        f"hdi-monitor: resumed with changed settings; {len(history)} measured point(s) of the history are kept. "
        + " ".join(f"Changed: {c}." for c in changes)
    )


#: The tracker state's entries and the Python types each may hold (None allowed for all but ``history``).
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "history": (dict, list),
    "events": (list,),
    "detector": (dict,),
    "activation_detector": (dict,),
    "kernel_detector": (dict,),
    "unhealthy": (list,),
    "explained": (list,),
    "generator": (str,),
    "settings": (dict,),
    "last_step": (int,),
    "step": (int,),
    "calls": (dict,),
}


def check_state(state: Any) -> Mapping[str, Any]:
    """``state`` if it looks like an `hdi_monitor.HDITracker.state_dict` (the kinds of its entries,
    each event's keys, the generator state's size); a TypeError or ValueError naming the entry that
    is wrong otherwise, before anything is restored."""
    import base64
    import binascii

    import torch

    if not isinstance(state, Mapping):
        raise TypeError(
            f"hdi-monitor state must be a dict from HDITracker.state_dict() (or a callback's state_dict()), "
            f"got {type(state).__name__}"
        )
    for key, kinds in _STATE_TYPES.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in kinds)
            raise TypeError(f"hdi-monitor state: {key!r} must be a {names}, got {type(value).__name__}")
    for i, event in enumerate(state.get("events") or []):
        missing = [k for k in ("kind", "layer", "projection", "metric", "step", "value") if k not in (event or {})]
        if not isinstance(event, Mapping) or missing:
            raise ValueError(f"hdi-monitor state: event {i} is not an event (missing {', '.join(missing) or 'a dict'})")
    if state.get("generator") is not None:
        try:
            raw = base64.b64decode(state["generator"], validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"hdi-monitor state: 'generator' is not base64 ({err})") from None
        size = torch.Generator().get_state().numel()
        if len(raw) != size:
            raise ValueError(f"hdi-monitor state: 'generator' holds {len(raw)} bytes, a CPU generator state has {size}")
    return state


def generator_state(generator: Any) -> str:
    """A ``torch.Generator``'s state as a base64 string (JSON-ready, ``weights_only``-loadable)."""
    import base64

    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def restore_generator(generator: Any, state: str) -> None:
    """Set ``generator`` to a state from `generator_state` (checked by `check_state`)."""
    import base64

    import torch

    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
