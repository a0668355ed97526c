"""Which heads to remove first: redundancy from diversity, importance, combined, random.

**Redundancy** (the diversity ranking). For one layer, the pairwise similarity of heads ``i`` and
``j`` is the mean over the measured views ``v`` of ``s^v_ij``:

* for each projection ``p`` in ``projections``: the spectrally weighted subspace overlap
  ``rho^w_ij = ||W_i^T W_j||_F^2 / (||W_i^T W_i||_F ||W_j^T W_j||_F)`` of the project's definitions
  (``weighting="uniform"``: the mean squared cosine of the principal angles);
* with ``inputs``: the positive part ``max(R_ij, 0)`` of the correlation of the heads'
  contributions ``c_h = W_O,h o_h`` to the layer output over the inputs' tokens (anti-correlated
  heads cancel each other; neither covers the other).

Under grouped-query attention the key and value views are left out: query heads of one group share
their key/value head, so those overlaps describe the group, not the query head. Invalid heads (all
zero or non-finite weights) get similarity 1 to every head (they contribute nothing).

Head ``h``'s redundancy within the set ``S`` of its layer's remaining heads is
``r_h(S) = max_{j in S, j != h} s_ij``: how well the closest other head already covers it. The
ranking is greedy: remove the head with the largest ``r_h`` over all layers (ties: earlier layer,
then lower index), drop it from ``S``, recompute, repeat. Removing one of two duplicate heads thus
makes the other one unique again. A layer's last head is never ranked before the others' heads run
out (it comes last).

**Importance**: heads in increasing order of the layer-normalised gradient importance of Michel et
al. (2019) (`head_importance`), compared across layers as in the paper.

**Combined**: heads in increasing order of the mean of their positions in the given orders.

**Random**: a permutation from a private, seeded ``torch.Generator`` (the global generator is never
drawn from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hdi_monitor.ablation._hooks import resolve_layers
from hdi_monitor.models import AttentionLayer

__all__ = [
    "Ranking",
    "combined_ranking",
    "head_similarity",
    "importance_ranking",
    "layer_head_counts",
    "random_ranking",
    "redundancy_ranking",
    "redundancy_scores",
    "select_heads",
]

Ranking = list[tuple[str, int]]
"""Heads in the order to remove them: ``[(layer name, head index), ...]``."""

Projection = Literal["query", "key", "value", "output"]


def head_similarity(
    model: nn.Module,
    *,
    projections: Sequence[Projection] = ("query", "key", "value", "output"),
    weighting: Literal["spectral", "uniform"] = "spectral",
    inputs: Any = None,
    max_tokens: int | None = None,
    layers: Sequence[AttentionLayer] | None = None,
) -> dict[str, Tensor]:
    """Pairwise head similarity of every layer, the mean over the measured views (module docstring).

    Args:
        model: the model.
        projections: projections whose subspace overlap is a view (may be empty when ``inputs`` is given).
        weighting: subspace overlap, ``"spectral"`` or ``"uniform"``.
        inputs: batches for the output-correlation view (see `hdi_monitor.head_diversity`).
        max_tokens: cap on tokens per layer for the correlation.
        layers: attention layers (default: all that discovery finds).

    Returns:
        ``{layer name: (H, H) float32 CPU similarity in [0, 1]}``, ones on the diagonal.

    Raises:
        ValueError: no view at all (no projection and no inputs).
    """
    from hdi_monitor.measure.oneshot import head_diversity

    projections = tuple(projections)
    if not projections and inputs is None:
        raise ValueError("head_similarity needs at least one view: a projection or inputs")
    by_name = resolve_layers(model, layers)
    report = head_diversity(
        model,
        projections=projections or ("output",),
        weighting=weighting,
        layers=list(by_name),
        inputs=inputs,
        max_tokens=max_tokens,
    )
    out: dict[str, Tensor] = {}
    for lay in report.layers:
        gqa = lay.num_kv_heads != lay.num_heads
        views = [lay.overlap[p] for p in projections if not (gqa and p in ("key", "value"))]
        if inputs is not None:
            assert lay.correlation is not None
            views.append(lay.correlation.float().clamp_min(0.0))
        if not views:
            raise ValueError(
                f"{lay.name}: grouped-query layer with only key/value projections and no inputs: no view left"
            )
        sim = torch.stack([v.float() for v in views]).nan_to_num(nan=1.0).mean(0)
        sim.fill_diagonal_(1.0)
        out[lay.name] = sim
    return out


def redundancy_ranking(similarity: Mapping[str, Tensor]) -> Ranking:
    """Greedy removal order by redundancy ``r_h(S) = max_{j in S, j != h} s_ij`` (module docstring)."""
    return [(name, h) for name, h, _ in redundancy_scores(similarity)]


def redundancy_scores(similarity: Mapping[str, Tensor]) -> list[tuple[str, int, float]]:
    """The greedy order of `redundancy_ranking` with each head's ``r_h(S)`` when it was removed.

    Each layer's last head comes at the end with score NaN (no other head is left to cover it).
    """
    names = list(similarity)
    remaining = {n: list(range(similarity[n].shape[0])) for n in names}
    order: list[tuple[str, int, float]] = []
    while True:
        best: tuple[float, int, int] | None = None  # (-score, layer position, head)
        for pos, name in enumerate(names):
            rest = remaining[name]
            if len(rest) < 2:
                continue
            sub = similarity[name][rest][:, rest].clone()
            sub.fill_diagonal_(-float("inf"))
            scores = sub.max(1).values.tolist()
            for h, score in zip(rest, scores, strict=True):
                key = (-score, pos, h)
                if best is None or key < best:
                    best = key
        if best is None:
            break
        neg, pos, h = best
        order.append((names[pos], h, -neg))
        remaining[names[pos]].remove(h)
    order.extend((n, remaining[n][0], float("nan")) for n in names if remaining[n])
    return order


def importance_ranking(importance: Mapping[str, Tensor]) -> Ranking:
    """Heads in increasing order of importance (ties: earlier layer, lower index)."""
    items = [
        (float(score), pos, h, name)
        for pos, (name, scores) in enumerate(importance.items())
        for h, score in enumerate(scores.detach().cpu().tolist())
    ]
    return [(name, h) for _, _, h, name in sorted(items)]


def combined_ranking(*orders: Ranking) -> Ranking:
    """Heads in increasing order of their mean position in ``orders`` (ties: the first order's)."""
    if not orders:
        raise ValueError("combined_ranking needs at least one order")
    heads = set(orders[0])
    for o in orders[1:]:
        if set(o) != heads or len(o) != len(orders[0]):
            raise ValueError("combined_ranking: the orders must rank the same heads, each once")
    position = {head: [o.index(head) for o in orders] for head in heads}
    first = {head: i for i, head in enumerate(orders[0])}
    return sorted(heads, key=lambda head: (sum(position[head]) / len(orders), first[head]))


def random_ranking(num_heads: Mapping[str, int], seed: int = 0) -> Ranking:
    """A random order of all heads from a private generator seeded with ``seed``."""
    heads = [(name, h) for name, n in num_heads.items() for h in range(n)]
    gen = torch.Generator().manual_seed(int(seed))
    return [heads[i] for i in torch.randperm(len(heads), generator=gen).tolist()]


def select_heads(order: Ranking, count: int, num_heads: Mapping[str, int]) -> dict[str, list[int]]:
    """The first ``count`` heads of ``order``, skipping any that would leave its layer without a head.

    Returns:
        ``{layer name: sorted head indices}`` for layers with at least one head selected.

    Raises:
        ValueError: ``count`` is negative or more than the heads that can go (all but one per layer).
    """
    removable = sum(n - 1 for n in num_heads.values())
    if not 0 <= count <= removable:
        raise ValueError(f"count must be in 0..{removable} (every layer keeps one head), got {count}")
    left = dict(num_heads)
    chosen: dict[str, list[int]] = {}
    taken = 0
    for name, h in order:
        if taken >= count:
            break
        if left[name] <= 1:
            continue
        chosen.setdefault(name, []).append(h)
        left[name] -= 1
        taken += 1
    return {name: sorted(v) for name, v in chosen.items()}


def layer_head_counts(model: nn.Module, layers: Sequence[AttentionLayer] | None = None) -> dict[str, int]:
    """``{layer name: num_heads}`` for the model's attention layers."""
    return {name: lay.num_heads for name, lay in resolve_layers(model, layers).items()}
