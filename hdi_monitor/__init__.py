"""hdi-monitor: watch attention-head diversity while transformers train.

Public API is re-exported here; see the README for the definitions.
"""

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
]
