"""Head-output covariance, effective number of heads, and the bias-variance-covariance split.

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

``C`` never needs the ``D``-wide contributions. With ``o`` the concatenated head outputs (``H d``
wide, head-major), ``S`` their centred second moment (``H d x H d``) and
``W_O = [W_O,1 ... W_O,H]`` (``D x H d``),

    C_ij = sum_{a, b} (W_O^T W_O)_{(i a), (j b)} S_{(i a), (j b)},

i.e. ``reduce((W_O^T W_O) * S, "(i a) (j b) -> i j", "sum")``. :class:`HeadCovarianceAccumulator`
keeps ``(n, sum o, centred Gram of o)`` in float64, so its memory is ``O((H d)^2)`` whatever the
batch size or sequence length.

:func:`bias_variance_covariance` gives the exact ensemble decomposition of Ueda and Nakano (1996),
``E[(f_bar - y)^2] = bias_bar^2 + var_bar / M + (1 - 1/M) covar_bar``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange, reduce
from torch import Tensor

__all__ = [
    "HeadCovarianceAccumulator",
    "HeadCovarianceResult",
    "head_covariance",
    "covariance_metrics",
    "subsample_mask",
    "bias_variance_covariance",
    "DEFAULT_CHUNK_BYTES",
    "ZERO_VARIANCE_RTOL",
]

#: ``update`` processes tokens in chunks whose float64 copy takes at most about this many bytes
#: (32 MiB; e.g. 5,461 tokens for ``H d = 768``), so its temporaries do not grow with the input.
DEFAULT_CHUNK_BYTES: int = 32 << 20

#: A head whose variance ``C_ii`` is at or below this fraction of the largest head variance (or is
#: exactly zero) counts as constant: its correlation row and column are NaN.
ZERO_VARIANCE_RTOL: float = 1e-12

_F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# Results and the pure math
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCovarianceResult:
    """Head-contribution covariance of one layer and the metrics derived from it.

    Attributes:
        covariance: ``(H, H)`` float64, ``C_ij = mean_t <c_i - mean c_i, c_j - mean c_j>``.
        correlation: ``(H, H)`` float64, ``R_ij = C_ij / sqrt(C_ii C_jj)``; rows and columns of
            zero-variance heads (see :data:`ZERO_VARIANCE_RTOL`) are NaN.
        variance_ratio: ``V = sum_ij C_ij / sum_i C_ii`` (NaN when every head is constant).
        effective_heads: ``H_eff = H / V``; ``H`` for uncorrelated heads, 1 for identical heads,
            more than ``H`` for anti-correlated heads (``inf`` if their contributions cancel exactly).
        mean_correlation: mean of the off-diagonal ``R_ij``, NaN entries left out (NaN when no
            valid pair exists, e.g. ``H = 1``).
        num_tokens: number of tokens the moments were taken over.
    """

    covariance: Tensor
    correlation: Tensor
    variance_ratio: float
    effective_heads: float
    mean_correlation: float
    num_tokens: int


def _check_w_out(w_out: Tensor, num_heads: int | None = None, head_dim: int | None = None) -> None:
    if not isinstance(w_out, Tensor):
        raise TypeError(f"w_out must be a torch.Tensor, got {type(w_out).__name__}")
    if w_out.ndim != 3:
        raise ValueError(
            f"w_out must have shape (H, D, d) (column block W_O,h of the output projection per head), "
            f"got {tuple(w_out.shape)}"
        )
    if not w_out.is_floating_point():
        raise TypeError(f"w_out must be a real floating tensor, got {w_out.dtype}")
    if num_heads is not None and (w_out.shape[0] != num_heads or w_out.shape[2] != head_dim):
        raise ValueError(
            f"w_out has shape {tuple(w_out.shape)} but the accumulator holds H={num_heads} heads of width "
            f"d={head_dim}; expected ({num_heads}, D, {head_dim})"
        )


def covariance_metrics(covariance: Tensor, num_tokens: int = 0) -> HeadCovarianceResult:
    """Correlation, variance ratio, effective heads and mean correlation from an ``(H, H)`` covariance.

    Args:
        covariance: ``(H, H)`` symmetric head covariance (any float dtype; computed in float64).
        num_tokens: carried into the result unchanged.
    """
    if not isinstance(covariance, Tensor):
        raise TypeError(f"covariance must be a torch.Tensor, got {type(covariance).__name__}")
    if covariance.ndim != 2 or covariance.shape[0] != covariance.shape[1] or covariance.shape[0] < 1:
        raise ValueError(f"covariance must have shape (H, H) with H >= 1, got {tuple(covariance.shape)}")
    c = covariance.detach().to(_F64)
    h = c.shape[0]
    var = c.diagonal()
    top = var.max()
    constant = (var <= ZERO_VARIANCE_RTOL * top) | (var <= 0)
    scale = torch.where(constant, torch.ones_like(var), var).sqrt()
    corr = c / (scale[:, None] * scale[None, :])
    pair_bad = constant[:, None] | constant[None, :]
    corr = torch.where(pair_bad, torch.full_like(corr, float("nan")), corr)
    eye = torch.eye(h, dtype=torch.bool, device=c.device)
    # Exact ones on the diagonal of valid heads (rounding would give 1 +- eps).
    corr = torch.where(eye & ~pair_bad, torch.ones_like(corr), corr)

    trace = var.sum()
    total = c.sum()
    ratio = (total / trace) if bool(trace > 0) else torch.tensor(float("nan"), dtype=_F64)
    ratio_f = float(ratio)
    if math.isnan(ratio_f):
        eff = float("nan")
    elif ratio_f <= 0.0:
        eff = float("inf")
    else:
        eff = h / ratio_f
    off = ~eye & ~torch.isnan(corr)
    mean_corr = float(corr[off].mean()) if bool(off.any()) else float("nan")
    return HeadCovarianceResult(
        covariance=c,
        correlation=corr,
        variance_ratio=ratio_f,
        effective_heads=eff,
        mean_correlation=mean_corr,
        num_tokens=int(num_tokens),
    )


def _head_covariance_from_moments(second_moment: Tensor, w_out: Tensor) -> Tensor:
    """``C_ij = sum over the (i, j) block of (W_O^T W_O) * S``; all float64, no D-wide per-head tensor."""
    h = w_out.shape[0]
    w = rearrange(w_out.detach().to(device=second_moment.device, dtype=_F64), "h D d -> D (h d)")
    gram = w.transpose(0, 1) @ w  # (H d, H d): every W_O,i^T W_O,j
    gram.mul_(second_moment)
    c = reduce(gram, "(i a) (j b) -> i j", "sum", i=h, j=h)
    return 0.5 * (c + c.transpose(0, 1))  # exact symmetry


def subsample_mask(keep: Tensor, max_tokens: int, generator: torch.Generator | None = None) -> Tensor:
    """Choose at most ``max_tokens`` of the kept tokens, uniformly at random without replacement.

    This is the selection :meth:`HeadCovarianceAccumulator.update` makes; it draws exactly one
    ``torch.randperm(keep.numel())`` from ``generator`` (or the default generator of ``keep``'s
    device), so a generator seeded the same way reproduces the accumulator's choice. No host sync:
    each token gets a random rank, masked-out tokens get the worst rank, and the ``max_tokens``
    best ranks are kept (and intersected with ``keep``).

    Args:
        keep: ``(N,)`` bool, True for tokens that may be chosen.
        max_tokens: positive number of tokens to keep.
        generator: optional RNG; it may live on another device than ``keep``.

    Returns:
        ``(N,)`` bool mask on ``keep``'s device with ``min(max_tokens, keep.sum())`` True entries.
    """
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.ndim != 1:
        raise TypeError("keep must be a 1-D bool tensor")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    n = keep.numel()
    if max_tokens >= n:
        return keep.clone()
    gen_device = generator.device if generator is not None else keep.device
    perm = torch.randperm(n, generator=generator, device=gen_device).to(keep.device)
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(n, device=keep.device)  # a uniformly random rank per token
    rank = torch.where(keep, rank, torch.full_like(rank, n))  # masked-out tokens last
    chosen = torch.topk(rank, max_tokens, largest=False, sorted=False).indices
    out = torch.zeros_like(keep)
    out[chosen] = True
    return out & keep


def head_covariance(o: Tensor, w_out: Tensor, keep_mask: Tensor | None = None) -> HeadCovarianceResult:
    """One-shot head-contribution covariance and its metrics.

    Args:
        o: ``(..., H * d)`` concatenated head outputs, head-major (``o[..., h*d:(h+1)*d]`` is head ``h``).
        w_out: ``(H, D, d)``; ``w_out[h]`` is ``W_O,h``, the columns of the output projection that
            head ``h`` writes through (so ``c_h = W_O,h o_h``).
        keep_mask: optional bool mask broadcastable to ``o.shape[:-1]`` (True = real token).

    Returns:
        :class:`HeadCovarianceResult` over the kept tokens.
    """
    _check_w_out(w_out)
    acc = HeadCovarianceAccumulator(w_out.shape[0], w_out.shape[2])
    acc.update(o, keep_mask)
    return acc.compute(w_out)


# --------------------------------------------------------------------------------------------------
# The streaming accumulator
# --------------------------------------------------------------------------------------------------


class HeadCovarianceAccumulator:
    """Streaming, exact head-contribution covariance for one layer.

    State (float64, on the device of the first ``o`` or of ``device``): token count ``n`` (int64),
    ``sum`` of ``o`` (``H d``), and the centred Gram ``M2 = sum_t (o_t - mean)(o_t - mean)^T``
    (``H d x H d``). Each chunk of tokens is centred on its own mean and merged into the state with
    Chan's parallel formula, so precision holds when the mean dwarfs the spread (a raw
    ``Gram / n - mean mean^T`` loses it). Memory is ``O((H d)^2)`` whatever the token count.

    Args:
        num_heads: ``H``.
        head_dim: ``d``.
        max_tokens: if set, each :meth:`update` call keeps at most this many of its (unmasked)
            tokens, chosen uniformly at random without replacement (see :func:`subsample_mask`).
        device: where to keep the state; default: the device of the first ``o``.
        generator: RNG for the subsampling (for reproducible runs); it may live on another device.
        chunk_size: tokens per chunk in :meth:`update`; default: as many as fit
            :data:`DEFAULT_CHUNK_BYTES` in float64.

    Distributed use: each rank updates with its own tokens, then **every rank** calls :meth:`sync`
    (a collective) before :meth:`compute`. After a sync the state is the all-rank total; call
    :meth:`reset` before accumulating the next window (``update`` or ``merge`` on a synced state
    raise, since a second sync would count the other ranks twice).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        max_tokens: int | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
    ) -> None:
        for name, value, optional in (
            ("num_heads", num_heads, False),
            ("head_dim", head_dim, False),
            ("max_tokens", max_tokens, True),
            ("chunk_size", chunk_size, True),
        ):
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                extra = " or None" if optional else ""
                raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.width = num_heads * head_dim
        self.max_tokens = max_tokens
        self.generator = generator
        self.chunk_size = chunk_size or max(1, DEFAULT_CHUNK_BYTES // (8 * self.width))
        self._device = torch.device(device) if device is not None else None
        self._n: Tensor | None = None
        self._sum: Tensor | None = None
        self._m2: Tensor | None = None
        self._synced = False

    # ---------------------------------------------------------------- state
    def _init_state(self, device: torch.device) -> None:
        self._n = torch.zeros((), dtype=torch.int64, device=device)
        self._sum = torch.zeros(self.width, dtype=_F64, device=device)
        self._m2 = torch.zeros(self.width, self.width, dtype=_F64, device=device)

    @property
    def device(self) -> torch.device | None:
        """Device of the state (None before the first update when no device was given)."""
        return self._sum.device if self._sum is not None else self._device

    @property
    def num_tokens(self) -> int:
        """Tokens accumulated so far (a host sync when the state is on an accelerator)."""
        return 0 if self._n is None else int(self._n)

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the state tensors (``(H d)^2 + H d + 1`` numbers)."""
        return sum(t.numel() * t.element_size() for t in (self._n, self._sum, self._m2) if t is not None)

    @property
    def mean(self) -> Tensor:
        """``(H d,)`` float64 mean of the accumulated head outputs."""
        self._require_tokens()
        return self._sum / self._n.to(_F64)

    @property
    def output_covariance(self) -> Tensor:
        """``(H d, H d)`` float64 population covariance ``S`` of the concatenated head outputs."""
        self._require_tokens()
        return self._m2 / self._n.to(_F64)

    def _require_tokens(self) -> None:
        if self._n is None or int(self._n) == 0:
            raise ValueError(
                "no tokens accumulated: call update() with at least one kept token before compute() "
                "(check keep_mask, and that the head-output hook fired)"
            )

    def reset(self) -> None:
        """Forget every token (the state is freed; the device choice is kept)."""
        self._n = self._sum = self._m2 = None
        self._synced = False

    def _merge_moments(self, n_b: Tensor, sum_b: Tensor, m2_b: Tensor) -> None:
        """Chan et al.'s pairwise update: ``M2 = M2_a + M2_b + n_a n_b / n (mean_b - mean_a)^{(x)2}``."""
        n_a = self._n.to(_F64)
        nb = n_b.to(_F64)
        n = n_a + nb
        delta = sum_b / nb.clamp_min(1.0) - self._sum / n_a.clamp_min(1.0)
        factor = n_a * nb / n.clamp_min(1.0)  # zero when either side is empty
        self._m2.add_(m2_b).add_(factor * torch.outer(delta, delta))
        self._sum.add_(sum_b)
        self._n.add_(n_b.to(torch.int64))

    # ---------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, o: Tensor, keep_mask: Tensor | None = None) -> None:
        """Add a batch of head outputs.

        Args:
            o: ``(..., H * d)`` concatenated head outputs, head-major. Any real float dtype; it is
                upcast to float64 chunk by chunk (``chunk_size`` tokens at a time), so temporaries
                stay bounded. ``o`` is read as ``o.reshape(-1, H * d)``, a view when ``o`` is
                contiguous (a non-contiguous ``o`` is copied once).
            keep_mask: None, or a bool tensor broadcastable to ``o.shape[:-1]``; True marks real
                tokens, False (padding) tokens are left out.

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
        if self._sum is None:
            self._init_state(self._device if self._device is not None else o.device)
        device = self._sum.device
        flat = o.detach().reshape(-1, self.width)
        n_tok = flat.shape[0]

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
            keep = keep.to(flat.device)
        if self.max_tokens is not None and self.max_tokens < n_tok:
            if keep is None:
                keep = torch.ones(n_tok, dtype=torch.bool, device=flat.device)
            keep = subsample_mask(keep, self.max_tokens, self.generator)
        if n_tok == 0:
            return

        for start in range(0, n_tok, self.chunk_size):
            x = flat[start : start + self.chunk_size].to(device=device, dtype=_F64)
            if keep is None:
                n_b = torch.full((), x.shape[0], dtype=torch.int64, device=device)  # a fill, no H2D copy
                sum_b = x.sum(dim=0)
                xc = x - sum_b / x.shape[0]
            else:
                w = keep[start : start + self.chunk_size].to(device=device)
                n_b = w.sum()
                wf = w.to(_F64)
                sum_b = wf @ x
                xc = (x - sum_b / n_b.to(_F64).clamp_min(1.0)) * wf[:, None]
            del x
            m2_b = xc.transpose(0, 1) @ xc
            del xc
            self._merge_moments(n_b, sum_b, m2_b)

    # ---------------------------------------------------------------- combine
    @torch.no_grad()
    def merge(self, other: HeadCovarianceAccumulator) -> None:
        """Add ``other``'s tokens to this accumulator (exact, Chan's formula); ``other`` is unchanged."""
        if not isinstance(other, HeadCovarianceAccumulator):
            raise TypeError(f"other must be a HeadCovarianceAccumulator, got {type(other).__name__}")
        if (other.num_heads, other.head_dim) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"cannot merge an accumulator of H={other.num_heads}, d={other.head_dim} into one of "
                f"H={self.num_heads}, d={self.head_dim}"
            )
        if self._synced:
            raise RuntimeError("this accumulator holds a synced all-rank total; call reset() before merging")
        if other._sum is None:
            return
        if self._sum is None:
            self._init_state(self._device if self._device is not None else other._sum.device)
        dev = self._sum.device
        self._merge_moments(other._n.to(dev), other._sum.to(dev), other._m2.to(dev))

    @torch.no_grad()
    def sync(self, group: Any = None) -> None:
        """Sum the state over the ranks of ``group`` (a collective: call it on **every** rank).

        No-op when ``torch.distributed`` is unavailable, not initialised, or the group has one rank.
        Two ``all_reduce(SUM)`` calls: ``[n, sum]`` first, giving the global mean ``mu``; then each
        rank's centred Gram moved to ``mu`` (``M2_r + n_r (mean_r - mu)(mean_r - mu)^T``), which sums
        to the exact global centred Gram. Ranks that saw no tokens take part with zeros. Afterwards
        every rank holds the all-rank state; a repeated ``sync`` is a no-op, and ``update``/``merge``
        raise until :meth:`reset`.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size(group) <= 1 or self._synced:
            return
        if self._sum is None:
            if self._device is not None:
                device = self._device
            elif dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
            self._init_state(device)
        n_local = self._n.to(_F64)
        packed = torch.cat([n_local[None], self._sum])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        n_total, sum_total = packed[0], packed[1:]
        mu = sum_total / n_total.clamp_min(1.0)
        shift = self._sum - n_local * mu  # n_r (mean_r - mu)
        m2 = self._m2 + torch.outer(shift, shift) / n_local.clamp_min(1.0)
        dist.all_reduce(m2, op=dist.ReduceOp.SUM, group=group)
        self._n = n_total.round().to(torch.int64)
        self._sum = sum_total.contiguous()
        self._m2 = m2
        self._synced = True

    # ---------------------------------------------------------------- results
    @torch.no_grad()
    def compute(self, w_out: Tensor) -> HeadCovarianceResult:
        """Head-contribution covariance ``C`` and its metrics over the accumulated tokens.

        Args:
            w_out: ``(H, D, d)``; ``w_out[h] = W_O,h`` (any float dtype; used in float64).

        Raises:
            ValueError: if no token was accumulated or ``w_out`` does not match ``(H, ., d)``.
        """
        _check_w_out(w_out, self.num_heads, self.head_dim)
        self._require_tokens()
        s = self._m2 / self._n.to(_F64)
        c = _head_covariance_from_moments(s, w_out)
        return covariance_metrics(c, num_tokens=int(self._n))

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict state with tensor copies.

        Keys: ``num_heads``, ``head_dim``, ``num_tokens``, ``sum``, ``m2`` (the centred Gram) and
        ``synced``; the tensors are None before the first update.
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
        """Restore a :meth:`state_dict` (tensors go to this accumulator's ``device`` if one was set)."""
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
        if tuple(s.shape) != (self.width,) or tuple(m2.shape) != (self.width, self.width):
            raise ValueError(
                f"state tensors have shapes sum={tuple(s.shape)}, m2={tuple(m2.shape)}; expected "
                f"({self.width},) and ({self.width}, {self.width})"
            )
        dev = self._device if self._device is not None else s.device
        self._n = torch.as_tensor(state["num_tokens"]).to(device=dev, dtype=torch.int64).clone()
        self._sum = s.to(device=dev, dtype=_F64).clone()
        self._m2 = m2.to(device=dev, dtype=_F64).clone()
        self._synced = bool(state.get("synced", False))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"max_tokens={self.max_tokens}, device={self.device})"
        )


