"""Family knowledge as data: the built-in `LAYOUTS` table, one `Layout` entry per attention
layout, and the classes refused out loud (`REFUSED`) or not attention at all (`NOT_ATTENTION`).

A layout entry names the children of an attention module that hold its projections (separate
``query``/``key``/``value`` children or one fused ``qkv`` child), how a fused projection packs its
rows (`Packing`, or a class's own `Splitter`), the out-projection child, and where the head counts
live. `hdi_monitor.models.layout` reads an entry (`build_layer` turns a matched module into an
`AttentionLayer`, reading head counts from the module, or the child named by ``heads_at``, then its
``config``, then the model's config passed to it, and checking every count against the weights'
shapes); this module holds only the table and the few predicates and row orders its entries name.

Fused layouts differ by family and cannot be told apart by shape, so a fused entry is always tied
to module classes; a module with a fused child that no entry knows is refused
(`hdi_monitor.models.layout.fused_refusal`), never guessed.

Order matters: `hdi_monitor.models.layout.layout_adapters` makes one adapter per family, in the
order each family first appears, trying its entries in table order (the gated-query ``llama``
entry comes before the structural one, whose children it shares).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models.base import AdapterMismatch
from hdi_monitor.models.heads import get_path, positive_int
from hdi_monitor.models.layout import Layout
from hdi_monitor.models.logits import INVERSE_SQRT_D, LogitRule
from hdi_monitor.models.weights import base_layer, is_conv1d

__all__ = ["LAYOUTS", "NOT_ATTENTION", "REFUSED", "REFUSED_PACKAGES", "codegen_split"]


#: Classes that look like a known layout but compute attention differently: refused with the reason.
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
    (
        r"Gemma(3n|4)AudioAttention",
        "queries are scaled per channel by softplus(per_dim_scale), so its query heads are not row blocks of "
        "q_proj. Not measured",
    ),
    (
        r"DoryAttention",
        "queries are rescaled per channel by the learned `sqk` after the rotary embedding (and "
        "q/k are unit-normalised), so its query heads are not row blocks of q_proj. Not measured",
    ),
    (
        r"Inkling(Text)?Attention",
        "keys and values pass a learned causal short convolution (k_sconv, v_sconv) "
        "after k_proj/v_proj, so its key/value heads are no fixed row blocks of the "
        "projections. Not measured",
    ),
)

#: Packages whose attention classes are refused whatever their children: ``(module prefix, reason)``.
REFUSED_PACKAGES: tuple[tuple[str, str], ...] = (
    (
        "megatron.core",
        "Megatron-core keeps its tensor-parallel shards as plain local tensors (ColumnParallelLinear / "
        "RowParallelLinear, no DTensor placements), so neither the full weights nor which heads this rank holds "
        "can be read without Megatron's parallel state, and its fused linear_qkv packs rows per query group. Not "
        "measured (and not testable here: its forward needs CUDA)",
    ),
)

#: Classes that have attention-like children (an ``in_proj``, or "Attention" in the class name) but hold no
#: attention: Mamba mixers (``in_proj`` packs z, x, B, C, dt), MLPs, a relative-position bias table, a
#: multimodal projector. Discovery does not list them as unmeasured attention.
NOT_ATTENTION = re.compile(
    r"\w*ShortConv|\w*Mamba\w*Mixer|FalconH1Mixer|\w*(MLP|Mlp)|\w*RelativeAttentionBias|\w*MultimodalProjection"
)


# ------------------------------------------------------------------------------------------ the table


def _cfg(module: nn.Module, attr: str) -> bool:
    cfg = getattr(module, "config", None)
    return bool(getattr(module, attr, getattr(cfg, attr, False)))


def _cross(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False))


def _has_n_head(module: nn.Module) -> bool:
    return positive_int(getattr(module, "n_head", None)) is not None


def _has(path: str) -> Callable[[nn.Module], bool]:
    return lambda m: isinstance(get_path(m, path), nn.Linear)


def codegen_split(
    module: nn.Module, w: Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """CodeGen's ``qkv_proj``: rows ``(mp_num, 3, D / mp_num)`` with the three parts in the order
    query, **value**, key (``CodeGenAttention.forward``: ``qkv.view(..., mp_num, 3 * local_dim)``, then
    ``query, value, key = qkv.split(local_dim, dim=-1)``); each part's rows, block-major, are the
    head-major ``(H, d)`` rows of that projection."""
    mp = getattr(module, "mp_num", None)
    if not isinstance(mp, int) or mp < 1:
        raise AdapterMismatch(f"{type(module).__name__} has no positive integer mp_num; its qkv_proj rows are unknown")
    parts = rearrange(w, "(mp s local) m -> s (mp local) m", mp=mp, s=3)
    return parts[0], parts[2], parts[1]


# ---------------------------------------------------------------------------- logit forms (per class)
# How each class forms its logits (position scheme, scale, QK-norm: `hdi_monitor.models.logits`), for
# the weight-only logit bound. Read from the transformers 5.24 source of the classes named (each
# keeps its scale as `scaling`, or `scale` for CLIP and SigLIP, and applies it to <q, k> or to the
# query); each is checked in tests/unit/models/test_logits.py against what its attention kernel receives:
# at token 0, where rotary embeddings are the identity, the declared scale times the weights'
# bilinear form gives the kernel's logit, and the bound times the input norms is never below the
# largest logit. Classes not named here have no bound (the report says so), never a guessed one.

_TF = "transformers."


def _absolute(classes: str, scale: float | str = "scaling", note: str = "") -> LogitRule:
    """Queries and keys reach the product unrotated (absolute or no position embeddings)."""
    return LogitRule(classes=classes, module_prefix=_TF, rotary=False, scale=scale, note=note)


def _rotary(classes: str, scale: float | str = "scaling") -> LogitRule:
    """Queries and keys are rotated by their positions (rotary embeddings, partial ones included)."""
    return LogitRule(classes=classes, module_prefix=_TF, rotary=True, scale=scale)


_DISENTANGLED = LogitRule(
    refusal="disentangled attention adds content-to-position and position-to-content terms, which grow with the "
    "query and key inputs and are not part of W_Q W_K^T"
)
_GPT2 = (_absolute(r"GPT2Attention"),)
_FALCON = (LogitRule(classes=r"FalconAttention", module_prefix=_TF, rotary=None, scale=INVERSE_SQRT_D),)
_ALIBI = "ALiBi position bias (added to the logits) left out of the logit bound"
_T5_BIAS = "relative position bias (added to the logits) left out of the logit bound"
_LLAMA_LIKE = _rotary(
    r"(Llama|Mistral|Mixtral|Qwen2|Qwen2Moe|Qwen3|Qwen3Moe|Gemma|Gemma2|Gemma3|Olmo|Olmo2|Cohere|StableLm|Granite)"
    r"Attention"
)


# A data table, one compact entry per layout: kept as written, not reformatted.
# fmt: off
LAYOUTS: tuple[Layout, ...] = (
    Layout("timm_vit", "proj", qkv="qkv", packing="contiguous", classes=r"Attention|AttentionRope",
           when=lambda m: positive_int(getattr(m, "num_heads", None)) is not None, masked=False,
           used_by="timm Attention / AttentionRope (ViT, DeiT, EVA, ...)"),
    Layout("timm_vit", "proj", "q_proj", "k_proj", "v_proj", classes=r"AttentionRope", masked=False,
           used_by="timm AttentionRope(qkv_fused=False)"),
    Layout("vit", "o_proj", "q_proj", "k_proj", "v_proj", vision=True, logits=(_absolute(r"ViTAttention"),),
           used_by="ViT, DeiT, Dinov2 and other vision towers with q_proj/k_proj/v_proj/o_proj"),
    Layout("vit", "output.dense", "attention.query", "attention.key", "attention.value", vision=True,
           heads_at="attention", used_by="ViT-style attention of transformers 4.x"),
    Layout("bert", "output.dense", "self.query", "self.key", "self.value", heads_at="self",
           logits=(_absolute(r"(Bert|Roberta|Electra)Attention"),),
           used_by="BERT, RoBERTa, ELECTRA, XLM-R, Camembert, ... (self- and cross-attention)"),
    Layout("deberta", "output.dense", "self.query_proj", "self.key_proj", "self.value_proj", heads_at="self",
           logits=(_DISENTANGLED,), used_by="DeBERTa, DeBERTa-v2/v3 (content projections)"),
    Layout("gpt2", "c_proj", cross_query="q_attn", qkv="c_attn", packing="contiguous",
           classes=r"(GPT2|DecisionTransformerGPT2|ImageGPT)Attention", when=_cross, logits=_GPT2,
           used_by="GPT-2 cross-attention (query in q_attn, [k|v] in c_attn)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: is_conv1d(base_layer(getattr(m, "c_attn", None))) and not _cross(m), logits=_GPT2,
           used_by="GPT-2 and its copies (Conv1D c_attn, transposed weights)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: _has_n_head(m) and isinstance(getattr(m, "c_attn", None), nn.Module) and not _cross(m),
           used_by="nanoGPT-style c_attn/c_proj nn.Linear with n_head"),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="multi_query", classes=r"GPTBigCode\w*Attention",
           when=lambda m: _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode / StarCoder, multi_query=True",
           logits=(_absolute(r"GPTBigCodeAttention"),)),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="interleaved", classes=r"GPTBigCode\w*Attention",
           when=lambda m: not _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode, multi_query=False",
           logits=(_absolute(r"GPTBigCodeAttention"),)),
    Layout("falcon", "dense", qkv="query_key_value", packing="grouped", classes=r"Falcon\w*Attention",
           when=lambda m: _cfg(m, "new_decoder_architecture"), used_by="Falcon, new decoder architecture (GQA)",
           logits=_FALCON),
    Layout("falcon", "dense", qkv="query_key_value", packing="multi_query", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and _cfg(m, "multi_query"),
           used_by="Falcon, old architecture with multi-query", logits=_FALCON),
    Layout("falcon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and not _cfg(m, "multi_query"),
           used_by="Falcon, old architecture without multi-query", logits=_FALCON),
    Layout("gpt_neox", "dense", qkv="query_key_value", packing="interleaved", classes=r"GPTNeoX\w*Attention",
           used_by="GPT-NeoX, Pythia", logits=(_rotary(r"GPTNeoXAttention"),)),
    Layout("bloom", "dense", qkv="query_key_value", packing="interleaved", classes=r"Bloom\w*Attention",
           used_by="Bloom", logits=(_absolute(r"BloomAttention", "inv_norm_factor", _ALIBI),)),
    Layout("phi3", "o_proj", qkv="qkv_proj", packing="contiguous", classes=r"Phi3\w*Attention",
           used_by="Phi-3 (fused qkv_proj, GQA)", logits=(_rotary(r"Phi3Attention"),)),
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
           used_by="ModernBERT (Wqkv viewed (3, H, d))", logits=(_rotary(r"ModernBertAttention", INVERSE_SQRT_D),)),
    Layout("persimmon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Persimmon\w*Attention",
           used_by="Persimmon, Fuyu", logits=(_rotary(r"PersimmonAttention"),)),
    Layout("litgpt", "proj", qkv="qkv", packing="contiguous", classes=r"CausalSelfAttention",
           module_prefix="litgpt", used_by="litgpt GPT (n_query_groups GQA)"),
    Layout("t5", "o", "q", "k", "v", used_by="T5, mT5, UMT5 (encoder, decoder self- and cross-attention)",
           logits=(_absolute(r"T5Attention", note=_T5_BIAS),)),
    Layout("llama", "o_proj", "q_proj", "k_proj", "v_proj", classes=r"(Qwen3Next|Qwen3_5|Qwen3_5Moe|Qwen4Exp\w*)Attention",
           gated_query=True,
           used_by="Qwen3-Next, Qwen3.5 full-attention layers (q_proj rows (H, [q|gate], d), output gate)"),
    Layout("llama", "o_proj", "q_proj", "k_proj", "v_proj", logits=(_LLAMA_LIKE,),
           used_by="Llama, Mistral, Mixtral, Qwen2/3, Gemma 1/2/3, OLMo 1/2, DeepSeek (MHA), ..."),
    Layout("bart", "out_proj", "q_proj", "k_proj", "v_proj",
           logits=(_rotary(r"GPTJAttention"), _absolute(r"(Bart|MBart|Marian|Whisper|Wav2Vec2|OPT)Attention"),
                   _absolute(r"(CLIP|Siglip)Attention", "scale")),
           used_by="BART, mBART, Marian, Pegasus, Whisper, Wav2Vec2, OPT, GPT-J, CLIP, SigLIP, ..."),
    Layout("phi", "dense", "q_proj", "k_proj", "v_proj", used_by="Phi-1/1.5/2", logits=(_rotary(r"PhiAttention"),)),
    Layout("vit", "proj", "q_proj", "k_proj", "v_proj", used_by="vision towers with q_proj/k_proj/v_proj/proj (Kimi-K2.5, ...)"),
    Layout("vit", "projection_layer", "q_proj", "k_proj", "v_proj", used_by="InternVL, Janus vision towers"),
    Layout("modernbert", "Wo", "q_proj", "k_proj", "v_proj", used_by="ModernBERT decoder"),
    Layout("conformer", "linear_out", "linear_q", "linear_k", "linear_v",
           used_by="Wav2Vec2-Conformer, Wav2Vec2-BERT, SeamlessM4T, FastSpeech2-Conformer (content projections)"),
    Layout("ctrl", "dense", "Wq", "Wk", "Wv", used_by="CTRL",
           logits=(LogitRule(classes=r"MultiHeadAttention", module_prefix="transformers.models.ctrl", rotary=False,
                             scale="scaling"),)),
    Layout("bert_attention", "output.dense", "attention.query", "attention.key", "attention.value",
           heads_at="attention", used_by="FLAVA and other attention.{query,key,value} + output.dense modules"),
    Layout("distilbert", "out_lin", "q_lin", "k_lin", "v_lin", used_by="DistilBERT",
           logits=(_absolute(r"DistilBertSelfAttention"),)),
    Layout("albert", "dense", "query", "key", "value", used_by="ALBERT (one module shared by all layers)",
           logits=(_absolute(r"AlbertAttention"),)),
    Layout("x_transformers", "to_out", "to_q", "to_k", "to_v", classes=r"Attention", module_prefix="x_transformers",
           kv_map="modulo", used_by="x-transformers Attention (GQA maps query head h to h % H_kv)"),
    Layout("wqkvo", "wo", "wq", "wk", "wv", used_by="Meta-reference style wq/wk/wv/wo"),
    # fmt: on
    # Read from the transformers 5.24 source of the classes they name; each is checked against what
    # the module feeds its attention kernel (or its own forward) in tests/unit/models/test_families_more.py.
    Layout(
        "codegen",
        "out_proj",
        qkv="qkv_proj",
        packing="contiguous",
        classes=r"CodeGenAttention",
        split=codegen_split,
        used_by="CodeGen (qkv_proj rows (mp_num=4, [q|v|k], D/4))",
    ),
    Layout(
        "deberta",
        "output.dense",
        qkv="self.in_proj",
        packing="interleaved",
        classes=r"DebertaAttention",
        heads_at="self",
        used_by="DeBERTa v1 (in_proj viewed (H, 3 d), content projections)",
        logits=(_DISENTANGLED,),
    ),
    Layout(
        "vit", "output", "query", "key", "value", classes=r"Kosmos2_5VisionAttention", used_by="Kosmos-2.5 vision tower"
    ),
    Layout(
        "vit",
        "proj",
        "query",
        "key",
        "value",
        classes=r"VJEPA2RopeAttention|PvtV2SelfAttention",
        masked=False,
        used_by="V-JEPA 2 (3D rotary attention), PVTv2 (key/value read the spatially reduced tokens)",
    ),
    Layout(
        "llama",
        "o_proj.linear",
        "q_proj.linear",
        "k_proj.linear",
        "v_proj.linear",
        classes=r"(Moshi|KyutaiSpeechToText)\w*Attention",
        when=_has("q_proj.linear"),
        used_by="Moshi, Kyutai speech-to-text (MoshiLinear without per-codebook weights)",
    ),
    Layout(
        "vit",
        "proj",
        "q",
        "k",
        "v",
        classes=r"Qwen2_5OmniVisionAttention",
        masked=False,
        used_by="Qwen2.5-Omni vision tower",
    ),
    Layout(
        "funnel",
        "post_proj",
        "q_head",
        "k_head",
        "v_head",
        classes=r"FunnelRelMultiheadAttention",
        used_by="Funnel Transformer (content projections; relative-position and token-type terms left out)",
    ),
    Layout(
        "cpmant",
        "attention_out",
        "project_q",
        "project_k",
        "project_v",
        classes=r"CpmAntAttention",
        used_by="CPM-Ant (position bias left out)",
    ),
    Layout(
        "blip",
        "projection",
        qkv="qkv",
        packing="contiguous",
        classes=r"BlipAttention",
        masked=False,
        used_by="BLIP vision tower (qkv reshaped (3, H, d))",
    ),
    Layout(
        "bert",
        "attention.dense",
        "attention.query",
        "attention.key",
        "attention.value",
        classes=r"TvpEncodeLayer",
        heads_at="attention",
        used_by="TVP (TvpAttention holds q/k/v and its out-projection dense)",
    ),
    Layout(
        "bert",
        "output",
        "longformer_self_attn.query",
        "longformer_self_attn.key",
        "longformer_self_attn.value",
        classes=r"LEDEncoderAttention",
        heads_at="longformer_self_attn",
        used_by="LED encoder (local-attention projections, as Longformer; the global-token projections "
        "query_global/key_global/value_global are not read)",
    ),
    Layout(
        "bark",
        "out_proj",
        qkv="att_proj",
        packing="contiguous",
        classes=r"BarkSelfAttention",
        used_by="Bark semantic / coarse / fine models (att_proj split [q|k|v])",
    ),
    Layout(
        "bert",
        "output",
        "self.query",
        "self.key",
        "self.value",
        classes=r"BigBirdPegasusEncoderAttention",
        heads_at="self",
        used_by="BigBird-Pegasus encoder (full or block-sparse attention)",
    ),
    Layout(
        "conformer",
        "to_out",
        cross_query="to_q",
        qkv="to_kv",
        packing="contiguous",
        classes=r"GraniteSpeech\w*ConformerAttention",
        masked=False,
        used_by="Granite Speech conformer encoder (to_kv chunked [k|v]; Shaw relative positions left out)",
    ),
)
