"""Tests for hdi_monitor.functional.covariance against brute-force references (explicit per-head loops in numpy)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hdi_monitor.contrib.ensemble import bias_variance_covariance
from hdi_monitor.functional.covariance import covariance_metrics, head_covariance, subsample_mask
from hdi_monitor.measure.covariance import HeadCovarianceAccumulator, compute_results

SCRIPTS = Path(__file__).parents[2] / "scripts"


# --------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------


def brute_covariance(o: np.ndarray, w_out: np.ndarray) -> np.ndarray:
    """C by materialising every head's contribution c_h = W_O,h o_h (float64, explicit loops)."""
    o = np.asarray(o, dtype=np.float64).reshape(-1, o.shape[-1])
    w = np.asarray(w_out, dtype=np.float64)
    h, _, d = w.shape
    contrib = []
    for i in range(h):
        c = o[:, i * d : (i + 1) * d] @ w[i].T  # (N, D)
        contrib.append(c - c.mean(axis=0))
    out = np.empty((h, h))
    for i in range(h):
        for j in range(h):
            out[i, j] = np.mean(np.sum(contrib[i] * contrib[j], axis=1))
    return out


def brute_metrics(c: np.ndarray) -> dict[str, float]:
    h = c.shape[0]
    r = c / np.sqrt(np.outer(np.diag(c), np.diag(c)))
    v = c.sum() / np.trace(c)
    off = [r[i, j] for i in range(h) for j in range(h) if i != j]
    return {"R": r, "V": v, "H_eff": h / v, "mean_corr": float(np.mean(off)) if off else float("nan")}


def random_case(gen: torch.Generator, h: int = 4, d: int = 3, dim: int = 10, n: int = 500, mean_scale: float = 100.0):
    """Head outputs with a large non-zero mean (mean_scale x std), and correlated heads."""
    width = h * d
    mix = torch.randn(width, width, generator=gen, dtype=torch.float64)
    o = torch.randn(n, width, generator=gen, dtype=torch.float64) @ mix / math.sqrt(width)
    o = o + mean_scale * torch.randn(width, generator=gen, dtype=torch.float64)
    w_out = torch.randn(h, dim, d, generator=gen, dtype=torch.float64)
    return o, w_out


def assert_close(actual, expected, rtol=1e-6, atol=0.0):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------------
# Covariance against brute force
# --------------------------------------------------------------------------------------------------


def test_single_batch_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    o, w_out = random_case(gen)
    res = head_covariance(o.reshape(5, 100, -1), w_out)
    ref = brute_covariance(o.numpy(), w_out.numpy())
    assert res.covariance.dtype == torch.float64 and res.covariance.shape == (4, 4)
    assert res.num_tokens == 500
    assert_close(res.covariance, ref, rtol=1e-6)
    m = brute_metrics(ref)
    assert_close(res.correlation, m["R"], rtol=1e-6)
    assert res.variance_ratio == pytest.approx(m["V"], rel=1e-6)
    assert res.effective_heads == pytest.approx(m["H_eff"], rel=1e-6)
    assert res.mean_correlation == pytest.approx(m["mean_corr"], rel=1e-6)


def test_sum_of_covariance_is_variance_of_layer_output():
    """sum_ij C_ij = mean_t ||y_t - mean y||^2 with y = W_O o, the (bias-free) layer output."""
    gen = torch.Generator().manual_seed(1)
    o, w_out = random_case(gen, h=3, d=4, dim=7, n=300)
    w_o = torch.cat(list(w_out), dim=1)  # (D, H d), written out without einops
    y = (o @ w_o.T).numpy()
    y = y - y.mean(axis=0)
    res = head_covariance(o, w_out)
    assert float(res.covariance.sum()) == pytest.approx(float(np.mean(np.sum(y * y, axis=1))), rel=1e-9)


@pytest.mark.parametrize("mean_scale", [100.0, 1e5])
def test_large_mean_keeps_precision(mean_scale):
    """A raw Gram/n - mu mu^T would lose ~ (mean/std)^2 * eps relative precision; Chan's merge does not."""
    gen = torch.Generator().manual_seed(2)
    o, w_out = random_case(gen, n=2000, mean_scale=mean_scale)
    acc = HeadCovarianceAccumulator(4, 3, w_out=w_out, chunk_size=300)  # several chunks merged
    for part in torch.split(o, [700, 1, 999, 300]):
        acc.update(part)
    assert_close(acc.compute().covariance, brute_covariance(o.numpy(), w_out.numpy()), rtol=1e-9)


