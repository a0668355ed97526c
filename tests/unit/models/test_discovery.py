"""Discovery rules: never silently wrong, never silently partial, specs that combine with built-ins.

Regression tests for the cases of issue 13: GPTBigCode without multi-query and GPT-NeoX read with
the wrong fused layout (silently wrong), SigLIP / LLaVA / multimodal Gemma 3 with towers dropped
(silently partial). References are analytic (collapsed heads have HDI 0) or the model's own
structure and forward pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from family_cases import CASES, build, text_image_batch
from kernel_capture import run_and_check, zero_biases
from torch import nn

from hdi_monitor import head_diversity
from hdi_monitor.models import AttentionSpec, SkippedModule, discover_attention, find_attention_layers
from hdi_monitor.report import DiversityReport

transformers = pytest.importorskip("transformers")
D, H, V = 32, 4, 64


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kw)


# ------------------------------------------------------------------------------ silently wrong


def _collapse_interleaved(weight: torch.Tensor, heads: int) -> None:
    """Make every query head of an (H, 3, d) interleaved fused weight the same: true query HDI 0."""
    w = rearrange(weight.data, "(h three d) m -> h three d m", h=heads, three=3)
    w[:, 0] = w[0, 0].clone()
    weight.data.copy_(rearrange(w, "h three d m -> (h three d) m"))


def test_gpt_bigcode_without_multi_query_reads_interleaved_heads():
    """On main the GPT-2 adapter split c_attn into three equal blocks: collapsed heads read 0.66."""
    torch.manual_seed(0)
    model = transformers.GPTBigCodeModel(
        transformers.GPTBigCodeConfig(vocab_size=V, n_embd=D, n_layer=2, n_head=H, multi_query=False)
    ).eval()
    for block in model.h:
        _collapse_interleaved(block.attn.c_attn.weight, H)
    report = _quiet(head_diversity, model, projections=("query", "key"))
    assert [lay.family for lay in report.layers] == ["gpt_bigcode"] * 2
    for lay in report.layers:
        assert abs(lay.hdi["query"]) < 1e-6
        assert lay.hdi["key"] > 0.3  # key heads untouched stay diverse


def test_gpt_neox_collapsed_heads_read_zero_and_packed_spec_warns():
    torch.manual_seed(0)
    model = transformers.GPTNeoXModel(
        transformers.GPTNeoXConfig(
            vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H, intermediate_size=37
        )
    ).eval()
    attn = model.layers[0].attention
    _collapse_interleaved(attn.query_key_value.weight, H)
    assert abs(_quiet(head_diversity, model, projections=("query",)).layers[0].hdi["query"]) < 1e-6
    # the layout said in a spec reads the same
    spec = AttentionSpec(
        modules=r"layers\.\d+\.attention", qkv="query_key_value", qkv_layout="interleaved", output="dense"
    )
    assert abs(_quiet(head_diversity, model, projections=("query",), spec=spec).layers[0].hdi["query"]) < 1e-6
    # the old README recipe (contiguous slices through callables) cannot be checked: it warns
    old = AttentionSpec(
        modules=r"layers\.\d+\.attention",
        query=lambda m: m.query_key_value.weight[:D],
        key=lambda m: m.query_key_value.weight[D : 2 * D],
        value=lambda m: m.query_key_value.weight[2 * D :],
        output="dense",
        num_heads=H,
    )
    with pytest.warns(UserWarning, match="slices of one fused weight"):
        wrong = head_diversity(model, projections=("query",), spec=old)
    assert wrong.layers[0].hdi["query"] > 0.3  # what it reads is indeed wrong; the warning says so


def test_unknown_fused_layout_is_refused_naming_class_and_spec_field():
    class FusedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = H
            self.query_key_value = nn.Linear(D, 3 * D)
            self.dense = nn.Linear(D, D)

    model = nn.ModuleDict({"a": FusedAttention(), "b": nn.MultiheadAttention(D, H)})
    found = discover_attention(model)
    assert [lay.name for lay in found.layers] == ["b"]
    (skip,) = found.skipped
    assert (skip.name, skip.class_name) == ("a", "FusedAttention")
    assert "'query_key_value'" in skip.reason and "qkv_layout" in skip.reason and "FusedAttention" in skip.reason
    with pytest.warns(UserWarning, match=r"1 attention-like module\(s\) not measured:\n  a \(FusedAttention\)"):
        find_attention_layers(model)
    with pytest.raises(ValueError, match=r"measured none of them:\n.*FusedAttention has a fused q/k/v projection"):
        find_attention_layers(nn.ModuleDict({"a": FusedAttention()}))
    # the spec field named in the message settles it; the spec reads head counts from the module
    spec = AttentionSpec(modules="a", qkv="query_key_value", qkv_layout="contiguous", output="dense")
    layers = _quiet(find_attention_layers, model, spec=spec)
    assert [(lay.name, lay.num_heads, lay.head_dim) for lay in layers] == [("a", H, D // H), ("b", H, D // H)]
    w = model["a"].query_key_value.weight
    torch.testing.assert_close(layers[0].head_weights("key")[1], w[D + 8 : D + 16].T)


def test_bad_qkv_spec_arguments():
    with pytest.raises(ValueError, match="qkv needs qkv_layout"):
        AttentionSpec(modules="a", qkv="w", output="o")
    with pytest.raises(ValueError, match="either qkv or query/key/value"):
        AttentionSpec(modules="a", qkv="w", qkv_layout="grouped", query="q", output="o")
    with pytest.raises(ValueError, match=r"\['value'\] missing"):
        AttentionSpec(modules="a", query="q", key="k", output="o")
    with pytest.raises(TypeError, match="list of AttentionSpec"):
        find_attention_layers(nn.MultiheadAttention(D, H), spec="bert")


# ------------------------------------------------------------------------------ silently partial


def _case(name):
    return next(c for c in CASES if c.id == name)


@pytest.mark.parametrize(
    "name, expected",
    [
        # text layers + vision layers + the pooling head's nn.MultiheadAttention
        ("siglip", {"text_model": 1, "vision_model": 3}),
        ("llava", {"language_model": 2, "vision_tower": 2}),
        ("gemma3_mm", {"language_model": 2, "vision_tower": 3}),
    ],
)
def test_multimodal_towers_are_all_found(name, expected):
    """On main SigLIP reported only its pooling head, LLaVA and Gemma 3 lost their vision towers."""
    model = build(_case(name))
    found = _quiet(discover_attention, model)
    counts: dict[str, int] = {}
    for lay in found.layers:
        top = next(p for p in lay.name.split(".") if p in expected)
        counts[top] = counts.get(top, 0) + 1
    assert counts == expected
    assert found.skipped == []
    vision = [lay for lay in found.layers if "vision" in lay.name]
    assert vision and all(lay.mask_key is None for lay in vision)


def test_unknown_attention_modules_are_listed_in_report_table_and_dict():
    class OddAttention(nn.Module):  # an attention module with a layout no entry knows
        def __init__(self):
            super().__init__()
            self.proj_in = nn.Linear(D, 3 * D)
            self.proj_out = nn.Linear(D, D)

    model = nn.ModuleDict({"mha": nn.MultiheadAttention(D, H), "odd": OddAttention()})
    with pytest.warns(UserWarning, match=r"odd \(OddAttention\): looks like attention"):
        report = head_diversity(model)
    assert isinstance(report, DiversityReport)
    assert [lay.name for lay in report.layers] == ["mha"]
    (skip,) = report.skipped
    assert isinstance(skip, SkippedModule) and skip.name == "odd" and skip.class_name == "OddAttention"
    assert report.to_dict()["skipped"] == [{"name": "odd", "class_name": "OddAttention", "reason": skip.reason}]
    table = report.format_table()
    assert "not measured (1 attention-like module):" in table and "odd (OddAttention)" in table


# ------------------------------------------------------------------------------ specs combine


def test_spec_list_combines_with_builtins_and_wins_where_both_match():
    model = build(_case("clip"))
    # override only the vision tower; the text tower stays with the built-in entry
    spec = AttentionSpec(
        modules=r"vision_model\.encoder\.layers\.\d+\.self_attn",
        query="q_proj",
        key="k_proj",
        value="v_proj",
        output="out_proj",
        family="my_vision",
    )
    extra = AttentionSpec(
        modules=r"text_model\.encoder\.layers\.0\.self_attn",
        query="q_proj",
        key="k_proj",
        value="v_proj",
        output="out_proj",
        family="my_text",
        mask_key="my_mask",
    )
    layers = _quiet(find_attention_layers, model, spec=[spec, extra])
    fams = {lay.name: (lay.family, lay.num_heads, lay.mask_key) for lay in layers}
    assert fams == {
        "text_model.encoder.layers.0.self_attn": ("my_text", H, "my_mask"),
        "vision_model.encoder.layers.0.self_attn": ("my_vision", 2, None),  # head counts per module
        "vision_model.encoder.layers.1.self_attn": ("my_vision", 2, None),
    }
    builtin = _quiet(find_attention_layers, model)
    for a, b in zip(builtin, layers, strict=True):
        torch.testing.assert_close(a.head_weights("key"), b.head_weights("key"))


def test_spec_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match="matched no module"):
        find_attention_layers(
            nn.MultiheadAttention(D, H), spec=[AttentionSpec(modules="nope", query="a", key="b", value="c", output="d")]
        )


# ------------------------------------------------------------------------------ q/k norms, MLA


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "olmo2"])
def test_qk_norm_layers_are_measured_on_their_projection_weights(name):
    """Per-head q/k norms change no subspace: the HDI is that of the q/k projection weights alone."""
    model = build(_case(name))
    report = _quiet(head_diversity, model, projections=("query", "key"), weighting="uniform")
    from scipy.linalg import orth

    for lay, found in zip(report.layers, _quiet(find_attention_layers, model), strict=True):
        attn = found.module
        for proj, lin, heads in (("query", attn.q_proj, H), ("key", attn.k_proj, 2)):
            w = rearrange(lin.weight.detach().double(), "(h d) m -> h m d", h=heads).numpy()
            bases = [orth(w[i]) for i in range(heads)]
            rho = [
                ((bases[i].T @ bases[j]) ** 2).sum() / min(bases[i].shape[1], bases[j].shape[1])
                for i in range(heads)
                for j in range(heads)
                if i != j
            ]
            assert abs(lay.hdi[proj] - (1 - sum(rho) / len(rho))) < 1e-5


def test_mla_composed_maps_and_rope_note():
    model = build(_case("deepseek_v3"))
    layers = _quiet(find_attention_layers, model)
    attn = layers[0].module
    lay = layers[0]
    # composed key map of head 1, by hand from the module's weights
    rank, nope = attn.kv_lora_rank, attn.qk_nope_head_dim
    w_dkv = attn.kv_a_proj_with_mqa.weight[:rank]
    g = attn.kv_a_layernorm.weight
    w_uk = attn.kv_b_proj.weight.view(H, nope + attn.v_head_dim, rank)[1, :nope]
    torch.testing.assert_close(lay.head_weights("key")[1], (w_uk @ (g[:, None] * w_dkv)).T)
    assert lay.head_weights("query").shape == (H, D, nope + attn.qk_rope_head_dim)
    assert lay.head_weights("value").shape == (H, D, attn.v_head_dim)
    report = _quiet(head_diversity, model, projections=("key",))
    assert "RoPE key part" in report.format_table() and report.to_dict()["layers"][0]["notes"]


# ------------------------------------------------------------------------------ litgpt, x-transformers


def test_litgpt_gpt_grouped_query():
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    cfg = litgpt.Config(
        block_size=16,
        vocab_size=V,
        padded_vocab_size=V,
        n_layer=2,
        n_head=H,
        n_query_groups=2,
        n_embd=D,
        head_size=8,
        bias=True,
        rotary_percentage=1.0,
    )
    model = litgpt.GPT(cfg).eval()
    zero_biases(model)
    layers = _quiet(find_attention_layers, model)
    assert [(lay.family, lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in layers] == [("litgpt", H, 2, 8)] * 2
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    assert set(run_and_check(model, layers, lambda: model(x)).values()) == {"ok"}


def test_x_transformers_gqa_maps_query_head_h_to_h_mod_kv():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(
        num_tokens=V, max_seq_len=16, attn_layers=xt.Decoder(dim=D, depth=2, heads=H, attn_kv_heads=2, attn_dim_head=8)
    ).eval()
    layers = _quiet(find_attention_layers, model)
    assert [(lay.family, lay.num_heads, lay.num_kv_heads, lay.kv_map) for lay in layers] == [
        ("x_transformers", H, 2, "modulo")
    ] * 2
    assert [layers[0].kv_head(h) for h in range(H)] == [0, 1, 0, 1]
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    assert set(run_and_check(model, layers, lambda: model(x)).values()) == {"ok"}
    # head outputs recomputed from the extraction with kv_head(h) match the hooked ones; h // g does not
    lay = layers[0]
    xs, os_ = {}, {}
    pre = lay.module.register_forward_pre_hook(lambda m, a: xs.setdefault("x", a[0]))
    hook = lay.attach_output_hook(lambda o, k: os_.setdefault("o", o))
    with torch.no_grad():
        model(x)
    pre.remove(), hook.remove()
    inp = xs["x"]
    q, k, v = (torch.einsum("btm,hmd->bhtd", inp, lay.head_weights(p)) for p in ("query", "key", "value"))
    o = rearrange(os_["o"], "b t (h d) -> b h t d", h=H)
    for mapping, should_match in ((lay.kv_head, True), (lambda h: h // 2, False)):
        idx = [mapping(h) for h in range(H)]
        mine = F.scaled_dot_product_attention(q, k[:, idx], v[:, idx], is_causal=True)
        assert torch.allclose(mine, o, atol=1e-5) is should_match


def test_two_tower_text_image_model_runs_with_activations():
    model = build(_case("clip"))
    report = _quiet(head_diversity, model, inputs=text_image_batch())
    assert all(lay.num_tokens for lay in report.layers)
    text = next(lay for lay in report.layers if lay.name.startswith("text"))
    assert text.num_tokens == 2 * 7


def test_qwen2_vl_vision_tower_fused_qkv_against_its_kernel():
    """The vision tower's qkv is reshaped (tokens, 3, H, d): contiguous, tied to its classes."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=1,
            num_attention_heads=H,
            num_key_value_heads=2,
            intermediate_size=37,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=D,
            hidden_size=D,
            num_heads=H,
            mlp_ratio=2,
            patch_size=4,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_channels=3,
        ),
    )
    model = transformers.Qwen2VLModel(cfg).eval()
    zero_biases(model)
    found = _quiet(discover_attention, model)
    assert [lay.family for lay in found.layers] == ["vision_qkv", "vision_qkv", "llama"] and found.skipped == []
    vision = found.layers[:2]
    assert all(lay.mask_key is None for lay in vision)
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    result = run_and_check(model, vision, lambda: model.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]])))
    assert result == {lay.name: "ok" for lay in vision}


