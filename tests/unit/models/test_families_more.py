"""The families of `hdi_monitor.models.layouts_more`, no spec, against what each module computes itself.

Registry-routed modules are checked with ``kernel_capture.run_and_check`` (per-head q/k/v at token 0
equal the kernel's, the hooked head outputs equal the kernel output, ``sum_h W_O,h o_h`` equals the
out-projection's output, at 1e-5, biases zeroed). Modules with their own attention code (DeBERTa v1,
Bark, PVTv2, Granite Speech) are checked the same way against tensors recorded inside their own
forward pass. Refused classes (Dory, Inkling) and modules that are no attention (Mamba mixers, MLPs)
are checked too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from einops import rearrange
from kernel_capture import run_and_check, zero_biases
from torch import Tensor, nn

from hdi_monitor.models import discover_attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

D, V, T = 32, 64, 7


def _ids(n: int = T, seed: int = 0) -> Tensor:
    return torch.randint(3, V, (2, n), generator=torch.Generator().manual_seed(seed))


def _x(*shape: int, seed: int = 5) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _model(cfg, impl: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=impl).eval()
    zero_biases(model)
    return model


def _module(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    module = make().eval()
    zero_biases(module)
    return module


def _discover(model: nn.Module, families: set[str]):
    found = discover_attention(model)
    assert found.skipped == [], found.skipped
    assert {lay.family for lay in found.layers} == families
    return found.layers


# ---------------------------------------------------------------- modules that use the kernel registry


def _codegen():
    # n_head=2: a head (16 rows) spans two mp blocks (local_dim 8), so a wrong block order fails
    cfg = transformers.CodeGenConfig(vocab_size=V, n_embd=D, n_layer=2, n_head=2, rotary_dim=4, n_positions=64)
    model = _model(cfg)
    return model, {"input_ids": _ids()}, {"codegen"}, 2


def _bigbird_pegasus():
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
        attention_type="original_full", pad_token_id=1, decoder_start_token_id=2,
    )  # fmt: skip
    model = _model(cfg, impl="eager")
    return model, {"input_ids": _ids(), "decoder_input_ids": _ids(5, 1)}, {"bert", "bart"}, 4


def _swin():
    cfg = transformers.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                  window_size=4, mlp_ratio=1.0)  # fmt: skip
    return _model(cfg), {"pixel_values": _x(2, 3, 16, 16)}, {"vit"}, None


def _moshi_attention():
    cfg = transformers.MoshiConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    module = _module(lambda: transformers.models.moshi.modeling_moshi.MoshiAttention(cfg, layer_idx=0))
    module.config._attn_implementation = "sdpa"
    x = _x(2, T, D)
    return module, {"hidden_states": x, "position_ids": torch.arange(T)[None].expand(2, -1)}, {"llama"}, 4


def _kosmos25_vision_attention():
    cfg = transformers.Kosmos2_5VisionConfig(hidden_size=D, num_attention_heads=4, head_dim=8)
    cfg._attn_implementation = "sdpa"
    module = _module(lambda: transformers.models.kosmos2_5.modeling_kosmos2_5.Kosmos2_5VisionAttention(cfg))
    return module, {"hidden_states": _x(2, T, D)}, {"vit"}, 4


def _vjepa2_attention():
    cfg = transformers.VJEPA2Config(hidden_size=D, num_attention_heads=4, crop_size=8, patch_size=4,
                                    frames_per_clip=2, tubelet_size=1)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    make = transformers.models.vjepa2.modeling_vjepa2.VJEPA2RopeAttention
    module = _module(lambda: make(cfg, hidden_size=D, num_attention_heads=4))
    return module, {"hidden_states": _x(2, 8, D)}, {"vit"}, 4


REGISTRY_CASES = {
    "codegen": _codegen,
    "bigbird_pegasus": _bigbird_pegasus,
    "swin": _swin,
    "moshi_attention": _moshi_attention,
    "kosmos2_5_vision_attention": _kosmos25_vision_attention,
    "vjepa2_rope_attention": _vjepa2_attention,
}


@pytest.mark.parametrize("case", list(REGISTRY_CASES))
def test_more_families_against_their_attention_kernel(case: str):
    model, batch, families, heads = REGISTRY_CASES[case]()
    layers = _discover(model, families)
    result = run_and_check(model, layers, lambda: model(**batch))
    # BigBird-Pegasus' encoder attention has its own code: checked in test_bigbird_pegasus_encoder_attention
    own_code = {"encoder.layers.0.self_attn"} if case == "bigbird_pegasus" else set()
    assert result == {lay.name: "no kernel call" if lay.name in own_code else "ok" for lay in layers}
    if heads is not None:
        assert all(lay.num_heads == heads for lay in layers if lay.family in families - {"bart"})


# ------------------------------------------------------ modules with their own attention code


@contextlib.contextmanager
def _recording(obj: object, method: str, record: Callable[..., None]) -> Iterator[None]:
    """Wrap ``obj.method`` (instance attribute) so that ``record(args, result)`` sees every call."""
    orig = getattr(obj, method)

    def wrapped(*args, **kwargs):
        out = orig(*args, **kwargs)
        record(args, out)
        return out

    setattr(obj, method, wrapped)
    try:
        yield
    finally:
        delattr(obj, method)


def _check_heads(layer, x: Tensor, kv_x: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, out: Tensor) -> None:
    """Per-head ``x W_h`` equal the module's own ``(B, H, T, d)`` q/k/v (up to one positive constant for
    q, its 1/sqrt(d) scale); ``sum_h W_O,h o_h`` equals the out-projection output (``o`` its input)."""
    for proj, src, ref in (("query", x, q), ("key", kv_x, k), ("value", kv_x, v)):
        mine = torch.einsum("btm,hmd->bhtd", src, layer.head_weights(proj))
        scale = float((mine * ref).sum() / (mine * mine).sum())
        assert scale > 0
        torch.testing.assert_close(mine * scale, ref, atol=1e-5, rtol=1e-4)
        if proj != "query":
            assert scale == pytest.approx(1.0, abs=1e-5)
    per_head = rearrange(o, "b t (h d) -> b t h d", h=layer.num_heads)
    got = torch.einsum("bthd,hmd->btm", per_head, layer.head_weights("output"))
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-4)


def _io(module: Any) -> tuple[dict, Callable[[], None]]:
    """Record ``module``'s first positional input and its input/output (of its last call)."""
    seen: dict = {}

    def first(args: tuple, kwargs: dict) -> Tensor:
        return (args[0] if args else kwargs["hidden_states"]).detach()

    h1 = module.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("x", first(a, kw)), with_kwargs=True)
    h2 = module.register_forward_hook(
        lambda m, a, kw, r: seen.update(o=first(a, kw), out=(r[0] if isinstance(r, tuple) else r).detach()),
        with_kwargs=True,
    )

    def undo() -> None:
        h1.remove()
        h2.remove()

    return seen, undo