def test_several_batches_of_varied_shapes_and_dtypes():
    gen = torch.Generator().manual_seed(3)
    h, d, dim = 4, 2, 6
    width = h * d
    offset = 50.0 * torch.randn(width, generator=gen)
    shapes = [(2, 7, width), (13, width), (width,), (3, 1, 5, width)]
    batches = [torch.randn(*s, generator=gen) + offset for s in shapes]
    batches.append((torch.randn(4, 9, width, generator=gen) + offset).to(torch.float16))
    batches.append((torch.randn(6, width, generator=gen) + offset).to(torch.bfloat16))
    batches.append(torch.randn(2, 5, 2 * width, generator=gen)[..., ::2] + offset)  # non-contiguous
    w_out = torch.randn(h, dim, d, generator=gen)
    acc = HeadCovarianceAccumulator(h, d, w_out=w_out)
    for b in batches:
        acc.update(b)
    flat = np.concatenate([b.double().reshape(-1, width).numpy() for b in batches])
    assert acc.num_tokens == flat.shape[0]
    state = acc.state_dict()
    assert state["sum"].dtype == state["m2"].dtype == torch.float64
    assert_close(acc.compute().covariance, brute_covariance(flat, w_out.double().numpy()), rtol=1e-6)


def test_padding_mask_excludes_tokens():
    gen = torch.Generator().manual_seed(4)
    h, d, dim = 3, 4, 9
    width = h * d
    w_out = torch.randn(h, dim, d, generator=gen, dtype=torch.float64)
    acc = HeadCovarianceAccumulator(h, d, w_out=w_out, chunk_size=7)  # chunks cut across sequences
    kept = []
    for b, t in [(3, 11), (2, 5), (4, 8)]:
        o = torch.randn(b, t, width, generator=gen, dtype=torch.float64) + 20.0
        lengths = torch.randint(0, t + 1, (b,), generator=gen)
        lengths[0] = t  # at least one full row
        mask = torch.arange(t)[None, :] < lengths[:, None]
        o[~mask] = 1e6  # garbage in the padding must not leak in
        acc.update(o, mask)
        kept.append(o[mask].numpy())
    # A broadcast mask: (T,) over a (B, T, H d) batch.
    o = torch.randn(2, 6, width, generator=gen, dtype=torch.float64) - 5.0
    tmask = torch.tensor([True, False, True, True, False, True])
    o[:, ~tmask] = -1e6
    acc.update(o, tmask)
    kept.append(o[:, tmask].reshape(-1, width).numpy())
    # A batch that is all padding adds nothing.
    acc.update(torch.full((2, 3, width), 7e5, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.bool))
    flat = np.concatenate(kept)
    assert acc.num_tokens == flat.shape[0]
    assert_close(acc.compute().covariance, brute_covariance(flat, w_out.numpy()), rtol=1e-6)


def test_merge_of_halves_equals_whole_and_state_round_trip():
    gen = torch.Generator().manual_seed(5)
    o, w_out = random_case(gen, n=400)
    whole = HeadCovarianceAccumulator(4, 3, w_out=w_out)
    whole.update(o)
    a, b = HeadCovarianceAccumulator(4, 3, w_out=w_out), HeadCovarianceAccumulator(4, 3, w_out=w_out)
    a.update(o[:123])
    b.update(o[123:250])
    b.update(o[250:])
    a.merge(b)
    empty = HeadCovarianceAccumulator(4, 3, w_out=w_out)
    a.merge(empty)  # merging nothing changes nothing
    assert a.num_tokens == 400 and b.num_tokens == 277
    ref = brute_covariance(o.numpy(), w_out.numpy())
    assert_close(a.compute().covariance, ref, rtol=1e-9)
    assert_close(whole.compute().covariance, ref, rtol=1e-9)
    into_empty = HeadCovarianceAccumulator(4, 3, w_out=w_out)
    into_empty.merge(whole)
    assert_close(into_empty.compute().covariance, ref, rtol=1e-9)

    restored = HeadCovarianceAccumulator(4, 3, w_out=w_out)
    restored.load_state_dict(a.state_dict())
    restored.update(o[:50])  # keeps accumulating from the restored state
    ref2 = brute_covariance(np.concatenate([o.numpy(), o[:50].numpy()]), w_out.numpy())
    assert_close(restored.compute().covariance, ref2, rtol=1e-9)
    a.reset()
    assert a.num_tokens == 0 and a.state_nbytes == 0
    with pytest.raises(ValueError, match="no tokens"):
        a.compute()


