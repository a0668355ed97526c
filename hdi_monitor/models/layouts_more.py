"""More declarative family entries, appended to `hdi_monitor.models.layouts.LAYOUTS`.

Each entry was read from the transformers 5.24 source of the classes it names (the row layout of a
fused projection, where the head counts live); each is checked against what the module feeds its
attention kernel (or its own forward) in ``tests/test_families_more.py``.

`MORE_REFUSED` names classes that look like a known layout but whose kernel q/k/v are not a fixed
row block of the projections: they are refused out loud (appended to
`hdi_monitor.models.layouts.REFUSED`).

Fused layouts that none of the `hdi_monitor.models.layouts.Packing` values describes are given
by a `SplitLayout`, whose ``split`` function turns the fused weight into head-major q, k, v.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models.base import AdapterMismatch, AttentionLayer, WeightSource
from hdi_monitor.models.layout import Layout, _get, build_layer, default_mask_key, resolve_heads
from hdi_monitor.models.weights import in_features, linear_weight, out_features

__all__ = [
    "FIRST_IN_FAMILY",
    "MORE_LAYOUTS",
    "MORE_REFUSED",
    "NOT_ATTENTION",
    "GatedQueryLayout",
    "merged",
    "SplitLayout",
    "codegen_split",
]

#: ``split(module, fused_weight, H, H_kv, d) -> (q, k, v)``, each ``nn.Linear`` layout, head-major.
Splitter = Callable[[nn.Module, Tensor, int, int, int], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class SplitLayout(Layout):
    """A fused entry whose row order no `Packing` describes.

    ``packing`` is still given (``"contiguous"`` for ``[q|k|v]``-sized fused rows): it sets the head
    counts' check against the fused row count; ``split`` then reads the rows in the class's own order.

    Attributes:
        split: the class's own row order, see `Splitter`.
    """

    split: Splitter | None = None

    def build(self, name: str, module: nn.Module, root_config: Any = None, **given: Any) -> AttentionLayer:
        """The `AttentionLayer` of a matched module, q/k/v read through ``split``."""
        layer = build_layer(self, name, module, root_config=root_config, **given)
        split, path = self.split, self.qkv
        if split is None or path is None:
            raise ValueError(f"SplitLayout {self.family}: give qkv and split")
        heads, kv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim

        def part(i: int) -> WeightSource:
            return lambda: split(module, linear_weight(_get(module, path)), heads, kv, d)[i]

        output = self.output
        return AttentionLayer(
            name,
            module,
            family=layer.family,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=d,
            model_dim=layer.model_dim,
            weights={
                "query": part(0),
                "key": part(1),
                "value": part(2),
                "output": lambda: linear_weight(_get(module, output)),
            },
            output_module=layer.output_module,
            mask_key=layer.mask_key,
            kv_map=layer.kv_map,
            projection_dims=layer.projection_dims,
            notes=layer.notes,
        )


@dataclass(frozen=True)
class GatedQueryLayout(Layout):
    """Separate q/k/v/o children where ``query`` also holds an output gate: its rows are ``(H, 2, d)``,
    per head ``[q_h | g_h]`` (Qwen3-Next: ``q_proj(x).view(..., H, 2 d).chunk(2, -1)``, then
    ``o * sigmoid(g)`` before ``o_proj``). The query heads are the ``q_h`` rows; the gate is not a
    projection the HDI reads, and the hooked head outputs are the gated ones (input of ``o_proj``)."""

    def build(self, name: str, module: nn.Module, root_config: Any = None, **given: Any) -> AttentionLayer:
        """The `AttentionLayer` of a matched module (head counts from the module, checked against the rows)."""
        paths = (self.query, self.key, self.value)
        if not all(paths):
            raise ValueError(f"GatedQueryLayout {self.family}: give query, key and value")
        q, k, out = _get(module, paths[0] or ""), _get(module, paths[1] or ""), _get(module, self.output)
        inner = in_features(out)
        heads, kv, d = resolve_heads(
            name, module, inner=inner, kv_rows=out_features(k), heads_at=self.heads_at, root_config=root_config,
            num_heads=given.get("num_heads"), num_kv_heads=given.get("num_kv_heads"), head_dim=given.get("head_dim"),
        )  # fmt: skip
        if out_features(q) != 2 * heads * d:
            raise AdapterMismatch(
                f"{name}: {type(module).__name__}: query rows {out_features(q)} are not (H={heads}, 2, d={d})"
            )

        def source(path: str | None, gated: bool = False) -> WeightSource:
            def read() -> Tensor:
                w = linear_weight(_get(module, path or ""))
                return rearrange(w, "(h two d) m -> two (h d) m", two=2, d=d)[0] if gated else w

            return read

        return AttentionLayer(
            name,
            module,
            family=self.family,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=d,
            model_dim=out_features(out),
            weights={
                "query": source(paths[0], gated=True),
                "key": source(paths[1]),
                "value": source(paths[2]),
                "output": source(self.output),
            },
            output_module=out,
            mask_key=default_mask_key(name, module, root_config) if self.masked else None,
            kv_map=self.kv_map,
        )


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


def _has(path: str) -> Callable[[nn.Module], bool]:
    return lambda m: isinstance(_get(m, path), nn.Linear)


MORE_LAYOUTS: tuple[Layout, ...] = (
    SplitLayout(
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
        classes=r"VJEPA2RopeAttention",
        masked=False,
        used_by="V-JEPA 2 (3D rotary attention)",
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
        "vit",
        "proj",
        "query",
        "key",
        "value",
        classes=r"PvtV2SelfAttention",
        masked=False,
        used_by="PVTv2 (key/value read the spatially reduced tokens)",
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

#: Entries that must be tried before the built-in entries of their family (the structural ``llama``
#: entry matches the same children but its widths do not fit).
FIRST_IN_FAMILY: tuple[Layout, ...] = (
    GatedQueryLayout(
        "llama",
        "o_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        classes=r"(Qwen3Next|Qwen3_5|Qwen3_5Moe|Qwen4Exp\w*)Attention",
        used_by="Qwen3-Next, Qwen3.5 full-attention layers (q_proj rows (H, [q|gate], d), output gate)",
    ),
)


def merged(layouts: tuple[Layout, ...]) -> tuple[Layout, ...]:
    """``layouts`` with each `FIRST_IN_FAMILY` entry put before the first entry of its family (the
    order of the families is unchanged), then `MORE_LAYOUTS` appended."""
    out = list(layouts)
    for entry in FIRST_IN_FAMILY:
        at = next((i for i, e in enumerate(out) if e.family == entry.family), len(out))
        out.insert(at, entry)
    return (*out, *MORE_LAYOUTS)


MORE_REFUSED: tuple[tuple[str, str], ...] = (
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

#: Classes that have attention-like children (an ``in_proj``, or "Attention" in the class name) but hold no
#: attention: Mamba mixers (``in_proj`` packs z, x, B, C, dt), MLPs, a relative-position bias table, a
#: multimodal projector. Discovery does not list them as unmeasured attention.
NOT_ATTENTION = re.compile(
    r"\w*ShortConv|\w*Mamba\w*Mixer|FalconH1Mixer|\w*(MLP|Mlp)|\w*RelativeAttentionBias|\w*MultimodalProjection"
)
