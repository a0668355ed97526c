"""`DiversityEvent`: one early-warning event, the record every detector returns and every reader
reads (the tracker's ``events``, the warnings, the Text tab, the study).

Plain data with no dependency on the detectors, so that the measured step's record
(`hdi_monitor.measure.measurement.Measurement`) can carry events without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hdi_monitor._validation import check_choice

__all__ = [
    "DIVERSITY_EVENT_KINDS",
    "EVENT_KINDS",
    "KERNEL_EVENT_KINDS",
    "METRICS",
    "PROJECTIONS",
    "DiversityEvent",
    "EventKind",
    "Metric",
    "Projection",
]

EventKind = Literal["saturation", "collapse", "redundancy", "entropy_collapse", "logit_blowup"]
Projection = Literal["query", "key", "value", "output", "activations", "kernel"]
Metric = Literal["hdi", "effective_heads", "attention_entropy", "max_attention_logit"]
#: The kinds of the diversity detector (`SaturationDetector`).
DIVERSITY_EVENT_KINDS: tuple[EventKind, ...] = ("saturation", "collapse", "redundancy")
#: The kinds of the kernel-statistics detector (`KernelDetector`; only with ``kernel_stats`` on).
KERNEL_EVENT_KINDS: tuple[EventKind, ...] = ("entropy_collapse", "logit_blowup")
EVENT_KINDS: tuple[EventKind, ...] = DIVERSITY_EVENT_KINDS + KERNEL_EVENT_KINDS
PROJECTIONS: tuple[Projection, ...] = ("query", "key", "value", "output", "activations", "kernel")
METRICS: tuple[Metric, ...] = ("hdi", "effective_heads", "attention_entropy", "max_attention_logit")


@dataclass(frozen=True)
class DiversityEvent:
    """One early-warning event for a layer (or the model mean) and projection.

    Attributes:
        kind: ``"saturation"``, ``"collapse"``, ``"redundancy"`` (`SaturationDetector`), or
            ``"entropy_collapse"``, ``"logit_blowup"`` (`KernelDetector`).
        layer: qualified module name of the attention layer, or ``"mean"`` for the model mean.
        projection: ``"query"``, ``"key"``, ``"value"``, ``"output"``, ``"activations"``, or
            ``"kernel"`` (kernel statistics).
        metric: ``"hdi"``, ``"effective_heads"``, ``"attention_entropy"`` or
            ``"max_attention_logit"``.
        step: training step of the measurement that triggered the event.
        value: the measured value at ``step`` (NaN for a redundancy event whose measurement had no
            value).
        best: best (highest) value of the series so far; None when no value was recorded (and for
            ``logit_blowup``).
        chance: chance level of the metric when the caller knows it (for ``entropy_collapse``: the
            uniform-attention level ``ln(n_keys)``).
        pairs: ``(i, j, overlap_or_correlation)`` with ``i < j``, strongest first (redundancy only).
        message: one readable sentence with the numbers, what the warnings study measured for the
            signal (`hdi_monitor.evidence`) and, only where the study backs one, a suggestion.
    """

    kind: EventKind
    layer: str
    projection: Projection
    metric: Metric
    step: int
    value: float
    best: float | None
    chance: float | None
    pairs: tuple[tuple[int, int, float], ...] = ()
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict (``pairs`` as a list of ``[i, j, value]`` lists)."""
        return {
            "kind": self.kind,
            "layer": self.layer,
            "projection": self.projection,
            "metric": self.metric,
            "step": self.step,
            "value": self.value,
            "best": self.best,
            "chance": self.chance,
            "pairs": [[i, j, v] for i, j, v in self.pairs],
            "message": self.message,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiversityEvent:
        """Inverse of `to_dict`."""
        return cls(
            kind=check_choice("kind", data["kind"], EVENT_KINDS),
            layer=str(data["layer"]),
            projection=check_choice("projection", data["projection"], PROJECTIONS),
            metric=check_choice("metric", data["metric"], METRICS),
            step=int(data["step"]),
            value=float(data["value"]),
            best=None if data["best"] is None else float(data["best"]),
            chance=None if data["chance"] is None else float(data["chance"]),
            pairs=tuple((int(i), int(j), float(v)) for i, j, v in data.get("pairs", ())),
            message=str(data.get("message", "")),
        )
