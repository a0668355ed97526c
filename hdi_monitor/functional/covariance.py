"""Head-output covariance and the effective number of heads.

Pure tensor math plus one small stateful accumulator (no ``nn.Module``, no Lightning, no logging).

Definitions (see the README, "Head-output covariance"). For one attention layer with ``H`` heads of
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
head, an all-zero output, a zero ``W_O`` block) contributes nothing and is not an independent head:
it is reported in ``invalid_heads`` and ``V``, ``H_eff`` and the mean correlation are taken over the
live heads only (``H`` in ``H_eff = H / V`` is the number of live heads).

`HeadCovarianceAccumulator` accumulates ``C`` directly. It reads ``W_O`` when head outputs
arrive (the forward pass's own weights), forms the contributions chunk by chunk, and keeps only
float64 ``(n, sum_t c_h(t), M2)``: the token count, the ``H x D`` per-head sums of contributions and
the ``H x H`` centred cross sums ``M2_ij = sum_t <c_i - mean c_i, c_j - mean c_j>``. That is
``H^2 + H D + 1`` numbers per layer whatever the batch or sequence length (the first version kept
the ``(H d)^2`` Gram of ``o``: 40 GiB for a 70B shape). Per batch (one `update`):

1. the head outputs are shifted by a float64 reference (the mean of the batch's first chunk of
   kept tokens), so every later product works on residuals of the size of the spread, not of the
   mean (a mean 1e5 times the spread keeps full precision);
2. per chunk of tokens, the residual contributions ``W_O,h (o_h - m_h)`` (one batched matmul over
   heads, ``(H, T, d) x (H, d, D)``) and their ``H x H`` Gram (summed over ``D`` and the chunk's
   tokens, in groups of at most `GRAM_BLOCK` products, then added in float64);
3. the batch's moments, corrected for the residuals' own mean exactly (float64), are merged into
   the state with Chan's parallel formula; so are other accumulators (`merge`) and ranks
   (`sync_accumulators`).

Precision of each step: shifts, chunk sums, the reference contributions ``W_O m`` (one float64
product per batch, in head groups of bounded size), all state and every merge: float64. The two
chunk products of step 2: float32 on accelerators, float64 on the CPU or when the head outputs or
``W_O`` are float64 (``matmul_dtype`` overrides this), never TF32 or bf16: reduced-precision float32 matmul modes
(``torch.backends.cuda.matmul`` / ``mkldnn.matmul`` ``fp32_precision``, which
``torch.set_float32_matmul_precision("high")`` sets) are switched off around them and restored.

`compute_results` turns any number of accumulators into results with one device-to-host
transfer per device; `sync_accumulators` sums any number of accumulators over the ranks in
two ``all_reduce`` calls in all (counts and sums, then the re-centred ``H x H`` cross sums).

The ensemble decomposition of Ueda and Nakano (1996) is an add-on: `hdi_monitor.contrib.ensemble`.

Size: about 800 lines, most of them the accumulator (update, merge, sync, state round trip) and
the precision notes above; the one-shot functions and the accumulator share the same helpers,
which is why they stay in one module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor

from hdi_monitor._validation import check_choice, check_instance, check_int
from hdi_monitor.functional._numerics import ieee_float32_matmul, no_autocast

__all__ = [
    "HeadCovarianceAccumulator",
    "HeadCovarianceResult",
    "WOutSource",
    "head_covariance",
    "covariance_metrics",
    "compute_results",
    "sync_accumulators",
    "subsample_mask",
    "budget_mask",
    "DEFAULT_CHUNK_BYTES",
    "GRAM_BLOCK",
    "ZERO_VARIANCE_RTOL",
]

#: `HeadCovarianceAccumulator.update` processes tokens in chunks whose temporaries (the
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

MatmulDtype = Literal["auto", "float32", "float64"]


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
            or a zero ``W_O`` block; see `ZERO_VARIANCE_RTOL`), in ascending order. They are left
            out of ``variance_ratio``, ``effective_heads`` and ``mean_correlation``.
    """

    covariance: Tensor
    correlation: Tensor
    variance_ratio: float
    effective_heads: float
    mean_correlation: float
    num_tokens: int
    invalid_heads: tuple[int, ...] = ()


