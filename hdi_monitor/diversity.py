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

Invalid heads (all-zero, or holding NaN/inf) are flagged by :func:`invalid_heads`. Their rows and
columns of the overlap matrix are NaN, and :func:`head_diversity_index` averages over the valid
pairs only (NaN when fewer than two valid heads remain).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from einops import rearrange, reduce
from torch import Tensor

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
WEIGHTINGS: tuple[str, ...] = ("spectral", "uniform")

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
    if x.is_complex():
        raise TypeError(f"{name} must be real, got {x.dtype}")


def _check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def invalid_heads(heads: Tensor) -> Tensor:
    """Flag heads that have no defined subspace.

    Args:
        heads: ``(..., H, D, d)`` head weights.

    Returns:
        ``(..., H)`` bool tensor, True where a head is all zero or holds NaN/inf.
    """
    _check_matrix(heads, "heads")
    nonfinite = ~torch.isfinite(heads).all(dim=-1).all(dim=-1)
    zero = (heads == 0).all(dim=-1).all(dim=-1)
    return nonfinite | zero


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
    finite = torch.isfinite(x).all(dim=-1).all(dim=-1)
    x = torch.where(finite[..., None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    keep = s > rtol * s[..., :1]
    keep &= s > 0
    return u * keep[..., None, :].to(u.dtype), keep.sum(dim=-1)


def _angles_from_bases(ua: Tensor, ra: Tensor, ub: Tensor, rb: Tensor) -> Tensor:
    """Principal angles between orthonormal bases (zero-padded past their ranks).

    Cosines are the singular values of ``M = U_a^T U_b``. Each angle below 45 degrees is read from
    its sine, ``||(I - U_a U_a^T) U_b z_k||`` with ``z_k`` the matching right singular vector of
    ``M``, so that tiny angles keep full relative accuracy (an ``acos`` of a cosine near 1 cannot).
    """
    m = ua.transpose(-1, -2) @ ub  # (..., p, q)
    _, cos, vh = torch.linalg.svd(m, full_matrices=False)  # cos descending, vh (..., k, q)
    z = vh.transpose(-1, -2)  # (..., q, k): z[..., :, k] pairs with cos[..., k]
    resid = ub @ z - ua @ (m @ z)  # (..., D, k): the part of U_b z_k outside span(U_a)
    sin = torch.linalg.vector_norm(resid, dim=-2)
    angles = torch.where(cos > _SQRT_HALF, torch.asin(sin.clamp(max=1.0)), torch.acos(cos.clamp(max=1.0)))
    k = torch.arange(angles.shape[-1], device=angles.device)
    valid = k < torch.minimum(ra, rb)[..., None]
    # cos descending means angles ascending; padded (rank-deficient) entries go last as NaN.
    return torch.where(valid, angles, torch.full_like(angles, float("nan")))


def principal_angles(a: Tensor, b: Tensor, *, rtol: float | None = None) -> Tensor:
    """Principal angles between the column spans of ``a`` and ``b``.

    Args:
        a: ``(..., D, p)`` spanning matrix; columns need not be orthonormal.
        b: ``(..., D, q)`` spanning matrix; leading dimensions broadcast against ``a``'s.
        rtol: relative tolerance for the numerical rank (see :func:`orthonormal_basis`).

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
    angles = _angles_from_bases(ua, ra, ub, rb)
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
        chunk_size: rows ``i`` handled at once; bounds the temporary ``(chunk, H, D, d)`` tensor
            used for the small-angle sines. Default: all rows when that tensor stays under 64 MiB.

    Returns:
        ``(..., H, H, d')`` angles in radians (float64), ascending along the last axis, with
        ``d' = min(D, d)``. The diagonal is zero for valid heads; invalid heads give NaN.

    Each head is orthonormalised once and one Gram matrix of the stacked bases gives every
    ``U_i^T U_j``; the ``H^2`` small SVDs then run as one batched call.
    """
    _check_matrix(heads, "heads")
    if heads.ndim < 3:
        raise ValueError(f"heads must have shape (..., H, D, d), got {tuple(heads.shape)}")
    dtype = _compute_dtype(heads, torch.float64)
    tol = _default_rtol(heads) if rtol is None else rtol
    u, r = orthonormal_basis(heads.to(dtype), rtol=tol)  # (..., H, D, d'), (..., H)
    h, dim, width = u.shape[-3:]
    if chunk_size is None:
        per_row = h * dim * width * u.element_size() * max(1, math.prod(u.shape[:-3]))
        chunk_size = max(1, min(h, (64 << 20) // max(per_row, 1)))
    outs = []
    for start in range(0, h, chunk_size):
        ua = u[..., start : start + chunk_size, None, :, :]  # (..., c, 1, D, d')
        ra = r[..., start : start + chunk_size, None]
        outs.append(_angles_from_bases(ua, ra, u[..., None, :, :, :], r[..., None, :]))
    return torch.cat(outs, dim=-3)


def subspace_overlap(heads: Tensor, weighting: Weighting = "spectral", *, rtol: float | None = None) -> Tensor:
    """Overlap matrix between the heads' subspaces.

    Args:
        heads: ``(..., H, D, d)``; ``heads[..., h, :, :]`` is ``W_h``, whose columns span what head
            ``h`` reads (query/key/value) or writes (output) in the model space.
        weighting: ``"spectral"`` (default), ``rho^w_ij = ||W_i^T W_j||_F^2 / (||W_i^T W_i||_F
            ||W_j^T W_j||_F)``, computed from one Gram matrix of the stacked heads with no SVD; or
            ``"uniform"``, ``rho_ij = ||U_i^T U_j||_F^2 / min(r_i, r_j)`` = the mean squared cosine of
            the principal angles.
        rtol: rank tolerance for ``"uniform"``.

    Returns:
        ``(..., H, H)`` symmetric overlaps in ``[0, 1]``, with ones on the diagonal, in float32 (or
        the input's dtype if wider). Rows and columns of invalid heads (see :func:`invalid_heads`)
        are NaN.
    """
    _check_matrix(heads, "heads")
    if heads.ndim < 3:
        raise ValueError(f"heads must have shape (..., H, D, d), got {tuple(heads.shape)}")
    _check_weighting(weighting)
    dtype = _compute_dtype(heads, torch.float32)
    bad = invalid_heads(heads)
    x = torch.where(bad[..., None, None], torch.zeros((), dtype=dtype, device=heads.device), heads.to(dtype))
    h = x.shape[-3]
    if weighting == "spectral":
        # Scale each head to unit Frobenius norm: rho^w is scale free and this keeps squares in range.
        norm = torch.linalg.matrix_norm(x).clamp_min(torch.finfo(dtype).tiny)
        x = x / norm[..., None, None]
        stacked = rearrange(x, "... h D d -> ... D (h d)")
        gram = stacked.transpose(-1, -2) @ stacked  # (..., H d, H d): every W_i^T W_j at once
        blocks = reduce(gram.square(), "... (i a) (j b) -> ... i j", "sum", i=h, j=h)
        diag = blocks.diagonal(dim1=-2, dim2=-1).sqrt()
        overlap = blocks / (diag[..., :, None] * diag[..., None, :]).clamp_min(torch.finfo(dtype).tiny)
    else:
        tol = _default_rtol(heads) if rtol is None else rtol
        u, r = orthonormal_basis(x, rtol=tol)
        stacked = rearrange(u, "... h D d -> ... D (h d)")
        gram = stacked.transpose(-1, -2) @ stacked
        blocks = reduce(gram.square(), "... (i a) (j b) -> ... i j", "sum", i=h, j=h)
        overlap = blocks / torch.minimum(r[..., :, None], r[..., None, :]).clamp_min(1).to(dtype)
    overlap = overlap.clamp(0.0, 1.0)
    pair_bad = bad[..., :, None] | bad[..., None, :]
    return torch.where(pair_bad, torch.full_like(overlap, float("nan")), overlap)


def head_diversity_index(overlap: Tensor) -> Tensor:
    """Head Diversity Index: ``1 - mean`` of the off-diagonal overlaps.

    Args:
        overlap: ``(..., H, H)`` overlap matrix (from :func:`subspace_overlap`). NaN entries (invalid
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


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def chance_hdi(model_dim: int, head_dim: int, weighting: Weighting = "spectral") -> float:
    """HDI of independent random Gaussian heads (what initialisation gives).

    * ``"uniform"``: ``1 - min(d, D) / D``, since ``E||U_i^T U_j||_F^2 = d^2 / D`` for independent
      uniformly random ``d``-dimensional subspaces of ``R^D``.
    * ``"spectral"``: about ``1 - d / (D + d + 1)``, the ratio of ``E||W_i^T W_j||_F^2 = D d^2`` to
      ``E tr((W^T W)^2) = D d (D + d + 1)`` for Gaussian ``W`` (exact to first order in ``1/D``).
    """
    _check_dims(model_dim=model_dim, head_dim=head_dim)
    _check_weighting(weighting)
    if weighting == "uniform":
        return 1.0 - min(head_dim, model_dim) / model_dim
    return 1.0 - head_dim / (model_dim + head_dim + 1)


def max_hdi(num_heads: int, head_dim: int, model_dim: int) -> float | None:
    """Largest HDI that ``H`` heads of width ``d`` can reach in ``R^D`` (frame bound).

    When ``H d <= D`` the heads can be mutually orthogonal and the bound is 1. Otherwise
    ``sum_{i != j} ||U_i^T U_j||_F^2 >= (H d)^2 / D - H d``, so
    ``HDI <= 1 - (H d / D - 1) / (H - 1)``. Exact for the uniform overlap; for the spectral one it is
    the bound for heads with flat spectra. None for a single head (no HDI exists).
    """
    _check_dims(num_heads=num_heads, head_dim=head_dim, model_dim=model_dim)
    if num_heads < 2:
        return None
    return 1.0 - max(0.0, (num_heads * head_dim / model_dim - 1.0) / (num_heads - 1))
