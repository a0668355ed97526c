"""Kernel statistics under the masks users write (issue 30, item 2).

An additive float mask is how many models pad: ``scores.masked_fill(mask == 0, -1e9)``, a ``-1e4``
constant (old BERT code, fp16-safe), or ``torch.finfo(dtype).min`` (transformers' eager masks). A
padded key gets no attention weight under any of them, so it must not count as an allowed key: not in
the uniform level ``ln(n_keys)`` nor in the maximum logit.

The reference is a float64 brute force written per query over the **real keys only** (the boolean
padding the float mask was made from, never the float mask itself).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hdi_monitor.functional.kernel import MASKED_AT, attention_kernel_stats, kernel_dtype, subsample_queries
from hdi_monitor.measure.kernel import KernelStatsCapture

TOL = 1e-9

FILLS = {"-1e9": -1e9, "-1e4": -1e4, "finfo.min": None}


def real_key_brute(q, k, real_keys, real_queries, scale):
    """Per head: mean entropy and ln(n) over the real queries, max logit over real query/key pairs."""
    b, h, t, _ = q.shape
    ent = torch.zeros(h, dtype=torch.float64)
    uni = torch.zeros(h, dtype=torch.float64)
    top = torch.full((h,), -math.inf, dtype=torch.float64)
    n = 0
    for bi in range(b):
        keys = [s for s in range(k.shape[2]) if real_keys[bi, s]]
        for ti in range(t):
            if not real_queries[bi, ti]:
                continue
            n += 1
            for hh in range(h):
                logits = torch.stack([q[bi, hh, ti].double() @ k[bi, hh, s].double() for s in keys]) * scale
                p = torch.softmax(logits, 0)
                ent[hh] += float(-(p * p.log()).sum())
                uni[hh] += math.log(len(keys))
                top[hh] = max(float(top[hh]), float(logits.max()))
    return ent / n, uni / n, top, n


def _fill(dtype: torch.dtype, fill: float | None) -> float:
    return torch.finfo(dtype).min if fill is None else fill


def _padded_batch(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 6, 8, generator=g, dtype=dtype) * 3
    k = torch.randn(2, 3, 6, 8, generator=g, dtype=dtype) * 3
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, 4:] = False  # right padding
    real[1, :2] = False  # left padding
    return q, k, real


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fill", list(FILLS), ids=list(FILLS))
def test_additive_float_masks_count_padded_keys_as_masked(fill, dtype):
    q, k, real = _padded_batch(dtype)
    # a padded key with a large logit: counted, it would set the max logit (it did: by 31.8 in the issue)
    k[0, :, 5] = q[0, :, 0] * 4
    keep = real[:, None, None, :]  # (B, 1, 1, S)
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, _fill(dtype, FILLS[fill]))
    res = attention_kernel_stats(q, k, mask=additive, query_keep=real)
    ent, uni, top, n = real_key_brute(q, k, real, real, 1 / math.sqrt(8))
    assert res.num_queries.tolist() == [n] * 3 == [8] * 3
    torch.testing.assert_close(res.uniform_entropy, uni, atol=TOL, rtol=0)
    torch.testing.assert_close(res.entropy, ent, atol=1e-5 if dtype == torch.float32 else TOL, rtol=0)
    torch.testing.assert_close(res.max_logit, top, atol=1e-4 if dtype == torch.float32 else TOL, rtol=0)


def test_a_finite_bias_above_the_threshold_is_a_bias_not_a_mask():
    """Relative-position biases (T5, ALiBi at short range) are finite and above ``MASKED_AT``: they
    shift the softmax but never remove a key."""
    q, k, _ = _padded_batch(torch.float64)
    bias = torch.full((1, 1, 6, 6), MASKED_AT / 2, dtype=torch.float64)
    bias[..., 0] = 0.0
    res = attention_kernel_stats(q, k, mask=bias)
    assert torch.allclose(res.uniform_entropy, torch.full((3,), math.log(6), dtype=torch.float64))


class AdditiveMaskAttention(nn.Module):
    """A user's attention module: an additive float mask made with ``masked_fill(mask == 0, fill)``."""

    def __init__(self, width: int = 16, heads: int = 2, fill: float | None = -1e9) -> None:
        super().__init__()
        self.heads, self.fill = heads, fill
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        self.seen.append((q.detach(), k.detach()))
        scores = torch.zeros(b, 1, 1, t, dtype=x.dtype)
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, _fill(x.dtype, self.fill))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=scores)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("fill", list(FILLS), ids=list(FILLS))
def test_capture_of_a_module_with_an_additive_mask_matches_the_real_key_brute_force(fill):
    torch.manual_seed(0)
    attn = AdditiveMaskAttention(fill=FILLS[fill]).eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1)) * 2
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, 3:] = False
    with torch.no_grad(), KernelStatsCapture({"attn": attn}, query_mask=real) as cap:
        attn(x, real.long())
    res = cap.results()["attn"]
    q, k = attn.seen[0]
    ent, uni, top, n = real_key_brute(q, k, real, real, 1 / math.sqrt(8))
    assert cap.unreachable == [] and res.num_queries.tolist() == [n, n] == [9, 9]
    torch.testing.assert_close(res.uniform_entropy, uni, atol=TOL, rtol=0)
    torch.testing.assert_close(res.entropy, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.max_logit, top, atol=1e-4, rtol=0)


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, position_bias=None, **_):
    """A modeling file's own eager function (T5 style: a relative position bias added to the logits);
    the capture patches it in this module, as it does in transformers' modeling modules."""
    logits = query @ key.transpose(-1, -2) * scaling + position_bias + attention_mask
    return torch.softmax(logits, -1) @ value, None


