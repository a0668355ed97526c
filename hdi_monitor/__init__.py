"""hdi-monitor: watch attention-head diversity while transformers train.

The public API. The Lightning callback and the tracker are imported on first use, so
``import hdi_monitor`` for the math alone does not import Lightning or TensorBoard.

Layout (data flows one way, each layer imports only those below it):

- `hdi_monitor.functional`: pure tensor math (principal angles, overlaps, HDI, reference levels,
  the head-output covariance accumulator).
- `hdi_monitor.models`: everything that touches `nn.Module`: attention discovery, the family
  table, `AttentionSpec`, LoRA weights, sharded weights, hooks.
- `hdi_monitor.report`: `head_diversity` / `compute_report` and the `DiversityReport`.
- `hdi_monitor.monitor`: the framework-free `HDITracker`, its early-warning detector, sinks and
  rendering.
- `hdi_monitor.integrations`: the Lightning callback `HDIMonitor`, the Hugging Face
  `HDITrainerCallback`.
- `hdi_monitor.ablation`: ablate, rank and prune heads.
- `hdi_monitor.cli`: the ``hdi-monitor`` command; `hdi_monitor.contrib`: add-ons (allocation
  advisor, ensemble decomposition, demo model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hdi_monitor.exceptions import AdapterMismatch, DiversityWarning, MonitoringWarning
from hdi_monitor.functional.diversity import (
    chance_hdi,
    head_diversity_index,
    invalid_heads,
    max_hdi,
    orthonormal_basis,
    pairwise_principal_angles,
    principal_angles,
    subspace_overlap,
)

__version__ = "0.2.0"

__all__ = [
    "AdapterMismatch",
    "AttentionLayer",
    "AttentionSpec",
    "Discovery",
    "DiversityEvent",
    "DiversityReport",
    "DiversityWarning",
    "HDIMonitor",
    "HDITracker",
    "HDITrainerCallback",
    "HeadCovarianceAccumulator",
    "HeadCovarianceResult",
    "LayerDiversity",
    "LoggerSink",
    "Measurement",
    "MemorySink",
    "MonitorConfig",
    "MonitoringWarning",
    "SaturationDetector",
    "SkippedModule",
    "TensorBoardSink",
    "__version__",
    "ablate_heads",
    "chance_hdi",
    "compute_report",
    "discover_attention",
    "find_attention_layers",
    "head_covariance",
    "head_diversity",
    "head_diversity_index",
    "head_importance",
    "invalid_heads",
    "max_hdi",
    "orthonormal_basis",
    "pairwise_principal_angles",
    "principal_angles",
    "prune_heads",
    "redundancy_ranking",
    "subspace_overlap",
]

# name -> defining module, imported on first access (keeps `import hdi_monitor` light)
_LAZY = {
    "AttentionLayer": "hdi_monitor.models",
    "AttentionSpec": "hdi_monitor.models",
    "Discovery": "hdi_monitor.models",
    "SkippedModule": "hdi_monitor.models",
    "discover_attention": "hdi_monitor.models",
    "find_attention_layers": "hdi_monitor.models",
    "HeadCovarianceAccumulator": "hdi_monitor.functional.covariance",
    "HeadCovarianceResult": "hdi_monitor.functional.covariance",
    "head_covariance": "hdi_monitor.functional.covariance",
    "DiversityReport": "hdi_monitor.report",
    "LayerDiversity": "hdi_monitor.report",
    "compute_report": "hdi_monitor.report",
    "head_diversity": "hdi_monitor.report",
    "HDITracker": "hdi_monitor.monitor.tracker",
    "Measurement": "hdi_monitor.monitor.tracker",
    "MonitorConfig": "hdi_monitor.monitor.config",
    "DiversityEvent": "hdi_monitor.monitor.detector",
    "SaturationDetector": "hdi_monitor.monitor.detector",
    "LoggerSink": "hdi_monitor.monitor.sinks",
    "MemorySink": "hdi_monitor.monitor.sinks",
    "TensorBoardSink": "hdi_monitor.monitor.sinks",
    "HDIMonitor": "hdi_monitor.integrations.lightning",
    "HDITrainerCallback": "hdi_monitor.integrations.hf_trainer",
    "ablate_heads": "hdi_monitor.ablation",
    "head_importance": "hdi_monitor.ablation",
    "prune_heads": "hdi_monitor.ablation",
    "redundancy_ranking": "hdi_monitor.ablation",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hdi_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - what static tools see
    from hdi_monitor.ablation import ablate_heads, head_importance, prune_heads, redundancy_ranking
    from hdi_monitor.functional.covariance import HeadCovarianceAccumulator, HeadCovarianceResult, head_covariance
    from hdi_monitor.integrations.hf_trainer import HDITrainerCallback
    from hdi_monitor.integrations.lightning import HDIMonitor
    from hdi_monitor.models import (
        AttentionLayer,
        AttentionSpec,
        Discovery,
        SkippedModule,
        discover_attention,
        find_attention_layers,
    )
    from hdi_monitor.monitor.config import MonitorConfig
    from hdi_monitor.monitor.detector import DiversityEvent, SaturationDetector
    from hdi_monitor.monitor.sinks import LoggerSink, MemorySink, TensorBoardSink
    from hdi_monitor.monitor.tracker import HDITracker, Measurement
    from hdi_monitor.report import DiversityReport, LayerDiversity, compute_report, head_diversity