# --------------------------------------------------------------------------------------------------
# Bias-variance-covariance decomposition (Ueda and Nakano, 1996)
# --------------------------------------------------------------------------------------------------


def bias_variance_covariance(predictions: Tensor, target: Tensor) -> dict[str, float]:
    """Exact bias-variance-covariance split of an averaging ensemble's squared error.

    With ``f_m`` the ``M`` members, ``f_bar = mean_m f_m`` the ensemble, and expectations taken
    over the ``R`` realisations (data resamples) with population (``1/R``) moments, per point:

    * ``bias_bar = mean_m E[f_m] - y``;
    * ``var_bar = mean_m Var(f_m)``;
    * ``covar_bar = mean_{m != m'} Cov(f_m, f_m')``;

    and ``E[(f_bar - y)^2] = bias_bar^2 + var_bar / M + (1 - 1/M) covar_bar`` exactly. Every term
    is then averaged over the ``N`` points.

    Args:
        predictions: ``(R, M, N)`` member predictions for each realisation and point.
        target: ``(N,)`` true values.

    Returns:
        ``{"bias2", "variance", "covariance", "mse"}`` as floats (computed in float64), with ``mse``
        the ensemble mean's error, so that
        ``mse == bias2 + variance / M + (1 - 1/M) * covariance`` to rounding. ``covariance`` is NaN
        for ``M = 1`` (no pairs; its weight ``1 - 1/M`` is then 0).
    """
    if not isinstance(predictions, Tensor) or not isinstance(target, Tensor):
        raise TypeError("predictions and target must be torch.Tensors")
    if predictions.ndim != 3:
        raise ValueError(
            f"predictions must have shape (R realisations, M members, N points), got {tuple(predictions.shape)}"
        )
    if target.ndim != 1 or target.shape[0] != predictions.shape[2]:
        raise ValueError(
            f"target must have shape (N,) = ({predictions.shape[2]},) to match predictions "
            f"{tuple(predictions.shape)}, got {tuple(target.shape)}"
        )
    if predictions.is_complex() or target.is_complex():
        raise TypeError("predictions and target must be real")
    r, m, n = predictions.shape
    if r < 1 or m < 1 or n < 1:
        raise ValueError(f"predictions needs R, M, N >= 1, got {tuple(predictions.shape)}")
    f = predictions.detach().to(_F64)
    y = target.detach().to(device=f.device, dtype=_F64)

    member_mean = f.mean(dim=0)  # (M, N): E[f_m]
    fc = f - member_mean  # (R, M, N) fluctuations
    bias = member_mean.mean(dim=0) - y  # (N,)
    var_m = fc.square().mean(dim=0)  # (M, N): Var(f_m)
    total = fc.sum(dim=1)  # (R, N): sum_m fluctuations
    # sum_{m != m'} Cov(f_m, f_m') = E[(sum_m fc)^2] - sum_m E[fc^2]
    cross = total.square().mean(dim=0) - var_m.sum(dim=0)  # (N,)
    ens = f.mean(dim=1)  # (R, N)
    mse = (ens - y).square().mean()
    covariance = (cross / (m * (m - 1))).mean().item() if m > 1 else float("nan")
    return {
        "bias2": bias.square().mean().item(),
        "variance": var_m.mean().item(),
        "covariance": covariance,
        "mse": mse.item(),
    }
