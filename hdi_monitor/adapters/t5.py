"""T5 attention (``T5Attention``): ``q``/``k``/``v``/``o`` ``nn.Linear`` without bias.

``n_heads`` heads of ``key_value_proj_dim`` (``d_kv``); ``inner_dim = n_heads * d_kv`` may differ
from ``d_model``. Encoder self-attention, decoder self-attention (``SelfAttention``) and decoder
cross-attention (``EncDecAttention``) are all ``T5Attention``; the decoder's layers (``is_decoder``)
take their token mask from ``decoder_attention_mask``, the encoder's from ``attention_mask``. The
hook is a pre-hook on ``o``.
"""

from __future__ import annotations

from torch import nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, int_attr, is_linear, linear_sources

__all__ = ["ADAPTER"]


def _match(name: str, module: nn.Module) -> bool:
    return all(is_linear(getattr(module, p, None)) for p in ("q", "k", "v", "o")) and (
        int_attr(module, "n_heads") is not None and int_attr(module, "key_value_proj_dim") is not None
    )


def _build(name: str, module: nn.Module) -> AttentionLayer:
    heads, head_dim = int_attr(module, "n_heads"), int_attr(module, "key_value_proj_dim")
    assert heads is not None and head_dim is not None
    q, k, v, o = module.q, module.k, module.v, module.o
    inner = heads * head_dim
    for label, size in (("q", q.out_features), ("k", k.out_features), ("v", v.out_features), ("o", o.in_features)):
        if size != inner:
            raise AdapterMismatch(f"{name}: {label} has {size} features, expected {heads} x {head_dim} = {inner}")
    return AttentionLayer(
        name,
        module,
        family="t5",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        model_dim=o.out_features,
        weights=linear_sources(q, k, v, o),
        output_module=o,
        mask_key="decoder_attention_mask" if getattr(module, "is_decoder", False) else "attention_mask",
    )


ADAPTER = Adapter(
    family="t5",
    classes="T5Attention (encoder, decoder self- and cross-attention)",
    match=_match,
    build=_build,
)
