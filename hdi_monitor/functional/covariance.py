"""Head-output covariance and the effective number of heads: the pure math.

Pure functions of tensors (no state, no collectives, no ``nn.Module``, no Lightning, no logging);
the streaming, mergeable accumulator that keeps a measured step's moments is
`hdi_monitor.measure.covariance.HeadCovarianceAccumulator`, which calls these functions.

Definitions (see the docs, "Head-output covariance"). For one attention layer with ``H`` heads of
width ``d`` and model width ``D``, ``o_h(t)`` in ``R^d`` is head ``h``'s attention output for token
``t`` (before the output projection), ``W_O,h`` in ``R^{D x d}`` the block of the output projection
that head ``h`` writes through, and ``c_h(t) = W_O,h o_h(t)`` in ``R^D`` the head's contribution to
the layer output. Over the measured tokens:

* covariance ``C_ij = mean_t <c_i(t) - mean c_i, c_j(t) - mean c_j>``  (``H x H``, population 1/n);
* correlation ``R_ij = C_ij / sqrt(C_ii C_jj)``;
* variance ratio ``V = sum_ij C_ij / sum_i C_ii`` (the variance of the summed contribution relative
  to the sum of the heads' own variances);
* effective number of heads ``H_eff = H / V``: ``H`` for uncorrelated heads, ``1`` for identical
  ones, and **above ``H`` for anti-correlated heads** (their contributions partly cancel);
* mean off-diagonal correlation.

A head whose contribution has zero variance (``C_ii <= ZERO_VARIANCE_RTOL * max_k C_kk``: a dead
head, an all-zero output, a zero ``W_O`` block) or holds a non-finite value contributes nothing
usable and is not an independent head: it is reported in ``invalid_heads`` and ``V``, ``H_eff`` and
the mean correlation are taken over the live heads only (``H`` in ``H_eff = H / V`` is the number of
live heads).

Moments, not Grams: `contribution_moments` turns one batch of head outputs into float64
``(n, sum_t c_h(t), M2)`` (the token count, the ``H x D`` per-head sums of contributions and the
``H x H`` centred cross sums ``M2_ij = sum_t <c_i - mean c_i, c_j - mean c_j>``): ``H^2 + H D + 1``
numbers per layer whatever the batch or sequence length (the first version kept the ``(H d)^2`` Gram
of ``o``: 40 GiB for a 70B shape). Per batch:

1. the head outputs are shifted by a float64 reference (the mean of the batch's first chunk of
   kept tokens), so every later product works on residuals of the size of the spread, not of the
   mean (a mean 1e5 times the spread keeps full precision);
2. per chunk of tokens, the residual contributions ``W_O,h (o_h - m_h)`` (one batched matmul over
   heads, ``(H, T, d) x (H, d, D)``) and their ``H x H`` Gram (summed over ``D`` and the chunk's
   tokens, in groups of at most `GRAM_BLOCK` products, then added in float64);
3. the batch's moments, corrected for the residuals' own mean exactly (float64); `merge_moments`
   adds two sets of moments with Chan's parallel formula.

Precision of each step: shifts, chunk sums, the reference contributions ``W_O m`` (one float64
product per batch, in head groups of bounded size) and every merge: float64. The two chunk products
of step 2: in the ``dtype`` the caller passes (float32 on accelerators, float64 on the CPU or for
float64 inputs, in the accumulator), never TF32 or bf16: the caller switches reduced-precision
float32 matmul modes off (`hdi_monitor.functional._numerics.ieee_float32_matmul`).

The ensemble decomposition of Ueda and Nakano (1996) is an add-on: `hdi_monitor.contrib.ensemble`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from hdi_monitor._validation import check_int
from hdi_monitor.functional._numerics import ieee_float32_matmul, no_autocast

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "GRAM_BLOCK",
    "ZERO_VARIANCE_RTOL",
    "HeadCovarianceResult",
    "Moments",
    "WOutSource",
    "as_head_weights",
    "budget_mask",
    "chunk_tokens",
    "contribution_moments",
    "covariance_from_moments",
    "covariance_metrics",
    "covariance_results",
    "head_covariance",
    "merge_moments",
    "subsample_mask",
]

#: `contribution_moments` processes tokens in chunks whose temporaries (the
#: ``(H, T, D)`` contributions and a few ``(T, H d)`` copies of the head outputs) take at most about
#: this many bytes (32 MiB; e.g. 577 tokens for a GPT-2-small layer, 54 for a 4096-wide 32-head one),
#: so memory does not grow with the input.
DEFAULT_CHUNK_BYTES: int = 32 << 20

#: The ``H x H`` Gram of a chunk's contributions is summed over ``D`` times the chunk's tokens; it is
#: taken in groups of tokens whose products are at most this long (at least one token), and the
#: groups are added in float64, so a float32 sum never runs over more than this many terms.
GRAM_BLOCK: int = 8192

#: A head whose variance ``C_ii`` is at or below this fraction of the largest head variance (or is
#: exactly zero) counts as constant: its correlation row and column are NaN.
ZERO_VARIANCE_RTOL: float = 1e-12

_F64 = torch.float64

#: Where the accumulator reads ``W_O``: a tensor, or a zero-argument callable returning one, either
#: ``(H, D, d)`` (``w[h] = W_O,h``) or the output projection's ``nn.Linear`` weight ``(D, H d)``.
WOutSource = Tensor | Callable[[], Tensor]


# --------------------------------------------------------------------------------------------------
# Results and the pure math
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCovarianceResult:
    """Head-contribution covariance of one layer and the metrics derived from it.

    Attributes:
        covariance: ``(H, H)`` float64 (on the CPU), ``C_ij = mean_t <c_i - mean c_i, c_j - mean c_j>``.
        correlation: ``(H, H)`` float64 (on the CPU), ``R_ij = C_ij / sqrt(C_ii C_jj)``; rows and
            columns of zero-variance heads (see `ZERO_VARIANCE_RTOL`) are NaN.
        variance_ratio: ``V = sum_ij C_ij / sum_i C_ii`` over the live heads (NaN when every head
            is constant).
        effective_heads: ``H_eff = H_live / V`` over the live heads (``H_live`` = ``H`` minus the
            invalid heads); ``H_live`` for uncorrelated heads, 1 for identical heads, more than
            ``H_live`` for anti-correlated heads (``inf`` if their contributions cancel exactly).
        mean_correlation: mean of the off-diagonal ``R_ij`` between live heads (NaN when no
            valid pair exists, e.g. ``H = 1``).
        num_tokens: number of tokens the moments were taken over.
        invalid_heads: heads whose contribution has zero variance (dead heads, an all-zero output
            or a zero ``W_O`` block; see `ZERO_VARIANCE_RTOL`) or is not finite (a NaN or inf in
            the head's outputs), in ascending order. They are left out of ``variance_ratio``,
            ``effective_heads`` and ``mean_correlation``.
        nonfinite_heads: those of ``invalid_heads`` whose contribution is not finite.
    """

    covariance: Tensor
    correlation: Tensor
    variance_ratio: float
    effective_heads: float
    mean_correlation: float
    num_tokens: int
    invalid_heads: tuple[int, ...] = ()
    nonfinite_heads: tuple[int, ...] = ()


def as_head_weights(w: Any, num_heads: int | None = None, head_dim: int | None = None) -> Tensor:
    """``W_O`` as a detached ``(H, D, d)`` tensor (from ``(H, D, d)`` or ``nn.Linear``'s ``(D, H d)``)."""
    if not isinstance(w, Tensor):
        raise TypeError(f"w_out must be a torch.Tensor (or a callable returning one), got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"w_out must be a real floating tensor, got {w.dtype}")
    w = w.detach()
    if w.ndim == 2 and num_heads is not None and head_dim is not None:
        if w.shape[1] != num_heads * head_dim:
            raise ValueError(
                f"w_out of shape {tuple(w.shape)} read as the output projection's (D, H*d) weight needs "
                f"H*d = {num_heads * head_dim} columns (H={num_heads}, d={head_dim})"
            )
        return rearrange(w, "D (h d) -> h D d", h=num_heads)
    if w.ndim != 3:
        raise ValueError(
            f"w_out must have shape (H, D, d) (column block W_O,h of the output projection per head) or "
            f"(D, H*d) (the projection's nn.Linear weight), got {tuple(w.shape)}"
        )
    if num_heads is not None and (w.shape[0] != num_heads or w.shape[2] != head_dim):
        raise ValueError(
            f"w_out has shape {tuple(w.shape)} but the accumulator holds H={num_heads} heads of width "
            f"d={head_dim}; expected ({num_heads}, D, {head_dim})"
        )
    return w


def _metrics_tensors(c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Device-side metrics of an ``(H, H)`` float64 covariance: ``(R, V, H_eff, mean R, invalid,
    non-finite)`` over the live heads (``invalid``: the bool mask of zero-variance or non-finite
    heads; ``non-finite``: of those with a NaN or inf variance), no host sync. A non-finite head
    only spoils its own row and column of ``C`` (the moments are products of contributions), so the
    other heads' values stay exact."""
    h = c.shape[0]
    var = c.diagonal()
    nonfinite = ~torch.isfinite(var)
    top = torch.where(nonfinite, 0.0, var).max()
    constant = nonfinite | (var <= ZERO_VARIANCE_RTOL * top) | (var <= 0)
    scale = torch.where(constant, torch.ones_like(var), var).sqrt()
    corr = c / (scale[:, None] * scale[None, :])
    pair_bad = constant[:, None] | constant[None, :]
    nan = torch.full((), float("nan"), dtype=c.dtype, device=c.device)
    corr = torch.where(pair_bad, nan, corr)
    eye = torch.eye(h, dtype=torch.bool, device=c.device)
    # Exact ones on the diagonal of valid heads (rounding would give 1 +- eps).
    corr = torch.where(eye & ~pair_bad, torch.ones_like(corr), corr)
    # dead heads are not independent heads: V and H_eff are taken over the live ones
    live_pairs = ~pair_bad
    trace = torch.where(constant, 0.0, var).sum()
    total = torch.where(live_pairs, c, 0.0).sum()
    ratio = torch.where(trace > 0, total / torch.where(trace > 0, trace, 1.0), nan)
    inf = torch.full((), float("inf"), dtype=c.dtype, device=c.device)
    live = (~constant).sum().to(c.dtype)
    eff = torch.where(ratio <= 0, inf, live / ratio)  # NaN stays NaN
    mean_corr = torch.nanmean(torch.where(eye, nan, corr)) if h > 1 else nan
    return corr, ratio, eff, mean_corr, constant, nonfinite


def covariance_results(covs: Sequence[Tensor], counts: Sequence[Tensor | int]) -> list[HeadCovarianceResult]:
    """Metrics of many ``(H, H)`` float64 covariances (any mix of ``H`` and devices) with one
    device-to-host transfer per device; ``counts`` are the token counts carried into the results."""
    out: list[HeadCovarianceResult | None] = [None] * len(covs)
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(covs):
        by_device.setdefault(c.device, []).append(i)
    for device, idx in by_device.items():
        parts = []
        for i in idx:
            c = covs[i]
            corr, ratio, eff, mean_corr, constant, nonfinite = _metrics_tensors(c)
            n = torch.as_tensor(counts[i], device=device).to(_F64).reshape(1)
            flags = constant.to(_F64) + nonfinite.to(_F64)  # 1: zero variance, 2: not finite
            parts += [n, c.reshape(-1), corr.reshape(-1), torch.stack([ratio, eff, mean_corr]), flags]
        host = torch.cat(parts).cpu()  # the one device-to-host transfer for this device
        pos = 0
        for i in idx:
            h = covs[i].shape[0]
            tokens = int(host[pos])
            cov = host[pos + 1 : pos + 1 + h * h].reshape(h, h).clone()
            corr_host = host[pos + 1 + h * h : pos + 1 + 2 * h * h].reshape(h, h).clone()
            scalars = [float(v) for v in host[pos + 1 + 2 * h * h : pos + 4 + 2 * h * h]]
            flags = host[pos + 4 + 2 * h * h : pos + 4 + 2 * h * h + h]
            pos += 4 + 2 * h * h + h
            invalid = tuple(int(k) for k in torch.nonzero(flags > 0.5).flatten().tolist())
            bad = tuple(int(k) for k in torch.nonzero(flags > 1.5).flatten().tolist())
            out[i] = HeadCovarianceResult(cov, corr_host, scalars[0], scalars[1], scalars[2], tokens, invalid, bad)
    return out  # type: ignore[return-value]


def covariance_metrics(covariance: Tensor, num_tokens: int = 0) -> HeadCovarianceResult:
    """Correlation, variance ratio, effective heads and mean correlation from an ``(H, H)`` covariance.

    Args:
        covariance: ``(H, H)`` symmetric head covariance (any float dtype; computed in float64).
        num_tokens: carried into the result unchanged.

    Returns:
        `HeadCovarianceResult` with CPU tensors (one device-to-host transfer).
    """
    if not isinstance(covariance, Tensor):
        raise TypeError(f"covariance must be a torch.Tensor, got {type(covariance).__name__}")
    if covariance.ndim != 2 or covariance.shape[0] != covariance.shape[1] or covariance.shape[0] < 1:
        raise ValueError(f"covariance must have shape (H, H) with H >= 1, got {tuple(covariance.shape)}")
    return covariance_results([covariance.detach().to(_F64)], [int(num_tokens)])[0]


def subsample_mask(keep: Tensor, max_tokens: int, generator: torch.Generator | None = None) -> Tensor:
    """Choose at most ``max_tokens`` of the kept tokens, uniformly at random without replacement.

    This is the selection the covariance accumulator makes; it draws exactly one random
    permutation of the ``keep.numel()`` tokens from ``generator`` (without one, from a fresh private
    generator seeded with 0: the global random generators are never drawn from, so subsampling
    inside a training step shifts no dropout mask), and a generator seeded the same way reproduces
    the accumulator's choice. No host sync:
    each token gets a random rank, masked-out tokens get the worst rank, and the ``max_tokens``
    best ranks are kept (and intersected with ``keep``).

    Args:
        keep: ``(N,)`` bool, True for tokens that may be chosen.
        max_tokens: positive number of tokens to keep.
        generator: the RNG to draw from; it may live on another device than ``keep``. None: a
            private CPU generator seeded with 0 (never the global one).

    Returns:
        ``(N,)`` bool mask on ``keep``'s device with ``min(max_tokens, keep.sum())`` True entries.
    """
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.ndim != 1:
        raise TypeError("keep must be a 1-D bool tensor")
    check_int("max_tokens", max_tokens)
    n = keep.numel()
    if max_tokens >= n:
        return keep.clone()
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=generator, device=generator.device).to(keep.device)
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(n, device=keep.device)  # a uniformly random rank per token
    rank = torch.where(keep, rank, torch.full_like(rank, n))  # masked-out tokens last
    chosen = torch.topk(rank, max_tokens, largest=False, sorted=False).indices
    out = torch.zeros_like(keep)
    out[chosen] = True
    return out & keep


def budget_mask(keep: Tensor, left: Tensor | int, generator: torch.Generator | None = None) -> Tensor:
    """Choose at most ``left`` of the kept tokens, uniformly at random without replacement, with
    ``left`` a tensor on the device (no host sync).

    Draws one random permutation of the ``keep.numel()`` tokens from ``generator`` (None: a private CPU generator
    seeded with 0), like `subsample_mask`, and makes the same choice as ``subsample_mask(keep,
    left)`` for the same generator state: the kept tokens with the ``left`` best random ranks.

    Args:
        keep: ``(N,)`` bool, True for tokens that may be chosen.
        left: how many may be chosen (a 0-d integer tensor or an int; 0 or less chooses none).
        generator: the RNG to draw from.

    Returns:
        ``(N,)`` bool mask on ``keep``'s device.
    """
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.ndim != 1:
        raise TypeError("keep must be a 1-D bool tensor")
    n = keep.numel()
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=generator, device=generator.device).to(keep.device)
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(n, device=keep.device)
    rank = torch.where(keep, rank, torch.full_like(rank, n))  # masked-out tokens last
    order = torch.argsort(rank)
    kept_sorted = keep[order]
    chosen_sorted = kept_sorted & (torch.cumsum(kept_sorted, 0) <= torch.as_tensor(left, device=keep.device))
    out = torch.zeros_like(keep)
    out[order] = chosen_sorted
    return out


def _project_f64(w: Tensor, v: Tensor, budget: int = DEFAULT_CHUNK_BYTES) -> Tensor:
    """``out[k, h] = W_h v[k, h]`` in float64: ``w`` ``(H, D, d)`` any dtype, ``v`` ``(K, H, d)`` float64.

    ``w`` is upcast a group of heads at a time (at most ``budget`` bytes of float64 weights).
    """
    h, dim, d = w.shape
    group = max(1, budget // (8 * dim * d))
    if group >= h:
        return torch.einsum("hDd,khd->khD", w.to(_F64), v)
    parts = [torch.einsum("hDd,khd->khD", w[i : i + group].to(_F64), v[:, i : i + group]) for i in range(0, h, group)]
    return torch.cat(parts, dim=1)


def _gram_f64(c: Tensor) -> Tensor:
    """``G_ij = sum_{t, D} c[i, t, D] c[j, t, D]`` in float64 for ``c`` ``(H, T, D)`` contiguous.

    Summed in the dtype of ``c`` over groups of tokens (at most `GRAM_BLOCK` terms per product
    in float32, 8 times that in float64; one batched matmul, far faster than one long, skinny
    product), the groups added in float64.
    """
    h, t, dim = c.shape
    block = GRAM_BLOCK if c.dtype != _F64 else 8 * GRAM_BLOCK  # float64 sums need no short groups
    per = max(1, min(t, block // dim))
    groups = t // per
    main = c[:, : groups * per].reshape(h, groups, per * dim).transpose(0, 1)  # (g, H, per*D), a view
    gram = torch.bmm(main, main.transpose(1, 2)).sum(dim=0, dtype=_F64)
    if groups * per < t:
        tail = c[:, groups * per :].reshape(h, 1, -1).transpose(0, 1)  # (1, H, rest*D)
        gram = gram + torch.bmm(tail, tail.transpose(1, 2))[0].to(_F64)
    return gram


#: One batch's (or any number of batches') moments: ``(n, sum, M2)``, float64 ``()`` / ``(H, D)`` /
#: ``(H, H)`` tensors on one device (``n`` int64).
Moments = tuple[Tensor, Tensor, Tensor]


def chunk_tokens(num_heads: int, head_dim: int, model_dim: int, dtype: torch.dtype) -> int:
    """Tokens per chunk of `contribution_moments` whose temporaries stay within `DEFAULT_CHUNK_BYTES`."""
    item = torch.finfo(dtype).bits // 8
    per_token = num_heads * model_dim * item + num_heads * head_dim * (8 + 8 + item)
    return max(1, DEFAULT_CHUNK_BYTES // per_token)


def contribution_moments(
    flat: Tensor, keep: Tensor | None, w: Tensor, *, dtype: torch.dtype, chunk: int | None = None
) -> Moments:
    """The float64 moments ``(n, sum_t c_h(t), M2)`` of one batch of head outputs.

    Args:
        flat: ``(N, H d)`` head outputs, head-major, any real float dtype (read ``chunk`` rows at a
            time; rows are moved to ``w``'s device chunk by chunk).
        keep: None or ``(N,)`` bool, True for the tokens to use (the others may hold anything, NaN
            included).
        w: ``(H, D, d)`` output-projection blocks ``W_O,h``; its device is where the moments live.
        dtype: dtype of the two chunk products (float32 or float64; see the module docstring).
        chunk: tokens per chunk; default `chunk_tokens`.

    Returns:
        ``(n, sum, M2)``: int64 ``()``, float64 ``(H, D)`` and float64 ``(H, H)`` on ``w``'s device. No
        host synchronisation.
    """
    h, dim, d = w.shape
    device = w.device
    w_t = w.to(dtype).transpose(1, 2)  # (H, d, D); a copy only when W_O is not in `dtype` already
    chunk = chunk or chunk_tokens(h, d, dim, dtype)
    n_b = torch.zeros((), dtype=torch.int64, device=device)
    resid_sum = torch.zeros(h * d, dtype=_F64, device=device)
    gram = torch.zeros(h, h, dtype=_F64, device=device)
    shift: Tensor | None = None
    for start in range(0, flat.shape[0], chunk):
        x = flat[start : start + chunk].to(device=device, dtype=_F64)
        rows = None if keep is None else keep[start : start + chunk].to(device=device)[:, None]
        if rows is not None:
            x = torch.where(rows, x, 0.0)  # padding may hold anything, NaN included
        count = torch.full((), x.shape[0], dtype=torch.int64, device=device) if rows is None else rows.sum()
        if shift is None:  # float64 reference: the mean of the first chunk's kept tokens
            shift = x.sum(dim=0) / count.clamp_min(1).to(_F64)
        r = x - shift
        del x
        if rows is not None:
            r = torch.where(rows, r, 0.0)
        n_b += count
        resid_sum += r.sum(dim=0)
        heads = rearrange(r.to(dtype), "t (h d) -> h t d", h=h)
        del r
        contrib = torch.bmm(heads, w_t)  # (H, T, D): residual contributions W_O,h (o_h - m_h)
        del heads
        gram += _gram_f64(contrib)
        del contrib
    if shift is None:  # no token at all
        return n_b, torch.zeros(h, dim, dtype=_F64, device=device), gram
    # float64: the reference contributions W_O m and the residual sums' contributions
    proj = _project_f64(w, torch.stack([shift, resid_sum]).view(2, h, d))  # (2, H, D)
    nf = n_b.to(_F64).clamp_min(1.0)
    resid_c = proj[1]
    m2_b = gram - (resid_c @ resid_c.transpose(0, 1)) / nf  # exact centring of the residuals
    sum_b = proj[0] * n_b.to(_F64) + resid_c
    return n_b, sum_b, m2_b


def merge_moments(a: Moments, b: Moments) -> Moments:
    """Chan et al.'s pairwise update in contribution space: the moments of both token sets,
    ``M2 = M2_a + M2_b + n_a n_b / n <delta_i, delta_j>`` with ``delta = mean_b - mean_a`` (float64,
    exact for any split of the tokens; an empty side leaves the other unchanged)."""
    n_a, sum_a, m2_a = a
    n_b, sum_b, m2_b = b
    na, nb = n_a.to(_F64), n_b.to(_F64)
    n = na + nb
    delta = sum_b / nb.clamp_min(1.0) - sum_a / na.clamp_min(1.0)  # (H, D)
    factor = na * nb / n.clamp_min(1.0)  # zero when either side is empty
    return n_a + n_b.to(torch.int64), sum_a + sum_b, m2_a + m2_b + factor * (delta @ delta.transpose(0, 1))


def covariance_from_moments(n: Tensor, m2: Tensor) -> Tensor:
    """``C = M2 / n``, made exactly symmetric (float64, on the moments' device)."""
    c = m2 / n.to(_F64).clamp_min(1.0)
    return 0.5 * (c + c.transpose(0, 1))


def head_covariance(o: Tensor, w_out: Tensor, keep_mask: Tensor | None = None) -> HeadCovarianceResult:
    """One-shot head-contribution covariance and its metrics (float64 throughout).

    Args:
        o: ``(..., H * d)`` concatenated head outputs, head-major (``o[..., h*d:(h+1)*d]`` is head ``h``).
        w_out: ``(H, D, d)``; ``w_out[h]`` is ``W_O,h``, the columns of the output projection that
            head ``h`` writes through (so ``c_h = W_O,h o_h``).
        keep_mask: optional bool mask broadcastable to ``o.shape[:-1]`` (True = real token).

    Returns:
        `HeadCovarianceResult` over the kept tokens.

    Raises:
        ValueError: no token is kept, or the shapes do not fit.
    """
    w = as_head_weights(w_out)
    h, _, d = w.shape
    if not isinstance(o, Tensor) or not o.is_floating_point() or o.ndim < 1 or o.shape[-1] != h * d:
        raise ValueError(f"o must be a real floating tensor of shape (..., H*d) = (..., {h * d})")
    keep = None
    if keep_mask is not None:
        if not isinstance(keep_mask, Tensor) or keep_mask.dtype != torch.bool:
            raise TypeError("keep_mask must be a bool tensor (True = real token)")
        keep = torch.broadcast_to(keep_mask, o.shape[:-1]).reshape(-1)
    flat = o.detach().reshape(-1, h * d)
    with no_autocast(), ieee_float32_matmul():
        n, _, m2 = contribution_moments(flat, keep, w, dtype=_F64)
    result = covariance_results([covariance_from_moments(n, m2)], [n])[0]
    if result.num_tokens == 0:
        raise ValueError("no tokens kept: check keep_mask")
    return result