# --------------------------------------------------------------------------------------------------
# Token subsampling
# --------------------------------------------------------------------------------------------------


def test_max_tokens_uses_the_documented_selection():
    gen = torch.Generator().manual_seed(6)
    o = torch.randn(4, 25, 6, generator=gen, dtype=torch.float64) + 3.0
    mask = torch.rand(4, 25, generator=gen) < 0.7
    w_out = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64)
    acc = HeadCovarianceAccumulator(3, 2, w_out=w_out, max_tokens=30, generator=torch.Generator().manual_seed(42))
    acc.update(o, mask)
    acc.update(o[:1], mask[:1])  # 25 tokens, fewer kept than max_tokens: all kept ones are used

    replay = torch.Generator().manual_seed(42)
    sel1 = subsample_mask(mask.reshape(-1), 30, replay)
    assert int(sel1.sum()) == 30 and not bool((sel1 & ~mask.reshape(-1)).any())
    sel2 = subsample_mask(mask[:1].reshape(-1), 30, replay)
    assert torch.equal(sel2, mask[:1].reshape(-1))
    flat = torch.cat([o.reshape(-1, 6)[sel1], o[:1].reshape(-1, 6)[sel2]]).numpy()
    assert acc.num_tokens == flat.shape[0]
    assert_close(acc.compute().covariance, brute_covariance(flat, w_out.numpy()), rtol=1e-9)


def test_subsample_mask_is_uniform_over_kept_tokens():
    """Each kept token is chosen with probability k / n_kept (binomial 5-sigma band), masked ones never."""
    n, k, draws = 40, 10, 4000
    keep = torch.ones(n, dtype=torch.bool)
    keep[::4] = False  # 30 kept tokens
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(n)
    for _ in range(draws):
        sel = subsample_mask(keep, k, gen)
        assert int(sel.sum()) == k
        counts += sel
    p = k / int(keep.sum())
    sd = math.sqrt(draws * p * (1 - p))
    assert float(counts[~keep].sum()) == 0.0
    assert float((counts[keep] - draws * p).abs().max()) < 5 * sd


# --------------------------------------------------------------------------------------------------
# Metrics on analytic cases
# --------------------------------------------------------------------------------------------------


def test_identical_heads_give_one_effective_head():
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(200, 2, generator=gen, dtype=torch.float64)
    o = torch.cat([base] * 3, dim=1)
    w = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    res = head_covariance(o, torch.stack([w] * 3))
    assert_close(res.correlation, np.ones((3, 3)), rtol=1e-12)
    assert res.variance_ratio == pytest.approx(3.0, rel=1e-12)
    assert res.effective_heads == pytest.approx(1.0, rel=1e-12)
    assert res.mean_correlation == pytest.approx(1.0, rel=1e-12)


def test_orthogonal_contributions_give_h_effective_heads():
    """Heads writing to orthogonal output directions are exactly uncorrelated: H_eff = H."""
    gen = torch.Generator().manual_seed(9)
    o = torch.randn(100, 4, generator=gen, dtype=torch.float64)
    w_out = torch.zeros(4, 4, 1, dtype=torch.float64)
    for h in range(4):
        w_out[h, h, 0] = 1.0 + h
    res = head_covariance(o, w_out)
    assert res.effective_heads == pytest.approx(4.0, rel=1e-12)
    assert res.mean_correlation == pytest.approx(0.0, abs=1e-12)


