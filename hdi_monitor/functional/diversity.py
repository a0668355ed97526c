"""Head-diversity math: principal angles, subspace overlaps, the HDI and its reference levels.

Pure functions of tensors (no ``nn.Module``, no Lightning, no logging). Every function is batched
over leading dimensions and runs on the input's device. Half-precision inputs are upcast: overlaps
are computed in float32 at least, principal angles in float64 at least.

Definitions (see the README, "Definitions"): for heads ``W_1..W_H`` with ``W_h`` in ``R^{D x d}``,

* principal angles between heads ``i`` and ``j``: ``cos(theta_k) = sigma_k(U_i^T U_j)`` with ``U_h``
  an orthonormal basis of ``span(W_h)`` (numerical rank ``r_h``);
* uniform overlap ``rho_ij = ||U_i^T U_j||_F^2 / min(r_i, r_j)``;
* spectral overlap ``rho^w_ij = ||W_i^T W_j||_F^2 / (||W_i^T W_i||_F ||W_j^T W_j||_F)``;
* ``HDI = 1 - mean_{i != j} rho_ij``.

Invalid heads (all-zero, or holding NaN/inf) are flagged by `invalid_heads`. Their rows and
columns of the overlap matrix are NaN, and `head_diversity_index` averages over the valid
pairs only (NaN when fewer than two valid heads remain).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from einops import rearrange, reduce
from torch import Tensor

from hdi_monitor._validation import check_choice, check_int

__all__ = [
    "Weighting",
    "WEIGHTINGS",
    "principal_angles",
    "pairwise_principal_angles",
    "orthonormal_basis",
    "subspace_overlap",
    "head_diversity_index",
    "invalid_heads",
    "chance_hdi",
    "max_hdi",
]

Weighting = Literal["spectral", "uniform"]
WEIGHTINGS: tuple[Weighting, ...] = ("spectral", "uniform")

_SQRT_HALF = math.sqrt(0.5)


def _compute_dtype(x: Tensor, minimum: torch.dtype) -> torch.dtype:
    """The dtype to compute in: ``x``'s own float dtype, but never below ``minimum``."""
    if not x.is_floating_point() or x.dtype in (torch.float16, torch.bfloat16):
        return minimum
    if torch.finfo(x.dtype).bits < torch.finfo(minimum).bits:
        return minimum
    return x.dtype


