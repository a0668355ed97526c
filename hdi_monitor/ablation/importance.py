"""Gradient head importance (Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor.ablation._hooks import edit_head_outputs, gate_edit, resolve_layers
from hdi_monitor.models import AttentionLayer
from hdi_monitor.models.hooks import eval_mode, iter_batches

__all__ = ["head_importance"]

LossFn = Callable[[nn.Module, Any], Tensor]
"""``loss_fn(model, batch) -> scalar loss``; it calls the model itself."""


def head_importance(
    model: nn.Module,
    batches: Any,
    loss_fn: LossFn,
    *,
    layers: Sequence[AttentionLayer] | None = None,
    normalize: bool = True,
) -> dict[str, Tensor]:
    """Gradient importance of every head: ``I_h = E_batches |dL / d xi_h|``.

    A gate ``xi_h = 1`` multiplies each head's output at the input of the output projection (the
    place `ablate_heads` edits), so the forward pass is unchanged, and ``dL/dxi_h`` is the
    first-order change of the loss when the head is removed (``xi_h = 0``). One backward pass per
    batch, ``torch.autograd.grad`` with respect to the gates only: the model's ``.grad`` fields are
    not touched. The model runs in eval mode (no dropout; restored afterwards). As in the paper's
    code, the absolute gradient of each batch's loss is averaged over batches, and with
    ``normalize`` each layer's scores are divided by their L2 norm over the layer's heads (the
    paper found the layer normalisation important when pruning across layers).

    Args:
        model: the model.
        batches: one batch or an iterable of batches (see `hdi_monitor.head_diversity`).
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss tensor.
        layers: attention layers (default: all that discovery finds).
        normalize: divide each layer's scores by their L2 norm.

    Returns:
        ``{layer name: (H,) float32 importance}`` on the layer's device; larger = more important.

    Raises:
        ValueError: no batch, or a loss that is not a scalar.
    """
    by_name = resolve_layers(model, layers)
    totals: dict[str, Tensor] = {}
    seen = 0
    with torch.enable_grad(), eval_mode(model):
        for batch in iter_batches(batches):
            gates = {
                name: torch.ones(
                    lay.num_heads, dtype=torch.float32, device=lay.head_weights("output").device, requires_grad=True
                )
                for name, lay in by_name.items()
            }
            edits = {name: gate_edit(gate, by_name[name].num_heads) for name, gate in gates.items()}
            with edit_head_outputs(by_name, edits):
                loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss).__name__)}"
                )
            grads = torch.autograd.grad(loss.reshape(()), list(gates.values()), allow_unused=True)
            for (name, gate), g in zip(gates.items(), grads, strict=True):
                g = torch.zeros_like(gate) if g is None else g.detach()
                totals[name] = totals.get(name, 0) + g.abs()
            seen += 1
    if seen == 0:
        raise ValueError("batches held no batch")
    out = {}
    for name, total in totals.items():
        score = total / seen
        if normalize:
            score = score / score.norm().clamp_min(1e-20)
        out[name] = score
    return out
