"""Kernel statistics (issue 25): attention entropy, its uniform level and the maximum logit per head.

References, all independent of `hdi_monitor.functional.kernel`:

* a brute-force softmax written out per query in float64 (`brute`), on random tensors and on the
  q/k/mask that the capture read from each model;
* the model's own attention probabilities (transformers' eager path with ``output_attentions=True``,
  ``nn.MultiheadAttention`` with ``need_weights=True``): the entropy of those probabilities must
  equal ours, which proves the captured q/k are the ones the kernel uses, RoPE and GQA included;
* analytic: ``q = 0`` gives exactly ``ln(n_allowed)`` per query;
* bit-identical training with the capture active on a measured step, and every patched global
  restored after the block, also on an exception.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hdi_monitor.functional.covariance import subsample_mask
from hdi_monitor.functional.kernel import attention_kernel_stats
from hdi_monitor.measure.kernel import KernelStatsAccumulator, KernelStatsCapture, compute_kernel_results
from hdi_monitor.models import discover_attention
from hdi_monitor.models.kernel_capture import KernelCall, KernelCapture

transformers = pytest.importorskip("transformers")

TOL = 1e-5


# --------------------------------------------------------------------------------------------------
# the brute-force reference
# --------------------------------------------------------------------------------------------------


def brute(q, k, *, scale=None, mask=None, is_causal=False, kv_map=None, query_keep=None):
    """Per head (entropy mean, ln(n) mean, max logit, count), one query row at a time, float64."""
    b, h, t, d = q.shape
    s = k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    if kv_map is None:
        kv_map = [hh // (h // k.shape[1]) for hh in range(h)]
    full = None if mask is None else torch.broadcast_to(mask, (b, h, t, s))
    ent = [[] for _ in range(h)]
    ref = [[] for _ in range(h)]
    top = [-math.inf] * h
    for bi in range(b):
        for ti in range(t):
            if query_keep is not None and not bool(query_keep[bi, ti]):
                continue
            for hh in range(h):
                raw = (k[bi if k.shape[0] == b else 0, kv_map[hh]].double() @ q[bi, hh, ti].double()) * scale
                bias = torch.zeros(s, dtype=torch.float64)
                allow = torch.ones(s, dtype=torch.bool)
                if full is not None:
                    row = full[bi, hh, ti]
                    if row.dtype == torch.bool:
                        allow = row.clone()
                    else:
                        allow = row.double() > -1e30  # -inf and finfo.min entries are masked out
                        bias = torch.where(allow, row.double(), 0.0)
                if is_causal:
                    allow &= torch.arange(s) <= ti
                if not allow.any():
                    continue
                lg = (raw + bias)[allow]
                p = torch.softmax(lg, 0)
                ent[hh].append(float(-(p * torch.log(p)).sum()))
                ref[hh].append(math.log(int(allow.sum())))
                top[hh] = max(top[hh], float(raw[allow].max()))
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return (
        torch.tensor([mean(e) for e in ent], dtype=torch.float64),
        torch.tensor([mean(r) for r in ref], dtype=torch.float64),
        torch.tensor(top, dtype=torch.float64),
        torch.tensor([len(e) for e in ent]),
    )


def assert_matches(res, ref, tol=TOL):
    ent, uni, top, n = ref
    assert torch.equal(res.num_queries, n)
    torch.testing.assert_close(res.entropy, ent, atol=tol, rtol=0, equal_nan=True)
    torch.testing.assert_close(res.uniform_entropy, uni, atol=tol, rtol=0, equal_nan=True)
    torch.testing.assert_close(res.max_logit, top, atol=tol, rtol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------------
# the pure math
# --------------------------------------------------------------------------------------------------


def _qk(b=2, h=4, hk=2, t=7, s=7, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g, dtype=dtype) * 2, torch.randn(b, hk, s, d, generator=g, dtype=dtype)


def test_matches_brute_force_causal_gqa_and_padding():
    q, k = _qk()
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :3] = False  # left padding: rows 0-2 of batch 1 are fully masked under the causal mask
    mask = pad[:, None, None, :]
    res = attention_kernel_stats(q, k, mask=mask, is_causal=True)
    ref = brute(q, k, mask=mask, is_causal=True)
    assert_matches(res, ref)
    assert int(res.num_queries[0]) == 2 * 7 - 3  # fully masked rows are left out, not NaN
    assert torch.isfinite(res.entropy).all()


def test_additive_mask_with_bias_and_dtype_min_and_custom_kv_map():
    q, k = _qk(h=6, hk=3, t=5, s=9)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(2, 6, 5, 9, generator=g, dtype=torch.float64)
    bias[0, :, :, 4:] = torch.finfo(torch.float64).min  # transformers' eager masks
    bias[1, 2, 3, :] = -math.inf  # a fully masked row of one head only
    kv_map = torch.tensor([h % 3 for h in range(6)])  # x-transformers' layout
    res = attention_kernel_stats(q, k, mask=bias, kv_head_map=kv_map, scale=0.3)
    assert_matches(res, brute(q, k, mask=bias, kv_map=kv_map.tolist(), scale=0.3))
    assert res.num_queries.tolist() == [10, 10, 9, 10, 10, 10]


def test_float32_inputs_and_small_chunks():
    q, k = _qk(dtype=torch.float32, t=11, s=13, seed=3)
    mask = torch.rand(1, 1, 11, 13, generator=torch.Generator().manual_seed(2)) > 0.3
    ref = brute(q, k, mask=mask)
    for chunk_bytes in (1, 1000, 1 << 25):
        for dtype in ("float32", "float64"):
            acc = KernelStatsAccumulator(4, chunk_bytes=chunk_bytes, compute_dtype=dtype)
            acc.update(q, k, mask=mask)
            assert_matches(acc.compute(), ref)


@pytest.mark.parametrize("is_causal", [False, True])
def test_uniform_attention_gives_ln_n_exactly(is_causal):
    q, k = _qk(t=9, s=9)
    res = attention_kernel_stats(torch.zeros_like(q), k, is_causal=is_causal)
    n = torch.arange(1, 10, dtype=torch.float64) if is_causal else torch.full((9,), 9.0, dtype=torch.float64)
    expected = float(torch.log(n).mean())
    torch.testing.assert_close(res.entropy, torch.full((4,), expected, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(res.uniform_entropy, res.entropy, atol=1e-12, rtol=0)
    assert (res.max_logit == 0).all()


def test_subsample_uses_private_generator_and_matches_brute_force_on_the_chosen_queries():
    q, k = _qk(t=10, s=10)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 7:] = False
    state = torch.get_rng_state()
    res = attention_kernel_stats(
        q, k, is_causal=True, query_keep=keep, max_tokens=6, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(torch.get_rng_state(), state)
    chosen = subsample_mask(keep.reshape(-1), 6, torch.Generator().manual_seed(5)).view(2, 10)
    assert int(chosen.sum()) == 6 and not (chosen & ~keep).any()
    assert_matches(res, brute(q, k, is_causal=True, query_keep=chosen))
    without = attention_kernel_stats(q, k, is_causal=True, query_keep=keep, max_tokens=6)  # default: seeded 0
    assert torch.equal(torch.get_rng_state(), state)
    assert int(without.num_queries[0]) == 6


def test_merge_state_dict_and_many_results():
    q, k = _qk(b=4, t=6, s=6)
    whole = attention_kernel_stats(q, k, is_causal=True)
    a, b = KernelStatsAccumulator(4), KernelStatsAccumulator(4)
    a.update(q[:1], k[:1], is_causal=True)
    b.update(q[1:3], k[1:3], is_causal=True)
    b.update(q[3:], k[3:], is_causal=True)
    a.merge(b)
    c = KernelStatsAccumulator(4)
    c.load_state_dict(a.state_dict())
    empty = KernelStatsAccumulator(3)
    got, none = compute_kernel_results([c, empty])
    for name in ("entropy", "uniform_entropy", "max_logit"):
        torch.testing.assert_close(getattr(got, name), getattr(whole, name), atol=1e-12, rtol=0)
    assert torch.equal(got.num_queries, whole.num_queries)
    assert torch.isnan(none.entropy).all() and (none.num_queries == 0).all()


def test_bad_inputs_raise():
    q, k = _qk()
    with pytest.raises(ValueError, match="heads"):
        KernelStatsAccumulator(3).update(q, k)
    with pytest.raises(ValueError, match="broadcast"):
        attention_kernel_stats(q, k, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_head_map"):
        attention_kernel_stats(q, k, kv_head_map=[0, 1])
    with pytest.raises(TypeError):
        attention_kernel_stats(q[0], k)


# --------------------------------------------------------------------------------------------------
# capture: brute force of the captured q/k, and the models' own attention probabilities
# --------------------------------------------------------------------------------------------------


def _bert(impl):
    cfg = transformers.BertConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, attn_implementation=impl,
    )  # fmt: skip
    return transformers.BertModel(cfg)


def _gpt2(impl):
    cfg = transformers.GPT2Config(
        vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_implementation=impl
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama(impl, dropout=0.0):
    cfg = transformers.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=dropout, attn_implementation=impl,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _t5(impl):  # relative position bias: added to the logits (eager) or folded into the mask (sdpa)
    cfg = transformers.T5Config(
        vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, attn_implementation=impl
    )
    return transformers.T5EncoderModel(cfg)


BUILDERS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5}


def _batch(seed=0, b=3, t=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, :3] = 0  # left padding
    am[2, 6:] = 0  # right padding
    return ids, am


def _build(family, impl):
    torch.manual_seed(0)
    return BUILDERS[family](impl).eval()


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "t5"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_capture_matches_brute_force_of_captured_qk(family, impl):
    model = _build(family, impl)
    layers = discover_attention(model).layers
    assert len(layers) == 2
    ids, am = _batch()
    calls: list[KernelCall] = []
    with torch.no_grad(), KernelCapture(layers, calls.append) as cap:
        model(input_ids=ids, attention_mask=am)
    assert cap.unreachable == []
    assert [c.layer for c in calls] == [lay.name for lay in layers]
    assert {c.source for c in calls} == {f"transformers:{impl}"}
    keep = am.bool()
    for call in calls:
        assert call.q.shape == (3, 4, 9, 8)
        if family == "llama" and impl == "eager":
            assert call.k.shape[1] == 2  # GQA: the kernel's own two key heads
        res = attention_kernel_stats(
            call.q, call.k, scale=call.scale, mask=call.mask, is_causal=call.is_causal,
            query_keep=keep, kv_head_map=call.kv_head_map,
        )  # fmt: skip
        kv = None if call.kv_head_map is None else call.kv_head_map.tolist()
        ref = brute(
            call.q, call.k, scale=call.scale, mask=call.mask, is_causal=call.is_causal, kv_map=kv, query_keep=keep
        )
        assert_matches(res, ref)


def _prob_entropy(probs, keep):
    """Per head mean entropy of the model's own attention probabilities over the kept queries."""
    p = probs.double()  # (B, H, T, S)
    ent = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)  # (B, H, T)
    w = keep[:, None, :].double()
    return (ent * w).sum((0, 2)) / w.sum((0, 2))


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "t5"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_entropy_equals_the_models_own_attention_probabilities(family, impl):
    """The q/k captured under either kernel are those of the model's own eager attention."""
    ids, am = _batch(seed=1)
    keep = am.bool()
    eager = _build(family, "eager")
    with torch.no_grad():
        out = eager(input_ids=ids, attention_mask=am, output_attentions=True)
    model = _build(family, impl)
    with torch.no_grad(), KernelStatsCapture(discover_attention(model).layers, query_mask=keep) as cap:
        model(input_ids=ids, attention_mask=am)
    results = cap.results()
    assert len(results) == 2 and cap.unreachable == []
    for res, probs in zip(results.values(), out.attentions, strict=True):
        torch.testing.assert_close(res.entropy, _prob_entropy(probs, keep), atol=TOL, rtol=0)
        assert (res.entropy <= res.uniform_entropy + 1e-12).all()
        assert int(res.num_queries[0]) == int(keep.sum())