class BiasedEagerAttention(AdditiveMaskAttention):
    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        self.seen.append((q.detach(), k.detach()))
        mask = torch.zeros(b, 1, 1, t).masked_fill(attention_mask[:, None, None, :] == 0, -1e4)
        self.bias = torch.full((1, self.heads, t, t), 50.0)  # pushes a -1e4 padded key above the threshold
        o, _ = eager_attention_forward(self, q, k, v, mask, scaling=0.5, position_bias=self.bias)
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


def test_a_position_bias_never_unmasks_a_padded_key():
    """Eager attention with a relative position bias: a padded key at ``-1e4`` stays masked whatever
    the bias adds (``-1e4 + 50`` is above the threshold: the sum was read as an allowed key)."""
    torch.manual_seed(0)
    attn = BiasedEagerAttention().eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, 4:] = False
    with torch.no_grad(), KernelStatsCapture({"attn": attn}, query_mask=real) as cap:
        attn(x, real.long())
    res = cap.results()["attn"]
    q, k = attn.seen[0]
    # the reference: a constant bias over the real keys does not change their softmax
    ent, uni, top, n = real_key_brute(q, k, real, real, 0.5)
    assert cap.unreachable == [] and res.num_queries.tolist() == [n, n] == [10, 10]
    torch.testing.assert_close(res.uniform_entropy, uni, atol=TOL, rtol=0)
    torch.testing.assert_close(res.entropy, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.max_logit, top, atol=1e-4, rtol=0)


def test_kernel_dtype_is_float64_on_the_cpu_the_named_one_otherwise_and_refuses_others():
    """``"auto"`` is float64 on the CPU (and for float64 inputs), float32 elsewhere; a named dtype is
    that dtype; anything else is refused with the choices named (never a silent float32)."""
    half = torch.zeros(2, dtype=torch.float16)
    assert kernel_dtype(half, half) is torch.float64  # CPU
    assert kernel_dtype(half, half, "float32") is torch.float32
    assert kernel_dtype(half, half, "float64") is torch.float64
    if torch.cuda.is_available():
        gpu = half.cuda()
        assert kernel_dtype(gpu, gpu) is torch.float32
        assert kernel_dtype(gpu, gpu.double()) is torch.float64
    for bad in ("bfloat16", "float16", None, 64):
        with pytest.raises(ValueError, match=r"compute_dtype must be one of \('auto', 'float32', 'float64'\)"):
            kernel_dtype(half, half, bad)  # type: ignore[arg-type]


def test_subsample_queries_keeps_max_tokens_of_the_kept_queries_from_the_given_generator():
    """At most ``max_tokens`` of the kept queries, all of them kept ones, drawn from the generator
    (the same seed gives the same draw; the global random state is not touched)."""
    keep = torch.tensor([True, False, True, True, True, True, False, True])  # flat, as check_kernel_call gives
    assert subsample_queries(keep, None) == (keep, None)
    same, slots = subsample_queries(keep, 8)
    assert same is keep and slots is None
    state = torch.random.get_rng_state()
    drawn, slots = subsample_queries(keep, 3, torch.Generator().manual_seed(1))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert slots == 3 and int(drawn.sum()) == 3 and not bool((drawn & ~keep).any())
    again, _ = subsample_queries(keep, 3, torch.Generator().manual_seed(1))
    assert torch.equal(drawn, again)
    with pytest.raises((TypeError, ValueError)):
        subsample_queries(keep, 1.5)  # type: ignore[arg-type]
