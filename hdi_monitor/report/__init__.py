"""The diversity report: what `compute_report` makes from the layers' weights, and its records.

Modules:

* `records`: `LayerDiversity` (one attention layer: HDI per projection, reference levels, invalid
  heads, overlaps, logit bound; the head-output covariance, kernel statistics and update entropy
  that a measured step adds) and `DiversityReport` (a model), frozen; `ACTIVATIONS`.
* `compute`: `compute_report` (one read of the weights, batched over the layers of one shape, on
  the weights' device), `weight_groups`, `AngleWork` and `compute_angles`.
* `_bounds`: the logit bounds (private).

The measured step (`hdi_monitor.measure.step.MeasuredStep`) adds a forward pass's statistics as
new records; `hdi_monitor.head_diversity` is the one-shot entry point. Use the names below.
"""

from hdi_monitor.report.compute import ANGLE_COPY_BYTES, AngleWork, compute_angles, compute_report, weight_groups
from hdi_monitor.report.records import (
    ACTIVATIONS,
    DiversityReport,
    LayerDiversity,
    Progress,
    Projection,
    WeightTap,
)

__all__ = [
    "ACTIVATIONS",
    "ANGLE_COPY_BYTES",
    "AngleWork",
    "DiversityReport",
    "LayerDiversity",
    "Progress",
    "Projection",
    "WeightTap",
    "compute_angles",
    "compute_report",
    "weight_groups",
]