def test_anti_correlated_heads_exceed_h():
    """c_2 = -c_1 / 2: V = (1 - 1 + 1/4) / (1 + 1/4) = 1/5, so H_eff = 10 > H = 2."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(300, 1, generator=gen, dtype=torch.float64)
    o = torch.cat([x, x], dim=1)
    w_out = torch.tensor([[[1.0]], [[-0.5]]], dtype=torch.float64)
    res = head_covariance(o, w_out)
    assert res.variance_ratio == pytest.approx(0.2, rel=1e-12)
    assert res.effective_heads == pytest.approx(10.0, rel=1e-12)
    assert res.mean_correlation == pytest.approx(-1.0, rel=1e-12)
    cancel = head_covariance(o, torch.tensor([[[1.0]], [[-1.0]]], dtype=torch.float64))
    assert cancel.effective_heads == math.inf


def test_zero_variance_head_has_nan_correlation_row():
    gen = torch.Generator().manual_seed(11)
    o = torch.randn(50, 6, generator=gen, dtype=torch.float64)
    o[:, 2:4] = 3.0  # head 1 constant
    w_out = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64)
    res = head_covariance(o, w_out)
    assert torch.isnan(res.correlation[1]).all() and torch.isnan(res.correlation[:, 1]).all()
    ref = brute_covariance(o.numpy(), w_out.numpy())
    keep = [0, 2]
    assert res.mean_correlation == pytest.approx(ref[0, 2] / math.sqrt(ref[0, 0] * ref[2, 2]), rel=1e-9)
    # a constant head is not an independent head: H_eff over the two live heads (issue 23, item 2)
    live = ref[np.ix_(keep, keep)]
    assert res.effective_heads == pytest.approx(2 * np.trace(live) / live.sum(), rel=1e-9)
    assert res.invalid_heads == (1,)
    single = covariance_metrics(torch.tensor([[2.0]]))
    assert single.effective_heads == 1.0 and math.isnan(single.mean_correlation)


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def _peak_extra_bytes(fn) -> int:
    """Peak of net CPU allocations inside fn, from the profiler's per-op memory records in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    cur = peak = 0
    for _, nbytes in records:
        cur += nbytes
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize(("h", "d", "dim"), [(4, 8, 24), (12, 64, 768), (3, 5, 2)])
def test_state_is_h_squared_plus_h_d_numbers(h, d, dim):
    """State: n, the (H, D) contribution sums and the (H, H) cross sums, 8 bytes each; nothing else."""
    gen = torch.Generator().manual_seed(11)
    acc = HeadCovarianceAccumulator(h, d, w_out=torch.randn(h, dim, d, generator=gen))
    assert acc.state_nbytes == 0
    acc.update(torch.randn(3, 7, h * d, generator=gen))
    state = acc.state_dict()  # copies of the live state tensors, same shapes and dtypes
    live = [state["num_tokens"], state["sum"], state["m2"]]
    assert sorted(tuple(t.shape) for t in live) == sorted([(), (h, dim), (h, h)])
    assert all(t.element_size() == 8 for t in live)
    assert acc.state_nbytes == sum(t.numel() * 8 for t in live) == 8 * (h * h + h * dim + 1)
    assert HeadCovarianceAccumulator.state_numel(h, dim) == h * h + h * dim + 1
    acc.update(torch.randn(50, h * d, generator=gen))  # more tokens: the same state
    assert acc.state_nbytes == 8 * (h * h + h * dim + 1)
    assert len(acc.state_dict()["sum"].shape) == 2


def test_state_of_llm_shapes():
    """The issue's projections: about 32 MiB for a 7B shape, about 0.3 GiB for a 70B shape (all layers)."""
    seven_b = 32 * 8 * HeadCovarianceAccumulator.state_numel(32, 4096)
    seventy_b = 80 * 8 * HeadCovarianceAccumulator.state_numel(64, 8192)
    assert seven_b == 32 * 8 * (32 * 32 + 32 * 4096 + 1) and 32 << 20 <= seven_b < 33 << 20
    assert 0.31 * (1 << 30) < seventy_b < 0.32 * (1 << 30)


def test_memory_is_flat_in_the_number_of_tokens():
    h, d, dim, chunk = 4, 8, 24, 256
    width = h * d
    gen = torch.Generator().manual_seed(12)
    w_out = torch.randn(h, dim, d, generator=gen)
    small = torch.randn(4, 256, width, generator=gen)
    large = torch.randn(64, 256, width, generator=gen)  # 16x the tokens
    peaks, states = [], []
    for o in (small, large):
        acc = HeadCovarianceAccumulator(h, d, w_out=w_out, chunk_size=chunk, matmul_dtype="float32")
        acc.update(o[:1])  # allocate the state outside the measured call
        states.append(acc.state_nbytes)
        peaks.append(_peak_extra_bytes(lambda acc=acc, o=o: acc.update(o)))
    assert states[0] == states[1] == (h * h + h * dim + 1) * 8
    # per chunk: two float64 copies of the head outputs, a float32 one, the float32 contributions
    chunk_bytes = chunk * (width * (8 + 8 + 4) + h * dim * 4)
    assert peaks[0] > 0
    assert peaks[1] <= peaks[0] * 1.1 + 1024
    assert peaks[1] < 2 * chunk_bytes
    assert large.numel() * 8 > 10 * peaks[1]  # a float64 copy of the input would be far bigger


