"""Every built-in family, no spec, against what the model itself feeds its attention kernel.

Each model is built from a tiny random-weight config with all biases zeroed; one forward pass
records, per attention module, the per-head q/k/v handed to the attention kernel and the kernel's
output (see ``kernel_capture.py``). At token position 0 (rotary embeddings are the identity there)
``x @ W_h`` of the extraction must equal those heads, the hooked head outputs the kernel output,
and ``sum_h W_O,h o_h`` the output projection's output, at 1e-5. The set of modules that called a
kernel is the independent count of what should be found.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from family_cases import CASES, Case, D, H, T, V, build, ids_batch, seq2seq_batch, transformers
from kernel_capture import Captured, capture_kernels, run_and_check
from torch import nn

from hdi_monitor import head_diversity
from hdi_monitor.models import discover_attention


def kernel_modules(model: nn.Module, batch: dict) -> set[int]:
    cap = Captured()
    with torch.no_grad(), capture_kernels(model, cap):
        model(**batch)
    return set(cap.calls)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_family_against_its_attention_kernel(case: Case):
    model = build(case)
    batch = case.batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing attention-like may be skipped
        found = discover_attention(model)
    assert found.skipped == []
    layers = found.layers
    assert {lay.family for lay in layers} == case.families
    # found vs expected: every module that called an attention kernel is (inside) a found layer
    callers = kernel_modules(model, batch)
    covered = {id(m) for lay in layers for m in lay.module.modules()}
    assert callers and callers <= covered, "an attention module that runs a kernel was not found"
    assert len(layers) == len({id(lay.module) for lay in layers})
    result = run_and_check(model, layers, lambda: model(**batch))
    # nn.MultiheadAttention (SigLIP's pooling head) runs no registry kernel; test_adapters checks it
    # against its own forward
    expected = {lay.name: "no kernel call" if lay.family == "torch_mha" else "ok" for lay in layers}
    assert result == expected
    if case.kv_heads is not None:
        text = [lay for lay in layers if lay.mask_key is not None]
        assert text and all(lay.num_kv_heads == case.kv_heads for lay in text)


def test_albert_shared_module_measured_once():
    model = build(next(c for c in CASES if c.id == "albert"))
    layers = discover_attention(model).layers
    assert len(layers) == 1  # three layers share one AlbertAttention
    assert layers[0].module is model.encoder.albert_layer_groups[0].albert_layers[0].attention


def test_two_towers_have_their_own_head_counts_and_masks():
    model = build(next(c for c in CASES if c.id == "clip"))
    layers = discover_attention(model).layers
    text = [lay for lay in layers if lay.name.startswith("text_model")]
    vision = [lay for lay in layers if lay.name.startswith("vision_model")]
    assert len(text) == 1 and len(vision) == 2
    assert all((lay.num_heads, lay.head_dim, lay.mask_key) == (H, D // H, "attention_mask") for lay in text)
    assert all((lay.num_heads, lay.head_dim, lay.mask_key) == (2, D // 2, None) for lay in vision)


def test_encoder_decoder_masks_are_found_per_sub_model():
    model = build(next(c for c in CASES if c.id == "bart"))
    keys = {lay.name: lay.mask_key for lay in discover_attention(model).layers}
    assert keys == {
        "encoder.layers.0.self_attn": "attention_mask",
        "decoder.layers.0.self_attn": "decoder_attention_mask",
        "decoder.layers.0.encoder_attn": "decoder_attention_mask",  # its query tokens are the decoder's
    }


def test_encoder_decoder_padding_is_not_counted():
    """Decoder padding tokens are left out of the decoder layers' covariance: equal to the run on the
    unpadded rows alone."""
    model = build(next(c for c in CASES if c.id == "bart"))
    batch = seq2seq_batch()
    dmask = torch.ones(2, 5, dtype=torch.long)
    dmask[1, -2:] = 0
    padded = head_diversity(model, inputs={**batch, "decoder_attention_mask": dmask})
    layer = "decoder.layers.0.self_attn"
    got = next(lay for lay in padded.layers if lay.name == layer)
    # reference: the same tokens, one row at a time, trimmed to their real length
    rows = [
        {
            "input_ids": batch["input_ids"][i : i + 1],
            "attention_mask": batch["attention_mask"][i : i + 1],
            "decoder_input_ids": batch["decoder_input_ids"][i : i + 1, : int(dmask[i].sum())],
        }
        for i in range(2)
    ]
    ref = next(lay for lay in head_diversity(model, inputs=rows).layers if lay.name == layer)
    assert got.num_tokens == ref.num_tokens == 8
    torch.testing.assert_close(got.covariance, ref.covariance, atol=1e-6, rtol=1e-5)


def test_deberta_content_projections_against_its_projections():
    """DeBERTa-v2 does not use the kernel registry: its heads are the head-major row blocks of
    query_proj/key_proj/value_proj (``transpose_for_scores``); the relative-position projections
    are not part of the HDI."""
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        intermediate_size=37,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=16,
    )
    model = transformers.AutoModel.from_config(cfg).eval()
    found = discover_attention(model)
    assert found.skipped == [] and [lay.family for lay in found.layers] == ["deberta", "deberta"]
    batch = ids_batch()
    seen = {}
    for lay in found.layers:
        inner = lay.module.self
        # the module's own head split, recorded from its forward
        orig = inner.transpose_for_scores
        calls = []

        def rec(x, heads, _orig=orig, _calls=calls):
            out = _orig(x, heads)
            _calls.append(out)
            return out

        inner.transpose_for_scores = rec
        seen[lay.name] = calls
    xs = {}
    hooks = [
        lay.module.register_forward_pre_hook(lambda m, a, n=lay.name: xs.__setitem__(n, a[0])) for lay in found.layers
    ]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    for lay in found.layers:
        del lay.module.self.transpose_for_scores
        q, k, v = seen[lay.name][:3]  # (B*H, T, d) for query, key, value
        x = xs[lay.name]
        inner = lay.module.self
        for t, proj, mod in (
            (q, "query", inner.query_proj),
            (k, "key", inner.key_proj),
            (v, "value", inner.value_proj),
        ):
            w = lay.head_weights(proj)
            mine = torch.einsum("btm,hmd->bhtd", x, w) + mod.bias.view(H, 1, -1)
            torch.testing.assert_close(mine.reshape(-1, T, D // H), t, atol=1e-5, rtol=1e-5)
