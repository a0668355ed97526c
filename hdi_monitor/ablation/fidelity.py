"""How much of a model's behaviour survives an ablation: sentence-embedding fidelity.

For encoders whose output is a sequence of hidden states (a Hugging Face ``BaseModelOutput``, a tuple
whose first item is the hidden states, or a plain tensor):

* the sentence embedding is the mean of the last hidden states over the real tokens
  (``attention_mask``), as sentence-transformers' mean pooling;
* **fidelity** is the mean cosine similarity between the full and the ablated model's embeddings of
  the same held-out sentences;
* **neighbours kept** is the fraction of held-out sentences whose nearest neighbour (cosine, among
  the other held-out sentences) is the same for the ablated model as for the full one.

`pair_contrastive_loss` is the loss used for the gradient importance of such a model when no
task loss exists: consecutive sentences ``(2i, 2i+1)`` of a batch are positives and the other
sentences of the batch negatives (the in-batch InfoNCE loss sentence-transformers trains with, scale
20). At the full model, any loss comparing the ablated model with the full one has a zero gradient in
the gates, so it cannot serve.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hdi_monitor.ablation.ablate import ablate_heads
from hdi_monitor.ablation.ranking import Ranking, select_heads
from hdi_monitor.models import AttentionLayer
from hdi_monitor.models.hooks import call_model, eval_mode, iter_batches

__all__ = ["embed", "fidelity", "mean_pooled", "pair_contrastive_loss", "sweep", "time_forward"]


def _hidden(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    if isinstance(hidden, Tensor):
        return hidden
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise ValueError(
        f"the model returned {type(out).__name__}; expected hidden states (a tensor, last_hidden_state, or a tuple)"
    )


def mean_pooled(model: nn.Module, batch: Any) -> Tensor:
    """Mean of the last hidden states over the batch's real tokens: ``(B, D)`` float32."""
    hidden = _hidden(call_model(model, batch)).float()
    if hidden.ndim != 3:
        raise ValueError(f"expected hidden states of shape (batch, tokens, width), got {tuple(hidden.shape)}")
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def embed(model: nn.Module, batches: Any) -> Tensor:
    """Mean-pooled embeddings of every sentence of ``batches``, ``(N, D)``, in eval mode, no_grad."""
    with torch.no_grad(), eval_mode(model):
        parts = [mean_pooled(model, b) for b in iter_batches(batches)]
    if not parts:
        raise ValueError("no batch to embed")
    return torch.cat(parts)


def _nearest(e: Tensor) -> Tensor:
    e = F.normalize(e, dim=-1)
    sim = e @ e.T
    sim.fill_diagonal_(-float("inf"))
    return sim.argmax(1)


def fidelity(full: Tensor, ablated: Tensor, full_neighbours: Tensor | None = None) -> dict[str, float]:
    """``{"cosine": mean cosine(full_i, ablated_i), "neighbours_kept": fraction of same nearest neighbour}``."""
    if full.shape != ablated.shape or full.ndim != 2 or full.shape[0] < 2:
        raise ValueError(
            f"need two (N >= 2, D) embeddings of the same shape, got {tuple(full.shape)} and {tuple(ablated.shape)}"
        )
    nn_full = _nearest(full) if full_neighbours is None else full_neighbours
    return {
        "cosine": float(F.cosine_similarity(full, ablated, dim=-1).mean()),
        "neighbours_kept": float((_nearest(ablated) == nn_full).float().mean()),
    }


def pair_contrastive_loss(model: nn.Module, batch: Any, scale: float = 20.0) -> Tensor:
    """In-batch InfoNCE over consecutive pairs ``(2i, 2i+1)`` of mean-pooled embeddings (module docstring)."""
    e = F.normalize(mean_pooled(model, batch), dim=-1)
    n = e.shape[0] // 2 * 2
    if n < 2:
        raise ValueError("pair_contrastive_loss needs batches of at least 2 sentences")
    a, b = e[0:n:2], e[1:n:2]
    logits = scale * a @ b.T
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def time_forward(model: nn.Module, batches: Any, repeats: int = 3) -> float:
    """Best of ``repeats`` wall-clock seconds for one no_grad pass over ``batches``."""
    best = float("inf")
    with torch.no_grad(), eval_mode(model):
        for _ in range(repeats):
            start = time.perf_counter()
            for b in iter_batches(batches):
                call_model(model, b)
            best = min(best, time.perf_counter() - start)
    return best


def sweep(
    model: nn.Module,
    heldout: Any,
    rankings: Mapping[str, Ranking],
    fractions: Sequence[float],
    *,
    layers: Sequence[AttentionLayer],
) -> list[dict[str, Any]]:
    """Fidelity on ``heldout`` after zero-ablating the first ``round(f * heads)`` heads of each ranking.

    Returns:
        One row per (ranking, fraction): ``{"ranking", "fraction", "removed", "cosine",
        "neighbours_kept", "heads"}`` (``heads``: ``{layer: [indices]}`` removed).
    """
    counts = {lay.name: lay.num_heads for lay in layers}
    total = sum(counts.values())
    removable = total - len(counts)
    full = embed(model, heldout)
    nn_full = _nearest(full)
    rows = []
    for name, order in rankings.items():
        for f in fractions:
            k = min(round(f * total), removable)
            chosen = select_heads(order, k, counts)
            with ablate_heads(model, chosen, layers=layers):
                ablated = embed(model, heldout)
            rows.append(
                {
                    "ranking": name,
                    "fraction": float(f),
                    "removed": k,
                    **fidelity(full, ablated, nn_full),
                    "heads": chosen,
                }
            )
    return rows
