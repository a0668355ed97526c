"""hdi-monitor: watch attention-head diversity while transformers train.

The root holds the names a user needs (see ``__all__``); everything else is imported from its
subpackage. The Lightning callback and the tracker are imported on first use, so
``import hdi_monitor`` does not import Lightning, TensorBoard or transformers.

Layout (data flows one way, each layer imports only those below it; ``docs/architecture.md``
draws a measurement's route):

- `hdi_monitor.functional`: pure tensor math (principal angles, overlaps, HDI, reference levels,
  head-output covariance moments, kernel statistics, the logit bound and update entropy).
- `hdi_monitor.models`: everything that touches `nn.Module`: attention discovery, the family
  table, `AttentionSpec`, LoRA weights, sharded weights, hooks, the kernel capture.
- `hdi_monitor.report`: `compute_report` (weights -> `DiversityReport`).
- `hdi_monitor.config` (`MonitorConfig`, the one settings object) and `hdi_monitor.events`
  (`DiversityEvent`): plain data, read by the layers above.
- `hdi_monitor.measure`: the measured step (`MeasuredStep` -> frozen `Measurement`), its
  accumulators and collectives, and the one-shot `head_diversity`.
- `hdi_monitor.monitor`: the framework-free `HDITracker` (schedule, resume, error policy) and the
  `Publisher` (detectors, history, warnings, sinks, pictures).
- `hdi_monitor.integrations`: the Lightning callback `HDIMonitor`, the Hugging Face
  `HDITrainerCallback`, the sinks for W&B, MLflow and Comet loggers.
- `hdi_monitor.ablation`: ablate, rank and prune heads.
- `hdi_monitor.cli`: the ``hdi-monitor`` command; `hdi_monitor.contrib`: add-ons (allocation
  advisor, ensemble decomposition, demo model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hdi_monitor.exceptions import DiversityWarning, MonitoringWarning

__version__ = "0.2.0"

__all__ = [
    "AttentionSpec",
    "DiversityEvent",
    "DiversityReport",
    "DiversityWarning",
    "HDIMonitor",
    "HDITracker",
    "HDITrainerCallback",
    "MonitorConfig",
    "MonitoringWarning",
    "SaturationDetector",
    "__version__",
    "discover_attention",
    "head_diversity",
    "head_importance",
    "prune_heads",
]

# name -> defining module, imported on first access (keeps `import hdi_monitor` light)
_LAZY = {
    "AttentionSpec": "hdi_monitor.models",
    "discover_attention": "hdi_monitor.models",
    "DiversityReport": "hdi_monitor.report",
    "head_diversity": "hdi_monitor.measure.oneshot",
    "HDITracker": "hdi_monitor.monitor.tracker",
    "MonitorConfig": "hdi_monitor.config",
    "DiversityEvent": "hdi_monitor.events",
    "SaturationDetector": "hdi_monitor.monitor.detector",
    "HDIMonitor": "hdi_monitor.integrations.lightning",
    "HDITrainerCallback": "hdi_monitor.integrations.hf_trainer",
    "head_importance": "hdi_monitor.ablation",
    "prune_heads": "hdi_monitor.ablation",
}

# names the root exported up to 0.2, and where they live now
_MOVED = {
    "AdapterMismatch": "hdi_monitor.exceptions",
    "AttentionLayer": "hdi_monitor.models",
    "Discovery": "hdi_monitor.models",
    "SkippedModule": "hdi_monitor.models",
    "find_attention_layers": "hdi_monitor.models",
    "HeadCovarianceAccumulator": "hdi_monitor.measure.covariance",
    "HeadCovarianceResult": "hdi_monitor.functional.covariance",
    "head_covariance": "hdi_monitor.functional.covariance",
    "LayerDiversity": "hdi_monitor.report",
    "compute_report": "hdi_monitor.report",
    "Measurement": "hdi_monitor.measure.measurement",
    "LoggerSink": "hdi_monitor.monitor.sinks",
    "MemorySink": "hdi_monitor.monitor.sinks",
    "TensorBoardSink": "hdi_monitor.monitor.sinks",
    "ablate_heads": "hdi_monitor.ablation",
    "redundancy_ranking": "hdi_monitor.ablation",
    **{
        name: "hdi_monitor.functional.diversity"
        for name in (
            "chance_hdi",
            "head_diversity_index",
            "invalid_heads",
            "max_hdi",
            "orthonormal_basis",
            "pairwise_principal_angles",
            "principal_angles",
            "subspace_overlap",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        moved = _MOVED.get(name)
        hint = f"; since 0.3 it is imported from its subpackage: from {moved} import {name}" if moved else ""
        raise AttributeError(f"module 'hdi_monitor' has no attribute {name!r}{hint}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - what static tools see
    from hdi_monitor.ablation import head_importance, prune_heads
    from hdi_monitor.config import MonitorConfig
    from hdi_monitor.events import DiversityEvent
    from hdi_monitor.integrations.hf_trainer import HDITrainerCallback
    from hdi_monitor.integrations.lightning import HDIMonitor
    from hdi_monitor.measure.oneshot import head_diversity
    from hdi_monitor.models import AttentionSpec, discover_attention
    from hdi_monitor.monitor.detector import SaturationDetector
    from hdi_monitor.monitor.tracker import HDITracker
    from hdi_monitor.report import DiversityReport
