"""Hugging Face BERT-layout attention: BERT, RoBERTa and models that copy their layout.

Matched module: the attention wrapper (``BertAttention``, ``RobertaAttention``, ...) that holds
``self`` (``BertSelfAttention`` / ``BertCrossAttention``, with ``query``/``key``/``value``
``nn.Linear`` and ``num_attention_heads``/``attention_head_size``) and ``output``
(``BertSelfOutput``, with the out-projection ``dense``). The wrapper is reported once; its input to
``output.dense`` is the concatenated head output under any attention kernel (eager or sdpa).
Detected by structure, so ``transformers`` is never imported.
"""

from __future__ import annotations

from torch import nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, int_attr, is_linear, linear_sources

__all__ = ["ADAPTER"]


def _match(name: str, module: nn.Module) -> bool:
    inner = getattr(module, "self", None)
    out = getattr(module, "output", None)
    return (
        isinstance(inner, nn.Module)
        and isinstance(out, nn.Module)
        and all(is_linear(getattr(inner, p, None)) for p in ("query", "key", "value"))
        and is_linear(getattr(out, "dense", None))
    )


def _build(name: str, module: nn.Module) -> AttentionLayer:
    inner, dense = module.self, module.output.dense
    heads = int_attr(inner, "num_attention_heads", "num_heads")
    if heads is None:
        raise AdapterMismatch(f"{name}: {type(inner).__name__} has no num_attention_heads")
    head_dim = int_attr(inner, "attention_head_size", "head_dim")
    if head_dim is None:
        head_dim = inner.query.out_features // heads
    for label, size in (("query", inner.query.out_features), ("key", inner.key.out_features),
                        ("value", inner.value.out_features), ("output", dense.in_features)):
        if size != heads * head_dim:
            raise AdapterMismatch(
                f"{name}: {label} has {size} features, expected {heads} heads x {head_dim} = {heads * head_dim}"
            )
    return AttentionLayer(
        name,
        module,
        family="bert",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        model_dim=dense.out_features,
        weights=linear_sources(inner.query, inner.key, inner.value, dense),
        output_module=dense,
        mask_key="attention_mask",
    )


ADAPTER = Adapter(
    family="bert",
    classes="BertAttention, RobertaAttention (self- and cross-attention), and any module with "
    "self.{query,key,value} + output.dense",
    match=_match,
    build=_build,
)
