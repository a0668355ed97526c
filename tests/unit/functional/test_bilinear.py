"""hdi_monitor.functional.bilinear: the logit bound and the update entropy against dense float64
SVDs of each head's D x D matrix, analytic cases and the bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from hdi_monitor.functional.bilinear import gram_factor, logit_bound, qk_norm_logit_bound, update_entropy


def _dense_bound(q: torch.Tensor, k: torch.Tensor, group: object, rotary: bool = False) -> torch.Tensor:
    d = q.shape[-1]
    out = []
    for h in range(q.shape[0]):
        g = group(h)  # type: ignore[operator]
        if rotary:
            out.append(torch.linalg.svdvals(q[h])[0] * torch.linalg.svdvals(k[g])[0] / math.sqrt(d))
        else:
            out.append(torch.linalg.svdvals(q[h] @ k[g].T)[0] / math.sqrt(d))
    return torch.stack(out)


def _dense_entropy(q0, k0, q1, k1, group) -> torch.Tensor:  # noqa: ANN001
    out = []
    for h in range(q0.shape[0]):
        g = group(h)
        delta = (q1[h] - q0[h]) @ k0[g].T + q0[h] @ (k1[g] - k0[g]).T  # D x D
        s2 = torch.linalg.svdvals(delta).square()
        p = s2 / s2.sum()
        p = p[p > 0]
        out.append(-(p * p.log()).sum())
    return torch.stack(out)


@pytest.mark.parametrize("kv_map", ["block", "modulo"])
@pytest.mark.parametrize("rotary", [False, True])
def test_logit_bound_matches_dense_svd(kv_map: str, rotary: bool) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv, dim, d = 6, 2, 24, 4
    q = torch.randn(heads, dim, d, generator=g, dtype=torch.float64)
    k = torch.randn(kv, dim, d, generator=g, dtype=torch.float64)
    group = (lambda h: h // 3) if kv_map == "block" else (lambda h: h % kv)
    got = logit_bound(q, k, rotary=rotary, kv_map=kv_map)  # type: ignore[arg-type]
    torch.testing.assert_close(got, _dense_bound(q, k, group, rotary), rtol=1e-12, atol=0)
    # float32 weights: float32 result, within float32 accuracy of the float64 reference
    got32 = logit_bound(q.float(), k.float(), rotary=rotary, kv_map=kv_map)  # type: ignore[arg-type]
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), _dense_bound(q, k, group, rotary), rtol=1e-5, atol=0)


@pytest.mark.parametrize("rotary", [False, True])
def test_cross_attention_with_other_key_width_and_gram_factors(rotary: bool) -> None:
    """Keys that read another width (``kdim != D``): the bound and the update entropy against dense
    SVDs of the ``D x kdim`` matrices; and the ``d x d`` Gram factors give the same bound, also for
    heads narrower than ``d`` (``D < d``)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(4, 12, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)  # kdim 3 < d_k 5
    ref = _dense_bound(q, k, lambda h: h // 2, rotary)
    torch.testing.assert_close(logit_bound(q, k, rotary=rotary), ref, rtol=1e-12, atol=0)
    fq, fk = gram_factor(q), gram_factor(k)
    assert fq.shape == (4, 5, 5) and fk.shape == (2, 5, 5)
    torch.testing.assert_close(fq.mT @ fq, q.mT @ q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fk.mT @ fk, k.mT @ k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logit_bound(fq, fk, rotary=rotary), ref, rtol=1e-10, atol=0)
    assert gram_factor(q.float()).dtype == torch.float32 and gram_factor(q.half()).dtype == torch.float32
    if not rotary:
        q1 = q + 0.1 * torch.randn(q.shape, generator=g, dtype=torch.float64)
        k1 = k + 0.1 * torch.randn(k.shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(
            update_entropy(q, k, q1, k1), _dense_entropy(q, k, q1, k1, lambda h: h // 2), rtol=0, atol=1e-10
        )


def test_gram_factor_non_finite_head_and_bad_input() -> None:
    w = torch.randn(3, 8, 2, dtype=torch.float64)
    w[1, 0, 0] = float("inf")
    f = gram_factor(w)
    assert torch.isnan(f[1]).all() and torch.isfinite(f[[0, 2]]).all()
    assert torch.isnan(logit_bound(f, f))[1] and torch.isfinite(logit_bound(f, f)[[0, 2]]).all()
    with pytest.raises(ValueError, match="shape"):
        gram_factor(torch.zeros(4))
    with pytest.raises(TypeError, match="real floating-point"):
        gram_factor(torch.zeros(2, 2, dtype=torch.long))


def test_logit_bound_is_reached_and_bounds_every_input() -> None:
    """The bound is the largest logit over unit inputs: the top singular vectors reach it, random
    unit inputs stay below it."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 16, 4, generator=g, dtype=torch.float64)
    bound = float(logit_bound(q, k)[0])
    u, s, vh = torch.linalg.svd(q[0] @ k[0].T)
    assert float(u[:, 0] @ q[0] @ k[0].T @ vh[0]) / 2 == pytest.approx(bound, rel=1e-12)  # sqrt(4) = 2
    x = torch.nn.functional.normalize(torch.randn(2000, 16, generator=g, dtype=torch.float64), dim=-1)
    y = torch.nn.functional.normalize(torch.randn(2000, 16, generator=g, dtype=torch.float64), dim=-1)
    logits = ((x @ q[0]) * (y @ k[0])).sum(-1) / 2
    assert float(logits.abs().max()) <= bound


def test_logit_bound_analytic_and_scale() -> None:
    """Heads c * [I_d; 0]: W_Q W_K^T = c_q c_k [[I, 0], [0, 0]], sigma_max = c_q c_k."""
    eye = torch.zeros(8, 2)
    eye[:2, :2] = torch.eye(2)
    q = torch.stack([3.0 * eye, 0.5 * eye])
    k = torch.stack([2.0 * eye])
    torch.testing.assert_close(logit_bound(q, k), torch.tensor([6.0, 1.0]) / math.sqrt(2))
    torch.testing.assert_close(logit_bound(q, k, scale=1.0), torch.tensor([6.0, 1.0]))
    # the heads' d_k coordinates pair their strong directions with the other's weak ones:
    # W_Q W_K^T = 3 * 0.5 e1 e1^T + 0.5 * 2 e2 e2^T (sigma_max 1.5); the rotary bound is 3 * 2
    wq = torch.zeros(1, 8, 2)
    wq[0, 0, 0], wq[0, 1, 1] = 3.0, 0.5
    wk = torch.zeros(1, 8, 2)
    wk[0, 0, 0], wk[0, 1, 1] = 0.5, 2.0
    torch.testing.assert_close(logit_bound(wq, wk), torch.tensor([1.5]) / math.sqrt(2))
    torch.testing.assert_close(logit_bound(wq, wk, rotary=True), torch.tensor([6.0]) / math.sqrt(2))


def test_logit_bound_half_precision_and_non_finite_heads() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 8, 2, generator=g)
    k = torch.randn(3, 8, 2, generator=g)
    assert logit_bound(q.bfloat16(), k.bfloat16()).dtype == torch.float32
    q[1, 0, 0] = float("nan")
    got = logit_bound(q, k)
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2]]).all()
    torch.testing.assert_close(got[[0, 2]], logit_bound(q[[0, 2]], k[[0, 2]]))


def test_logit_bound_batched_over_layers() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 12, 3, generator=g, dtype=torch.float64)
    k = torch.randn(5, 2, 12, 3, generator=g, dtype=torch.float64)
    got = logit_bound(q, k)
    assert got.shape == (5, 4)
    for layer in range(5):
        torch.testing.assert_close(got[layer], logit_bound(q[layer], k[layer]))


def test_qk_norm_bound_analytic() -> None:
    """RMS-normalised heads: q = g_q * u with |u| = sqrt(d); the logit's largest value pairs the
    coordinate with the largest |g_q,i g_k,i| (no rotation) or the largest gains (rotary)."""
    gq = torch.tensor([[1.0, 3.0, 0.5]])
    gk = torch.tensor([[2.0, 0.5, 4.0]])
    d = 3
    scale = 1 / math.sqrt(d)
    got = qk_norm_logit_bound(gq, gk, radius_q=math.sqrt(d), radius_k=math.sqrt(d), scale=scale)
    torch.testing.assert_close(got, torch.tensor([scale * d * 2.0]))  # max(2, 1.5, 2) = 2
    rot = qk_norm_logit_bound(gq, gk, radius_q=math.sqrt(d), radius_k=math.sqrt(d), scale=scale, rotary=True)
    torch.testing.assert_close(rot, torch.tensor([scale * d * 12.0]))
    # brute force: unit directions u, v on the sphere of radius sqrt(d) never exceed it
    g = torch.Generator().manual_seed(4)
    u = torch.nn.functional.normalize(torch.randn(5000, d, generator=g), dim=-1) * math.sqrt(d)
    v = torch.nn.functional.normalize(torch.randn(5000, d, generator=g), dim=-1) * math.sqrt(d)
    logits = ((gq * u) * (gk * v)).sum(-1) * scale
    assert float(logits.max()) <= float(got[0]) + 1e-6


@pytest.mark.parametrize("kv_map", ["block", "modulo"])
def test_update_entropy_matches_dense_svd(kv_map: str) -> None:
    g = torch.Generator().manual_seed(5)
    heads, kv, dim, d = 4, 2, 20, 3
    q0 = torch.randn(heads, dim, d, generator=g, dtype=torch.float64)
    k0 = torch.randn(kv, dim, d, generator=g, dtype=torch.float64)
    q1 = q0 + 1e-3 * torch.randn(q0.shape, generator=g, dtype=torch.float64)
    k1 = k0 + 1e-3 * torch.randn(k0.shape, generator=g, dtype=torch.float64)
    group = (lambda h: h // 2) if kv_map == "block" else (lambda h: h % kv)
    got = update_entropy(q0, k0, q1, k1, kv_map=kv_map)  # type: ignore[arg-type]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _dense_entropy(q0, k0, q1, k1, group), rtol=1e-10, atol=1e-12)
    # float32 weights give the same to float32 accuracy of the change
    got32 = update_entropy(q0.float(), k0.float(), q1.float(), k1.float(), kv_map=kv_map)  # type: ignore[arg-type]
    torch.testing.assert_close(got32, got, rtol=1e-3, atol=1e-3)


def test_update_entropy_analytic_cases() -> None:
    dim, d = 10, 2
    q0 = torch.zeros(2, dim, d, dtype=torch.float64)
    q0[:, :2, :2] = torch.eye(2, dtype=torch.float64)
    k0 = q0.clone()
    q1 = q0.clone()
    # head 0: one rank-one change of W_Q only -> Delta = dQ K^T has rank one: entropy 0
    q1[0, 5, 0] = 0.1
    # head 1: dQ = 0.1 * [e3 e4] (two equal directions) -> Delta = 0.1 [e3 e4][e1 e2]^T: entropy ln 2
    q1[1, 2:4, :2] = 0.1 * torch.eye(2, dtype=torch.float64)
    got = update_entropy(q0, k0, q1, k0.clone())
    torch.testing.assert_close(got, torch.tensor([0.0, math.log(2)], dtype=torch.float64), atol=1e-12, rtol=0)
    # no change at all: no update to describe
    assert torch.isnan(update_entropy(q0, k0, q0, k0)).all()


def test_update_entropy_non_finite_head_is_nan_alone() -> None:
    g = torch.Generator().manual_seed(6)
    q0, k0 = torch.randn(3, 8, 2, generator=g), torch.randn(3, 8, 2, generator=g)
    q1, k1 = q0 + 0.01, k0 - 0.01
    q1[2, 0, 0] = float("inf")
    got = update_entropy(q0, k0, q1, k1)
    assert torch.isnan(got[2]) and torch.isfinite(got[:2]).all()


@pytest.mark.parametrize(
    ("q", "k", "match"),
    [
        (torch.zeros(4, 8, 2), torch.zeros(3, 8, 2), "divide"),
        (torch.zeros(4, 8, 2), torch.zeros(2, 8, 3), "same head width d_k"),
        (torch.zeros(8, 2), torch.zeros(8, 2), "shape"),
        (torch.zeros(2, 3, 8, 2), torch.zeros(3, 2, 8, 2), "leading"),
    ],
)
def test_bad_shapes(q: torch.Tensor, k: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        logit_bound(q, k)


def test_bad_arguments() -> None:
    q = torch.zeros(2, 4, 2)
    with pytest.raises(TypeError, match="real floating-point"):
        logit_bound(q.long(), q.long())
    with pytest.raises(ValueError, match="scale"):
        logit_bound(q, q, scale=0.0)
    with pytest.raises(ValueError, match="kv_map"):
        logit_bound(q, q[:1], kv_map="interleaved")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rotary"):
        logit_bound(q, q, rotary=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same shapes"):
        update_entropy(q, q, torch.zeros(2, 4, 3), torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="radius_q"):
        qk_norm_logit_bound(torch.ones(2, 2), torch.ones(2, 2), radius_q=-1.0, radius_k=1.0, scale=1.0)