def test_deberta_v1_in_proj_is_per_head_interleaved():
    """DeBERTa v1 views ``in_proj(x)`` as (H, 3 d) and chunks q, k, v per head (``transpose_for_scores``)."""
    cfg = transformers.DebertaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                     max_relative_positions=16)  # fmt: skip
    model = _model(cfg, impl="eager")
    layers = _discover(model, {"deberta"})
    assert [lay.name for lay in layers] == ["encoder.layer.0.attention", "encoder.layer.1.attention"]
    for lay in layers:
        inner = lay.module.self
        calls: list[Tensor] = []
        x_in, undo_x = _io(inner)
        out_io, undo_o = _io(lay.module.output.dense)
        with _recording(inner, "transpose_for_scores", lambda a, r, c=calls: c.append(r)), torch.no_grad():
            model(input_ids=_ids())
        undo_x()
        undo_o()
        q, k, v = calls[0].chunk(3, dim=-1)  # the module's own split, (B, H, T, d)
        x = x_in["x"]
        _check_heads(lay, x, x, q, k, v, out_io["o"], out_io["out"])


def test_bigbird_pegasus_encoder_attention():
    """Per-head softmax(q_h k_h^T / sqrt(d)) from the extraction equals the module's own attention
    probabilities, probs_h v_h its context, and sum_h W_O,h o_h the output projection's output."""
    model, batch, _, _ = _bigbird_pegasus()
    lay = next(lay for lay in discover_attention(model).layers if lay.name == "encoder.layers.0.self_attn")
    assert lay.family == "bert" and lay.num_heads == 4
    x_in, undo_x = _io(lay.module)
    rec: dict = {}
    h = lay.module.self.register_forward_hook(lambda m, a, r: rec.update(context=r[0], probs=r[1]))
    out_io, undo_o = _io(lay.module.output)
    with torch.no_grad():
        model(**{**batch, "attention_mask": torch.ones(2, T, dtype=torch.long)})
    undo_x()
    undo_o()
    h.remove()
    x = x_in["x"]
    q, k, v = (torch.einsum("btm,hmd->bhtd", x, lay.head_weights(p)) for p in ("query", "key", "value"))
    probs = torch.softmax(q @ k.transpose(-1, -2) / lay.head_dim**0.5, dim=-1)
    torch.testing.assert_close(probs, rec["probs"], atol=1e-5, rtol=1e-4)
    o = probs @ v  # (B, H, T, d)
    torch.testing.assert_close(rearrange(o, "b h t d -> b t (h d)"), rec["context"], atol=1e-5, rtol=1e-4)
    got = torch.einsum("bhtd,hmd->btm", o, lay.head_weights("output"))
    torch.testing.assert_close(got, out_io["out"], atol=1e-5, rtol=1e-4)


