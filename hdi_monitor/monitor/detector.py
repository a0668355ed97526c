"""Early warnings for head diversity: saturation, collapse and redundant heads.

A `SaturationDetector` is fed one measurement at a time (a layer's HDI for one projection, the
model mean, or the effective number of heads from activations) and returns the *new* warnings that
measurement triggers as `DiversityEvent` objects. It is pure Python: no Lightning, no logging,
no warnings of its own; the caller decides what to do with an event (warn with
`DiversityWarning`, stop training, call a user function). Its state (bounded history, best
values, events already issued) round-trips through `SaturationDetector.state_dict` as plain
Python types, so ``torch.load(..., weights_only=True)`` can read a checkpoint that holds it.

Higher is better for every metric it watches (the HDI, the effective number of heads). Events,
for one series ``(layer, projection, metric)``; only measurements after the warm-up count (the
first ``warmup_measurements`` of the series, or those at steps below ``warmup_steps``):

* **saturation**: over the last ``patience + 1`` measurements (the window), the best value has not
  improved by more than ``min_delta`` (EarlyStopping's rule) *and* the Theil-Sen median slope
  projects a gain of at most ``min_delta`` across the window. The robust slope keeps one lucky or
  unlucky point from deciding. After it fires, the series is re-armed once it improves again: the
  best has moved more than ``min_delta`` past the best at the time of the event and the window's
  robust gain exceeds ``min_delta``. It can then fire again at the next plateau.
* **collapse**: the value is worse than the best so far by more than ``collapse_delta``. Fires once
  per series. The message says when the value is on the wrong side of the chance level (for HDI: the
  heads are more alike than random heads, as in the trained MiniLM's keys).
* **redundancy**: some pairs ``i < j`` of the ``(H, H)`` overlap (or activation correlation) matrix are
  at least ``redundancy_threshold``. Fires when the set of redundant pairs first becomes non-empty and
  again whenever it contains a pair not reported before. Each event lists all current pairs.

Kernel statistics (opt-in, `hdi_monitor.monitor.kernel_detector.KernelDetector`, fed each layer's
mean over heads): **entropy_collapse** (the attention entropy falls below a fraction of its best)
and **logit_blowup** (the maximum attention logit passes a threshold or grows by a factor within a
window). The events are `hdi_monitor.events.DiversityEvent` records.

Each message states what was measured and what the warnings study measured for the signal out of
sample (`hdi_monitor.evidence`); it advises an action (pruning, fewer heads, another H or d_k) only
where the study backs it: the signal beats every baseline and, for pruning, the redundancy ablation
beat random heads (``EVIDENCE["redundancy"].default_on``).

The defaults were checked by ``benchmarks/warnings_study.py`` (30 small language models trained on
real text, each event scored against what the held-out loss did next; see
``docs/early-warnings.md``), which set the kernel detector's thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from hdi_monitor._validation import check_choice, check_index, check_int, check_real
from hdi_monitor.events import METRICS, PROJECTIONS, DiversityEvent, EventKind, Metric, Projection
from hdi_monitor.evidence import backed, evidence_clause
from hdi_monitor.functional.trend import check_pairwise, redundant_pairs, theil_sen_slope

__all__ = [
    "ACTIVATION_COLLAPSE_DELTA",
    "ACTIVATION_MIN_DELTA",
    "ACTIVATION_PATIENCE",
    "DetectorArg",
    "MAX_KEPT_EVENTS",
    "check_detector",
    "resolve_detectors",
    "SaturationDetector",
    "redundant_pairs",
    "theil_sen_slope",
]


_Key = tuple[str, Projection, Metric]  # one series: (layer, projection, metric)

_STATE_VERSION = 1
_MAX_PAIRS_IN_MESSAGE = 6
_METRIC_NAMES = {
    "hdi": "HDI",
    "effective_heads": "effective number of heads",
    "attention_entropy": "attention entropy",
    "max_attention_logit": "maximum attention logit",
}


def _check_warmup(warmup_measurements: int, warmup_steps: int | None) -> tuple[int, int | None]:
    """A detector's warm-up settings, checked: ``warmup_measurements`` an int >= 0, ``warmup_steps``
    None or an int >= 0 (TypeError, ValueError otherwise)."""
    measurements = check_int("warmup_measurements", check_index("warmup_measurements", warmup_measurements), low=0)
    if warmup_steps is not None:
        warmup_steps = check_int("warmup_steps", check_index("warmup_steps", warmup_steps), low=0)
    return measurements, warmup_steps


def _warming(step: int, seen: int, warmup_measurements: int, warmup_steps: int | None) -> bool:
    """True while a series is warming up: its ``seen``-th measurement (1-based), at ``step``, is
    ignored: a step below ``warmup_steps`` when that is set, else one of the first
    ``warmup_measurements`` measurements."""
    if warmup_steps is not None:
        return step < warmup_steps
    return seen <= warmup_measurements


def _measurement(value: Any) -> float | None:
    """The value as a float, or None when it is missing (None, NaN, inf)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"value must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    try:
        return check_real("value", value)  # TypeError for a string, a bool or a non-number
    except ValueError:  # NaN or inf
        return None