def _mha_model():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_mha_matches_its_own_attention_weights(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True  # key padding
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # MHA's convention: True = not allowed
    xin = x if batch_first else x.transpose(0, 1)
    calls: list[KernelCall] = []
    with torch.no_grad(), KernelCapture({"mha": mha}, calls.append) as cap:
        _, weights = mha(xin, xin, xin, key_padding_mask=pad, attn_mask=causal, average_attn_weights=False)
    assert cap.unreachable == [] and len(calls) == 1
    call = calls[0]
    res = attention_kernel_stats(call.q, call.k, scale=call.scale, mask=call.mask)
    assert_matches(res, brute(call.q, call.k, scale=call.scale, mask=call.mask))
    torch.testing.assert_close(
        res.entropy, _prob_entropy(weights, torch.ones(2, 6, dtype=torch.bool)), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("nested", [False, True])
def test_transformer_encoder_padded_queries_are_not_counted(nested):
    """Self-attention with a key padding mask: the padded tokens are padded queries too, and are
    not counted (they were: 10 queries for 8 real tokens). ``nested``: nn.TransformerEncoder in eval
    mode hands its layers a nested tensor, read padded again. Reference: the entropy of the first
    layer's own attention probabilities over the real queries; the global fast-path flag is never
    touched."""
    layer = _mha_model()
    model: nn.Module = nn.TransformerEncoder(layer, 2).eval() if nested else layer
    first = model.layers[0] if nested else model
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    with torch.no_grad():
        _, probs = first.self_attn(x, x, x, key_padding_mask=pad, average_attn_weights=False)
    before = torch.backends.mha.get_fastpath_enabled()
    watched = {"self_attn": first.self_attn}
    with torch.no_grad(), KernelStatsCapture(watched) as cap:
        assert torch.backends.mha.get_fastpath_enabled() == before
        model(x, src_key_padding_mask=pad)
    assert torch.backends.mha.get_fastpath_enabled() == before
    res = cap.results()["self_attn"]
    assert cap.unreachable == [] and int(res.num_queries[0]) == int((~pad).sum()) == 8
    torch.testing.assert_close(res.entropy, _prob_entropy(probs, ~pad), atol=TOL, rtol=0)


def test_unreachable_layers_are_named():
    class EinsumAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    class Sdpa(EinsumAttention):
        def forward(self, x):
            q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, -1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]

    layers = {"einsum": EinsumAttention(), "sdpa": Sdpa(), "idle": EinsumAttention()}
    with torch.no_grad(), KernelStatsCapture(layers) as cap:
        x = torch.randn(2, 4, 8)
        layers["einsum"](x)
        layers["sdpa"](x)
    reasons = dict(cap.unreachable)
    assert set(reasons) == {"einsum", "idle"}
    assert "not reachable" in reasons["einsum"] and "did not run" in reasons["idle"]
    assert int(cap.results()["sdpa"].num_queries[0]) == 8


# --------------------------------------------------------------------------------------------------
# no global state left changed, no effect on training
# --------------------------------------------------------------------------------------------------


def _globals():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    return (
        dict(ALL_ATTENTION_FUNCTIONS.items()),
        dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
        F.scaled_dot_product_attention,
        modeling_llama.eager_attention_forward,
        torch.backends.mha.get_fastpath_enabled(),
    )


@pytest.mark.parametrize("fail", [False, True])
def test_globals_restored_after_exit_also_on_exception(fail):
    model = _build("llama", "sdpa")
    mha = _mha_model()
    layers = {**{lay.name: lay.module for lay in discover_attention(model).layers}, "mha": mha.self_attn}
    before = _globals()
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers.values()]
    ids, am = _batch()

    inside = []

    def look(*_):  # runs in the first layer's forward, after the capture's own pre-hook
        inside.append(_globals()[2] is not before[2])
        if fail:
            raise RuntimeError("boom")  # inside the layer's forward: its always-called hook puts the wrappers back

    def run():
        with torch.no_grad(), KernelCapture(layers, lambda c: None):
            assert _globals()[2] is before[2]  # wrapped only while a watched layer's forward runs
            first = next(iter(layers.values()))
            handle = first.register_forward_pre_hook(look)
            try:
                model(input_ids=ids, attention_mask=am)
            finally:
                handle.remove()
                assert inside == [True]  # wrapped inside
                assert _globals()[2] is before[2]  # and put back when the forward returned or raised

    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            run()
    else:
        run()
    after = _globals()
    assert after[0] == before[0] and after[1] == before[1]
    assert all(a is b for a, b in zip(after[2:4], before[2:4], strict=True)) and after[4] == before[4]
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in layers.values()] == hooks_before