def test_bark_att_proj_against_its_attn():
    cfg = transformers.BarkSemanticConfig(hidden_size=D, num_heads=4, num_layers=2, block_size=16,
                                          input_vocab_size=V, output_vocab_size=V)  # fmt: skip
    model = _module(lambda: transformers.BarkSemanticModel(cfg))
    layers = _discover(model, {"bark"})
    assert len(layers) == 2
    lay = layers[0]
    rec: dict = {}
    x_in, undo_x = _io(lay.module)
    out_io, undo_o = _io(lay.module.out_proj)
    with _recording(lay.module, "_attn", lambda a, r: rec.update(q=a[0], k=a[1], v=a[2])), torch.no_grad():
        model(input_ids=_ids())
    undo_x()
    undo_o()
    _check_heads(lay, x_in["x"], x_in["x"], rec["q"], rec["k"], rec["v"], out_io["o"], out_io["out"])


def test_pvt_v2_keys_read_the_reduced_tokens():
    cfg = transformers.PvtV2Config(image_size=16, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                   hidden_sizes=[16, 32], num_attention_heads=[2, 4], patch_sizes=[4, 2],
                                   strides=[4, 2], mlp_ratios=[1, 1])  # fmt: skip
    model = _model(cfg, impl="eager")
    layers = _discover(model, {"vit"})
    assert [lay.num_heads for lay in layers] == [2, 4]
    for lay in layers:
        heads: list[Tensor] = []
        q_in, undo_q = _io(lay.module.query)
        k_in, undo_k = _io(lay.module.key)
        out_io, undo_o = _io(lay.module.proj)
        with _recording(lay.module, "transpose_for_scores", lambda a, r, c=heads: c.append(r)), torch.no_grad():
            model(pixel_values=_x(2, 3, 16, 16))
        for undo in (undo_q, undo_k, undo_o):
            undo()
        q, k, v = heads  # query, key, value, each (B, H, T, d); key/value over the spatially reduced tokens
        _check_heads(lay, q_in["x"], k_in["x"], q, k, v, out_io["o"], out_io["out"])


