"""Hugging Face ViT attention (``ViTAttention``) and vision models that copy its layout.

transformers 5.x: ``ViTAttention`` holds ``q_proj``/``k_proj``/``v_proj``/``o_proj`` ``nn.Linear``,
``num_attention_heads`` and ``head_dim``. transformers 4.x: ``ViTAttention`` holds ``attention``
(``ViTSelfAttention`` with ``query``/``key``/``value``) and ``output`` (``ViTSelfOutput`` with
``dense``). Vision modules are recognised by a ``config`` with ``patch_size``/``image_size`` or by
the class name (``ViT*``, ``DeiT*``, ``Dinov2*``); they have no token mask (``mask_key=None``). The
hook is a pre-hook on the out-projection (``o_proj`` or ``output.dense``).
"""

from __future__ import annotations

import re

from torch import nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, int_attr, is_linear, linear_sources

__all__ = ["ADAPTER"]

_VISION_CLASS = re.compile(r"^(ViT|Vit|DeiT|Deit|Dinov2|Dinov2WithRegisters)\w*Attention$")
_NEW = ("q_proj", "k_proj", "v_proj", "o_proj")


def _is_vision(module: nn.Module) -> bool:
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "patch_size") and hasattr(cfg, "image_size"):
        return True
    return _VISION_CLASS.match(type(module).__name__) is not None


def _layout(module: nn.Module) -> str | None:
    if all(is_linear(getattr(module, p, None)) for p in _NEW):
        return "new"
    inner, out = getattr(module, "attention", None), getattr(module, "output", None)
    if (
        isinstance(inner, nn.Module)
        and all(is_linear(getattr(inner, p, None)) for p in ("query", "key", "value"))
        and is_linear(getattr(out, "dense", None))
    ):
        return "old"
    return None


def _match(name: str, module: nn.Module) -> bool:
    return _layout(module) is not None and _is_vision(module)


def _build(name: str, module: nn.Module) -> AttentionLayer:
    if _layout(module) == "new":
        q, k, v, o = (getattr(module, p) for p in _NEW)
        holder = module
    else:
        holder = module.attention
        q, k, v, o = holder.query, holder.key, holder.value, module.output.dense
    heads = int_attr(holder, "num_attention_heads", "num_heads")
    if heads is None:
        raise AdapterMismatch(f"{name}: {type(holder).__name__} has no num_attention_heads")
    head_dim = int_attr(holder, "head_dim", "attention_head_size") or q.out_features // heads
    inner = heads * head_dim
    for label, size in (("query", q.out_features), ("key", k.out_features), ("value", v.out_features),
                        ("output", o.in_features)):
        if size != inner:
            raise AdapterMismatch(f"{name}: {label} has {size} features, expected {heads} x {head_dim} = {inner}")
    return AttentionLayer(
        name,
        module,
        family="vit",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        model_dim=o.out_features,
        weights=linear_sources(q, k, v, o),
        output_module=o,
        mask_key=None,
    )


ADAPTER = Adapter(
    family="vit",
    classes="ViTAttention (transformers 5 q_proj/k_proj/v_proj/o_proj layout and the 4.x "
    "attention.{query,key,value} + output.dense layout), DeiT/Dinov2 copies",
    match=_match,
    build=_build,
)
