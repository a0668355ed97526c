"""Tests of the head-diversity math (hdi_monitor.functional.diversity) against independent references.

References used: ``scipy.linalg.subspace_angles`` and ``scipy.linalg.orth`` on random Gaussian
subspaces; uncentred linear CKA written out in numpy in its kernel form; analytic constructions
(planted angles, orthogonal and identical heads, tight fusion frames); Monte-Carlo estimates of the
chance levels with tolerances from the known variance; finite differences (gradcheck).

scipy 1.17's ``subspace_angles`` takes some angles near 0 (and near pi/2) from an ``acos`` (an
``asin``) of a value near 1 (its small-angle mask is misordered), which costs it up to
``sqrt(2 eps) ~ 2e-8`` rad. Comparisons with scipy therefore use ``SCIPY_ATOL = 1e-7``; small angles
are checked against planted, analytic cases to 1e-14.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.linalg
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st

from hdi_monitor.functional.diversity import (
    chance_hdi,
    head_diversity_index,
    invalid_heads,
    max_hdi,
    orthonormal_basis,
    pairwise_principal_angles,
    principal_angles,
    subspace_overlap,
)

SCIPY_ATOL = 1e-7
WEIGHTINGS = ("spectral", "uniform")
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]
HYPO = settings(max_examples=20, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------- reference helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype=dtype, device=device)


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(_randn(n, n, seed=seed))
    return q * torch.sign(torch.diagonal(r))


def _scipy_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """scipy's principal angles, ascending (scipy returns them descending)."""
    return np.sort(scipy.linalg.subspace_angles(a, b))


def _cka_uncentred(x: np.ndarray, y: np.ndarray) -> float:
    """Uncentred linear CKA of ``x`` (D, p) and ``y`` (D, q), rows = samples: the kernel form
    <K, L>_F / (||K||_F ||L||_F) with K = x x^T, L = y y^T."""
    k, l_ = x @ x.T, y @ y.T
    return float((k * l_).sum() / (np.linalg.norm(k) * np.linalg.norm(l_)))


def _energy_weighted_cos2(x: np.ndarray, y: np.ndarray) -> float:
    """DESIGN 3 read literally: squared cosines between the heads' singular directions, weighted by
    the product of their spectral energies s^2."""
    ux, sx, _ = np.linalg.svd(x, full_matrices=False)
    uy, sy, _ = np.linalg.svd(y, full_matrices=False)
    cos2 = (ux.T @ uy) ** 2
    return float((sx[:, None] ** 2 * sy[None, :] ** 2 * cos2).sum() / (np.linalg.norm(sx**2) * np.linalg.norm(sy**2)))


def _mean_offdiag_hdi(rho: np.ndarray) -> float:
    h = rho.shape[0]
    return 1.0 - float(rho[~np.eye(h, dtype=bool)].mean())