def test_granite_speech_to_kv_halves():
    cfg = transformers.GraniteSpeechEncoderConfig(input_dim=8, num_layers=1, hidden_dim=D, num_heads=4, dim_head=8,
                                                  output_dim=5, context_size=4, max_pos_emb=8)  # fmt: skip
    model = _module(lambda: transformers.models.granite_speech.modeling_granite_speech.GraniteSpeechCTCEncoder(cfg))
    layers = _discover(model, {"conformer"})
    lay = layers[0]
    assert (lay.num_heads, lay.head_dim, lay.mask_key) == (4, 8, None)
    rec: dict = {}
    q_in, undo_q = _io(lay.module.to_q)
    out_io, undo_o = _io(lay.module.to_out)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        rec.update(q=q, k=k, v=v)
        return sdpa(q, k, v, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(_x(2, 8, 8))  # 8 frames = 2 blocks of context_size 4
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        undo_q()
        undo_o()
    # the module attends in blocks: (B * blocks, H, context, d) -> (B, H, T, d)
    q, k, v = (rearrange(rec[n], "(b n) h c d -> b h (n c) d", b=2) for n in ("q", "k", "v"))
    x = q_in["x"]
    _check_heads(lay, x, x, q, k, v, out_io["o"][:, :8], out_io["out"])


# ------------------------------------------------------------------- refused, and not attention


def test_dory_and_inkling_are_refused_with_the_reason():
    dory = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(
        "dory", vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=1, intermediate_size=37))  # fmt: skip
    with pytest.raises(ValueError, match=r"DoryAttention: queries are rescaled per channel by the learned `sqk`"):
        discover_attention(dory)
    inkling = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(
        "inkling_text", vocab_size=V, hidden_size=D, num_hidden_layers=1, intermediate_size=37))  # fmt: skip
    with pytest.raises(ValueError, match=r"InklingAttention: keys and values pass a learned causal short convolution"):
        discover_attention(inkling)


def test_mamba_mixers_are_not_listed_as_attention():
    """Falcon-H1 layers hold attention and a Mamba-2 mixer (``in_proj`` packs z, x, B, C, dt): every
    attention module is measured and the mixer is not reported as unmeasured attention."""
    cfg = transformers.AutoConfig.for_model(
        "falcon_h1", vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, intermediate_size=37, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=8)  # fmt: skip
    model = _model(cfg)
    found = discover_attention(model)
    assert found.skipped == []
    attn = [n for n, m in model.named_modules() if type(m).__name__ == "FalconH1Attention"]
    assert [lay.name for lay in found.layers] == attn and len(attn) == 2
    assert any(type(m).__name__ == "FalconH1Mixer" for m in model.modules())


def _check_probs(layer, x: Tensor, kv_x: Tensor, probs: Tensor, context: Tensor | None, out: Tensor) -> None:
    """softmax(q_h k_h^T / sqrt(d)) from the extraction equals the module's own attention probabilities
    (no mask, no position terms), probs_h v_h its context (head-major), sum_h W_O,h o_h its output."""
    q = torch.einsum("btm,hmd->bhtd", x, layer.head_weights("query"))
    k, v = (torch.einsum("btm,hmd->bhtd", kv_x, layer.head_weights(p)) for p in ("key", "value"))
    mine = torch.softmax(q @ k.transpose(-1, -2) / layer.head_dim**0.5, dim=-1)
    torch.testing.assert_close(mine, probs, atol=1e-5, rtol=1e-4)
    o = mine @ v
    if context is not None:
        torch.testing.assert_close(rearrange(o, "b h t d -> b t (h d)"), context, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        torch.einsum("bhtd,hmd->btm", o, layer.head_weights("output")), out, atol=1e-5, rtol=1e-4
    )


