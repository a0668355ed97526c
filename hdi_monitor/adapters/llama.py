"""Llama-layout attention: Llama, Mistral, Qwen2 and other ``q_proj/k_proj/v_proj/o_proj`` models.

Separate ``nn.Linear`` projections; grouped-query attention has ``k_proj``/``v_proj`` with
``num_key_value_heads * head_dim`` outputs, fewer than ``q_proj``'s ``num_attention_heads *
head_dim``. Head counts come from the weights' shapes and ``head_dim`` (an attribute of the module
in transformers 4.4x and 5.x, else its ``config``), so no ``transformers`` import is needed. Query
and key weights are the pre-RoPE projections. The hook is a pre-hook on ``o_proj``.
"""

from __future__ import annotations

from torch import nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, int_attr, is_linear, linear_sources

__all__ = ["ADAPTER"]

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _match(name: str, module: nn.Module) -> bool:
    if not all(is_linear(getattr(module, p, None)) for p in _PROJ):
        return False
    return (
        int_attr(module, "head_dim") is not None
        or int_attr(module, "num_heads", "num_attention_heads") is not None
    )


def _build(name: str, module: nn.Module) -> AttentionLayer:
    q, k, v, o = (getattr(module, p) for p in _PROJ)
    head_dim = int_attr(module, "head_dim")
    if head_dim is None:
        heads = int_attr(module, "num_heads", "num_attention_heads")
        assert heads is not None
        if q.out_features % heads:
            raise AdapterMismatch(f"{name}: q_proj has {q.out_features} outputs, not divisible by {heads} heads")
        head_dim = q.out_features // heads
    for label, lin, size in (("q_proj", q, q.out_features), ("k_proj", k, k.out_features),
                             ("v_proj", v, v.out_features), ("o_proj", o, o.in_features)):
        if size % head_dim:
            raise AdapterMismatch(f"{name}: {label} has {size} features, not a multiple of head_dim {head_dim}")
    heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
    if v.out_features != k.out_features or o.in_features != q.out_features or heads % kv_heads:
        raise AdapterMismatch(
            f"{name}: inconsistent shapes q_proj {q.out_features}, k_proj {k.out_features}, v_proj "
            f"{v.out_features}, o_proj input {o.in_features} for head_dim {head_dim}"
        )
    return AttentionLayer(
        name,
        module,
        family="llama",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        model_dim=o.out_features,
        weights=linear_sources(q, k, v, o),
        output_module=o,
        mask_key="attention_mask",
    )


ADAPTER = Adapter(
    family="llama",
    classes="LlamaAttention, MistralAttention, Qwen2Attention (grouped-query attention), and any "
    "module with q_proj/k_proj/v_proj/o_proj nn.Linear and head_dim",
    match=_match,
    build=_build,
)
