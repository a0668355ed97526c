"""Family knowledge as data: one `Layout` entry per attention layout, and the refusals.

A layout entry names the children of an attention module that hold its projections (separate
``query``/``key``/``value`` children or one fused ``qkv`` child), how a fused projection packs its
rows (`Packing`), the out-projection child, and where the head counts live. `LAYOUTS`
is the built-in table; `hdi_monitor.models.layout.build_layer` turns a matched module into an
`AttentionLayer`, reading head counts from the module (or the child
named by ``heads_at``), then its ``config``, then the model's ``config`` (only for modules without
one), and checking every count against the weights' shapes.

Fused layouts differ by family and cannot be told apart by shape, so a fused entry is always tied
to module classes; a module with a fused child that no entry knows is refused (see
`fused_refusal`), never guessed.

The code that reads an entry lives in `hdi_monitor.models.layout`; more entries are in
`hdi_monitor.models.layouts_more`.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from hdi_monitor.models.base import Adapter, AdapterMismatch, AttentionLayer, KVMap
from hdi_monitor.models.layout import (
    FUSED_NAMES,
    PACKINGS,
    Layout,
    Packing,
    _positive_int,
    build_layer,
    default_mask_key,
    is_vision_module,
    resolve_heads,
    split_fused,
)
from hdi_monitor.models.layouts_more import MORE_REFUSED, merged
from hdi_monitor.models.weights import base_layer, in_features, is_conv1d, is_projection, out_features

__all__ = [
    "FUSED_NAMES",
    "KVMap",
    "LAYOUTS",
    "Layout",
    "PACKINGS",
    "Packing",
    "ROOT_CONFIG",
    "REFUSED",
    "build_layer",
    "class_refusal",
    "default_mask_key",
    "fused_refusal",
    "is_vision_module",
    "layout_adapters",
    "resolve_heads",
    "split_fused",
]


REFUSED: tuple[tuple[str, str], ...] = (
    (
        r"\w*(Delta|Linear|Lightning)\w*Attention",
        "linear attention (no softmax kernel over q/k); its heads are not "
        "the Nadaraya-Watson heads the HDI describes. Not measured",
    ),
    (
        r"DiffLlama\w*Attention",
        "differential attention pairs heads (two softmax maps per value head); its heads are "
        "not q/k/v row blocks. Not measured; describe the heads you mean with an AttentionSpec",
    ),
)


def class_refusal(module: nn.Module) -> str | None:
    """The refusal message for a class known not to fit its look-alike layout, else None."""
    cls = type(module).__name__
    for pattern, reason in REFUSED:
        if re.fullmatch(pattern, cls):
            return f"{cls}: {reason}"
    return None


def fused_refusal(name: str, module: nn.Module) -> str | None:
    """The refusal message for a module with a fused q/k/v child whose layout no entry knows, else None."""
    for child in FUSED_NAMES:
        m = getattr(module, child, None)
        if is_projection(m) and out_features(m) > in_features(m):
            cls = type(module).__name__
            return (
                f"{cls} has a fused q/k/v projection {child!r} whose row layout is not known for this class "
                f"(it cannot be told from the shapes); not measured. Describe it with AttentionSpec("
                f"modules=..., qkv={child!r}, qkv_layout=..., output=...), qkv_layout one of {PACKINGS}"
            )
    return None


# ------------------------------------------------------------------------------------------ the table


def _cfg(module: nn.Module, attr: str) -> bool:
    cfg = getattr(module, "config", None)
    return bool(getattr(module, attr, getattr(cfg, attr, False)))


def _cross(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False))


def _has_n_head(module: nn.Module) -> bool:
    return _positive_int(getattr(module, "n_head", None)) is not None


# A data table, one compact entry per layout: kept as written, not reformatted.
# fmt: off
LAYOUTS: tuple[Layout, ...] = (
    Layout("timm_vit", "proj", qkv="qkv", packing="contiguous", classes=r"Attention|AttentionRope",
           when=lambda m: _positive_int(getattr(m, "num_heads", None)) is not None, masked=False,
           used_by="timm Attention / AttentionRope (ViT, DeiT, EVA, ...)"),
    Layout("timm_vit", "proj", "q_proj", "k_proj", "v_proj", classes=r"AttentionRope", masked=False,
           used_by="timm AttentionRope(qkv_fused=False)"),
    Layout("vit", "o_proj", "q_proj", "k_proj", "v_proj", vision=True,
           used_by="ViT, DeiT, Dinov2 and other vision towers with q_proj/k_proj/v_proj/o_proj"),
    Layout("vit", "output.dense", "attention.query", "attention.key", "attention.value", vision=True,
           heads_at="attention", used_by="ViT-style attention of transformers 4.x"),
    Layout("bert", "output.dense", "self.query", "self.key", "self.value", heads_at="self",
           used_by="BERT, RoBERTa, ELECTRA, XLM-R, Camembert, ... (self- and cross-attention)"),
    Layout("deberta", "output.dense", "self.query_proj", "self.key_proj", "self.value_proj", heads_at="self",
           used_by="DeBERTa, DeBERTa-v2/v3 (content projections)"),
    Layout("gpt2", "c_proj", cross_query="q_attn", qkv="c_attn", packing="contiguous",
           classes=r"(GPT2|DecisionTransformerGPT2|ImageGPT)Attention", when=_cross,
           used_by="GPT-2 cross-attention (query in q_attn, [k|v] in c_attn)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: is_conv1d(base_layer(getattr(m, "c_attn", None))) and not _cross(m),
           used_by="GPT-2 and its copies (Conv1D c_attn, transposed weights)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: _has_n_head(m) and isinstance(getattr(m, "c_attn", None), nn.Module) and not _cross(m),
           used_by="nanoGPT-style c_attn/c_proj nn.Linear with n_head"),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="multi_query", classes=r"GPTBigCode\w*Attention",
           when=lambda m: _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode / StarCoder, multi_query=True"),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="interleaved", classes=r"GPTBigCode\w*Attention",
           when=lambda m: not _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode, multi_query=False"),
    Layout("falcon", "dense", qkv="query_key_value", packing="grouped", classes=r"Falcon\w*Attention",
           when=lambda m: _cfg(m, "new_decoder_architecture"), used_by="Falcon, new decoder architecture (GQA)"),
    Layout("falcon", "dense", qkv="query_key_value", packing="multi_query", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and _cfg(m, "multi_query"),
           used_by="Falcon, old architecture with multi-query"),
    Layout("falcon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and not _cfg(m, "multi_query"),
           used_by="Falcon, old architecture without multi-query"),
    Layout("gpt_neox", "dense", qkv="query_key_value", packing="interleaved", classes=r"GPTNeoX\w*Attention",
           used_by="GPT-NeoX, Pythia"),
    Layout("bloom", "dense", qkv="query_key_value", packing="interleaved", classes=r"Bloom\w*Attention",
           used_by="Bloom"),
    Layout("phi3", "o_proj", qkv="qkv_proj", packing="contiguous", classes=r"Phi3\w*Attention",
           used_by="Phi-3 (fused qkv_proj, GQA)"),
    Layout("phi3", "o_proj", qkv="qkv_proj", packing="contiguous", classes=r"Phi4MultimodalAttention",
           used_by="Phi-4-multimodal language model"),
    Layout("mpt", "out_proj", qkv="Wqkv", packing="contiguous", classes=r"MptAttention", used_by="MPT"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", classes=r"Exaone4_5_VisionAttention|MgpstrAttention",
           masked=False, used_by="EXAONE 4.5 vision tower (split [q|k|v]), MGP-STR"),
    Layout("vision_qkv", "output.dense", qkv="attention.qkv", packing="contiguous", classes=r"TimeSformerAttention",
           heads_at="attention", masked=False, used_by="TimeSformer"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", module_prefix="transformers.", masked=False,
           classes=r"(CohereCompass|Dots3Note|Ernie4_5_VLMoe|Glm4vMoe|Glm4v|Glm5Next|GlmImage|GlmOcr|Qwen2_5_VL|"
                   r"Qwen3OmniMoe|Qwen3VLMoe|Qwen3VL|Qwen3_5Moe|Qwen3_5|Qwen4Exp)VisionAttention|Sam2MultiScaleAttention|"
                   r"VitDetAttention|\w*SamVision(Sdpa)?Attention|SamHQVision(Sdpa)?Attention|GotOcr2Vision(Sdpa)?Attention|"
                   r"SegGptAttention",
           used_by="Qwen2/2.5/3-VL, GLM-4V, SAM, SAM-HQ, SAM 2, GOT-OCR2, SegGPT and VitDet vision towers "
                   "(qkv reshaped (3, H, d))"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", classes=r"VisionAttention",
           module_prefix="transformers.models.qwen2_vl", masked=False, used_by="Qwen2-VL vision tower"),
    Layout("blip", "projection", qkv="qkv", packing="contiguous", classes=r"(Blip2|InstructBlip|InstructBlipVideo)Attention",
           masked=False, used_by="BLIP-2 / InstructBLIP vision towers"),
    Layout("modernbert", "Wo", qkv="Wqkv", packing="contiguous", classes=r"ModernBert\w*Attention",
           used_by="ModernBERT (Wqkv viewed (3, H, d))"),
    Layout("persimmon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Persimmon\w*Attention",
           used_by="Persimmon, Fuyu"),
    Layout("litgpt", "proj", qkv="qkv", packing="contiguous", classes=r"CausalSelfAttention",
           module_prefix="litgpt", used_by="litgpt GPT (n_query_groups GQA)"),
    Layout("t5", "o", "q", "k", "v", used_by="T5, mT5, UMT5 (encoder, decoder self- and cross-attention)"),
    Layout("llama", "o_proj", "q_proj", "k_proj", "v_proj",
           used_by="Llama, Mistral, Mixtral, Qwen2/3, Gemma 1/2/3, OLMo 1/2, DeepSeek (MHA), ..."),
    Layout("bart", "out_proj", "q_proj", "k_proj", "v_proj",
           used_by="BART, mBART, Marian, Pegasus, Whisper, Wav2Vec2, OPT, GPT-J, CLIP, SigLIP, ..."),
    Layout("phi", "dense", "q_proj", "k_proj", "v_proj", used_by="Phi-1/1.5/2"),
    Layout("vit", "proj", "q_proj", "k_proj", "v_proj", used_by="vision towers with q_proj/k_proj/v_proj/proj (Kimi-K2.5, ...)"),
    Layout("vit", "projection_layer", "q_proj", "k_proj", "v_proj", used_by="InternVL, Janus vision towers"),
    Layout("modernbert", "Wo", "q_proj", "k_proj", "v_proj", used_by="ModernBERT decoder"),
    Layout("conformer", "linear_out", "linear_q", "linear_k", "linear_v",
           used_by="Wav2Vec2-Conformer, Wav2Vec2-BERT, SeamlessM4T, FastSpeech2-Conformer (content projections)"),
    Layout("ctrl", "dense", "Wq", "Wk", "Wv", used_by="CTRL"),
    Layout("bert_attention", "output.dense", "attention.query", "attention.key", "attention.value",
           heads_at="attention", used_by="FLAVA and other attention.{query,key,value} + output.dense modules"),
    Layout("distilbert", "out_lin", "q_lin", "k_lin", "v_lin", used_by="DistilBERT"),
    Layout("albert", "dense", "query", "key", "value", used_by="ALBERT (one module shared by all layers)"),
    Layout("x_transformers", "to_out", "to_q", "to_k", "to_v", classes=r"Attention", module_prefix="x_transformers",
           kv_map="modulo", used_by="x-transformers Attention (GQA maps query head h to h % H_kv)"),
    Layout("wqkvo", "wo", "wq", "wk", "wv", used_by="Meta-reference style wq/wk/wv/wo"),
)
# fmt: on

LAYOUTS, REFUSED = merged(LAYOUTS), REFUSED + MORE_REFUSED


#: The model config of the discovery under way (for modules without a config of their own).
ROOT_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("hdi_monitor_root_config", default=None)


def _matches_any(first: Callable[[str, nn.Module], Layout | None], name: str, module: nn.Module) -> bool:
    return first(name, module) is not None


def layout_adapters(layouts: tuple[Layout, ...] = LAYOUTS) -> list[Adapter]:
    """The layout table as registry `Adapter` objects: one per family label, in table order,
    trying that family's entries in order."""
    families: dict[str, list[Layout]] = {}
    for lay in layouts:
        families.setdefault(lay.family, []).append(lay)
    out = []
    for family, entries in families.items():

        def first(name: str, module: nn.Module, _entries: list[Layout] = entries) -> Layout | None:
            return next((e for e in _entries if e.matches(name, module)), None)

        def build(name: str, module: nn.Module, _first=first) -> AttentionLayer:
            entry = _first(name, module)
            if entry is None:
                raise AdapterMismatch(f"{name}: {type(module).__name__} does not match its layout any more")
            return entry.build(name, module, ROOT_CONFIG.get())

        out.append(
            Adapter(
                family=family,
                classes="; ".join(e.used_by or ", ".join(e.children()) for e in entries),
                match=partial(_matches_any, first),
                build=build,
            )
        )
    return out