def test_cpmant_attention_against_its_own_probabilities():
    cfg = transformers.CpmAntConfig(vocab_size=V, hidden_size=D, num_attention_heads=4, dim_head=8, dim_ff=37,
                                    num_hidden_layers=1)  # fmt: skip
    module = _module(lambda: transformers.models.cpmant.modeling_cpmant.CpmAntAttention(cfg))
    layers = _discover(module, {"cpmant"})
    assert (layers[0].num_heads, layers[0].head_dim) == (4, 8)
    x = _x(2, T, D)
    out_io, undo = _io(module.attention_out)
    with torch.no_grad():
        out, probs = module(x, x, torch.ones(2, T, T, dtype=torch.bool), torch.zeros(2, 4, T, T),
                            output_attentions=True)  # fmt: skip
    undo()
    _check_probs(layers[0], x, x, probs, out_io["o"], out)


def test_blip_vision_qkv_against_its_own_probabilities():
    cfg = transformers.BlipVisionConfig(hidden_size=D, intermediate_size=37, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=16, patch_size=8)  # fmt: skip
    cfg._attn_implementation = "eager"
    model = _module(lambda: transformers.BlipVisionModel(cfg))
    layers = _discover(model, {"blip"})
    lay = layers[0]
    x_in, undo_x = _io(lay.module)
    out_io, undo_o = _io(lay.module.projection)
    with torch.no_grad():
        res = model(pixel_values=_x(2, 3, 16, 16), output_attentions=True)
    undo_x()
    undo_o()
    _check_probs(lay, x_in["x"], x_in["x"], res.attentions[0], out_io["o"], out_io["out"])


def test_tvp_attention_inside_its_encode_layer():
    cfg = transformers.TvpConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
                                 vocab_size=V)  # fmt: skip
    layer_mod = _module(lambda: transformers.models.tvp.modeling_tvp.TvpEncodeLayer(cfg))
    layers = _discover(layer_mod, {"bert"})
    lay = layers[0]
    heads: list[Tensor] = []
    x = _x(2, T, D)
    out_io, undo = _io(layer_mod.attention.dense)
    with _recording(layer_mod.attention, "_reshape", lambda a, r: heads.append(r)), torch.no_grad():
        layer_mod(x)
    undo()
    q, k, v = heads  # the module's own head split of query, key, value
    _check_heads(lay, x, x, q, k, v, out_io["o"], out_io["out"])


def test_funnel_content_projections_against_its_einsums():
    """Funnel's content score is einsum(q_h, k_h) over the module's own head split; its context is
    einsum(probs, v_h). Both are recorded from the module's forward (r_w_bias zeroed)."""
    cfg = transformers.FunnelConfig(vocab_size=V, d_model=D, n_head=4, d_head=8, d_inner=37, block_sizes=[1, 1],
                                    num_decoder_layers=1)  # fmt: skip
    model = _module(lambda: transformers.FunnelModel(cfg))
    layers = _discover(model, {"funnel"})
    lay = layers[0]
    with torch.no_grad():
        lay.module.r_w_bias.zero_()
    rec: dict = {}
    einsum = torch.einsum

    def spy(eq, *ops):
        res = einsum(eq, *ops)
        if eq == "bind,bjnd->bnij" and "q" not in rec:
            rec.update(q=ops[0], k=ops[1])
        if eq == "bnij,bjnd->bind" and "v" not in rec:
            rec.update(v=ops[1])
        return res

    q_in, undo_q = _io(lay.module.q_head)
    k_in, undo_k = _io(lay.module.k_head)
    out_io, undo_o = _io(lay.module.post_proj)
    on = lay.module.register_forward_pre_hook(lambda m, a: setattr(torch, "einsum", spy))
    off = lay.module.register_forward_hook(lambda m, a, r: setattr(torch, "einsum", einsum))
    try:
        with torch.no_grad():
            model(input_ids=_ids())
    finally:
        torch.einsum = einsum
        for h in (on, off):
            h.remove()
        for undo in (undo_q, undo_k, undo_o):
            undo()
    q, k, v = (rearrange(rec[n], "b t h d -> b h t d") for n in ("q", "k", "v"))
    _check_heads(lay, q_in["x"], k_in["x"], q, k, v, out_io["o"], out_io["out"])