def _as_heads(w: Any, num_heads: int | None = None, head_dim: int | None = None) -> Tensor:
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


def _metrics_tensors(c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Device-side metrics of an ``(H, H)`` float64 covariance: ``(R, V, H_eff, mean R, constant)``
    over the live heads (``constant``: the bool mask of zero-variance heads), no host sync."""
    h = c.shape[0]
    var = c.diagonal()
    top = var.max()
    constant = (var <= ZERO_VARIANCE_RTOL * top) | (var <= 0)
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
    return corr, ratio, eff, mean_corr, constant


def _packed_results(covs: Sequence[Tensor], counts: Sequence[Tensor | int]) -> list[HeadCovarianceResult]:
    """Metrics of many covariances with one host transfer per device."""
    out: list[HeadCovarianceResult | None] = [None] * len(covs)
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(covs):
        by_device.setdefault(c.device, []).append(i)
    for device, idx in by_device.items():
        parts = []
        for i in idx:
            c = covs[i]
            corr, ratio, eff, mean_corr, constant = _metrics_tensors(c)
            n = torch.as_tensor(counts[i], device=device).to(_F64).reshape(1)
            parts += [n, c.reshape(-1), corr.reshape(-1), torch.stack([ratio, eff, mean_corr]), constant.to(_F64)]
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
            out[i] = HeadCovarianceResult(cov, corr_host, scalars[0], scalars[1], scalars[2], tokens, invalid)
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
    return _packed_results([covariance.detach().to(_F64)], [int(num_tokens)])[0]


def subsample_mask(keep: Tensor, max_tokens: int, generator: torch.Generator | None = None) -> Tensor:
    """Choose at most ``max_tokens`` of the kept tokens, uniformly at random without replacement.

    This is the selection `HeadCovarianceAccumulator.update` makes; it draws exactly one random
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


def head_covariance(o: Tensor, w_out: Tensor, keep_mask: Tensor | None = None) -> HeadCovarianceResult:
    """One-shot head-contribution covariance and its metrics.

    Args:
        o: ``(..., H * d)`` concatenated head outputs, head-major (``o[..., h*d:(h+1)*d]`` is head ``h``).
        w_out: ``(H, D, d)``; ``w_out[h]`` is ``W_O,h``, the columns of the output projection that
            head ``h`` writes through (so ``c_h = W_O,h o_h``).
        keep_mask: optional bool mask broadcastable to ``o.shape[:-1]`` (True = real token).

    Returns:
        `HeadCovarianceResult` over the kept tokens.
    """
    w = _as_heads(w_out)
    acc = HeadCovarianceAccumulator(w.shape[0], w.shape[2], w_out=w)
    acc.update(o, keep_mask)
    return acc.compute()


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


# --------------------------------------------------------------------------------------------------
# The streaming accumulator
# --------------------------------------------------------------------------------------------------


class HeadCovarianceAccumulator:
    """Streaming, exact head-contribution covariance for one layer, in ``O(H^2 + H D)`` memory.

    State (float64, on the device of the first ``o`` or of ``device``): token count ``n`` (int64),
    ``sum`` of the contributions ``c_h(t) = W_O,h o_h(t)`` (``H x D``), and the centred cross sums
    ``M2_ij = sum_t <c_i(t) - mean c_i, c_j(t) - mean c_j>`` (``H x H``): `state_nbytes` is
    ``8 (H^2 + H D + 1)``. See the module docstring for the algorithm and the precision of each step.

    ``W_O`` is read when head outputs arrive (in `update`), from ``w_out`` given here or to
    ``update``. Read inside the forward pass it is the ``W_O`` that produced the head outputs, so
    `compute` may run at any later time (after the optimizer step too) and needs no weights.

    Args:
        num_heads: ``H``.
        head_dim: ``d``.
        w_out: where to read ``W_O`` (see `WOutSource`): a tensor ``(H, D, d)`` or ``(D, H d)``,
            or a zero-argument callable returning one (called once per `update`; e.g.
            ``functools.partial(layer.head_weights, "output")``). May also be passed to each
            `update` instead.
        model_dim: ``D``, the width of the contributions. Needed only by `sync_accumulators` on
            a rank whose accumulator saw no tokens and whose ``w_out`` is a callable (otherwise the
            callable would be called there, which under FSDP2 is a collective on that rank alone).
        max_tokens: if set, each `update` call keeps at most this many of its (unmasked)
            tokens, chosen uniformly at random without replacement (see `subsample_mask`).
        total_tokens: if set, all `update` calls together (until `reset`) keep at most this many
            tokens: a call that could pass the budget keeps a uniform random subsample of its kept
            tokens, as many as the budget has left (see `budget_mask`; no host sync). A module
            called several times per forward pass (ALBERT's shared layer) or several micro-batches
            then cannot let more than this through. Tokens added by `merge` count against it too.
        device: where to keep the state; default: the device of the first ``o``.
        generator: RNG for the subsampling; it may live on another device. None: a private CPU
            generator seeded with 0, owned by the accumulator (the global generators are never
            drawn from).
        chunk_size: tokens per chunk in `update`; default: as many as fit
            `DEFAULT_CHUNK_BYTES`.
        matmul_dtype: dtype of the two chunk products: ``"auto"`` (float64 when the state is on the
            CPU, where it costs about twice float32, or when the head outputs or ``W_O`` are float64;
            else float32, since float64 matmuls run at 1/64 of the float32 rate on many GPUs),
            ``"float32"`` or ``"float64"``. Everything else is float64 whatever this says.

    Distributed use: each rank updates with its own tokens, then **every rank** calls
    `sync_accumulators` on all its accumulators at once (or `sync` on each, in the same
    order): a collective. After a sync the state is the all-rank total; call `reset` before
    accumulating the next window (``update`` or ``merge`` on a synced state raise, since a second
    sync would count the other ranks twice).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        w_out: WOutSource | None = None,
        model_dim: int | None = None,
        max_tokens: int | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        matmul_dtype: MatmulDtype = "auto",
        total_tokens: int | None = None,
    ) -> None:
        check_int("num_heads", num_heads)
        check_int("head_dim", head_dim)
        for name, value in (
            ("model_dim", model_dim),
            ("max_tokens", max_tokens),
            ("chunk_size", chunk_size),
            ("total_tokens", total_tokens),
        ):
            if value is not None:
                check_int(name, value)
        check_instance("generator", generator, torch.Generator, optional=True)
        check_choice("matmul_dtype", matmul_dtype, MatmulDtype)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.width = num_heads * head_dim
        if isinstance(w_out, Tensor):
            w_out = _as_heads(w_out, num_heads, head_dim)
            if model_dim is not None and w_out.shape[1] != model_dim:
                raise ValueError(f"w_out has D={w_out.shape[1]} but model_dim={model_dim}")
            model_dim = w_out.shape[1]
        elif w_out is not None and not callable(w_out):
            raise TypeError(
                f"w_out must be a tensor, a zero-argument callable returning one, or None, got {type(w_out).__name__}"
            )
        self.w_out = w_out
        self.model_dim = model_dim
        self.max_tokens = max_tokens
        self.total_tokens = total_tokens
        self._offered = 0  # host upper bound on the tokens taken since the last reset (no sync)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.chunk_size = chunk_size
        self.matmul_dtype = matmul_dtype
        self._device = torch.device(device) if device is not None else None
        self._n: Tensor | None = None
        self._sum: Tensor | None = None
        self._m2: Tensor | None = None
        self._n_host: int | None = None  # host copy of n, valid until the state changes
        self._synced = False

    # ---------------------------------------------------------------- state
    def _init_state(self, device: torch.device, model_dim: int) -> None:
        self.model_dim = model_dim
        self._n = torch.zeros((), dtype=torch.int64, device=device)
        self._sum = torch.zeros(self.num_heads, model_dim, dtype=_F64, device=device)
        self._m2 = torch.zeros(self.num_heads, self.num_heads, dtype=_F64, device=device)
        self._n_host = 0

    @property
    def device(self) -> torch.device | None:
        """Device of the state (None before the first update when no device was given)."""
        return self._sum.device if self._sum is not None else self._device

    @property
    def num_tokens(self) -> int:
        """Tokens accumulated so far (a host sync when the state is on an accelerator, unless
        `compute_results` has just read it)."""
        if self._n is None:
            return 0
        if self._n_host is None:
            self._n_host = int(self._n)
        return self._n_host

    @staticmethod
    def state_numel(num_heads: int, model_dim: int) -> int:
        """Numbers in the state of one layer: ``H^2 + H D + 1`` (stored as 8-byte numbers)."""
        return num_heads * num_heads + num_heads * model_dim + 1

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the state tensors: ``8 (H^2 + H D + 1)`` once allocated, else 0."""
        return sum(t.numel() * t.element_size() for t in (self._n, self._sum, self._m2) if t is not None)

    def _require_tokens(self) -> None:
        if self._n is None or self.num_tokens == 0:
            raise ValueError(
                "no tokens accumulated: call update() with at least one kept token before compute() "
                "(check keep_mask, and that the head-output hook fired)"
            )

    def _state(self) -> tuple[Tensor, Tensor, Tensor]:
        """The allocated state ``(n, sum, m2)``; callers have made sure it exists."""
        n, total, m2 = self._n, self._sum, self._m2
        if n is None or total is None or m2 is None:
            raise RuntimeError("HeadCovarianceAccumulator: the state is used before it was allocated")
        return n, total, m2

    def reset(self) -> None:
        """Forget every token (the state is freed; the device choice and ``w_out`` are kept)."""
        self._n = self._sum = self._m2 = None
        self._n_host = None
        self._synced = False
        self._offered = 0

    def _merge_moments(self, n_b: Tensor, sum_b: Tensor, m2_b: Tensor) -> None:
        """Chan et al.'s pairwise update in contribution space:
        ``M2_ij = M2a_ij + M2b_ij + n_a n_b / n <delta_i, delta_j>`` with ``delta = mean_b - mean_a``."""
        n_cur, sum_cur, m2_cur = self._state()
        n_a = n_cur.to(_F64)
        nb = n_b.to(_F64)
        n = n_a + nb
        delta = sum_b / nb.clamp_min(1.0) - sum_cur / n_a.clamp_min(1.0)  # (H, D)
        factor = n_a * nb / n.clamp_min(1.0)  # zero when either side is empty
        m2_cur.add_(m2_b).add_(factor * (delta @ delta.transpose(0, 1)))
        sum_cur.add_(sum_b)
        n_cur.add_(n_b.to(torch.int64))
        self._n_host = None

    def _read_w_out(self, w_out: WOutSource | None) -> Tensor:
        src = self.w_out if w_out is None else w_out
        if src is None:
            raise ValueError(
                "no W_O to form the head contributions: give the accumulator w_out= (a tensor (H, D, d) or "
                "(D, H*d), or a callable returning one) or pass update(o, w_out=...)"
            )
        w = _as_heads(src if isinstance(src, Tensor) else src(), self.num_heads, self.head_dim)
        if self.model_dim is not None and w.shape[1] != self.model_dim:
            raise ValueError(
                f"w_out has D={w.shape[1]}, but this accumulator's contributions are D={self.model_dim} wide"
            )
        return w

    def _resolve_model_dim(self) -> int:
        if self.model_dim is None:
            self.model_dim = self._read_w_out(None).shape[1]
        return self.model_dim

    def _chunk_tokens(self, model_dim: int, dtype: torch.dtype) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        item = torch.finfo(dtype).bits // 8
        per_token = self.num_heads * model_dim * item + self.width * (8 + 8 + item)
        return max(1, DEFAULT_CHUNK_BYTES // per_token)

    # ---------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, o: Tensor, keep_mask: Tensor | None = None, *, w_out: WOutSource | None = None) -> None:
        """Add a batch of head outputs.

        Args:
            o: ``(..., H * d)`` concatenated head outputs, head-major. Any real float dtype; it is
                read ``chunk_size`` tokens at a time, so temporaries stay bounded. ``o`` is read as
                ``o.reshape(-1, H * d)``, a view when ``o`` is contiguous (a non-contiguous ``o`` is
                copied once).
            keep_mask: None, or a bool tensor broadcastable to ``o.shape[:-1]``; True marks real
                tokens, False (padding) tokens are left out (whatever they hold, NaN included).
            w_out: ``W_O`` for this batch (see `WOutSource`); default: the accumulator's ``w_out``.

        With ``max_tokens`` set, at most that many kept tokens of this call are used, chosen
        uniformly at random without replacement (one ``randperm`` over the call's tokens).
        The call does not synchronise with the host.
        """
        if self._synced:
            raise RuntimeError(
                "this accumulator was synced across ranks and now holds the all-rank total; call reset() "
                "before accumulating new tokens"
            )
        if not isinstance(o, Tensor):
            raise TypeError(f"o must be a torch.Tensor, got {type(o).__name__}")
        if not o.is_floating_point():
            raise TypeError(f"o must be a real floating tensor, got {o.dtype}")
        if o.ndim < 1 or o.shape[-1] != self.width:
            raise ValueError(
                f"o must have shape (..., H*d) = (..., {self.width}) for H={self.num_heads}, d={self.head_dim}, "
                f"got {tuple(o.shape)}"
            )
        keep: Tensor | None = None
        if keep_mask is not None:
            if not isinstance(keep_mask, Tensor):
                raise TypeError(f"keep_mask must be a torch.Tensor or None, got {type(keep_mask).__name__}")
            if keep_mask.dtype != torch.bool:
                raise TypeError(
                    f"keep_mask must be a bool tensor (True = real token), got {keep_mask.dtype}; "
                    "convert an attention mask with mask.bool()"
                )
            try:
                keep = torch.broadcast_to(keep_mask, o.shape[:-1]).reshape(-1)
            except RuntimeError as err:
                raise ValueError(
                    f"keep_mask of shape {tuple(keep_mask.shape)} does not broadcast to o.shape[:-1] = "
                    f"{tuple(o.shape[:-1])}"
                ) from err
        w = self._read_w_out(w_out)
        if self._sum is None:
            self._init_state(self._device if self._device is not None else o.device, w.shape[1])
        flat = o.detach().reshape(-1, self.width)
        n_tok = flat.shape[0]
        if keep is not None:
            keep = keep.to(flat.device)
        keep = self._choose(keep, n_tok, flat.device)
        self._offered += n_tok
        if n_tok == 0:
            return
        wide = o.dtype == _F64 or w.dtype == _F64 or self._state()[1].device.type == "cpu"
        dtype = {"auto": _F64 if wide else torch.float32, "float32": torch.float32, "float64": _F64}[self.matmul_dtype]
        with no_autocast(), ieee_float32_matmul():
            self._update_chunks(flat, keep, w, dtype)

    def _choose(self, keep: Tensor | None, n_tok: int, device: torch.device) -> Tensor | None:
        """The tokens of a call of ``n_tok`` tokens that `update` uses: ``keep``, then at most
        ``max_tokens`` of them, then at most what is left of ``total_tokens`` (None: all)."""
        if self.max_tokens is not None and self.max_tokens < n_tok:
            if keep is None:
                keep = torch.ones(n_tok, dtype=torch.bool, device=device)
            keep = subsample_mask(keep, self.max_tokens, self.generator)
        if self.total_tokens is not None and self._offered + n_tok > self.total_tokens:
            # this call may pass the budget: keep at most what is left of it (a device-side count)
            if keep is None:
                keep = torch.ones(n_tok, dtype=torch.bool, device=device)
            left = (
                (self.total_tokens - self._state()[0]).clamp_min(0).to(device)
                if self._sum is not None
                else self.total_tokens
            )
            keep = budget_mask(keep, left, self.generator)
        return keep

    def select_tokens(self, keep: Tensor | None, n_tok: int) -> tuple[Tensor | None, int]:
        """The tokens the next `update` of ``n_tok`` tokens (keep mask ``keep``, flat ``(n_tok,)``)
        would use, chosen now with the accumulator's generator, and the most that can be chosen.

        For callers that must move the chosen tokens before updating (tensor parallelism gathers
        them over ranks): pass the chosen tokens to `update` afterwards, as at most the returned
        number of rows flagged by the mask. Draws what `update` would draw; no host sync.

        Returns:
            ``(mask, cap)``: the ``(n_tok,)`` bool mask of chosen tokens (None: all ``n_tok``) and
            ``cap = min(n_tok, max_tokens, total_tokens)``.
        """
        caps = [c for c in (self.max_tokens, self.total_tokens) if c is not None]
        cap = min([n_tok, *caps])
        device = keep.device if keep is not None else (self._device or torch.device("cpu"))
        return self._choose(keep, n_tok, device), cap

    def _update_chunks(self, flat: Tensor, keep: Tensor | None, w: Tensor, dtype: torch.dtype) -> None:
        device = self._state()[1].device
        h, d = self.num_heads, self.head_dim
        w = w.to(device=device)
        w_t = w.to(dtype).transpose(1, 2)  # (H, d, D); a copy only when W_O is not in `dtype` already
        chunk = self._chunk_tokens(w.shape[1], dtype)
        n_b = torch.zeros((), dtype=torch.int64, device=device)
        resid_sum = torch.zeros(self.width, dtype=_F64, device=device)
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
        # float64: the reference contributions W_O m and the residual sums' contributions
        assert shift is not None  # update() returns early for zero tokens, so one chunk ran
        proj = _project_f64(w, torch.stack([shift, resid_sum]).view(2, h, d))  # (2, H, D)
        nf = n_b.to(_F64).clamp_min(1.0)
        resid_c = proj[1]
        m2_b = gram - (resid_c @ resid_c.transpose(0, 1)) / nf  # exact centring of the residuals
        sum_b = proj[0] * n_b.to(_F64) + resid_c
        self._merge_moments(n_b, sum_b, m2_b)

    # ---------------------------------------------------------------- combine
    def _check_compatible(self, other: HeadCovarianceAccumulator) -> None:
        if not isinstance(other, HeadCovarianceAccumulator):
            raise TypeError(f"other must be a HeadCovarianceAccumulator, got {type(other).__name__}")
        if (other.num_heads, other.head_dim) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"cannot merge an accumulator of H={other.num_heads}, d={other.head_dim} into one of "
                f"H={self.num_heads}, d={self.head_dim}"
            )

    @torch.no_grad()
    def merge(self, other: HeadCovarianceAccumulator) -> None:
        """Add ``other``'s tokens to this accumulator (exact, Chan's formula); ``other`` is unchanged."""
        self._check_compatible(other)
        if self._synced:
            raise RuntimeError("this accumulator holds a synced all-rank total; call reset() before merging")
        if other._sum is None:
            return
        n_o, sum_o, m2_o = other._state()
        if self._sum is not None and self._sum.shape != sum_o.shape:
            raise ValueError(f"cannot merge contributions of D={sum_o.shape[1]} into ones of D={self._sum.shape[1]}")
        if self._sum is None:
            self._init_state(self._device if self._device is not None else sum_o.device, sum_o.shape[1])
        dev = self._state()[1].device
        self._merge_moments(n_o.to(dev), sum_o.to(dev), m2_o.to(dev))
        self._offered += other._offered if other._offered else (self.total_tokens or 0)

    def sync(self, group: Any = None) -> None:
        """Sum the state over the ranks of ``group``: ``sync_accumulators([self], group)`` (a collective)."""
        sync_accumulators([self], group)

    # ---------------------------------------------------------------- results
    @torch.no_grad()
    def compute(self, *args: Any) -> HeadCovarianceResult:
        """Head-contribution covariance ``C`` and its metrics over the accumulated tokens.

        Needs no weights: ``W_O`` was read in `update`. One device-to-host transfer; for many
        layers use `compute_results` (one transfer for all).

        Raises:
            ValueError: if no token was accumulated.
        """
        if args:
            raise TypeError(
                "compute() takes no W_O any more: the accumulator reads W_O when head outputs arrive; give "
                "it w_out= at construction (or to update())"
            )
        result = compute_results([self], min_tokens=1)[0]
        if result is None:
            self._require_tokens()
        assert result is not None
        return result

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict state with tensor copies.

        Keys: ``num_heads``, ``head_dim``, ``num_tokens``, ``sum`` (``(H, D)`` contribution sums),
        ``m2`` (``(H, H)`` centred cross sums) and ``synced``; the tensors are None before the first
        update. ``w_out`` is not part of the state.
        """
        return {
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "num_tokens": None if self._n is None else self._n.clone(),
            "sum": None if self._sum is None else self._sum.clone(),
            "m2": None if self._m2 is None else self._m2.clone(),
            "synced": self._synced,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (tensors go to this accumulator's ``device`` if one was set)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        missing = {"num_heads", "head_dim", "num_tokens", "sum", "m2"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if (state["num_heads"], state["head_dim"]) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"state is for H={state['num_heads']}, d={state['head_dim']}, this accumulator has "
                f"H={self.num_heads}, d={self.head_dim}"
            )
        if state["sum"] is None:
            self.reset()
            return
        s, m2 = state["sum"], state["m2"]
        h = self.num_heads
        if s.ndim != 2 or s.shape[0] != h or tuple(m2.shape) != (h, h):
            raise ValueError(
                f"state tensors have shapes sum={tuple(s.shape)}, m2={tuple(m2.shape)}; expected ({h}, D) and "
                f"({h}, {h}) (a state saved by the older (H d)^2 accumulator cannot be converted)"
            )
        if self.model_dim is not None and s.shape[1] != self.model_dim:
            raise ValueError(f"state has D={s.shape[1]}, this accumulator has D={self.model_dim}")
        dev = self._device if self._device is not None else s.device
        self.model_dim = s.shape[1]
        self._n = torch.as_tensor(state["num_tokens"]).to(device=dev, dtype=torch.int64).clone()
        self._sum = s.to(device=dev, dtype=_F64).clone()
        self._m2 = m2.to(device=dev, dtype=_F64).clone()
        self._n_host = None
        self._synced = bool(state.get("synced", False))
        self._offered = self.total_tokens or 0  # unknown here: later updates check the budget on the device

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"model_dim={self.model_dim}, max_tokens={self.max_tokens}, device={self.device})"
        )


# --------------------------------------------------------------------------------------------------
# Many accumulators at once: results with one host transfer, one sync for all layers
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_results(
    accumulators: Sequence[HeadCovarianceAccumulator], min_tokens: int = 1
) -> list[HeadCovarianceResult | None]:
    """Results of many accumulators (e.g. every layer of a model) with one host transfer per device.

    Args:
        accumulators: the accumulators (any mix of shapes).
        min_tokens: an accumulator with fewer tokens gets None instead of a result.

    Returns:
        One `HeadCovarianceResult` (CPU tensors) or None per accumulator, in order. Each
        accumulator's token count is cached on the host as well, so ``acc.num_tokens`` costs no
        further sync until its state changes.
    """
    check_int("min_tokens", min_tokens)
    covs, counts, live = [], [], []
    for i, acc in enumerate(accumulators):
        if not isinstance(acc, HeadCovarianceAccumulator):
            raise TypeError(f"accumulators[{i}] is a {type(acc).__name__}, not a HeadCovarianceAccumulator")
        if acc._n is None or acc._n_host == 0:
            acc._n_host = 0 if acc._n is None else acc._n_host
            continue
        n_acc, _, m2_acc = acc._state()
        c = m2_acc / n_acc.to(_F64).clamp_min(1.0)
        covs.append(0.5 * (c + c.transpose(0, 1)))  # exact symmetry
        counts.append(n_acc)
        live.append(i)
    results: list[HeadCovarianceResult | None] = [None] * len(accumulators)
    for i, res in zip(live, _packed_results(covs, counts), strict=True):
        accumulators[i]._n_host = res.num_tokens
        if res.num_tokens >= min_tokens:
            results[i] = res
    return results


def _collective_device(accs: Sequence[HeadCovarianceAccumulator], group: Any) -> torch.device:
    import torch.distributed as dist

    for acc in accs:
        if acc.device is not None:
            return acc.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def sync_accumulators(accumulators: Sequence[HeadCovarianceAccumulator], group: Any = None) -> None:
    """Sum many accumulators over the ranks of ``group``: two ``all_reduce`` calls for all of them.

    A collective: call it on **every** rank with the same accumulators (same shapes, same order).
    No-op when ``torch.distributed`` is unavailable, not initialised, or the group has one rank.
    The first ``all_reduce(SUM)`` moves one flat float64 buffer of every accumulator's ``[n, sum]``
    (``H D + 1`` numbers each), giving the global means ``mu``; the second every accumulator's cross
    sums re-centred on ``mu`` (``M2_r + <s_r - n_r mu, s_r - n_r mu> / n_r``, ``H^2`` numbers each),
    which add up to the exact global centred cross sums. Accumulators that saw no tokens take part
    with zeros (their ``D`` from ``model_dim``, or ``w_out``). Afterwards every rank holds the
    all-rank state; synced accumulators are skipped by a repeated sync, and ``update``/``merge``
    raise on them until `HeadCovarianceAccumulator.reset`.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) <= 1:
        return
    todo = [acc for acc in accumulators if not acc._synced]
    if not todo:
        return
    device = _collective_device(todo, group)
    for acc in todo:
        if acc._sum is None:
            acc._init_state(acc._device if acc._device is not None else device, acc._resolve_model_dim())
    states = [acc._state() for acc in todo]
    packed = torch.cat(
        [torch.cat([n.to(device=device, dtype=_F64)[None], s.to(device).reshape(-1)]) for n, s, _ in states]
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    centred, totals, pos = [], [], 0
    for n_acc, sum_acc, m2_acc in states:
        size = sum_acc.numel()
        n_total, sum_total = packed[pos], packed[pos + 1 : pos + 1 + size].view_as(sum_acc)
        pos += 1 + size
        n_local = n_acc.to(device=device, dtype=_F64)
        shift = sum_acc.to(device) - n_local * (sum_total / n_total.clamp_min(1.0))  # n_r (mean_r - mu)
        m2 = m2_acc.to(device) + (shift @ shift.transpose(0, 1)) / n_local.clamp_min(1.0)
        centred.append(m2.reshape(-1))
        totals.append((n_total, sum_total))
    m2_all = torch.cat(centred)
    dist.all_reduce(m2_all, op=dist.ReduceOp.SUM, group=group)
    pos = 0
    for acc, (n_total, sum_total) in zip(todo, totals, strict=True):
        h = acc.num_heads
        dev = acc._state()[1].device
        acc._n = n_total.round().to(device=dev, dtype=torch.int64)
        acc._sum = sum_total.to(dev).clone()
        acc._m2 = m2_all[pos : pos + h * h].view(h, h).to(dev).clone()
        acc._n_host = None
        acc._synced = True
        pos += h * h
