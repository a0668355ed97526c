"""`Measurement`: the one typed, frozen record of a measured step, and `Series`, the typed key of
a scalar series.

A measured step (`hdi_monitor.measure.step.MeasuredStep`) returns a `Measurement` holding the step,
its `hdi_monitor.report.DiversityReport` (per layer and projection: HDI, chance and maximum levels,
invalid heads, overlap matrices, the logit bound; the head-output covariance results and kernel
statistics of the step's forward pass) and what the step noticed. The publisher
(`hdi_monitor.monitor._publish.Publisher`) makes a new record from it, adding the early-warning
events and the scalar series; nothing changes a record once it is made. Every consumer reads
records: the scalar tags, the history, the detectors, the dashboards, ``callback_metrics``, the CLI.
Values stay typed (`Series` keys) until a sink writes them as tags; nothing parses a tag back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hdi_monitor.events import DiversityEvent
from hdi_monitor.report import AngleWork, DiversityReport

__all__ = ["RESERVED_LAYER_NAMES", "ROOT_TAG", "Measurement", "Series", "layer_tag"]

#: Layer names that are also summary tag names; such a layer is tagged ``<name>_layer``.
RESERVED_LAYER_NAMES = frozenset({"mean", "min", "max"})


#: The tag part of the model's own root module, when it is the attention layer (its name is ``""``).
ROOT_TAG = "<root>"


def layer_tag(name: str) -> str:
    """The tag part of a layer name: the name itself, ``<name>_layer`` for a reserved name, or
    ``<root>`` for the model's root module (named ``""``)."""
    if not name:
        return ROOT_TAG
    return f"{name}_layer" if name in RESERVED_LAYER_NAMES else name


@dataclass(frozen=True)
class Series:
    """A typed key of one scalar series.

    Attributes:
        family: ``"hdi"``, ``"hdi_chance"``, ``"hdi_max"``, ``"invalid_heads"``,
            ``"effective_heads"``, ``"head_correlation"``, ``"attention_entropy"``,
            ``"attention_entropy_uniform"``, ``"max_attention_logit"``, ``"logit_bound"``,
            ``"update_entropy"``, ``"diversity_events"``; or a whole tag, for scalars that carry no
            structure (the dashboard's summaries, say).
        projection: the projection (or the event kind, for ``"diversity_events"``), where the
            family has one.
        layer: the layer's qualified name (per-layer series), else None.
        stat: ``"mean"``, ``"min"`` or ``"max"`` (a summary over layers), else None.
    """

    family: str
    projection: str | None = None
    layer: str | None = None
    stat: str | None = None

    @property
    def tag(self) -> str:
        """The scalar tag written for this series."""
        parts = [self.family]
        if self.projection is not None:
            parts.append(self.projection)
        if self.layer is not None:
            parts.append(layer_tag(self.layer))
        elif self.stat is not None:
            parts.append(self.stat)
        return "/".join(parts)


@dataclass(frozen=True)
class Measurement:
    """One measured step (frozen: later stages make new records with `dataclasses.replace`).

    Attributes:
        step: the optimizer step measured.
        report: per-layer results (`DiversityReport`).
        image_step: True if this step's pictures are drawn.
        activations: True if head outputs were captured (their statistics, detector and charts).
        notes: what the measured step noticed and the user should hear once (a watched layer that
            changed, a hook that never fired, a layer with too few tokens, kernel statistics that
            could not be taken); said in the step's one `MonitoringWarning`.
        token_counts: head-output tokens per layer name, summed over the ranks.
        calls: head-output hook calls per layer name in this step (how ``max_tokens`` is shared at
            the next measured step).
        angle_work: principal angles left for the picture worker (CPU copies of the weights); the
            published record drops them.
        events: the early-warning events this step raised (set by the publisher).
        series: the scalar values by typed key (set by the publisher).
    """

    step: int
    report: DiversityReport
    image_step: bool = False
    activations: bool = False
    notes: tuple[str, ...] = ()
    token_counts: Mapping[str, int] = field(default_factory=dict)
    calls: Mapping[str, int] = field(default_factory=dict)
    angle_work: tuple[AngleWork, ...] = ()
    events: tuple[DiversityEvent, ...] = ()
    series: Mapping[Series, float] = field(default_factory=dict)

    @property
    def scalars(self) -> dict[str, float]:
        """The scalar tags written for this step (``series`` by tag; for readers that want tags)."""
        return {key.tag: value for key, value in self.series.items()}

    def value(
        self, family: str, projection: str | None = None, *, layer: str | None = None, stat: str | None = None
    ) -> Any:
        """One scalar of this step by its typed key (None where it was not measured)."""
        return self.series.get(Series(family, projection, layer, stat))