def test_default_chunk_is_bounded_by_default_chunk_bytes():
    """Without chunk_size, the transient memory of update stays near DEFAULT_CHUNK_BYTES."""
    import hdi_monitor.functional.covariance as cov

    h, d, dim = 4, 8, 64
    gen = torch.Generator().manual_seed(16)
    w_out = torch.randn(h, dim, d, generator=gen)
    o = torch.randn(20000, h * d, generator=gen)
    old = cov.DEFAULT_CHUNK_BYTES
    cov.DEFAULT_CHUNK_BYTES = 1 << 20
    try:
        acc = HeadCovarianceAccumulator(h, d, w_out=w_out, matmul_dtype="float32")
        acc.update(o[:1])
        peak = _peak_extra_bytes(lambda: acc.update(o))
        acc_ref = HeadCovarianceAccumulator(h, d, w_out=w_out.double())
        acc_ref.update(o[:1].double())
        acc_ref.update(o.double())
    finally:
        cov.DEFAULT_CHUNK_BYTES = old
    assert peak < 2 * (1 << 20)
    ref = acc_ref.compute().covariance  # float32 products against float64 ones: 1e-6 of the largest entry
    assert_close(acc.compute().covariance, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_float32_products_match_brute_force_under_reduced_precision_settings():
    """float32 head outputs and W_O (float32 chunk products): still 1e-6 against float64 brute force,
    with TF32/bf16 float32 matmuls allowed globally; the global settings come back unchanged."""
    gen = torch.Generator().manual_seed(17)
    o, w_out = random_case(gen, n=3000, mean_scale=30.0)
    o32, w32 = o.float(), w_out.float()
    ref = brute_covariance(o32.double().numpy(), w32.double().numpy())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # bf16 on oneDNN CPUs, TF32 on CUDA
    try:
        flags = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
        acc = HeadCovarianceAccumulator(4, 3, w_out=w32, chunk_size=700, matmul_dtype="float32")
        for part in torch.split(o32, [1000, 1, 1999]):
            acc.update(part)
        after = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
        assert after == flags and torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    res = acc.compute()
    assert_close(res.covariance, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_linear_layout_and_callable_sources_agree():
    """w_out as (H, D, d), as the nn.Linear weight (D, H d), as a callable, or per update: one result."""
    gen = torch.Generator().manual_seed(18)
    o, w_out = random_case(gen, n=200)
    linear = torch.cat(list(w_out), dim=1)  # (D, H d), written out without einops
    ref = brute_covariance(o.numpy(), w_out.numpy())
    sources = [w_out, linear, lambda: linear]
    for src in sources:
        acc = HeadCovarianceAccumulator(4, 3, w_out=src)
        acc.update(o)
        assert_close(acc.compute().covariance, ref, rtol=1e-9)
    acc = HeadCovarianceAccumulator(4, 3)
    acc.update(o[:80], w_out=w_out)
    acc.update(o[80:], w_out=linear)
    assert_close(acc.compute().covariance, ref, rtol=1e-9)


def test_w_out_read_per_update_is_the_one_that_produced_the_outputs():
    """W_O changes between batches (an optimizer step): each batch's contributions use its own W_O."""
    gen = torch.Generator().manual_seed(19)
    o1, w1 = random_case(gen, n=150)
    o2, w2 = random_case(gen, n=250)
    current = {"w": w1}
    acc = HeadCovarianceAccumulator(4, 3, w_out=lambda: current["w"])
    acc.update(o1)
    current["w"] = w2
    acc.update(o2)
    current["w"] = torch.zeros_like(w2)  # what compute would see if it read W_O late
    contrib = [
        np.stack([o[:, i * 3 : (i + 1) * 3].numpy() @ w[i].numpy().T for i in range(4)], 1)
        for o, w in ((o1, w1), (o2, w2))
    ]
    c = np.concatenate(contrib)
    c = c - c.mean(axis=0)
    ref = np.einsum("tiD,tjD->ij", c, c) / c.shape[0]
    assert_close(acc.compute().covariance, ref, rtol=1e-9)


def test_compute_results_batches_layers_with_one_transfer():
    gen = torch.Generator().manual_seed(20)
    accs, refs = [], []
    for h, d, dim in [(4, 3, 10), (2, 5, 7), (3, 2, 4)]:
        w = torch.randn(h, dim, d, generator=gen, dtype=torch.float64)
        o = torch.randn(60, h * d, generator=gen, dtype=torch.float64)
        acc = HeadCovarianceAccumulator(h, d, w_out=w)
        acc.update(o)
        accs.append(acc)
        refs.append(brute_covariance(o.numpy(), w.numpy()))
    empty = HeadCovarianceAccumulator(2, 2, w_out=torch.randn(2, 3, 2))
    one = HeadCovarianceAccumulator(2, 2, w_out=torch.randn(2, 3, 2))
    one.update(torch.randn(1, 4))
    results = compute_results([*accs, empty, one], min_tokens=2)
    assert results[3] is None and results[4] is None and one.num_tokens == 1 and empty.num_tokens == 0
    for res, ref in zip(results[:3], refs, strict=True):
        assert res.num_tokens == 60 and res.covariance.device.type == "cpu"
        assert_close(res.covariance, ref, rtol=1e-9)
        m = brute_metrics(ref)
        assert res.effective_heads == pytest.approx(m["H_eff"], rel=1e-9)
        assert res.mean_correlation == pytest.approx(m["mean_corr"], rel=1e-9)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_stays_on_device_and_memory_is_flat():
    h, d, dim = 8, 16, 64
    width = h * d
    w_out = torch.randn(h, dim, d, device="cuda")
    peaks = []
    for n in (4096, 65536):
        o = torch.randn(n, width, device="cuda")
        acc = HeadCovarianceAccumulator(h, d, w_out=w_out, chunk_size=1024, max_tokens=n - 1)
        acc.update(o[:2])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        acc.update(o)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        assert acc.device.type == "cuda"
        assert all(acc.state_dict()[k].device.type == "cuda" for k in ("num_tokens", "sum", "m2"))
        keep = subsample_mask(torch.ones(n, dtype=torch.bool), n - 1, None)  # only for the count
        cpu = HeadCovarianceAccumulator(h, d, w_out=w_out.cpu().double())
        cpu.load_state_dict(acc.state_dict())
        assert int(keep.sum()) + 2 == acc.num_tokens
        assert_close(acc.compute().covariance, cpu.compute().covariance, rtol=1e-12)
    # Only the O(N) int64 subsampling ranks grow (a few 8-byte numbers per token), not the chunks.
    assert peaks[1] - peaks[0] <= 64 * (65536 - 4096) + (1 << 20)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_matches_float64_brute_force_with_tf32_allowed():
    gen = torch.Generator().manual_seed(21)
    o, w_out = random_case(gen, h=8, d=16, dim=128, n=5000, mean_scale=30.0)
    ref = brute_covariance(o.float().double().numpy(), w_out.float().double().numpy())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 allowed for the training
    try:
        acc = HeadCovarianceAccumulator(8, 16, w_out=w_out.float().cuda(), chunk_size=999)
        acc.update(o.float().cuda())
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert_close(acc.compute().covariance, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_no_autograd_graph_is_built():
    gen = torch.Generator().manual_seed(15)
    o = torch.randn(20, 6, generator=gen, requires_grad=True)
    w_out = torch.nn.Parameter(torch.randn(2, 4, 3, generator=gen))
    res = head_covariance(o * 2.0, w_out)
    assert res.covariance.grad_fn is None and not res.covariance.requires_grad
    assert_close(res.covariance, brute_covariance((o * 2.0).detach().numpy(), w_out.detach().numpy()), rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    acc = HeadCovarianceAccumulator(2, 3, w_out=torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
        acc.update(torch.randn(4, 5))
    with pytest.raises(TypeError, match="floating"):
        acc.update(torch.ones(4, 6, dtype=torch.int64))
    with pytest.raises(TypeError, match="bool"):
        acc.update(torch.randn(2, 4, 6), torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="broadcast"):
        acc.update(torch.randn(2, 4, 6), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens"):
        acc.compute()
    acc.update(torch.randn(4, 6))
    with pytest.raises(TypeError, match="takes no W_O"):
        acc.compute(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="D=5"):
        acc.update(torch.randn(4, 6), w_out=torch.randn(2, 7, 3))
    with pytest.raises(ValueError, match=r"\(2, D, 3\)"):
        HeadCovarianceAccumulator(2, 3, w_out=torch.randn(3, 5, 2))
    with pytest.raises(ValueError, match=r"H\*d = 6"):
        HeadCovarianceAccumulator(2, 3, w_out=torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"\(H, D, d\)"):
        HeadCovarianceAccumulator(2, 3, w_out=torch.randn(6))
    with pytest.raises(TypeError, match="callable"):
        HeadCovarianceAccumulator(2, 3, w_out="o_proj")
    with pytest.raises(ValueError, match="model_dim"):
        HeadCovarianceAccumulator(2, 3, w_out=torch.randn(2, 5, 3), model_dim=4)
    with pytest.raises(ValueError, match="no W_O"):
        HeadCovarianceAccumulator(2, 3).update(torch.randn(4, 6))
    with pytest.raises(ValueError, match="matmul_dtype"):
        HeadCovarianceAccumulator(2, 3, matmul_dtype="bfloat16")
    with pytest.raises(ValueError, match="H=3"):
        acc.merge(HeadCovarianceAccumulator(3, 2))
    with pytest.raises(ValueError, match="max_tokens"):
        HeadCovarianceAccumulator(2, 3, max_tokens=0)
    with pytest.raises(ValueError, match="num_heads"):
        HeadCovarianceAccumulator(0, 3)
    acc.sync()  # torch.distributed not initialised: a no-op
    assert acc.num_tokens == 4


# --------------------------------------------------------------------------------------------------
# Two ranks
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_rank_sync_equals_one_rank(tmp_path, gloo2):
    gen = torch.Generator().manual_seed(13)
    h, d, dim = 3, 4, 8
    width = h * d
    offset = 30.0 * torch.randn(width, generator=gen, dtype=torch.float64)
    batches = []
    for b, t in [(2, 9), (3, 4), (1, 17), (4, 6)]:
        o = torch.randn(b, t, width, generator=gen, dtype=torch.float64) + offset
        mask = torch.rand(b, t, generator=gen) < 0.8
        batches.append((o, mask))
    batches.append((torch.randn(5, width, generator=gen, dtype=torch.float64) - offset, None))
    w_out = torch.randn(h, dim, d, generator=gen, dtype=torch.float64)
    assignment = [0, 1, 0, 0, 1]  # uneven split of the global data
    inputs, output = tmp_path / "inputs.pt", tmp_path / "output.pt"
    torch.save({"batches": batches, "assignment": assignment, "num_heads": h, "head_dim": d, "w_out": w_out}, inputs)

    gloo2.run(SCRIPTS / "ddp_covariance.py", "scenario", str(inputs), str(output), timeout_s=120)
    out = torch.load(output, weights_only=False)

    one = HeadCovarianceAccumulator(h, d, w_out=w_out)
    for o, mask in batches:
        one.update(o, mask)
    expected = one.compute()
    flat = np.concatenate([(o[m] if m is not None else o).reshape(-1, width).numpy() for o, m in batches])
    assert out["num_tokens"] == expected.num_tokens == flat.shape[0]
    assert sum(out["local_tokens"]) == flat.shape[0] and min(out["local_tokens"]) > 0
    assert out["tokens_after_first"] == flat.shape[0]
    assert_close(out["covariance"], expected.covariance, rtol=1e-10)
    assert_close(out["covariance"], brute_covariance(flat, w_out.numpy()), rtol=1e-9)
    assert out["repeat_equal"] and out["update_after_sync_raised"]
    assert out["lonely_tokens"] == flat.shape[0]
    assert_close(out["lonely_covariance"], expected.covariance, rtol=1e-10)


# --------------------------------------------------------------------------------------------------
# Bias-variance-covariance
# --------------------------------------------------------------------------------------------------


def brute_bvc(f: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Textbook terms with explicit loops and population (1/R) moments."""
    r, m, n = f.shape
    bias2 = var = cov = mse = 0.0
    for p in range(n):
        means = [f[:, k, p].mean() for k in range(m)]
        bias2 += (np.mean(means) - y[p]) ** 2
        var += np.mean([np.mean((f[:, k, p] - means[k]) ** 2) for k in range(m)])
        pairs = [
            np.mean((f[:, k, p] - means[k]) * (f[:, q, p] - means[q])) for k in range(m) for q in range(m) if k != q
        ]
        cov += np.mean(pairs) if pairs else float("nan")
        mse += np.mean((f[:, :, p].mean(axis=1) - y[p]) ** 2)
    return {"bias2": bias2 / n, "variance": var / n, "covariance": cov / n, "mse": mse / n}


@pytest.mark.parametrize("shape", [(30, 4, 17), (2, 7, 5), (1, 3, 4), (50, 2, 1)])
def test_bvc_identity_and_terms(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    r, m, n = shape
    shared = torch.randn(r, 1, n, generator=gen, dtype=torch.float64)  # correlated members
    f = 0.7 * shared + torch.randn(r, m, n, generator=gen, dtype=torch.float64) + 0.3
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    out = bias_variance_covariance(f, y)
    assert set(out) == {"bias2", "variance", "covariance", "mse"}
    assert all(isinstance(v, float) for v in out.values())
    rhs = out["bias2"] + out["variance"] / m + (1 - 1 / m) * out["covariance"]
    assert abs(out["mse"] - rhs) <= 1e-10 * max(1.0, out["mse"])
    ref = brute_bvc(f.numpy(), y.numpy())
    for key in out:
        assert out[key] == pytest.approx(ref[key], rel=1e-10, abs=1e-12)


def test_bvc_single_member_and_float32_input():
    gen = torch.Generator().manual_seed(14)
    f = torch.randn(20, 1, 6, generator=gen)
    y = torch.randn(6, generator=gen)
    out = bias_variance_covariance(f, y)
    assert math.isnan(out["covariance"])
    assert out["mse"] == pytest.approx(out["bias2"] + out["variance"], rel=1e-12)
    ref = brute_bvc(f.double().numpy(), y.double().numpy())
    assert out["mse"] == pytest.approx(ref["mse"], rel=1e-12)


def test_bvc_shape_errors():
    with pytest.raises(ValueError, match=r"\(R realisations, M members, N points\)"):
        bias_variance_covariance(torch.randn(3, 4), torch.randn(4))
    with pytest.raises(ValueError, match=r"\(N,\) = \(5,\)"):
        bias_variance_covariance(torch.randn(3, 2, 5), torch.randn(4))
    with pytest.raises(TypeError):
        bias_variance_covariance(np.zeros((3, 2, 5)), torch.randn(5))


# --------------------------------------------------------------------------------------------------
# The theory experiment (tiny smoke run with real checks)
# --------------------------------------------------------------------------------------------------


def test_nw_theory_experiment_runs_and_splits_exactly(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("nw_theory", Path(__file__).parents[3] / "examples" / "nw_theory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--out", str(tmp_path), "--angles", "3", "--resamples", "4", "--train", "40", "--test", "30"])
    for name in ("nw_theory.png", "nw_theory.md", "nw_theory.json"):
        assert (tmp_path / name).stat().st_size > 0
    rows = result["rows"]
    assert [round(r["hdi"], 9) for r in rows if r["target"] == "noise"] == [0.0, 0.5, 1.0]
    for r in rows:
        assert r["mse"] == pytest.approx(r["bias2"] + r["var_term"] + r["cov_term"], rel=1e-10, abs=1e-14)
    # Identical heads (HDI 0): every head predicts the same, so covariance = variance and H_eff = 1.
    for r in (r for r in rows if r["hdi"] == 0.0):
        assert r["covariance"] == pytest.approx(r["variance"], rel=1e-9)
        assert r["effective_heads"] == pytest.approx(1.0, rel=1e-9)


def test_subsampling_never_draws_from_the_global_generator():
    """Without a generator, `subsample_mask` and the accumulator draw from a private seeded one: the
    global RNG state is untouched (it would shift every later dropout mask), and the choice is
    reproducible (the same as an explicit generator seeded with 0)."""
    keep = torch.ones(64, dtype=torch.bool)
    w_out, o = torch.randn(2, 5, 3, dtype=torch.float64), torch.randn(64, 6, dtype=torch.float64)
    before = torch.get_rng_state()
    sel = subsample_mask(keep, 10)
    acc = HeadCovarianceAccumulator(2, 3, w_out=w_out, max_tokens=10)
    acc.update(o)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(sel, subsample_mask(keep, 10, torch.Generator().manual_seed(0)))
    assert acc.num_tokens == 10
