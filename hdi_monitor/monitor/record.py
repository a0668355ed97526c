"""`Measurement`: the one typed record of a measured step.

A measured step produces one record: the step, the `DiversityReport` (per layer and projection:
HDI, chance and maximum levels, invalid heads, the overlap matrices, the head-output covariance
results, the principal angles on image steps) and the early-warning events. It is made by the
same pipeline as `hdi_monitor.head_diversity` (`hdi_monitor.report.compute_report`, weights read
once per measured step) and every consumer reads it: the scalar tags (`hdi_monitor.monitor.tags`),
the bounded history (`hdi_monitor.monitor.history`), the detector and the dashboards. Values stay
typed until a sink turns them into tags; nothing parses tags back into values.

Extending it: a new per-layer result is an optional field of
`hdi_monitor.report.LayerDiversity` (default None or empty); a new scalar it should produce is
one entry in `hdi_monitor.monitor.tags.record_series`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hdi_monitor.monitor.detector import DiversityEvent
from hdi_monitor.report import DiversityReport

__all__ = ["Measurement", "Series", "layer_tag", "RESERVED_LAYER_NAMES"]

#: Layer names that are also summary tag names; such a layer is tagged ``<name>_layer``.
RESERVED_LAYER_NAMES = frozenset({"mean", "min", "max"})


def layer_tag(name: str) -> str:
    """The tag part of a layer name: the name itself, or ``<name>_layer`` for a reserved name."""
    return f"{name}_layer" if name in RESERVED_LAYER_NAMES else name


@dataclass(frozen=True)
class Series:
    """A typed key of one scalar series.

    Attributes:
        family: ``"hdi"``, ``"hdi_chance"``, ``"hdi_max"``, ``"invalid_heads"``,
            ``"effective_heads"``, ``"head_correlation"``, ``"attention_entropy"``,
            ``"attention_entropy_uniform"``, ``"max_attention_logit"``; or a whole tag, for scalars that carry
            no structure (the dashboard's summaries, say).
        projection: the projection, where the family has one.
        layer: the layer's qualified name (per-layer series), else None.
        stat: ``"mean"`` or ``"max"`` (or another summary over layers), else None.
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
    """One measured step.

    Attributes:
        step: the optimizer step measured.
        report: per-layer results (`DiversityReport`); ``report.layers[i].angles`` is filled on
            image steps.
        scalars: the scalar tags written for this step (made from the record by
            `hdi_monitor.monitor.tags.scalar_tags`; a convenience for readers that want tags).
        events: the early-warning events this step raised.
        image_step: True if this step's images and histograms were queued.
    """

    step: int
    report: DiversityReport
    scalars: Mapping[str, float]
    events: list[DiversityEvent] = field(default_factory=list)
    image_step: bool = False
