"""hdi-monitor: watch attention-head diversity while transformers train.

The public API is re-exported here. ``HDIMonitor`` (Lightning) and ``HDITracker`` are imported on
first use, so ``import hdi_monitor`` for the math alone does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hdi_monitor.diversity import (
    chance_hdi,
    head_diversity_index,
    invalid_heads,
    max_hdi,
    orthonormal_basis,
    pairwise_principal_angles,
    principal_angles,
    subspace_overlap,
)

__version__ = "0.1.0"

_LAZY = {
    "HDIMonitor": "hdi_monitor.callback",
    "HDITracker": "hdi_monitor.tracker",
    "HDITrainerCallback": "hdi_monitor.integrations.hf_trainer",
    "Measurement": "hdi_monitor.tracker",
    "MonitoringWarning": "hdi_monitor.tracker",
    "head_diversity": "hdi_monitor.report",
    "compute_report": "hdi_monitor.report",
    "DiversityReport": "hdi_monitor.report",
    "LayerDiversity": "hdi_monitor.report",
    "AttentionSpec": "hdi_monitor.adapters",
    "AttentionLayer": "hdi_monitor.adapters",
    "find_attention_layers": "hdi_monitor.adapters",
    "HeadCovarianceAccumulator": "hdi_monitor.covariance",
    "HeadCovarianceResult": "hdi_monitor.covariance",
    "head_covariance": "hdi_monitor.covariance",
    "bias_variance_covariance": "hdi_monitor.covariance",
    "DiversityWarning": "hdi_monitor.saturation",
    "DiversityEvent": "hdi_monitor.saturation",
    "SaturationDetector": "hdi_monitor.saturation",
    "AllocationLaw": "hdi_monitor.allocation",
    "recommend_allocation": "hdi_monitor.allocation",
    "fit_allocation_law": "hdi_monitor.allocation",
    "optimal_head_dim": "hdi_monitor.allocation",
    "TensorBoardSink": "hdi_monitor.sinks",
    "LoggerSink": "hdi_monitor.sinks",
    "MemorySink": "hdi_monitor.sinks",
}

__all__ = [
    "__version__",
    "chance_hdi",
    "head_diversity_index",
    "invalid_heads",
    "max_hdi",
    "orthonormal_basis",
    "pairwise_principal_angles",
    "principal_angles",
    "subspace_overlap",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hdi_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from hdi_monitor.adapters import AttentionLayer, AttentionSpec, find_attention_layers
    from hdi_monitor.allocation import AllocationLaw, fit_allocation_law, optimal_head_dim, recommend_allocation
    from hdi_monitor.callback import HDIMonitor
    from hdi_monitor.integrations.hf_trainer import HDITrainerCallback
    from hdi_monitor.covariance import (
        HeadCovarianceAccumulator,
        HeadCovarianceResult,
        bias_variance_covariance,
        head_covariance,
    )
    from hdi_monitor.report import DiversityReport, LayerDiversity, compute_report, head_diversity
    from hdi_monitor.saturation import DiversityEvent, DiversityWarning, SaturationDetector
    from hdi_monitor.sinks import LoggerSink, MemorySink, TensorBoardSink
    from hdi_monitor.tracker import HDITracker, Measurement, MonitoringWarning
