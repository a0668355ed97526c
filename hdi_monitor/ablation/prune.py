"""``prune_heads``: physically remove heads, for the families whose layout is declared here.

The family knowledge is one declarative entry per layout (child names of the projections, the fused
projection and its layout, and the module attributes the forward pass reads for head counts).
Families without an entry are refused with the reason; `ablate_heads` works for all of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hdi_monitor.ablation._hooks import check_heads, resolve_layers
from hdi_monitor.models import AttentionLayer, find_attention_layers

__all__ = ["PRUNE_LAYOUTS", "PruneLayout", "count_parameters", "prune_heads"]

Quantity = Literal["heads", "kv_heads", "kv_groups", "inner"]
"""What an attribute holds: query heads, key/value heads, query heads per key/value head, or
``heads * head_dim``."""


@dataclass(frozen=True)
class PruneLayout:
    """Where one family keeps the tensors and counts that pruning must edit.

    Attributes:
        query, key, value: dotted child paths of separate ``nn.Linear`` projections (None when fused).
        output: dotted child path of the out-projection.
        fused: dotted child path of a fused ``[q | k | v]`` projection (None when separate).
        conv1d: the projections are Hugging Face ``Conv1D`` (weight ``(in, out)``, transposed).
        attributes: ``(dotted path, quantity)`` of the counts the forward pass reads; each is updated
            when the module has it.
        grouped: key/value heads may be fewer than query heads (grouped-query attention).
    """

    output: str
    query: str | None = None
    key: str | None = None
    value: str | None = None
    fused: str | None = None
    conv1d: bool = False
    attributes: tuple[tuple[str, Quantity], ...] = ()
    grouped: bool = False


PRUNE_LAYOUTS: dict[str, PruneLayout] = {
    "bert": PruneLayout(
        query="self.query",
        key="self.key",
        value="self.value",
        output="output.dense",
        attributes=(("self.num_attention_heads", "heads"), ("self.all_head_size", "inner")),
    ),
    "gpt2": PruneLayout(
        fused="c_attn",  # contiguous [q | k | v] columns of a Conv1D
        output="c_proj",
        conv1d=True,
        attributes=(("num_heads", "heads"), ("split_size", "inner")),
    ),
    "llama": PruneLayout(
        query="q_proj",
        key="k_proj",
        value="v_proj",
        output="o_proj",
        attributes=(
            ("num_heads", "heads"),
            ("num_attention_heads", "heads"),
            ("num_key_value_heads", "kv_heads"),
            ("num_kv_heads", "kv_heads"),
            ("num_key_value_groups", "kv_groups"),
        ),
        grouped=True,
    ),
}
"""Declared pruning layouts, keyed by discovery's family label."""

_REFUSED = {
    "torch_mha": "nn.MultiheadAttention's forward requires num_heads * head_dim == embed_dim, so the module "
    "cannot run with fewer heads",
}


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _child(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set_param(module: nn.Module, name: str, value: Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.clone().contiguous(), requires_grad=old.requires_grad))


def _keep_out(module: Any, idx: Tensor, conv1d: bool) -> None:
    """Keep output features ``idx`` (rows of a Linear, columns of a Conv1D) and their bias."""
    w = module.weight.detach()
    _set_param(module, "weight", w[:, idx] if conv1d else w[idx])
    if module.bias is not None:
        _set_param(module, "bias", module.bias.detach()[idx])
    if conv1d:
        module.nf = int(idx.numel())
    else:
        module.out_features = int(idx.numel())


def _keep_in(module: Any, idx: Tensor, conv1d: bool) -> None:
    """Keep input features ``idx`` (columns of a Linear, rows of a Conv1D)."""
    w = module.weight.detach()
    _set_param(module, "weight", w[idx] if conv1d else w[:, idx])
    if conv1d:
        module.nx = int(idx.numel())
    else:
        module.in_features = int(idx.numel())


def _features(heads: Sequence[int], d: int, device: torch.device) -> Tensor:
    return (torch.as_tensor(list(heads), device=device)[:, None] * d + torch.arange(d, device=device)).reshape(-1)


def _check_layout(layer: AttentionLayer) -> PruneLayout:
    if layer.family in _REFUSED:
        raise ValueError(
            f"{layer.name}: cannot prune heads of family {layer.family!r}: {_REFUSED[layer.family]}; "
            "use ablate_heads for it"
        )
    layout = PRUNE_LAYOUTS.get(layer.family)
    if layout is None:
        raise ValueError(
            f"{layer.name}: no pruning layout for family {layer.family!r} (declared: {', '.join(PRUNE_LAYOUTS)}); "
            "use ablate_heads, which works for every family"
        )
    mod = layer.module
    for path in (layout.query, layout.key, layout.value, layout.fused, layout.output):
        if path is None:
            continue
        try:
            child = _child(mod, path)
        except AttributeError:
            raise ValueError(f"{layer.name}: family {layer.family!r} layout expects a child {path!r}") from None
        w = getattr(child, "weight", None)
        if callable(getattr(w, "full_tensor", None)):
            raise ValueError(f"{layer.name}: {path} is sharded (DTensor); prune the unsharded model")  # noqa: TRY004
        if layout.conv1d != (type(child).__name__ == "Conv1D"):
            kind = "Conv1D" if layout.conv1d else "nn.Linear"
            raise ValueError(
                f"{layer.name}: family {layer.family!r} pruning expects {path} to be a {kind}, got {type(child).__name__}"
            )
        if not layout.conv1d and not isinstance(child, nn.Linear):
            raise ValueError(f"{layer.name}: {path} is a {type(child).__name__}, expected nn.Linear")
    if layer.family == "gpt2" and (getattr(mod, "is_cross_attention", False) or hasattr(mod, "q_attn")):
        raise ValueError(f"{layer.name}: GPT-2 cross-attention (q_attn) has no declared pruning layout")
    return layout