def test_errors_go_to_on_error():
    model = _build("gpt2", "sdpa")
    errors = []

    def broken(_call):
        raise ValueError("inside")

    ids, am = _batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
        with KernelCapture(discover_attention(model).layers, broken, on_error=errors.append):
            got = model(input_ids=ids, attention_mask=am).logits
        assert torch.equal(got, ref) and len(errors) == 2
        with pytest.raises(ValueError, match="inside"), KernelCapture(discover_attention(model).layers, broken):
            model(input_ids=ids, attention_mask=am)
    assert _globals()[2] is F.scaled_dot_product_attention


def _train(measure_step: int | None, impl: str):
    torch.manual_seed(0)
    model = _llama(impl, dropout=0.2).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layers = discover_attention(model).layers
    g = torch.Generator().manual_seed(7)
    losses = []
    for step in range(4):
        ids = torch.randint(0, 60, (4, 12), generator=g)
        am = torch.ones(4, 12, dtype=torch.long)
        am[0, :4] = 0
        if step == measure_step:
            with KernelStatsCapture(layers, max_tokens=10, query_mask=am.bool()) as cap:
                out = model(input_ids=ids, attention_mask=am, labels=ids)
            assert all(int(r.num_queries[0]) == 10 for r in cap.results().values())
        else:
            out = model(input_ids=ids, attention_mask=am, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.detach())
    return model.state_dict(), torch.stack(losses), torch.get_rng_state()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_training_bit_identical_with_capture(impl):
    w0, l0, rng0 = _train(None, impl)
    w1, l1, rng1 = _train(1, impl)
    assert torch.equal(l0, l1) and torch.equal(rng0, rng1)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_training_bit_identical_with_capture_torch_mha():
    def train(measure: bool):
        torch.manual_seed(0)
        enc = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True)
        opt = torch.optim.SGD(enc.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(3, 7, 16, generator=g)
            if measure and step == 1:
                with KernelStatsCapture({"attn": enc.self_attn}, max_tokens=5):
                    loss = enc(x).square().mean()
            else:
                loss = enc(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return copy.deepcopy(enc.state_dict()), torch.get_rng_state()

    (w0, r0), (w1, r1) = train(False), train(True)
    assert torch.equal(r0, r1) and all(torch.equal(w0[n], w1[n]) for n in w0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_one_token_decoding_with_cache_matches_the_full_forward(impl):
    """Decoding one token with a KV cache (transformers packs GQA heads into the query axis there)."""
    ids, am = _batch(seed=2)
    am[2, 6:] = 1  # the decoded token is real in every row
    eager = _build("llama", "eager")
    with torch.no_grad():
        probs = eager(input_ids=ids, attention_mask=am, output_attentions=True).attentions
    model = _build("llama", impl)
    with torch.no_grad():
        past = model(input_ids=ids[:, :-1], attention_mask=am[:, :-1], use_cache=True).cache
        calls: list[KernelCall] = []
        with KernelCapture(discover_attention(model).layers, calls.append) as cap:
            model(input_ids=ids[:, -1:], attention_mask=am, cache=past)
    assert cap.unreachable == [] and len(calls) == 2
    for call, p in zip(calls, probs, strict=True):
        assert call.q.shape == (3, 4, 1, 8) and call.k.shape[2] == 9
        assert impl == "eager" or call.k.shape[1] == 2  # sdpa packed the grouped heads: read before packing
        res = attention_kernel_stats(
            call.q, call.k, scale=call.scale, mask=call.mask, is_causal=call.is_causal, kv_head_map=call.kv_head_map
        )
        torch.testing.assert_close(
            res.entropy, _prob_entropy(p[:, :, -1:], torch.ones(3, 1, dtype=torch.bool)), atol=TOL, rtol=0
        )


def test_sync_over_two_gloo_ranks(tmp_path, gloo2):
    """Entropy and uniform sums and counts add over ranks, maxima take the maximum (2 processes)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "kernel_sync.py"
    gloo2.run(script, "scenario", str(tmp_path), timeout_s=120)
    spec = importlib.util.spec_from_file_location("kernel_sync", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inputs = [mod.rank_inputs(r) for r in range(2)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for layer in range(2):  # the reference: brute force per rank, combined by query counts
            refs = [brute(*inputs[r][layer], is_causal=True) for r in range(2)]
            n = refs[0][3] + refs[1][3]
            ent, uni, top, count = got[layer]
            for mine, i in ((ent, 0), (uni, 1)):
                want = (refs[0][i] * refs[0][3] + refs[1][i] * refs[1][3]) / n
                torch.testing.assert_close(mine, want, atol=TOL, rtol=0)
            torch.testing.assert_close(top, torch.maximum(refs[0][2], refs[1][2]), atol=TOL, rtol=0)
            assert torch.equal(count, n)
        assert torch.isnan(got[2][0]).all() and (got[2][3] == 0).all()


def test_softcapped_eager_attention_is_named_not_measured():
    """Gemma-2 logit soft-capping changes the softmax: refused out loud, with the reason."""
    cfg = transformers.Gemma2Config(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_implementation="eager", attn_logit_softcapping=50.0,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad(), KernelStatsCapture(discover_attention(model).layers) as cap:
        model(input_ids=torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(0)))
    assert cap.results() == {}
    assert cap.unreachable == [(f"model.layers.{i}.self_attn", "eager attention takes 'softcap'") for i in range(2)]