def _default_rtol(x: Tensor) -> float:
    """Relative rank tolerance like ``scipy.linalg.orth``: ``eps * max(D, p)`` of the input precision."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.finfo(dtype).eps * max(x.shape[-2], x.shape[-1])


def _check_matrix(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., D, k) with at least 2 dimensions, got {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be a real number tensor, got {x.dtype}")
    if x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have at least one row and one column, got shape {tuple(x.shape)}")


def _check_heads(heads: Tensor) -> None:
    _check_matrix(heads, "heads")
    if heads.ndim < 3:
        raise ValueError(f"heads must have shape (..., H, D, d), got {tuple(heads.shape)}")
    if heads.shape[-3] == 0:
        raise ValueError(f"heads must hold at least one head, got shape {tuple(heads.shape)}")


def _head_peak(heads: Tensor) -> Tensor:
    """``(..., H)`` largest absolute entry of each head: NaN or inf for a non-finite head, 0 for a dead one."""
    return heads.abs().amax(dim=(-2, -1))  # amax propagates NaN


def _invalid_from_peak(peak: Tensor) -> Tensor:
    return ~torch.isfinite(peak) | (peak == 0)


def invalid_heads(heads: Tensor) -> Tensor:
    """Flag heads that have no defined subspace.

    Args:
        heads: ``(..., H, D, d)`` head weights.

    Returns:
        ``(..., H)`` bool tensor, True where a head is all zero or holds NaN/inf.
    """
    _check_matrix(heads, "heads")
    return _invalid_from_peak(_head_peak(heads))


def orthonormal_basis(x: Tensor, rtol: float | None = None) -> tuple[Tensor, Tensor]:
    """Orthonormal basis of the column span of ``x`` with its numerical rank.

    Args:
        x: ``(..., D, k)`` matrices. Non-finite matrices are treated as rank 0.
        rtol: singular values at or below ``rtol * sigma_max`` count as zero. Default
            ``eps * max(D, k)`` of the input precision (as ``scipy.linalg.orth``).

    Returns:
        ``(basis, rank)``: ``basis`` is ``(..., D, min(D, k))`` with orthonormal leading columns and
        the columns past each matrix's rank set to zero; ``rank`` is ``(...)`` int64.
    """
    _check_matrix(x, "x")
    rtol = _default_rtol(x) if rtol is None else float(rtol)
    finite = torch.isfinite(_head_peak(x))
    if not bool(finite.all()):
        x = torch.where(finite[..., None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    # x = Q R (Householder): the singular values of the small R are those of x, and where x has full
    # column rank Q is already the basis. Only rank-deficient matrices need R's singular vectors,
    # which turn Q into x's left singular vectors. Half the cost of an SVD of every x.
    q, r = torch.linalg.qr(x)  # (..., D, k'), (..., k', k) with k' = min(D, k)
    s = torch.linalg.svdvals(r)  # descending
    keep = s > rtol * s[..., :1]
    keep &= s > 0
    deficient = ~keep.all(dim=-1)
    if bool(deficient.any()):
        u_r, _, _ = torch.linalg.svd(r[deficient], full_matrices=False)  # (n, k', k')
        q = q.clone()
        q[deficient] = (q[deficient] @ u_r) * keep[deficient][:, None, :].to(q.dtype)
    return q, keep.sum(dim=-1)


def _angles_core(m: Tensor, ra: Tensor, rb: Tensor, fetch: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """Principal angles from the cross products of orthonormal bases (zero-padded past their ranks).

    Args:
        m: ``(..., p', q')`` cross products ``M = U_a^T U_b``.
        ra, rb: ranks of ``U_a`` and ``U_b``, broadcasting against ``m``'s leading dimensions.
        fetch: given a bool mask over ``m``'s leading dimensions, returns ``U_a`` and ``U_b``
            (``(n, D, p')`` and ``(n, D, q')``) and ``r_b`` (``(n,)``) of the selected items, in the
            order of ``mask.nonzero()``.

    Cosines are the singular values of ``M``. Angles below 45 degrees are read from their sines,
    the singular values of ``R = U_b - U_a M`` (Knyazev and Argentati, 2002), so tiny angles keep
    full accuracy, clustered ones included (an ``acos`` of a cosine near 1 cannot). ``R`` is only
    formed for the items that have such an angle. Returns ascending angles with NaN past
    ``min(ra, rb)``.
    """
    cos = torch.linalg.svdvals(m)  # (..., k) descending, k = min(p', q')
    angles = torch.acos(cos.clamp(0.0, 1.0))
    k = cos.shape[-1]
    small = cos > _SQRT_HALF
    need = small[..., 0]  # items with at least one angle below 45 degrees
    if bool(need.any()):
        ua_s, ub_s, rb_s = fetch(need)
        resid = ub_s - ua_s @ m[need]  # (n, D, q'): the part of span(U_b) outside span(U_a)
        sin = torch.linalg.svdvals(resid).flip(-1)  # ascending, q' values
        # The q' - r_b zero columns of U_b give the first q' - r_b (zero) singular values of R; the
        # next min(r_a, r_b) are the sines of the principal angles, ascending.
        width = resid.shape[-1]
        idx = (width - rb_s)[:, None] + torch.arange(k, device=cos.device)
        sin_k = sin.gather(-1, idx.clamp(max=width - 1))
        angles[need] = torch.where(small[need], torch.asin(sin_k.clamp(max=1.0)), angles[need])
    valid = torch.arange(k, device=cos.device) < torch.minimum(ra, rb)[..., None]
    angles = torch.where(valid, angles, torch.full_like(angles, float("nan")))
    # Ascending by construction; the sort only irons out rounding at the 45 degree switch. NaN go last.
    return angles.sort(dim=-1).values


def principal_angles(a: Tensor, b: Tensor, *, rtol: float | None = None) -> Tensor:
    """Principal angles between the column spans of ``a`` and ``b``.

    Args:
        a: ``(..., D, p)`` spanning matrix; columns need not be orthonormal.
        b: ``(..., D, q)`` spanning matrix; leading dimensions broadcast against ``a``'s.
        rtol: relative tolerance for the numerical rank (see `orthonormal_basis`).

    Returns:
        ``(..., min(p, q))`` angles in radians, ascending, computed in float64 (or the input's
        dtype if wider). Where a matrix is rank deficient only ``min(rank_a, rank_b)`` angles exist
        and the rest are NaN; an all-zero or non-finite matrix gives all NaN.

    Small angles are taken from sines (Knyazev and Argentati, 2002), so a 1e-6 rad angle is
    recovered to about 1e-15 in float64; ``scipy.linalg.subspace_angles`` agrees on ordinary angles.
    """
    _check_matrix(a, "a")
    _check_matrix(b, "b")
    if a.shape[-2] != b.shape[-2]:
        raise ValueError(f"a and b must live in the same space: a has D={a.shape[-2]}, b has D={b.shape[-2]}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    dtype = _compute_dtype(torch.empty((), dtype=torch.promote_types(a.dtype, b.dtype)), torch.float64)
    tol_a = _default_rtol(a) if rtol is None else rtol
    tol_b = _default_rtol(b) if rtol is None else rtol
    ua, ra = orthonormal_basis(a.to(dtype), rtol=tol_a)
    ub, rb = orthonormal_basis(b.to(dtype), rtol=tol_b)
    m = ua.transpose(-1, -2) @ ub  # (..., p', q')
    batch = m.shape[:-2]

    def fetch(need: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # expand is free; the mask copies only what it selects
        return ua.expand(*batch, *ua.shape[-2:])[need], ub.expand(*batch, *ub.shape[-2:])[need], rb.expand(batch)[need]

    angles = _angles_core(m, ra, rb, fetch)
    width = min(a.shape[-1], b.shape[-1])
    if angles.shape[-1] < width:  # D < p or D < q: no more than D angles exist
        pad = angles.new_full((*angles.shape[:-1], width - angles.shape[-1]), float("nan"))
        angles = torch.cat([angles, pad], dim=-1)
    return angles


def pairwise_principal_angles(heads: Tensor, *, rtol: float | None = None, chunk_size: int | None = None) -> Tensor:
    """Principal angles between every pair of heads.

    Args:
        heads: ``(..., H, D, d)`` head weights.
        rtol: relative tolerance for the numerical rank.
        chunk_size: rows ``i`` handled at once; bounds the temporaries of one chunk (the
            ``(chunk, H, d', d')`` cross products and the small-angle residuals). Default: all rows
            when a ``(chunk, H, D, d')`` tensor stays under 64 MiB.

    Returns:
        ``(..., H, H, d')`` angles in radians (float64, or the input's dtype if wider), ascending along
        the last axis, with ``d' = min(D, d)``; symmetric in the two head axes. The diagonal holds
        ``r_i`` zeros for a head of rank ``r_i``; angles past ``min(r_i, r_j)`` are NaN, so invalid
        heads give NaN rows and columns.

    Each head is orthonormalised once and the upper half of the Gram matrix of the stacked bases
    gives every ``U_i^T U_j``, ``i < j``; their ``H (H - 1) / 2`` small SVDs run as one batched call
    (per chunk), and the residuals needed for angles below 45 degrees are formed only for the pairs
    that have one.
    """
    _check_heads(heads)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size)
    dtype = _compute_dtype(heads, torch.float64)
    tol = _default_rtol(heads) if rtol is None else rtol
    u, r = orthonormal_basis(heads.to(dtype), rtol=tol)  # (..., H, D, d'), (..., H)
    h, dim, width = u.shape[-3:]
    lead = u.shape[:-3]
    u = u.reshape(-1, h, dim, width)  # one flat batch axis b
    r = r.reshape(-1, h)
    if chunk_size is None:
        per_row = h * dim * width * u.element_size() * u.shape[0]
        chunk_size = max(1, min(h, (64 << 20) // max(per_row, 1)))
    k = torch.arange(width, device=u.device)
    out = u.new_full((u.shape[0], h, h, width), float("nan"))
    out.diagonal(dim1=1, dim2=2).copy_(torch.where(k[:, None] < r[:, None, :], 0.0, float("nan")))  # (b, d', H)
    stacked = rearrange(u, "b h D w -> b D (h w)")
    for start in range(0, h - 1, chunk_size):
        rows = range(start, min(h - 1, start + chunk_size))
        # U_i^T U_j for the pairs j > i of these rows: one (d', D) x (D, (H - 1 - i) d') product per
        # row, the upper half of the Gram matrix of the stacked bases (half the work of all of it)
        m = torch.cat(
            [
                rearrange(
                    stacked[..., i * width : (i + 1) * width].transpose(-1, -2) @ stacked[..., (i + 1) * width :],
                    "b a (j c) -> b j a c",
                    c=width,
                )
                for i in rows
            ],
            dim=1,
        )  # (b, P, d', d')
        gi = torch.cat([torch.full((h - 1 - i,), i, device=u.device) for i in rows])  # head indices, gi < gj
        gj = torch.cat([torch.arange(i + 1, h, device=u.device) for i in rows])

        def fetch(need: Tensor, gi: Tensor = gi, gj: Tensor = gj) -> tuple[Tensor, Tensor, Tensor]:
            bsel, psel = need.nonzero(as_tuple=True)
            return u[bsel, gi[psel]], u[bsel, gj[psel]], r[bsel, gj[psel]]

        angles = _angles_core(m, r[:, gi], r[:, gj], fetch)
        out[:, gi, gj] = angles
        out[:, gj, gi] = angles
    return out.reshape(*lead, h, h, width)


def _cross_sq_norms(x: Tensor) -> Tensor:
    """``(..., H, H)`` squared Frobenius norms ``||X_i^T X_j||_F^2`` of heads ``x`` ``(..., H, D, d)``.

    These are the squared ``(d, d)`` blocks of the Gram matrix of the stacked ``(D, H d)`` heads,
    summed. Only its upper half is computed, one ``(d, D) x (D, (H - i) d)`` product per row of
    blocks (half the work of the whole Gram matrix, which is the entire cost), then mirrored.
    """
    h, width = x.shape[-3], x.shape[-1]
    stacked = rearrange(x, "... h D d -> ... D (h d)")
    out = x.new_zeros((*x.shape[:-3], h, h))
    for i in range(h):
        gram_row = stacked[..., i * width : (i + 1) * width].transpose(-1, -2) @ stacked[..., i * width :]
        out[..., i, i:] = reduce(gram_row.square(), "... a (j c) -> ... j", "sum", c=width)
    return out + out.triu(1).transpose(-1, -2)


#: Largest condition number ``sigma_max / sigma_min`` of a head for which the uniform overlap whitens
#: it from its block of the Gram matrix (float32, float64). The whitened basis carries an error of
#: about ``eps * kappa^2`` (measured: below 5e-7 in float32 up to 8, 1e-15 in float64 up to 64);
#: heads above the limit (and rank-deficient ones) take a QR factorisation instead.
WHITEN_MAX_COND: dict[torch.dtype, float] = {torch.float32: 8.0, torch.float64: 100.0}


def _whitened_bases(x: Tensor, rtol: float) -> tuple[Tensor, Tensor]:
    """Orthonormal bases ``U_h`` of the heads ``x`` ``(..., H, D, d)`` and their ranks, by whitening.

    Each head's ``d x d`` block of the Gram matrix, ``W_h^T W_h = V diag(s^2) V^T`` (``eigh``), gives
    ``Z_h = V diag(1/s)`` and the orthonormal ``U_h = W_h Z_h``, so that
    ``||U_i^T U_j||_F^2 = ||Z_i^T (W_i^T W_j) Z_j||_F^2`` comes from one Gram matrix of the stacked
    (whitened) heads, as for the spectral overlap: no factorisation of the ``D x d`` heads. This
    needs the head to have full numerical rank (``s_min > rtol * s_max``, the rule of
    `orthonormal_basis`) and to be well conditioned (``s_max / s_min`` at most
    `WHITEN_MAX_COND`: the whitened basis carries an error of about ``eps * kappa^2``); only
    the other heads are factorised (`orthonormal_basis`, QR, with their numerical rank).
    """
    dim, width = x.shape[-2:]
    lam, vec = torch.linalg.eigh(x.transpose(-1, -2) @ x)  # the Gram's diagonal blocks; ascending
    s = lam.clamp_min(0).sqrt()
    s_min, s_max = s[..., 0], s[..., -1]
    limit = min(WHITEN_MAX_COND.get(x.dtype, WHITEN_MAX_COND[torch.float32]), 1.0 / max(rtol, 1e-300))
    good = (s_max > 0) & (s_min * limit >= s_max) & (dim >= width)
    z = vec * torch.where(good[..., None], s, torch.ones_like(s)).reciprocal()[..., None, :]
    u = x @ z  # (..., H, D, d)
    rank = torch.full(good.shape, width, dtype=torch.int64, device=x.device)
    bad = ~good
    if bool(bad.any()):
        q, r_bad = orthonormal_basis(x[bad], rtol=rtol)  # (n, D, min(D, d)), zero past each rank
        if q.shape[-1] < width:
            q = torch.cat([q, q.new_zeros(*q.shape[:-1], width - q.shape[-1])], dim=-1)
        u[bad] = q
        rank[bad] = r_bad
    return u, rank


def subspace_overlap(heads: Tensor, weighting: Weighting = "spectral", *, rtol: float | None = None) -> Tensor:
    """Overlap matrix between the heads' subspaces.

    Args:
        heads: ``(..., H, D, d)``; ``heads[..., h, :, :]`` is ``W_h``, whose columns span what head
            ``h`` reads (query/key/value) or writes (output) in the model space.
        weighting: ``"spectral"`` (default), ``rho^w_ij = ||W_i^T W_j||_F^2 / (||W_i^T W_i||_F
            ||W_j^T W_j||_F)``, computed from the Gram matrix of the stacked heads with no SVD; or
            ``"uniform"``, ``rho_ij = ||U_i^T U_j||_F^2 / min(r_i, r_j)`` = the mean squared cosine of
            the principal angles.
        rtol: rank tolerance for ``"uniform"``.

    Returns:
        ``(..., H, H)`` symmetric overlaps in ``[0, 1]``, with ones on the diagonal, in float32 (or
        the input's dtype if wider). Rows and columns of invalid heads (see `invalid_heads`)
        are NaN.
    """
    _check_heads(heads)
    check_choice("weighting", weighting, WEIGHTINGS)
    dtype = _compute_dtype(heads, torch.float32)
    peak = _head_peak(heads)
    bad = _invalid_from_peak(peak)
    x = heads.to(dtype)
    any_bad = bool(bad.any())
    if any_bad:
        x = torch.where(bad[..., None, None], torch.zeros((), dtype=dtype, device=x.device), x)
        peak = torch.where(bad, torch.ones((), dtype=peak.dtype, device=peak.device), peak)
    # Both overlaps are scale free. Dividing each head by its largest entry keeps every product in
    # range: no overflow for huge weights, no underflow for tiny ones.
    x = x / peak.to(dtype)[..., None, None]
    if weighting == "spectral":
        blocks = _cross_sq_norms(x)  # ||W_i^T W_j||_F^2
        diag = blocks.diagonal(dim1=-2, dim2=-1).sqrt()
        overlap = blocks / (diag[..., :, None] * diag[..., None, :]).clamp_min(torch.finfo(dtype).tiny)
    else:
        tol = _default_rtol(heads) if rtol is None else rtol
        u, r = _whitened_bases(x, tol)
        blocks = _cross_sq_norms(u)  # ||U_i^T U_j||_F^2
        overlap = blocks / torch.minimum(r[..., :, None], r[..., None, :]).clamp_min(1).to(dtype)
    overlap = overlap.clamp(0.0, 1.0)
    if any_bad:
        pair_bad = bad[..., :, None] | bad[..., None, :]
        overlap = torch.where(pair_bad, torch.full_like(overlap, float("nan")), overlap)
    return overlap


def head_diversity_index(overlap: Tensor) -> Tensor:
    """Head Diversity Index: ``1 - mean`` of the off-diagonal overlaps.

    Args:
        overlap: ``(..., H, H)`` overlap matrix (from `subspace_overlap`). NaN entries (invalid
            heads) are left out of the mean.

    Returns:
        ``(...)`` HDI in ``[0, 1]``; NaN where fewer than two valid heads (so fewer than one valid
        pair) exist. A one-head layer has no HDI.
    """
    if not isinstance(overlap, Tensor):
        raise TypeError(f"overlap must be a torch.Tensor, got {type(overlap).__name__}")
    if overlap.ndim < 2 or overlap.shape[-1] != overlap.shape[-2]:
        raise ValueError(f"overlap must have shape (..., H, H), got {tuple(overlap.shape)}")
    h = overlap.shape[-1]
    off = ~torch.eye(h, dtype=torch.bool, device=overlap.device)
    valid = off & ~torch.isnan(overlap)
    total = torch.where(valid, overlap, torch.zeros((), dtype=overlap.dtype, device=overlap.device)).sum((-2, -1))
    count = valid.sum((-2, -1))
    mean = total / count.clamp_min(1).to(overlap.dtype)
    return torch.where(count > 0, 1.0 - mean, torch.full_like(mean, float("nan")))


def chance_hdi(*, model_dim: int, head_dim: int, weighting: Weighting = "spectral") -> float:
    """HDI of independent random Gaussian heads (what initialisation gives).

    * ``"uniform"``: ``1 - min(d, D) / D``, since ``E||U_i^T U_j||_F^2 = d^2 / D`` for independent
      uniformly random ``d``-dimensional subspaces of ``R^D``.
    * ``"spectral"``: about ``1 - d / (D + d + 1)``, the ratio of ``E||W_i^T W_j||_F^2 = D d^2`` to
      ``E tr((W^T W)^2) = D d (D + d + 1)`` for Gaussian ``W`` (exact to first order in ``1/D``).
    """
    check_int("model_dim", model_dim)
    check_int("head_dim", head_dim)
    check_choice("weighting", weighting, WEIGHTINGS)
    if weighting == "uniform":
        return 1.0 - min(head_dim, model_dim) / model_dim
    return 1.0 - head_dim / (model_dim + head_dim + 1)


def max_hdi(*, num_heads: int, head_dim: int, model_dim: int) -> float | None:
    """Largest HDI that ``H`` heads of width ``d`` can reach in ``R^D`` (frame bound).

    When ``H d <= D`` the heads can be mutually orthogonal and the bound is 1. Otherwise
    ``sum_{i != j} ||U_i^T U_j||_F^2 >= (H d)^2 / D - H d``, so
    ``HDI <= 1 - (H d / D - 1) / (H - 1)`` (with ``d`` read as ``min(d, D)``: a head spans at most
    ``R^D``). Exact and attained (by tight fusion frames) for the uniform overlap. For the spectral
    overlap it is the bound for heads with flat spectra only: heads whose energy sits in fewer
    directions can exceed it (random Gaussian heads with ``D=8, d=4, H=4`` average 0.667 against a
    bound of 0.6667). None for a single head (no HDI exists).
    """
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("model_dim", model_dim)):
        check_int(name, value)
    if num_heads < 2:
        return None
    rank = min(head_dim, model_dim)  # a head cannot span more than R^D
    return 1.0 - max(0.0, (num_heads * rank / model_dim - 1.0) / (num_heads - 1))
