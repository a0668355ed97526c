"""Act on the diagnosis: ablate heads, measure their importance, rank and prune them.

* `ablate_heads`: a context manager removing heads' contributions (zero or mean), at the input
  of the output projection, for every family discovery knows.
* `head_importance`: the gradient importance of Michel et al. (2019).
* `head_similarity`, `redundancy_ranking` and the other rankings: which heads the others of their layer already cover.
* `prune_heads`: physically remove heads (BERT layout, GPT-2, Llama layout with GQA).

See docs/pruning.md for the definitions and the MiniLM experiment.
"""

from hdi_monitor.ablation._hooks import head_output_means
from hdi_monitor.ablation.ablate import AblationMode, ablate_heads
from hdi_monitor.ablation.importance import head_importance
from hdi_monitor.ablation.prune import (
    PRUNE_LAYOUTS,
    PruneLayout,
    count_parameters,
    prune_heads,
)
from hdi_monitor.ablation.ranking import (
    Ranking,
    combined_ranking,
    head_similarity,
    importance_ranking,
    layer_head_counts,
    random_ranking,
    redundancy_ranking,
    redundancy_scores,
    select_heads,
)

__all__ = [
    "PRUNE_LAYOUTS",
    "AblationMode",
    "PruneLayout",
    "Ranking",
    "ablate_heads",
    "combined_ranking",
    "count_parameters",
    "head_importance",
    "head_output_means",
    "head_similarity",
    "importance_ranking",
    "layer_head_counts",
    "prune_heads",
    "random_ranking",
    "redundancy_ranking",
    "redundancy_scores",
    "select_heads",
]