def _planted_pair(dim: int, thetas: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal U (dim, k) and V = U cos(theta) + P sin(theta), with P orthonormal and orthogonal to U:
    the principal angles between span(U) and span(V) are exactly ``thetas``."""
    k = len(thetas)
    q = _orthogonal(dim, seed)
    u, p = q[:, :k], q[:, k : 2 * k]
    th = torch.tensor(thetas, dtype=torch.float64)
    return u, u * torch.cos(th) + p * torch.sin(th)


# ----------------------------------------------------------------------------- principal angles


@HYPO
@given(
    dim=st.integers(2, 24),
    p=st.integers(1, 6),
    q=st.integers(1, 6),
    batch=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_principal_angles_match_scipy_on_random_subspaces(dim, p, q, batch, seed):
    shape = (batch,) if batch else ()
    a = _randn(*shape, dim, p, seed=seed)
    b = _randn(*shape, dim, q, seed=seed + 1)
    got = principal_angles(a, b)
    assert got.dtype == torch.float64
    assert got.shape == (*shape, min(p, q))
    a2, b2 = a.reshape(-1, dim, p).numpy(), b.reshape(-1, dim, q).numpy()
    got2 = got.reshape(-1, min(p, q)).numpy()
    for i in range(a2.shape[0]):
        ref = _scipy_angles(a2[i], b2[i])  # min(p, q, dim) angles (fewer when dim < p or q)
        np.testing.assert_allclose(got2[i, : len(ref)], ref, atol=SCIPY_ATOL, rtol=0)
        assert np.isnan(got2[i, len(ref) :]).all()  # D < min(p, q): no more than D angles exist
        assert (np.diff(got2[i, : len(ref)]) >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_principal_angles_broadcast_leading_dims(device):
    a = _randn(3, 1, 12, 4, seed=1, device=device)
    b = _randn(5, 12, 3, seed=2, device=device)
    b[4] = a[1, 0, :, :3] @ _randn(3, 3, seed=3, device=device)  # inside span(a[1]): the small-angle path
    got = principal_angles(a, b)
    assert got.shape == (3, 5, 3) and got.device.type == device
    for i in range(3):
        for j in range(5):
            ref = _scipy_angles(a[i, 0].cpu().numpy(), b[j].cpu().numpy())
            np.testing.assert_allclose(got[i, j].cpu().numpy(), ref, atol=SCIPY_ATOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "thetas",
    [
        [1e-6],
        [1e-6, 0.3, 1.2],
        [1e-12, 1.0, 1.4],
        [1e-9, 3e-9, 1e-8, 0.7, 1.3],  # a cluster of tiny angles whose cosines all round to 1
        [1e-9, 2e-9, math.pi / 2],
        [0.0, 1e-7, math.pi / 4, math.pi / 2],
    ],
)
def test_principal_angles_planted_small_angles(thetas, device):
    u, v = _planted_pair(16, thetas)
    want = torch.tensor(sorted(thetas), dtype=torch.float64)
    got = principal_angles(u.to(device), v.to(device)).cpu()
    # 1e-6 rad back to 1e-9 relative (here: 2e-17 absolute); every angle to 1e-14 absolute.
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-9)
    # Non-orthonormal spanning sets of the same subspaces (a well-conditioned mixing of the columns):
    # the orthonormalisation adds rounding of order cond * eps.
    k = len(thetas)
    mix_a = torch.eye(k, dtype=torch.float64) + 0.3 * _randn(k, k, seed=5)
    mix_b = torch.eye(k, dtype=torch.float64) + 0.3 * _randn(k, k, seed=6)
    got = principal_angles((u @ mix_a).to(device), (v @ mix_b).to(device)).cpu()
    torch.testing.assert_close(got, want, atol=2e-14, rtol=1e-9)


def test_principal_angles_small_angle_in_float32_input_beats_acos():
    # A float32 cosine of a 1e-4 rad angle is 1 - 5e-9, which rounds to 1: acos would say 0. The
    # input itself carries float32 rounding (~6e-8 per entry), so the angle is good to ~1e-7.
    u, v = _planted_pair(32, [1e-4, 0.9])
    got = principal_angles(u.float(), v.float())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor([1e-4, 0.9], dtype=torch.float64), atol=3e-7, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_principal_angles_rank_deficient_use_numerical_rank(device):
    dim = 20
    a = _randn(dim, 2, seed=1) @ _randn(2, 5, seed=2)  # rank 2 spanning set with 5 columns
    b = _randn(dim, 3, seed=3) @ _randn(3, 4, seed=4)  # rank 3 with 4 columns
    got = principal_angles(a.to(device), b.to(device)).cpu()
    assert got.shape == (4,)
    ref = _scipy_angles(scipy.linalg.orth(a.numpy()), scipy.linalg.orth(b.numpy()))
    assert len(ref) == 2
    np.testing.assert_allclose(got[:2].numpy(), ref, atol=SCIPY_ATOL, rtol=0)
    assert torch.isnan(got[2:]).all()
    # the same subspace spanned twice: rank-many zero angles, then NaN
    same = principal_angles(a, a @ _randn(5, 5, seed=9))
    assert torch.allclose(same[:2], torch.zeros(2, dtype=torch.float64), atol=1e-12) and torch.isnan(same[2:]).all()
    # span(a) inside a rank-4 span, either way round; and a planted tiny angle next to a rank-deficient side
    c = torch.cat([a[:, :2], _randn(dim, 2, seed=10)], dim=1)
    for x, y in ((a, c), (c, a)):
        got = principal_angles(x.to(device), y.to(device)).cpu()
        torch.testing.assert_close(got[:2], torch.zeros(2, dtype=torch.float64), atol=1e-14, rtol=0)
        assert torch.isnan(got[2:]).all()
    u, v = _planted_pair(dim, [1e-7, 2e-7, 1.0], seed=11)
    u_def = torch.cat([u, u[:, :1] + u[:, 1:2]], dim=1)  # 4 columns, rank 3
    got = principal_angles(u_def.to(device), v.to(device)).cpu()
    torch.testing.assert_close(got, torch.tensor([1e-7, 2e-7, 1.0], dtype=torch.float64), atol=1e-14, rtol=0)
    got = principal_angles(v.to(device), u_def.to(device)).cpu()
    torch.testing.assert_close(got, torch.tensor([1e-7, 2e-7, 1.0], dtype=torch.float64), atol=1e-14, rtol=0)


def test_rank_tolerance_is_relative_and_follows_the_input_precision():
    q, _ = torch.linalg.qr(_randn(10, 3, seed=1))
    # float64: a direction 1e-9 times weaker than the others counts (default eps64 * 10), unless rtol says no
    a = q * torch.tensor([1.0, 1.0, 1e-9], dtype=torch.float64)
    assert orthonormal_basis(a)[1].item() == 3
    assert orthonormal_basis(a, rtol=1e-6)[1].item() == 2
    assert orthonormal_basis(a * 1e-200)[1].item() == 3  # relative, not absolute
    # float32 input: 1e-8 is below float32 resolution (default eps32 * 10), although the angles are
    # computed in float64; rtol=1e-12 keeps it
    a32 = (q * torch.tensor([1.0, 1.0, 1e-8], dtype=torch.float64)).float()
    b = _randn(10, 3, seed=2)
    assert torch.isnan(principal_angles(a32, b)[2])
    assert not torch.isnan(principal_angles(a32, b, rtol=1e-12)).any()


def test_orthonormal_basis_spans_the_input():
    x = _randn(3, 12, 2, seed=1) @ _randn(3, 2, 4, seed=2)  # rank 2, four columns
    basis, rank = orthonormal_basis(x)
    assert basis.shape == (3, 12, 4) and rank.tolist() == [2, 2, 2]
    u = basis[..., :2]
    torch.testing.assert_close(u.transpose(-1, -2) @ u, torch.eye(2, dtype=torch.float64).expand(3, 2, 2))
    torch.testing.assert_close(u @ (u.transpose(-1, -2) @ x), x)  # x lies in span(u)
    assert (basis[..., 2:] == 0).all()


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_principal_angles_of_invalid_matrix_are_nan(bad):
    if bad == 0.0:
        a = torch.zeros(8, 3, dtype=torch.float64)
    else:
        a = _randn(8, 3, seed=1)
        a[2, 1] = bad
    got = principal_angles(a, _randn(8, 2, seed=2))
    assert got.shape == (2,) and torch.isnan(got).all()
    assert torch.isnan(principal_angles(_randn(8, 2, seed=2), a)).all()


# ----------------------------------------------------------------------------- pairwise angles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_pairwise_principal_angles_match_per_pair_and_scipy(chunk_size, device):
    heads = _randn(2, 5, 16, 3, seed=7)
    heads[1, 2] = heads[1, 0] @ _randn(3, 3, seed=8)  # a duplicate subspace: angles 0 (the small-angle path)
    got = pairwise_principal_angles(heads.to(device), chunk_size=chunk_size).cpu()
    assert got.shape == (2, 5, 5, 3) and got.dtype == torch.float64
    for b in range(2):
        for i in range(5):
            for j in range(5):
                one = principal_angles(heads[b, i], heads[b, j])
                torch.testing.assert_close(got[b, i, j], one, atol=1e-12, rtol=0)
                if i != j:
                    ref = _scipy_angles(heads[b, i].numpy(), heads[b, j].numpy())
                    np.testing.assert_allclose(got[b, i, j].numpy(), ref, atol=SCIPY_ATOL, rtol=0)
    assert (got.diagonal(dim1=-3, dim2=-2) == 0).all()  # a head with itself
    assert torch.equal(got, got.transpose(-3, -2))
    torch.testing.assert_close(got[1, 0, 2], torch.zeros(3, dtype=torch.float64), atol=1e-13, rtol=0)


def test_pairwise_principal_angles_invalid_and_rank_deficient_heads():
    heads = _randn(4, 10, 3, seed=1)
    heads[1] = 0.0
    heads[2, 4, 0] = float("nan")
    heads[3] = _randn(10, 1, seed=2) @ _randn(1, 3, seed=3)  # rank 1
    heads = torch.cat([heads, torch.cat([heads[3, :, :1], _randn(10, 2, seed=4)], dim=1)[None]])  # 4 contains 3
    got = pairwise_principal_angles(heads)
    assert torch.isnan(got[1]).all() and torch.isnan(got[:, 1]).all()
    assert torch.isnan(got[2]).all() and torch.isnan(got[:, 2]).all()
    ref = _scipy_angles(heads[0].numpy(), scipy.linalg.orth(heads[3].numpy()))
    np.testing.assert_allclose(got[0, 3, :1].numpy(), ref, atol=SCIPY_ATOL, rtol=0)
    assert torch.isnan(got[0, 3, 1:]).all()
    assert not torch.isnan(got[0, 0]).any()
    assert got[3, 3, 0] == 0 and torch.isnan(got[3, 3, 1:]).all()  # rank 1: one zero angle with itself
    for i, j in ((3, 4), (4, 3)):
        assert abs(got[i, j, 0].item()) < 1e-14 and torch.isnan(got[i, j, 1:]).all()


def test_pairwise_principal_angles_half_precision_input():
    heads = _randn(3, 16, 4, seed=1).to(torch.bfloat16)
    got = pairwise_principal_angles(heads)
    assert got.dtype == torch.float64
    ref = _scipy_angles(heads[0].double().numpy(), heads[1].double().numpy())
    np.testing.assert_allclose(got[0, 1].numpy(), ref, atol=SCIPY_ATOL, rtol=0)


# ----------------------------------------------------------------------------- overlaps: references


@HYPO
@given(
    num_heads=st.integers(1, 5),
    dim=st.integers(1, 20),
    width=st.integers(1, 6),
    batch=st.sampled_from([(), (2,), (2, 3)]),
    seed=st.integers(0, 2**16),
)
def test_spectral_overlap_equals_uncentred_linear_cka(num_heads, dim, width, batch, seed):
    heads = _randn(*batch, num_heads, dim, width, seed=seed)
    got64 = subspace_overlap(heads)
    got32 = subspace_overlap(heads.float())
    assert got64.dtype == torch.float64 and got32.dtype == torch.float32
    assert got64.shape == (*batch, num_heads, num_heads)
    flat = heads.reshape(-1, num_heads, dim, width).numpy()
    g64 = got64.reshape(-1, num_heads, num_heads).numpy()
    g32 = got32.reshape(-1, num_heads, num_heads).numpy()
    for b in range(flat.shape[0]):
        ref = np.array([[_cka_uncentred(flat[b, i], flat[b, j]) for j in range(num_heads)] for i in range(num_heads)])
        np.testing.assert_allclose(g64[b], ref, atol=1e-12, rtol=0)
        np.testing.assert_allclose(g32[b], ref, atol=2e-6, rtol=0)
        if num_heads > 1:
            assert head_diversity_index(got64.reshape(-1, num_heads, num_heads)[b]).item() == pytest.approx(
                _mean_offdiag_hdi(ref), abs=1e-12
            )


def test_spectral_overlap_is_energy_weighted_mean_cos2():
    heads = _randn(4, 24, 5, seed=3) * torch.tensor([3.0, 1.0, 0.5, 0.1, 0.01], dtype=torch.float64)
    got = subspace_overlap(heads).numpy()
    ref = np.array([[_energy_weighted_cos2(heads[i].numpy(), heads[j].numpy()) for j in range(4)] for i in range(4)])
    np.testing.assert_allclose(got, ref, atol=1e-12, rtol=0)


@HYPO
@given(
    num_heads=st.integers(2, 5),
    dim=st.integers(2, 20),
    width=st.integers(1, 5),
    rank_cut=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_uniform_overlap_is_mean_cos2_of_scipy_angles(num_heads, dim, width, rank_cut, seed):
    heads = _randn(num_heads, dim, width, seed=seed)
    rank = max(1, width - rank_cut)
    heads[0] = heads[0, :, :rank] @ _randn(rank, width, seed=seed + 1)  # head 0 has rank <= rank
    got = subspace_overlap(heads.float(), "uniform").numpy()
    assert got.dtype == np.float32
    bases = [scipy.linalg.orth(h) for h in heads.numpy()]
    ref = np.array([[np.mean(np.cos(_scipy_angles(bi, bj)) ** 2) for bj in bases] for bi in bases])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    got64 = subspace_overlap(heads, "uniform").numpy()
    np.testing.assert_allclose(got64, ref, atol=1e-10, rtol=0)


def _conditioned_head(dim: int, width: int, kappa: float, seed: int, rank: int | None = None) -> torch.Tensor:
    """A (dim, width) head with singular values from 1 down to 1/kappa (zeros past ``rank``)."""
    q = torch.linalg.qr(_randn(dim, width, seed=seed))[0]
    v = torch.linalg.qr(_randn(width, width, seed=seed + 1))[0]
    s = torch.logspace(0, -math.log10(kappa), width, dtype=torch.float64)
    if rank is not None:
        s[rank:] = 0.0
    return (q * s) @ v


def test_uniform_overlap_whitens_well_conditioned_heads_and_factors_only_the_others():
    """Well-conditioned heads come from the one Gram matrix (eigh whitening), ill-conditioned and
    rank-deficient ones from QR; every pair (mixed ones too) equals scipy's mean cos^2."""
    dim, width = 40, 5
    heads = torch.stack(
        [
            _conditioned_head(dim, width, 1.0, seed=1),
            _conditioned_head(dim, width, 3.0, seed=3),
            _conditioned_head(dim, width, 1e4, seed=5),  # ill-conditioned: QR
            _conditioned_head(dim, width, 2.0, seed=7, rank=3),  # rank 3: QR
            _conditioned_head(dim, width, 5.0, seed=9),
        ]
    )
    heads[4] = 0.6 * heads[0] + 0.4 * heads[4]  # a head sharing much of head 0's subspace
    bases = [scipy.linalg.orth(h) for h in heads.numpy()]
    ref = np.array([[np.mean(np.cos(_scipy_angles(bi, bj)) ** 2) for bj in bases] for bi in bases])

    def factored(x):
        """subspace_overlap(x, "uniform") and the batch sizes of the QR factorisations torch ran."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            got = subspace_overlap(x, "uniform").numpy()
        return got, [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::linalg_qr"]

    got64, qr_batches = factored(heads)
    np.testing.assert_allclose(got64, ref, atol=1e-10, rtol=0)
    assert qr_batches == [2]  # heads 2 and 3 only, in one batched QR
    got32, qr_batches = factored(heads.float())
    well = [0, 1, 4]  # the whitened heads: 1e-6 (float32); pairs with the kappa=1e4 head: eps * kappa
    np.testing.assert_allclose(got32[np.ix_(well, well)], ref[np.ix_(well, well)], atol=1e-6, rtol=0)
    np.testing.assert_allclose(got32, ref, atol=2e-5, rtol=0)
    assert qr_batches == [2]
    assert got64[3, 0] == pytest.approx(ref[3, 0], abs=1e-10)  # min(r_i, r_j) = 3 for head 3


def test_uniform_overlap_of_gpt2_small_heads_matches_scipy_to_1e6():
    heads = torch.randn(4, 768, 64, generator=torch.Generator().manual_seed(0))  # 4 of its 12 heads
    got = subspace_overlap(heads, "uniform").double().numpy()
    bases = [scipy.linalg.orth(h) for h in heads.double().numpy()]
    ref = np.array([[np.mean(np.cos(_scipy_angles(bi, bj)) ** 2) for bj in bases] for bi in bases])
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_overlap_batched_over_leading_dims_equals_per_item(weighting, device):
    heads = _randn(3, 2, 4, 16, 4, seed=11, device=device)
    got = subspace_overlap(heads, weighting)
    assert got.shape == (3, 2, 4, 4) and got.device.type == device
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(got[i, j], subspace_overlap(heads[i, j], weighting), atol=1e-12, rtol=0)
    hdi = head_diversity_index(got)
    assert hdi.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            assert hdi[i, j].item() == pytest.approx(_mean_offdiag_hdi(got[i, j].cpu().numpy()), abs=1e-12)


# ----------------------------------------------------------------------------- overlaps: analytic cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_orthogonal_heads_give_hdi_one_and_identical_heads_zero(weighting, device):
    q = _orthogonal(24, seed=1)
    mix = _randn(4, 3, 3, seed=2)  # each head an arbitrary (full rank) spanning set of its own subspace
    orth = rearrange(q[:, :12], "D (h d) -> h D d", h=4) @ mix
    o = subspace_overlap(orth.to(device), weighting)
    torch.testing.assert_close(o.cpu(), torch.eye(4, dtype=torch.float64), atol=1e-12, rtol=0)
    assert head_diversity_index(o).item() == pytest.approx(1.0, abs=1e-12)
    same = orth[:1].expand(4, -1, -1)
    assert head_diversity_index(subspace_overlap(same.to(device), weighting)).item() == pytest.approx(0.0, abs=1e-12)
    hdi32 = head_diversity_index(subspace_overlap(same.float().to(device), weighting))
    assert hdi32.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("theta", [0.0, 1e-3, 0.2, math.pi / 6, math.pi / 4, 1.1, math.pi / 2])
def test_planted_angle_gives_cos2(theta, weighting, device):
    u, v = _planted_pair(20, [theta] * 4, seed=3)
    heads = torch.stack([u, v])
    o = subspace_overlap(heads.to(device), weighting).cpu()
    assert o[0, 1].item() == pytest.approx(math.cos(theta) ** 2, abs=1e-12)
    assert head_diversity_index(o).item() == pytest.approx(math.sin(theta) ** 2, abs=1e-12)
    o32 = subspace_overlap(heads.float().to(device), weighting).cpu()
    assert o32.dtype == torch.float32
    assert o32[0, 1].item() == pytest.approx(math.cos(theta) ** 2, abs=2e-6)


def test_uniform_overlap_with_mixed_planted_angles():
    thetas = [0.1, 0.5, 1.0]
    u, v = _planted_pair(12, thetas, seed=4)
    o = subspace_overlap(torch.stack([u @ _randn(3, 3, seed=1), v @ _randn(3, 3, seed=2)]), "uniform")
    assert o[0, 1].item() == pytest.approx(np.mean(np.cos(thetas) ** 2), abs=1e-12)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_overlap_invariances(weighting):
    heads = _randn(5, 16, 4, seed=21)
    ref = subspace_overlap(heads, weighting)
    # W_h -> W_h Q_h with an orthogonal Q_h per head (a change of basis inside the head)
    qs = torch.stack([_orthogonal(4, seed=30 + h) for h in range(5)])
    torch.testing.assert_close(subspace_overlap(heads @ qs, weighting), ref, atol=1e-12, rtol=0)
    # a global rotation of R^D
    rot = _orthogonal(16, seed=40)
    torch.testing.assert_close(subspace_overlap(rot @ heads, weighting), ref, atol=1e-12, rtol=0)
    # scale, per head, over many orders of magnitude (float32 included: no overflow or underflow)
    scale = torch.tensor([1e-30, 1e-8, 1.0, 1e8, 1e30], dtype=torch.float64)[:, None, None]
    torch.testing.assert_close(subspace_overlap(heads * scale, weighting), ref, atol=1e-12, rtol=0)
    got32 = subspace_overlap(heads.float() * scale.float(), weighting)
    torch.testing.assert_close(got32, ref.float(), atol=2e-6, rtol=0)
    if weighting == "uniform":  # any invertible mixing inside a head keeps its subspace
        mix = _randn(5, 4, 4, seed=50)
        torch.testing.assert_close(subspace_overlap(heads @ mix, weighting), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_overlap_properties_on_random_heads(weighting):
    o = subspace_overlap(_randn(3, 6, 8, 3, seed=60), weighting)
    torch.testing.assert_close(o, o.transpose(-1, -2), atol=1e-12, rtol=0)
    torch.testing.assert_close(o.diagonal(dim1=-2, dim2=-1), torch.ones(3, 6, dtype=torch.float64), atol=1e-12, rtol=0)
    assert ((o >= 0) & (o <= 1)).all()


def test_requires_grad_input_and_spectral_gradient():
    heads = _randn(3, 6, 2, seed=70).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w: head_diversity_index(subspace_overlap(w)), (heads,))
    assert subspace_overlap(heads, "uniform").shape == (3, 3)


# ----------------------------------------------------------------------------- invalid heads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_dead_and_nonfinite_heads_are_flagged_and_excluded(weighting, device):
    heads = _randn(2, 6, 16, 3, seed=80)
    heads[0, 1] = 0.0
    heads[0, 3, 5, 2] = float("nan")
    heads[1, 0, 0, 0] = float("inf")
    heads[1, 5, 7, 1] = -float("inf")
    heads = heads.to(device)
    flags = invalid_heads(heads)
    assert flags.cpu().tolist() == [[False, True, False, True, False, False], [True, False, False, False, False, True]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = subspace_overlap(heads, weighting)
        hdi = head_diversity_index(o)
    bad = flags[..., :, None] | flags[..., None, :]
    assert torch.isnan(o[bad]).all() and not torch.isnan(o[~bad]).any()
    for b in range(2):
        keep = ~flags[b]
        alone = head_diversity_index(subspace_overlap(heads[b][keep], weighting))
        assert hdi[b].item() == pytest.approx(alone.item(), abs=1e-12)
        assert math.isfinite(hdi[b].item())


def test_invalid_heads_finds_a_single_bad_entry_anywhere():
    gen = np.random.default_rng(0)
    for value in (float("nan"), float("inf"), -float("inf")):
        for _ in range(5):
            heads = _randn(4, 33, 7, seed=int(gen.integers(1000)))
            h, r, c = (int(gen.integers(n)) for n in heads.shape)
            heads[h, r, c] = value
            want = [i == h for i in range(4)]
            assert invalid_heads(heads).tolist() == want
            assert invalid_heads(heads.to(torch.bfloat16)).tolist() == want


def test_tiny_but_nonzero_head_is_valid():
    heads = _randn(3, 8, 2, seed=1).float()
    heads[2] = 0.0
    heads[2, 3, 1] = 1e-45  # a float32 subnormal: spans one direction
    assert invalid_heads(heads).tolist() == [False, False, False]
    e = torch.zeros(8, 2)
    e[3, 1] = 1.0
    for weighting in WEIGHTINGS:
        unit = subspace_overlap(torch.stack([heads[0], heads[1], e]), weighting)
        torch.testing.assert_close(subspace_overlap(heads, weighting)[:2, 2], unit[:2, 2])


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_one_head_or_one_valid_head_has_no_hdi(weighting):
    assert torch.isnan(head_diversity_index(subspace_overlap(_randn(1, 8, 2, seed=1), weighting)))
    heads = _randn(3, 8, 2, seed=2)
    heads[0] = 0.0
    heads[2, 0, 0] = float("nan")
    assert torch.isnan(head_diversity_index(subspace_overlap(heads, weighting)))
    assert max_hdi(num_heads=1, head_dim=64, model_dim=768) is None


def test_head_diversity_index_against_numpy():
    rho = np.random.default_rng(1).uniform(0, 1, size=(2, 5, 5))
    rho = (rho + rho.transpose(0, 2, 1)) / 2
    got = head_diversity_index(torch.from_numpy(rho))
    assert got.shape == (2,)
    for b in range(2):
        assert got[b].item() == pytest.approx(_mean_offdiag_hdi(rho[b]), abs=1e-14)
    rho[0, 2, :] = rho[0, :, 2] = np.nan
    keep = [0, 1, 3, 4]
    assert head_diversity_index(torch.from_numpy(rho))[0].item() == pytest.approx(
        _mean_offdiag_hdi(rho[0][np.ix_(keep, keep)]), abs=1e-14
    )


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_computed_in_float32(half, weighting, device):
    heads = _randn(6, 32, 4, seed=90)
    low = heads.to(half)
    got = subspace_overlap(low.to(device), weighting)
    assert got.dtype == torch.float32 and got.device.type == device
    # the same (rounded) weights in float64: only the arithmetic differs
    torch.testing.assert_close(got.cpu(), subspace_overlap(low.double(), weighting).float(), atol=2e-6, rtol=0)
    # against the unrounded weights: the input rounding (2^-8 relative for bf16) is all that is left
    tol = 2e-3 if half == torch.float16 else 2e-2
    torch.testing.assert_close(got.cpu(), subspace_overlap(heads, weighting).float(), atol=tol, rtol=0)
    hdi = head_diversity_index(got)
    assert hdi.dtype == torch.float32


def test_integer_input_is_computed_in_float():
    heads = torch.tensor([[[1, 0], [0, 1], [0, 0]], [[1, 0], [0, 0], [0, 1]]])  # (2, 3, 2)
    for weighting in WEIGHTINGS:
        o = subspace_overlap(heads, weighting)
        assert o.dtype == torch.float32
        assert o[0, 1].item() == pytest.approx(0.5)  # share one of two directions


# ----------------------------------------------------------------------------- reference levels


def _offdiag_pairs(num: int, dim: int, width: int, seed: int, weighting: str) -> torch.Tensor:
    """Overlaps of ``num`` independent pairs of Gaussian heads."""
    heads = _randn(num, 2, dim, width, seed=seed)
    return subspace_overlap(heads, weighting)[:, 0, 1]


@pytest.mark.parametrize(("dim", "width"), [(16, 4), (24, 3)])
def test_chance_level_uniform_monte_carlo(dim, width):
    n = 4000
    rho = _offdiag_pairs(n, dim, width, seed=dim, weighting="uniform").double()
    # ||U^T V||_F^2 of random k-planes in R^n: mean k^2/n, variance 2k^2(n-k)^2 / (n^2 (n-1)(n+2)); rho = that / k.
    mean = width / dim
    var = 2 * width**2 * (dim - width) ** 2 / (dim**2 * (dim - 1) * (dim + 2)) / width**2
    se = math.sqrt(var / n)
    assert abs(rho.mean().item() - mean) < 4 * se
    assert rho.var().item() == pytest.approx(var, rel=0.15)
    assert 1 - rho.mean().item() == pytest.approx(
        chance_hdi(model_dim=dim, head_dim=width, weighting="uniform"), abs=4 * se
    )


@pytest.mark.parametrize(("dim", "width"), [(16, 4), (32, 8), (12, 20)])
def test_chance_level_spectral_monte_carlo(dim, width):
    # E[rho^w] is not exactly d / (D + d + 1) (E[X/Y] != E[X]/E[Y]). Measured with 2e5 pairs, the
    # mean exceeds it by +0.0074 (D=16, d=4), +0.0019 (32, 8), +0.0005 (64, 8), +0.013 (8, 16),
    # +0.026 (8, 2): below the bias bound 4 * level / (D d) used here, and vanishing at model sizes
    # (about 3e-6 for D=768, d=64).
    n = 4000
    rho = _offdiag_pairs(n, dim, width, seed=100 + dim, weighting="spectral").double()
    level = 1 - chance_hdi(model_dim=dim, head_dim=width, weighting="spectral")
    assert level == pytest.approx(width / (dim + width + 1))
    se = rho.std().item() / math.sqrt(n)
    bias_bound = 4 * level / (dim * width)
    assert abs(rho.mean().item() - level) < 4 * se + bias_bound


def test_chance_level_of_a_wide_random_layer():
    # 64 random heads, D=96, d=8: the layer's HDI sits at the chance level (2016 pairs, correlated).
    heads = _randn(64, 96, 8, seed=5)
    for weighting, tol in (("uniform", 0.01), ("spectral", 0.01)):
        hdi = head_diversity_index(subspace_overlap(heads, weighting)).item()
        assert hdi == pytest.approx(chance_hdi(model_dim=96, head_dim=8, weighting=weighting), abs=tol)
    assert chance_hdi(model_dim=8, head_dim=16, weighting="uniform") == 0.0  # d >= D: every head spans R^D


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize(("dim", "width", "copies"), [(6, 2, 2), (12, 3, 3), (8, 8, 2)])
def test_frame_bound_is_attained_by_tight_fusion_frames(dim, width, copies, weighting):
    # `copies` orthonormal bases of R^D, each split into D/d heads: sum_h P_h = copies * I, which
    # meets the frame bound with equality.
    heads = torch.cat([rearrange(_orthogonal(dim, seed=s), "D (h d) -> h D d", d=width) for s in range(copies)])
    heads = heads @ torch.stack([_orthogonal(width, seed=100 + i) for i in range(heads.shape[0])])
    num = heads.shape[0]
    bound = max_hdi(num_heads=num, head_dim=width, model_dim=dim)
    assert bound == pytest.approx(1 - (num * width / dim - 1) / (num - 1))
    assert head_diversity_index(subspace_overlap(heads, weighting)).item() == pytest.approx(bound, abs=1e-12)


@HYPO
@given(num_heads=st.integers(2, 8), dim=st.integers(2, 16), width=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_frame_bound_holds_for_random_heads(num_heads, dim, width, seed):
    bound = max_hdi(num_heads=num_heads, head_dim=width, model_dim=dim)
    hdi = head_diversity_index(subspace_overlap(_randn(num_heads, dim, width, seed=seed), "uniform")).item()
    assert 0.0 <= bound <= 1.0
    assert hdi <= bound + 1e-6
    if num_heads * width <= dim:
        assert bound == 1.0


def test_max_hdi_when_heads_are_wider_than_the_model():
    # d >= D: every head spans R^D, so the HDI is 0 (not negative).
    assert max_hdi(num_heads=2, head_dim=10, model_dim=5) == 0.0
    hdi = head_diversity_index(subspace_overlap(_randn(2, 5, 10, seed=1), "uniform"))
    assert hdi.item() == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    good = _randn(3, 8, 2, seed=1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        subspace_overlap(good.numpy())
    with pytest.raises(ValueError, match=r"\(\.\.\., H, D, d\)"):
        subspace_overlap(good[0])
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        principal_angles(torch.ones(3), good[0])
    with pytest.raises(ValueError, match="same space"):
        principal_angles(good[0], _randn(9, 2, seed=2))
    with pytest.raises(ValueError, match="weighting must be one of"):
        subspace_overlap(good, "cosine")
    with pytest.raises(TypeError, match="real"):
        subspace_overlap(good.to(torch.complex128))
    with pytest.raises(ValueError, match="at least one row and one column"):
        subspace_overlap(torch.zeros(3, 8, 0))
    with pytest.raises(ValueError, match="at least one head"):
        subspace_overlap(torch.zeros(0, 8, 2))
    with pytest.raises(ValueError, match=r"\(\.\.\., H, H\)"):
        head_diversity_index(torch.ones(3, 4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        head_diversity_index([[1.0, 0.5], [0.5, 1.0]])
    with pytest.raises(ValueError, match="chunk_size"):
        pairwise_principal_angles(good, chunk_size=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="model_dim must be an integer >= 1"):
            chance_hdi(model_dim=bad, head_dim=4)
        with pytest.raises(ValueError, match="head_dim must be an integer >= 1"):
            max_hdi(num_heads=4, head_dim=bad, model_dim=16)
    with pytest.raises(ValueError, match="weighting must be one of"):
        chance_hdi(model_dim=16, head_dim=4, weighting="cosine")
