"""The family table shared by the kernel tests: one tiny random-weight config and batch per family.

`CASES` lists every built-in family with the layer families discovery must report for it;
`build` makes the model (biases zeroed, see `kernel_capture.zero_biases`). Used by
`test_families.py` (each case against its attention kernel) and `test_discovery.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from kernel_capture import zero_biases
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

D, H, V, T = 32, 4, 64, 7


def _ids(n: int = T, seed: int = 0, low: int = 3) -> torch.Tensor:
    return torch.randint(low, V, (2, n), generator=torch.Generator().manual_seed(seed))


def ids_batch() -> dict:
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, -2:] = 0
    return {"input_ids": _ids(), "attention_mask": mask}


def seq2seq_batch() -> dict:
    return {**ids_batch(), "decoder_input_ids": _ids(5, 1)}


def pixels(size: int = 16) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))


def text_image_batch() -> dict:
    return {"input_ids": _ids(), "pixel_values": pixels()}


def whisper_batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"input_features": torch.randn(2, 8, 32, generator=g), "decoder_input_ids": _ids(5, 1)}


def audio_batch() -> dict:
    return {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(4))}


def llava_batch() -> dict:
    ids = _ids(12)
    ids[:, 1:5] = 60  # 4 image tokens = 4 patches of the 16x16 image (CLS dropped)
    return {"input_ids": ids, "pixel_values": pixels()}


def gemma3_batch() -> dict:
    ids = _ids(12)
    ids[:, 1:5] = 60  # mm_tokens_per_image
    return {"input_ids": ids, "pixel_values": pixels(), "token_type_ids": (ids == 60).long()}


@dataclass
class Case:
    id: str
    config: Callable[[], object]
    batch: Callable[[], dict]
    families: set[str]
    kv_heads: int | None = None  # expected H_kv of the text layers, where it matters


def _llama_kw(**kw) -> dict:
    base = dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    return {**base, **kw}


_BART = dict(
    vocab_size=V,
    d_model=D,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=H,
    decoder_attention_heads=H,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    max_position_embeddings=64,
    pad_token_id=1,
    decoder_start_token_id=2,
)
_VISION = dict(
    image_size=16, patch_size=8, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37
)
_TEXT = dict(
    vocab_size=V,
    hidden_size=D,
    num_hidden_layers=1,
    num_attention_heads=H,
    intermediate_size=37,
    max_position_embeddings=16,
)


def _c(name: str, **kw) -> Callable[[], object]:
    return lambda: getattr(transformers, name)(**kw)


CASES = [
    Case(
        "distilbert",
        _c("DistilBertConfig", vocab_size=V, dim=D, n_layers=2, n_heads=H, hidden_dim=37),
        ids_batch,
        {"distilbert"},
    ),
    Case(
        "albert",
        _c(
            "AlbertConfig",
            vocab_size=V,
            embedding_size=16,
            hidden_size=D,
            num_hidden_layers=3,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        ids_batch,
        {"albert"},
    ),
    Case(
        "gpt_bigcode_mqa",
        _c("GPTBigCodeConfig", vocab_size=V, n_embd=D, n_layer=2, n_head=H, multi_query=True),
        ids_batch,
        {"gpt_bigcode"},
        kv_heads=1,
    ),
    Case(
        "gpt_bigcode_mha",
        _c("GPTBigCodeConfig", vocab_size=V, n_embd=D, n_layer=2, n_head=H, multi_query=False),
        ids_batch,
        {"gpt_bigcode"},
        kv_heads=H,
    ),
    Case(
        "gpt_neox",
        _c(
            "GPTNeoXConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        ids_batch,
        {"gpt_neox"},
    ),
    Case("bloom", _c("BloomConfig", vocab_size=V, hidden_size=D, n_layer=2, n_head=H), ids_batch, {"bloom"}),
    Case(
        "falcon_new_gqa",
        _c(
            "FalconConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_kv_heads=2,
            new_decoder_architecture=True,
        ),
        ids_batch,
        {"falcon"},
        kv_heads=2,
    ),
    Case(
        "falcon_old_mqa",
        _c(
            "FalconConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            new_decoder_architecture=False,
            multi_query=True,
        ),
        ids_batch,
        {"falcon"},
        kv_heads=1,
    ),
    Case(
        "falcon_old_mha",
        _c(
            "FalconConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            new_decoder_architecture=False,
            multi_query=False,
        ),
        ids_batch,
        {"falcon"},
        kv_heads=H,
    ),
    Case(
        "gptj",
        _c("GPTJConfig", vocab_size=V, n_embd=D, n_layer=2, n_head=H, rotary_dim=4, n_positions=64),
        ids_batch,
        {"bart"},
    ),
    Case(
        "opt",
        _c(
            "OPTConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            ffn_dim=37,
            word_embed_proj_dim=D,
            max_position_embeddings=64,
        ),
        ids_batch,
        {"bart"},
    ),
    Case("phi", _c("PhiConfig", **_llama_kw()), ids_batch, {"phi"}, kv_heads=2),
    Case("phi3", _c("Phi3Config", **_llama_kw(pad_token_id=0)), ids_batch, {"phi3"}, kv_heads=2),
    Case("bart", _c("BartConfig", **_BART), seq2seq_batch, {"bart"}),
    Case("mbart", _c("MBartConfig", **_BART), seq2seq_batch, {"bart"}),
    Case("marian", _c("MarianConfig", **_BART), seq2seq_batch, {"bart"}),
    Case(
        "whisper",
        _c(
            "WhisperConfig",
            vocab_size=V,
            num_mel_bins=8,
            d_model=D,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=H,
            decoder_attention_heads=H,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_source_positions=16,
            max_target_positions=16,
            pad_token_id=1,
            decoder_start_token_id=2,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        ),
        whisper_batch,
        {"bart"},
    ),
    Case(
        "wav2vec2",
        _c(
            "Wav2Vec2Config",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
            conv_dim=(8, 8),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2,
        ),
        audio_batch,
        {"bart"},
    ),
    Case(
        "clip", _c("CLIPConfig", text_config=_TEXT, vision_config=_VISION, projection_dim=8), text_image_batch, {"bart"}
    ),
    Case(
        "siglip", _c("SiglipConfig", text_config=_TEXT, vision_config=_VISION), text_image_batch, {"bart", "torch_mha"}
    ),
    Case(
        "llava",
        _c(
            "LlavaConfig",
            text_config={"model_type": "llama", **_llama_kw(vocab_size=V)},
            vision_config={"model_type": "clip_vision_model", **_VISION},
            image_token_index=60,
            projector_hidden_act="gelu",
        ),
        llava_batch,
        {"llama", "bart"},
    ),
    Case(
        "gemma3_mm",
        _c(
            "Gemma3Config",
            text_config={"model_type": "gemma3_text", **_llama_kw(head_dim=8)},
            vision_config={"model_type": "siglip_vision_model", **{**_VISION, "patch_size": 4}},
            mm_tokens_per_image=4,
            image_token_index=60,
        ),
        gemma3_batch,
        {"llama", "bart", "torch_mha"},
    ),
    Case(
        "modernbert",
        _c(
            "ModernBertConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        ids_batch,
        {"modernbert"},
    ),
    Case(
        "persimmon",
        _c(
            "PersimmonConfig",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        ids_batch,
        {"persimmon"},
    ),
    Case("ctrl", _c("CTRLConfig", vocab_size=V, n_embd=D, n_layer=2, n_head=H, dff=37), ids_batch, {"ctrl"}),
    # families that worked before, now also against the kernel
    Case(
        "bert",
        _c("BertConfig", vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, intermediate_size=37),
        ids_batch,
        {"bert"},
    ),
    Case(
        "electra",
        _c(
            "ElectraConfig",
            vocab_size=V,
            embedding_size=16,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        ids_batch,
        {"bert"},
    ),
    Case("gpt2", _c("GPT2Config", vocab_size=V, n_embd=D, n_layer=2, n_head=H), ids_batch, {"gpt2"}),
    Case("llama", _c("LlamaConfig", **_llama_kw()), ids_batch, {"llama"}, kv_heads=2),
    Case("mistral", _c("MistralConfig", **_llama_kw()), ids_batch, {"llama"}, kv_heads=2),
    Case(
        "mixtral",
        _c("MixtralConfig", **_llama_kw(num_local_experts=2, num_experts_per_tok=1, intermediate_size=32)),
        ids_batch,
        {"llama"},
        kv_heads=2,
    ),
    Case("qwen2", _c("Qwen2Config", **_llama_kw()), ids_batch, {"llama"}, kv_heads=2),
    Case("qwen3", _c("Qwen3Config", **_llama_kw(head_dim=8)), ids_batch, {"llama"}, kv_heads=2),
    Case("gemma2", _c("Gemma2Config", **_llama_kw(head_dim=8)), ids_batch, {"llama"}, kv_heads=2),
    Case("gemma3_text", _c("Gemma3TextConfig", **_llama_kw(head_dim=8)), ids_batch, {"llama"}, kv_heads=2),
    Case("olmo", _c("OlmoConfig", **_llama_kw()), ids_batch, {"llama"}, kv_heads=2),
    Case("olmo2", _c("Olmo2Config", **_llama_kw()), ids_batch, {"llama"}, kv_heads=2),
    Case(
        "t5",
        _c("T5Config", vocab_size=V, d_model=D, d_kv=6, d_ff=37, num_layers=1, num_decoder_layers=1, num_heads=H),
        seq2seq_batch,
        {"t5"},
    ),
    Case("vit", _c("ViTConfig", **_VISION), lambda: {"pixel_values": pixels()}, {"vit"}),
    Case(
        "deepseek_v3",
        _c(
            "DeepseekV3Config",
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=H,
            intermediate_size=37,
            moe_intermediate_size=16,
            q_lora_rank=12,
            kv_lora_rank=10,
            qk_nope_head_dim=6,
            qk_rope_head_dim=4,
            v_head_dim=5,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            max_position_embeddings=64,
            rope_interleave=False,
        ),
        ids_batch,
        {"mla"},
    ),
]


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    impl = "eager" if case.id in ("bloom", "gemma2") else "sdpa"  # these two have no sdpa path
    model = transformers.AutoModel.from_config(case.config(), attn_implementation=impl).eval()
    zero_biases(model)
    return model