def test_led_encoder_local_attention_against_its_output():
    """With the attention window wider than the text, LED's sliding-window attention is full attention over
    the real tokens: softmax(q_h k_h^T / sqrt(d)) v_h from the extraction, summed through W_O,h, equals the
    module's output on every real token (the padding the model adds up to the window is masked)."""
    cfg = transformers.LEDConfig(vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                 decoder_ffn_dim=37, attention_window=[16], max_encoder_position_embeddings=64,
                                 max_decoder_position_embeddings=64, pad_token_id=1)  # fmt: skip
    model = _module(lambda: transformers.LEDModel(cfg))
    layers = discover_attention(model).layers
    lay = next(lay for lay in layers if lay.name == "encoder.layers.0.self_attn")
    assert (lay.family, lay.num_heads, lay.head_dim) == ("bert", 4, 8)
    x_in, undo_x = _io(lay.module)
    out_io, undo_o = _io(lay.module.output)
    with torch.no_grad():
        model(input_ids=_ids(), decoder_input_ids=_ids(5, 1))
    undo_x()
    undo_o()
    x = x_in["x"][:, :T]  # the real tokens (the encoder pads to a multiple of the window)
    q, k, v = (torch.einsum("btm,hmd->bhtd", x, lay.head_weights(p)) for p in ("query", "key", "value"))
    o = torch.softmax(q @ k.transpose(-1, -2) / lay.head_dim**0.5, dim=-1) @ v
    got = torch.einsum("bhtd,hmd->btm", o, lay.head_weights("output"))
    torch.testing.assert_close(got, out_io["out"][:, :T], atol=1e-5, rtol=1e-4)


def test_qwen3_next_gated_query_rows():
    """Qwen3-Next's q_proj packs (H, [q | gate], d): the query heads are the q rows (checked against the
    kernel), the hooked head outputs the gated ones (the input of o_proj)."""
    cfg = transformers.AutoConfig.for_model(
        "qwen3_next", vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=4, intermediate_size=37, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
    model = _model(cfg)
    found = discover_attention(model)
    layers = found.layers
    assert [lay.name for lay in layers] == ["layers.3.self_attn"] and layers[0].family == "llama"
    assert (layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim) == (4, 2, 8)
    assert all(s.class_name.endswith("GatedDeltaNet") or "Linear" in s.reason for s in found.skipped)
    result = run_and_check(model, layers, lambda: model(input_ids=_ids()))
    assert result == {"layers.3.self_attn": "ok (gated head outputs)"}


def test_qwen2_5_omni_vision_attention_against_its_kernel():
    cfg = transformers.models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniVisionEncoderConfig(
        hidden_size=D, num_heads=4, intermediate_size=37, depth=1
    )
    cfg._attn_implementation = "sdpa"
    make = transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionAttention
    module = _module(lambda: make(cfg))
    layers = _discover(module, {"vit"})
    assert (layers[0].num_heads, layers[0].head_dim, layers[0].mask_key) == (4, 8, None)
    x = _x(T, D)  # unbatched tokens, as the vision tower runs
    rotary = (torch.ones(T, 8), torch.zeros(T, 8))  # identity rotation: the check runs at every token
    result = run_and_check(
        module,
        layers,
        lambda: module(x, cu_seqlens=torch.tensor([0, T], dtype=torch.int32), position_embeddings=rotary),
    )
    assert result == {"": "ok"}