def _prune_layer(layer: AttentionLayer, drop: list[int], layout: PruneLayout) -> tuple[int, int]:
    h, kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    mod = layer.module
    keep = [i for i in range(h) if i not in set(drop)]
    group = h // kv
    groups = [[q for q in keep if q // group == g] for g in range(kv)]
    kept_kv = [g for g in range(kv) if groups[g]]  # a key/value head goes only with all its query heads
    sizes = {len(groups[g]) for g in kept_kv}
    expand = len(sizes) > 1
    if expand:
        warnings.warn(
            f"{layer.name}: pruning leaves key/value groups of unequal sizes {[len(groups[g]) for g in kept_kv]}; "
            "each kept query head gets its own copy of its key/value head (exact, but key/value parameters grow)",
            UserWarning,
            stacklevel=3,
        )
        kv_index = [q // group for q in keep]  # one key/value head per kept query head
    else:
        kv_index = kept_kv
    new_h, new_kv = len(keep), len(kv_index)
    dev = layer.head_weights("output").device
    q_idx, kv_idx = _features(keep, d, dev), _features(kv_index, d, dev)
    if layout.fused is not None:
        inner = h * d
        fused = _child(mod, layout.fused)
        _keep_out(fused, torch.cat([q_idx, kv_idx + inner, kv_idx + 2 * inner]), layout.conv1d)
    else:
        assert layout.query and layout.key and layout.value
        _keep_out(_child(mod, layout.query), q_idx, layout.conv1d)
        _keep_out(_child(mod, layout.key), kv_idx, layout.conv1d)
        _keep_out(_child(mod, layout.value), kv_idx, layout.conv1d)
    _keep_in(_child(mod, layout.output), q_idx, layout.conv1d)
    values = {"heads": new_h, "kv_heads": new_kv, "kv_groups": new_h // new_kv, "inner": new_h * d}
    for path, quantity in layout.attributes:
        owner_path, _, attr = path.rpartition(".")
        owner = _child(mod, owner_path) if owner_path else mod
        if isinstance(getattr(owner, attr, None), int):
            setattr(owner, attr, values[quantity])
    return new_h, new_kv


def prune_heads(
    model: nn.Module,
    heads: Mapping[str, Iterable[int]],
    *,
    layers: Sequence[AttentionLayer] | None = None,
) -> nn.Module:
    """Remove heads for good: their rows of the q/k/v projections and columns of the out-projection.

    Edits ``model`` in place (copy it first to keep the original) and returns it. Its outputs
    equal those of ``ablate_heads(model, heads, "zero")`` on the unpruned model. Biases of the
    removed rows go too; the out-projection's bias stays. The module attributes the forward pass
    reads for head counts are updated (BERT: ``num_attention_heads``, ``all_head_size``; GPT-2:
    ``num_heads``, ``split_size``; Llama layout: ``num_key_value_groups`` and any head-count
    attribute present). The model's ``config`` is not changed: it describes the unpruned layers,
    so save a pruned model's ``state_dict`` together with the pruned heads, not with
    ``save_pretrained`` alone.

    Grouped-query attention: a key/value head goes only when all its query heads go. When the
    groups left have unequal sizes, the module's uniform group mapping cannot express them; each
    kept query head then gets its own copy of its key/value head (exact outputs, more key/value
    parameters) and a UserWarning says so.

    Head indices refer to the unpruned model; after pruning, a layer's heads are renumbered
    ``0..H'-1`` in their old order.

    Args:
        model: the model.
        heads: ``{layer name: [head indices]}``.
        layers: attention layers (default: all that discovery finds).

    Returns:
        ``model``, pruned.

    Raises:
        ValueError: an unknown layer or head, all heads of a layer, or a family without a declared
            pruning layout (``torch_mha``, ``t5``, ``vit``, ``timm_vit``, ...), named in the message.
    """
    by_name = resolve_layers(model, layers)
    chosen = {n: idx for n, idx in check_heads(heads, by_name).items() if idx}
    layouts = {}
    for name, idx in chosen.items():
        layer = by_name[name]
        if len(idx) == layer.num_heads:
            raise ValueError(f"{name}: cannot remove all {layer.num_heads} heads of a layer; keep at least one")
        layouts[name] = _check_layout(layer)  # every layer checked before anything is edited
    expected = {}
    with torch.no_grad():
        for name, idx in chosen.items():
            expected[name] = _prune_layer(by_name[name], idx, layouts[name])
        found = {lay.name: lay for lay in find_attention_layers(model)}
    for name, (new_h, new_kv) in expected.items():
        lay = found.get(name)
        if lay is None or (lay.num_heads, lay.num_kv_heads) != (new_h, new_kv):
            got = None if lay is None else (lay.num_heads, lay.num_kv_heads)
            raise RuntimeError(
                f"{name}: after pruning discovery reads (heads, kv heads) = {got}, expected {(new_h, new_kv)}"
            )
    return model