#: Events a detector keeps (the most recent): its state stays bounded however long the run.
MAX_KEPT_EVENTS = 1000


@dataclass
class _Series:
    """Mutable state of one ``(layer, projection, metric)`` series."""

    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, value, running best)
    best: float | None = None
    last_step: int | None = None
    saturation_armed: bool = True
    saturation_best: float | None = None  # best when saturation last fired
    collapse_fired: bool = False
    reported_pairs: set[tuple[int, int]] = field(default_factory=set)
    seen: int = 0  # measurements fed, warmup included

    def to_state(self) -> dict[str, Any]:
        return {
            "history": [[s, v, b] for s, v, b in self.history],
            "best": self.best,
            "last_step": self.last_step,
            "saturation_armed": self.saturation_armed,
            "saturation_best": self.saturation_best,
            "collapse_fired": self.collapse_fired,
            "reported_pairs": sorted([i, j] for i, j in self.reported_pairs),
            "seen": self.seen,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Series:
        return cls(
            history=[(int(s), float(v), float(b)) for s, v, b in state["history"]],
            best=None if state["best"] is None else float(state["best"]),
            last_step=None if state["last_step"] is None else int(state["last_step"]),
            saturation_armed=bool(state["saturation_armed"]),
            saturation_best=None if state["saturation_best"] is None else float(state["saturation_best"]),
            collapse_fired=bool(state["collapse_fired"]),
            reported_pairs={(int(i), int(j)) for i, j in state["reported_pairs"]},
            seen=int(state.get("seen", 0)),
        )


class SaturationDetector:
    """Detects saturating, collapsing and redundant head diversity from a stream of measurements.

    Args:
        patience: number of measurements (not steps) without improvement before saturation fires;
            the robust slope is fitted over the last ``patience + 1`` measurements.
        min_delta: the smallest gain, over the whole window, that counts as improvement; in the
            metric's units (HDI units by default).
        warmup_measurements: the first this many measurements of each series are ignored entirely
            (no history, no best value, no event): the transient after random initialisation is no
            reference. Counted in measurements, so the warm-up follows the measuring cadence.
        warmup_steps: instead, ignore the measurements at training steps below this (None: count
            measurements).
        collapse_delta: collapse fires when the value is worse than the best so far by more than
            this, in the metric's units.
        redundancy_threshold: a head pair is redundant when its overlap (or correlation) is at least
            this; in ``(0, 1]``.

    The defaults are the settings the warnings study chose on all its runs
    (``benchmarks/results/warnings_study.json``, ``chosen_on_all_runs``; ``docs/early-warnings.md``):
    ``patience=3`` measurements, ``min_delta=0.01`` HDI over that window, a warm-up of 10
    measurements, ``collapse_delta=0.01`` HDI and ``redundancy_threshold=0.9``. Chosen on the runs
    that score them, they are a starting point, not evidence: held out, no event kind beat the
    study's baselines (saturation's plateaus are predicted better by extrapolating the held-out loss,
    collapse's spikes by "this run has already spiked"), so none of them warns by default
    (`hdi_monitor.evidence.DEFAULTS_ON`); the events are recorded and drawn. The
    thresholds are absolute, in the metric's units: feed effective heads to a second detector with
    thresholds in heads.

    Each series is keyed by ``(layer, projection, metric)``; steps must increase within a series.
    """

    def __init__(
        self,
        *,
        patience: int = 3,
        min_delta: float = 0.01,
        warmup_measurements: int = 10,
        warmup_steps: int | None = None,
        collapse_delta: float = 0.01,
        redundancy_threshold: float = 0.9,
    ) -> None:
        patience = check_int("patience", check_index("patience", patience))  # measurements
        min_delta = check_real("min_delta", min_delta)
        if min_delta < 0:
            raise ValueError(
                f"min_delta must be >= 0 (higher is better for every metric watched), got {min_delta}; "
                "pass its absolute value"
            )
        warmup_measurements, warmup_steps = _check_warmup(warmup_measurements, warmup_steps)
        collapse_delta = check_real("collapse_delta", collapse_delta, low=0.0, low_open=True)
        redundancy_threshold = check_real(
            "redundancy_threshold", redundancy_threshold, low=0.0, high=1.0, low_open=True
        )
        self.patience = patience
        self.min_delta = min_delta
        self.warmup_measurements = warmup_measurements
        self.warmup_steps = warmup_steps
        self.collapse_delta = collapse_delta
        self.redundancy_threshold = redundancy_threshold
        self._series: dict[_Key, _Series] = {}
        self._events: list[DiversityEvent] = []

    # ------------------------------------------------------------------ public API

    @property
    def events(self) -> tuple[DiversityEvent, ...]:
        """The events issued so far, in order: the last `MAX_KEPT_EVENTS` (survives `state_dict`)."""
        return tuple(self._events)

    @property
    def seen(self) -> int:
        """Measurements fed so far to its most-fed series, warm-up included (0 for a fresh detector;
        a resumed one goes on counting)."""
        return max((series.seen for series in self._series.values()), default=0)

    def best(self, layer: str, projection: Projection, metric: Metric = "hdi") -> float | None:
        """Best (highest) value of a series after warmup, or None before its first measurement."""
        series = self._series.get((layer, projection, metric))
        return None if series is None else series.best

    def history(self, layer: str, projection: Projection, metric: Metric = "hdi") -> list[tuple[int, float]]:
        """The ``(step, value)`` measurements kept for a series: the last ``patience + 1`` after warmup."""
        series = self._series.get((layer, projection, metric))
        return [] if series is None else [(s, v) for s, v, _ in series.history]

    def reset(self) -> None:
        """Forget every series and event (for a new, unrelated run)."""
        self._series.clear()
        self._events.clear()

    def update(
        self,
        step: int,
        layer: str,
        projection: Projection,
        value: float | Tensor | None,
        *,
        metric: Metric = "hdi",
        chance: float | None = None,
        pairwise: Tensor | None = None,
    ) -> list[DiversityEvent]:
        """Feed one measurement and return the events it triggers that were not issued before.

        Args:
            step: training step of the measurement; must increase within a series.
            layer: qualified module name, or ``"mean"`` for the model mean.
            projection: one of `PROJECTIONS`.
            value: the measurement (float, int, numpy or 0-d tensor). None, NaN and inf are treated
                as missing: no history, no saturation or collapse check.
            metric: one of `METRICS`.
            chance: chance level of the metric (e.g. `hdi_monitor.chance_hdi`), quoted in
                messages.
            pairwise: optional ``(H, H)`` overlap (metric ``"hdi"``) or activation correlation
                matrix for the redundancy check; NaN entries are ignored. Checked even when
                ``value`` is missing.

        Returns:
            New events, in the order saturation, collapse, redundancy; ``[]`` during warmup.
        """
        step = check_int("step", check_index("step", step), low=0)
        if not isinstance(layer, str) or not layer:
            raise TypeError(f"layer must be a non-empty str (qualified module name or 'mean'), got {layer!r}")
        check_choice("projection", projection, PROJECTIONS)
        check_choice("metric", metric, METRICS)
        chance = None if chance is None else check_real("chance", chance)
        if pairwise is not None:
            check_pairwise(pairwise)
        measured = _measurement(value)

        key = (layer, projection, metric)
        series = self._series.get(key)
        if series is not None and series.last_step is not None and step <= series.last_step:
            raise ValueError(
                f"step {step} for {layer!r} ({projection}, {metric}) is not after the previous measurement "
                f"at step {series.last_step}; steps must increase (call reset() or use a fresh detector "
                "for a new run)"
            )
        if series is None:
            series = self._series[key] = _Series()
        series.last_step = step
        series.seen += 1
        if self.warming(step, series.seen):
            return []

        events: list[DiversityEvent] = []
        if measured is not None:
            events.extend(self._update_series(series, key, step, measured, chance))
        if pairwise is not None:
            event = self._check_redundancy(series, key, step, measured, chance, pairwise)
            if event is not None:
                events.append(event)
        self._events.extend(events)
        del self._events[:-MAX_KEPT_EVENTS]
        return events

    def warming(self, step: int, seen: int) -> bool:
        """True while a series is warming up: its ``seen``-th measurement at ``step`` (1-based) is
        ignored (see ``warmup_measurements`` and ``warmup_steps``)."""
        return _warming(step, seen, self.warmup_measurements, self.warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (ints, floats, strs, bools, None, lists, dicts): loadable with
        ``torch.load(..., weights_only=True)``."""
        return {
            "version": _STATE_VERSION,
            "config": {
                "patience": self.patience,
                "min_delta": self.min_delta,
                "warmup_measurements": self.warmup_measurements,
                "warmup_steps": self.warmup_steps,
                "collapse_delta": self.collapse_delta,
                "redundancy_threshold": self.redundancy_threshold,
            },
            "series": [
                {"layer": layer, "projection": projection, "metric": metric, **series.to_state()}
                for (layer, projection, metric), series in self._series.items()
            ],
            "events": [event.to_dict() for event in self._events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore history, best values and issued events from `state_dict`.

        The settings given to this detector's constructor are kept (a saved ``config`` is only
        informative); if ``patience`` shrank, each history is cut to the last ``patience + 1``
        measurements.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from SaturationDetector.state_dict(), got {type(state).__name__}")
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported SaturationDetector state version {version!r} (expected {_STATE_VERSION})")
        try:
            series: dict[_Key, _Series] = {}
            for record in state["series"]:
                restored = _Series.from_state(record)
                restored.history = restored.history[-(self.patience + 1) :]
                projection: Projection = check_choice("projection", record["projection"], PROJECTIONS)
                metric: Metric = check_choice("metric", record["metric"], METRICS)
                series[(str(record["layer"]), projection, metric)] = restored
            events = [DiversityEvent.from_dict(e) for e in state["events"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed SaturationDetector state: {err!r}") from err
        self._series = series
        self._events = events[-MAX_KEPT_EVENTS:]

    # ------------------------------------------------------------------ detection

    def _update_series(
        self, series: _Series, key: _Key, step: int, value: float, chance: float | None
    ) -> list[DiversityEvent]:
        previous_best = series.best
        if series.best is None or value > series.best:
            series.best = value
        series.history.append((step, value, series.best))
        del series.history[: -(self.patience + 1)]

        events: list[DiversityEvent] = []
        if len(series.history) == self.patience + 1:
            steps = [float(s) for s, _, _ in series.history]
            values = [v for _, v, _ in series.history]
            gain = theil_sen_slope(steps, values) * (steps[-1] - steps[0])
            improvement = series.best - series.history[0][2]
            if series.saturation_armed:
                if improvement <= self.min_delta and gain <= self.min_delta:
                    series.saturation_armed = False
                    series.saturation_best = series.best
                    events.append(self._event("saturation", key, step, value, series.best, chance))
            elif (
                series.saturation_best is not None
                and series.best - series.saturation_best > self.min_delta
                and gain > self.min_delta
            ):
                series.saturation_armed = True  # improving again: the next plateau is news

        if not series.collapse_fired and previous_best is not None and series.best - value > self.collapse_delta:
            series.collapse_fired = True
            events.append(self._event("collapse", key, step, value, series.best, chance))
        return events

    def _check_redundancy(
        self,
        series: _Series,
        key: _Key,
        step: int,
        value: float | None,
        chance: float | None,
        pairwise: Tensor,
    ) -> DiversityEvent | None:
        pairs = redundant_pairs(pairwise, self.redundancy_threshold)
        new = {(i, j) for i, j, _ in pairs} - series.reported_pairs
        if not new:
            return None
        series.reported_pairs |= new
        pairs.sort(key=lambda p: (-p[2], p[0], p[1]))
        shown = math.nan if value is None else value
        return self._event("redundancy", key, step, shown, series.best, chance, tuple(pairs))

    # ------------------------------------------------------------------ messages

    def _event(
        self,
        kind: EventKind,
        key: _Key,
        step: int,
        value: float,
        best: float | None,
        chance: float | None,
        pairs: tuple[tuple[int, int, float], ...] = (),
    ) -> DiversityEvent:
        layer, projection, metric = key
        if kind == "saturation":
            message = self._saturation_message(key, step, value, best, chance)
        elif kind == "collapse":
            message = self._collapse_message(key, step, value, best, chance)
        else:
            message = self._redundancy_message(key, step, chance, pairs)
        return DiversityEvent(kind, layer, projection, metric, step, value, best, chance, pairs, message)

    def _subject(self, key: _Key) -> str:
        layer, projection, metric = key
        name = _METRIC_NAMES[metric]
        if layer == "mean":
            return f"The model-mean {name} ({projection})"
        return f"{name[0].upper()}{name[1:]} of '{layer}' ({projection})"

    def _worse_than_chance(self, value: float, chance: float | None) -> bool:
        return chance is not None and value < chance

    def _saturation_message(self, key: _Key, step: int, value: float, best: float | None, chance: float | None) -> str:
        if chance is None:
            ref = ""
        elif self._worse_than_chance(value, chance):
            ref = f", below the {chance:.3f} chance level of random heads"
        else:
            ref = f", chance {chance:.3f}"
        signal = f"saturation/{key[2]}"
        below = self._worse_than_chance(value, chance) and key[2] == "hdi"
        seen = (
            "diversity has saturated with the heads more alike than random ones" if below else "diversity has saturated"
        )
        if backed(signal) and backed("redundancy"):  # the study backs acting on it: the pruning advice
            advice = (
                "; prune redundant heads or try fewer heads (H) or a smaller head width (d_k)"
                if below
                else "; if the loss has stalled too, consider pruning redundant heads or changing H or d_k"
            )
        else:
            advice = ""
        return (
            f"{self._subject(key)} has not improved by more than {self.min_delta:.3g} over the last "
            f"{self.patience} measurements (now {value:.3f}, best {best:.3f}{ref}, step {step}): {seen}{advice} "
            f"({_evidence(signal)})."
        )

    def _collapse_message(self, key: _Key, step: int, value: float, best: float | None, chance: float | None) -> str:
        assert best is not None
        drop = best - value
        signal = f"collapse/{key[2]}"
        head = (
            f"{self._subject(key)} fell by {drop:.3f} from its best {best:.3f} to {value:.3f} at step {step} "
            f"(more than the {self.collapse_delta:.3g} collapse threshold"
        )
        below = self._worse_than_chance(value, chance)
        if backed(signal) and backed("redundancy"):
            advice = (
                "; if the loss has stalled, look for redundant head pairs, or reduce H or d_k"
                if below
                else "; if the loss has stalled, look for redundant head pairs"
            )
        else:
            advice = ""
        if below:
            return (
                f"{head}), now below the {chance:.3f} chance level of random heads: the heads are converging, "
                f"as they do in healthy runs too while they learn{advice} ({_evidence(signal)})."
            )
        ref = "" if chance is None else f"; chance {chance:.3f}"
        return (
            f"{head}{ref}): the heads are becoming more alike, as they do in healthy runs too while they "
            f"learn{advice} ({_evidence(signal)})."
        )

    def _redundancy_message(
        self, key: _Key, step: int, chance: float | None, pairs: tuple[tuple[int, int, float], ...]
    ) -> str:
        layer, projection, metric = key
        where = "The model mean's" if layer == "mean" else f"Layer '{layer}'"
        what = "overlap" if metric == "hdi" else "activation correlation"
        notes = [f"step {step}"]
        if chance is not None and metric == "hdi":
            notes.insert(0, f"random heads overlap about {1.0 - chance:.2f}")
        prune = backed("redundancy")  # pruning advice only where the ablation beat random heads
        if len(pairs) == 1:
            i, j, v = pairs[0]
            advice = ": consider pruning one of them" if prune else ""
            return (
                f"{where} {projection} heads {i} and {j} have {what} {v:.2f} (>= {self.redundancy_threshold:.2f} "
                f"redundancy threshold; {'; '.join(notes)}){advice} ({_evidence('redundancy')})."
            )
        listed = ", ".join(f"{i} and {j} ({v:.2f})" for i, j, v in pairs[:_MAX_PAIRS_IN_MESSAGE])
        more = len(pairs) - _MAX_PAIRS_IN_MESSAGE
        if more > 0:
            listed += f" and {more} more pair{'s' if more > 1 else ''}"
        advice = ": consider pruning one head of each pair, or fewer heads (H)" if prune else ""
        return (
            f"{where} {projection} head pairs {listed} have {what} at or above the "
            f"{self.redundancy_threshold:.2f} redundancy threshold ({'; '.join(notes)}){advice} "
            f"({_evidence('redundancy')})."
        )


def _evidence(signal: str) -> str:
    """The evidence clause of an event message: what the warnings study measured for ``signal``
    out of sample, and whether it warns by default."""
    clause = evidence_clause(signal)
    return clause if backed(signal) else f"an observation, not a validated warning: {clause}"


#: Effective-heads series: a rise of less than this many heads is no improvement.
ACTIVATION_MIN_DELTA = 0.2
#: Effective-heads series: losing more than this many effective heads from the best is a collapse.
ACTIVATION_COLLAPSE_DELTA = 2.0
#: Effective-heads series: the window, in measurements, of the default activation detector.
ACTIVATION_PATIENCE = 10
#: A detector argument: a configured detector, None (off), or ``"default"``.
DetectorArg = SaturationDetector | Literal["default"] | None


def check_detector(name: str, value: Any) -> Any:
    """``value`` if it is a `SaturationDetector`, ``"default"`` or None, else TypeError."""
    if (
        value is not None
        and not isinstance(value, SaturationDetector)
        and not (isinstance(value, str) and value == "default")
    ):
        raise TypeError(f"{name} must be a SaturationDetector, 'default' or None, got {type(value).__name__} {value!r}")
    return value


def resolve_detectors(
    detector: DetectorArg, activation_detector: DetectorArg, *, activations: bool = True
) -> tuple[SaturationDetector | None, SaturationDetector | None]:
    """The two detectors a tracker uses, from its ``detector`` arguments (given objects are used
    as they are, not copied).

    * ``detector`` watches the HDI series. ``"default"`` is ``SaturationDetector()`` (the
      settings the warnings study chose on all its runs: ``patience=3``, ``min_delta=0.01``,
      a warm-up of 10 measurements, ...); None turns HDI early warnings off.
    * ``activation_detector`` watches the effective-heads series (counted in heads) and redundant
      head pairs by output correlation. ``"default"`` derives it from the HDI detector: the same
      warm-up and ``redundancy_threshold``, with the window and thresholds in heads the study chose
      (`ACTIVATION_PATIENCE`, `ACTIVATION_MIN_DELTA`, `ACTIVATION_COLLAPSE_DELTA`; a configured HDI
      detector passes on its own ``patience``); it is None when ``detector`` is None
      or ``activations`` is off. Pass a `SaturationDetector` to configure it on its own.
    """
    check_detector("detector", detector)
    check_detector("activation_detector", activation_detector)
    hdi = SaturationDetector() if isinstance(detector, str) else detector
    if not isinstance(activation_detector, str):
        return hdi, activation_detector
    if hdi is None or not activations:
        return hdi, None
    act = SaturationDetector(
        patience=ACTIVATION_PATIENCE if isinstance(detector, str) else hdi.patience,
        warmup_measurements=hdi.warmup_measurements,
        warmup_steps=hdi.warmup_steps,
        redundancy_threshold=hdi.redundancy_threshold,
        min_delta=ACTIVATION_MIN_DELTA,
        collapse_delta=ACTIVATION_COLLAPSE_DELTA,
    )
    return hdi, act