def test_head_counts_come_from_the_weights_where_a_config_disagrees():
    """An unused config attribute (num_key_value_heads of a config whose modules ignore it) yields to the
    weights; the same count as an attribute of the module itself is a contradiction and is named."""

    class Cfg:
        num_attention_heads, num_key_value_heads = H, 2

    class SelfAttention(nn.Module):
        def __init__(self, kv_attr: int | None = None):
            super().__init__()
            self.config = Cfg()
            if kv_attr is not None:
                self.num_key_value_heads = kv_attr
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    (lay,) = _quiet(find_attention_layers, nn.ModuleDict({"a": SelfAttention()}))
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim) == (H, H, D // H)
    found = discover_attention(nn.ModuleDict({"a": SelfAttention(), "b": SelfAttention(kv_attr=2)}))
    assert [lay.name for lay in found.layers] == ["a"]
    assert found.skipped[0].name == "b" and "2 key/value heads given, the weights have 4" in found.skipped[0].reason


def test_linear_attention_is_refused_with_the_reason():
    class KimiDeltaAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = H
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    found = discover_attention(nn.ModuleDict({"mha": nn.MultiheadAttention(D, H), "lin": KimiDeltaAttention()}))
    assert [lay.name for lay in found.layers] == ["mha"]
    assert found.skipped[0].name == "lin" and "linear attention" in found.skipped[0].reason


def test_value_heads_narrower_than_query_heads():
    """MiMo-style: query/key heads of width 8, value heads of width 4; each projection keeps its width."""

    class NarrowValueAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = H
            self.q_proj, self.k_proj = nn.Linear(D, H * 8), nn.Linear(D, 2 * 8)
            self.v_proj, self.o_proj = nn.Linear(D, 2 * 4), nn.Linear(H * 4, D)

    model = NarrowValueAttention()
    (lay,) = _quiet(find_attention_layers, nn.ModuleDict({"a": model}))
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim) == (H, 2, 4)
    assert lay.head_weights("query").shape == (H, D, 8) and lay.head_weights("key").shape == (2, D, 8)
    torch.testing.assert_close(lay.head_weights("value")[1], model.v_proj.weight[4:8].T)
    torch.testing.assert_close(lay.head_weights("output")[3], model.o_proj.weight[:, 12:16])
