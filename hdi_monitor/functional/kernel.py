"""Per-head kernel statistics: attention entropy, its uniform level and the maximum attention logit.

Pure tensor math (no state, no collectives, no ``nn.Module``, no Lightning, no logging); the
mergeable accumulator that keeps a measured step's sums is
`hdi_monitor.measure.kernel.KernelStatsAccumulator`, which calls `kernel_sums`.

Definitions (DESIGN.md, rule 8). Each head is a kernel smoother over the keys. For query ``t`` of
head ``h``, with the logits ``l_t(s) = scale * <q_t, k_s>`` (``scale`` is ``1/sqrt(d)`` unless the
layer says otherwise) and the set ``A_t`` of keys the layer's own mask allows (causal, padding):

* attention weights ``p_t(s) = softmax_{s in A_t}(l_t(s) + b_t(s))``, ``b`` the finite part of an
  additive mask (zero for boolean masks);
* attention entropy ``H_t = -sum_s p_t(s) ln p_t(s)`` in nats (``exp(H_t)`` is the kernel's
  effective sample size);
* the uniform-attention reference ``ln |A_t|`` (what ``H_t`` would be for ``q_t = 0``);
* the maximum attention logit ``max_{s in A_t} l_t(s)`` (the kernel's sharpness; the additive mask
  is not part of it).

Per head, a measurement reports the mean of ``H_t`` and of ``ln |A_t|`` over the kept queries and the
maximum of the logit over them. Query rows with no allowed key (``A_t`` empty: a left-padded
position under a causal mask, say) are left out, not counted as NaN.

Masks follow `torch.nn.functional.scaled_dot_product_attention`: broadcastable to
``(B, H, T, S)``; a boolean mask is True where attention is allowed; a float mask is added to the
logits, and entries at or below `MASKED_AT` (``-1e4``: ``-inf``, the ``torch.finfo(dtype).min`` of
transformers' eager masks, ``masked_fill(mask == 0, -1e9)`` and the ``-1e4`` of older code alike) or NaN
count as not allowed; finite entries above it (relative-position biases) are a bias. ``is_causal``
allows key ``s`` for query ``t`` when ``s <= t`` (top-left aligned, as SDPA does). Grouped-query
attention: query head ``h`` reads key head ``h // (H / H_k)`` unless a ``kv_head_map`` says
otherwise (x-transformers uses ``h % H_k``).

Cost: `kernel_sums` works through a fixed number of query slots (the caller's subsample: at most
``max_tokens`` of the kept queries, chosen with a private generator, never the global one) in
chunks whose temporaries fit `DEFAULT_CHUNK_BYTES`, so memory is bounded whatever the sequence
length; no call synchronises with the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hdi_monitor._validation import check_int
from hdi_monitor.functional._numerics import ieee_float32_matmul, no_autocast
from hdi_monitor.functional.covariance import subsample_mask

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MASKED_AT",
    "ComputeDtype",
    "KernelStatsResult",
    "KernelSums",
    "allowed_keys",
    "attention_kernel_stats",
    "check_kernel_call",
    "default_kv_head_map",
    "kernel_dtype",
    "kernel_results",
    "kernel_sums",
    "subsample_queries",
]

#: `kernel_sums` takes queries in chunks whose temporaries (each query's keys
#: for every head, the logits and their mask) stay within about this many bytes (32 MiB).
DEFAULT_CHUNK_BYTES: int = 32 << 20

#: An additive float mask entry at or below this masks its key out (``-inf``, ``finfo.min``, ``-1e9``,
#: ``-1e4``): the key's softmax weight is at most ``exp(-1e4)`` of the others', which is exactly 0 in
#: float32 and float64 alike. The one threshold wherever a float mask is read (kernel statistics,
#: ``nn.MultiheadAttention``'s key padding, a batch's token mask).
MASKED_AT: float = -1e4

_F64 = torch.float64

#: The dtype choice of the logits and the softmax: ``"auto"`` (see `kernel_dtype`), ``"float32"`` or
#: ``"float64"``.
ComputeDtype = Literal["auto", "float32", "float64"]
_NAMED_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": _F64}


@dataclass(frozen=True)
class KernelStatsResult:
    """Kernel statistics of one attention layer, per query head.

    Attributes:
        entropy: ``(H,)`` float64 (CPU), mean attention entropy over the measured queries, in nats.
        uniform_entropy: ``(H,)`` float64, mean of ``ln(n_allowed_keys)`` over the same queries: the
            entropy uniform attention would have (the reference level; ``entropy <= uniform_entropy``).
        max_logit: ``(H,)`` float64, the largest ``scale * <q, k>`` over the measured queries and the
            keys they may attend to.
        num_queries: ``(H,)`` int64, how many queries each head's statistics are over (query rows with
            no allowed key are not counted). Heads with none have NaN statistics.
    """

    entropy: Tensor
    uniform_entropy: Tensor
    max_logit: Tensor
    num_queries: Tensor

    @property
    def num_heads(self) -> int:
        """Number of query heads ``H``."""
        return int(self.entropy.shape[0])


def default_kv_head_map(num_heads: int, num_kv_heads: int, device: torch.device | str | None = None) -> Tensor:
    """The grouped-query map ``h -> h // (H / H_k)`` as an ``(H,)`` int64 tensor.

    This is what transformers' ``repeat_kv`` and SDPA's ``enable_gqa`` do.

    Raises:
        ValueError: if ``H_k`` does not divide ``H``.
    """
    check_int("num_heads", num_heads)
    check_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_kv_heads} key heads do not divide {num_heads} query heads")
    return torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)


def _kv_map(kv_head_map: Tensor | Sequence[int] | None, h: int, hk: int, device: torch.device) -> Tensor | None:
    """The map as an ``(H,)`` int64 tensor on ``device``, or None for the identity (``H_k == H``)."""
    if kv_head_map is None:
        return None if hk == h else default_kv_head_map(h, hk, device)
    m = torch.as_tensor(kv_head_map, dtype=torch.int64, device=device)
    if m.shape != (h,):
        raise ValueError(f"kv_head_map must have shape ({h},), one key head per query head, got {tuple(m.shape)}")
    if m.device.type == "cpu" and ((m < 0) | (m >= hk)).any():
        raise ValueError(f"kv_head_map entries must be in [0, {hk}), got {m.tolist()}")
    return m


def allowed_keys(
    mask: Tensor | None, is_causal: bool, shape: tuple[int, int, int, int], device: torch.device
) -> Tensor:
    """The ``(B, H, T, S)`` boolean view (broadcast, not copied) of which keys each query may attend to.

    Args:
        mask: None, a boolean mask (True = allowed) or an additive float mask, broadcastable to
            ``shape``; see the module docstring for which float entries count as not allowed.
        is_causal: also require ``s <= t``.
        shape: ``(B, H, T, S)``.
        device: where to build the causal part.
    """
    b, h, t, s = shape
    if mask is None:
        allowed = torch.ones((), dtype=torch.bool, device=device)
    elif mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > MASKED_AT  # also False for -inf and NaN
    if is_causal:
        causal = torch.ones(t, s, dtype=torch.bool, device=device).tril()
        allowed = allowed.to(device) & causal
    return torch.broadcast_to(allowed.to(device), shape)


#: The per-head sums of one layer's kernel statistics: ``(entropy_sum, uniform_sum, num_queries,
#: max_logit)``, ``(H,)`` float64 / float64 / int64 / float64 tensors on one device.
KernelSums = tuple[Tensor, Tensor, Tensor, Tensor]


def check_kernel_call(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    query_keep: Tensor | None = None,
    kv_head_map: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Check one attention call's tensors; returns the ``(B*T,)`` bool keep flags of its queries
    (all True without ``query_keep``) and the ``(H,)`` key head map (None: one key head per query
    head). See `kernel_sums` for the arguments.

    Raises:
        TypeError, ValueError: a tensor of the wrong kind or shape.
    """
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim != 4:
            raise TypeError(f"{name} must be a 4-D real floating tensor (batch, heads, tokens, d)")
    b, h, t, d = q.shape
    bk, hk, s, dk = k.shape
    if dk != d or bk not in (b, 1):
        raise ValueError(f"k of shape {tuple(k.shape)} does not match q of shape {tuple(q.shape)}")
    kv_map = _kv_map(kv_head_map, h, hk, q.device)
    if kv_map is None and hk != h:
        raise ValueError(f"k has {hk} heads for {h} query heads")
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
        try:
            torch.broadcast_shapes(mask.shape, (b, h, t, s))
        except RuntimeError as err:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, t, s)}") from err
    keep = torch.ones(b * t, dtype=torch.bool, device=q.device)
    if query_keep is not None:
        if not isinstance(query_keep, Tensor) or query_keep.dtype != torch.bool:
            raise TypeError("query_keep must be a bool tensor (True = real query token)")
        try:
            keep = torch.broadcast_to(query_keep.to(q.device), (b, t)).reshape(-1)
        except RuntimeError as err:
            raise ValueError(f"query_keep of shape {tuple(query_keep.shape)} does not broadcast to {(b, t)}") from err
    return keep, kv_map


def subsample_queries(
    keep: Tensor, max_tokens: int | None, generator: torch.Generator | None = None
) -> tuple[Tensor, int | None]:
    """The queries `kernel_sums` measures and its ``slots``, from the keep flags of `check_kernel_call`.

    ``(keep, None)`` (every kept query) when ``max_tokens`` is None or at least ``keep.numel()``;
    otherwise at most ``max_tokens`` of the kept queries, chosen uniformly at random without
    replacement by `subsample_mask` (one ``randperm`` drawn from ``generator``; None: a private
    generator seeded with 0, never the global one), and ``max_tokens`` slots.
    """
    if max_tokens is None or check_int("max_tokens", max_tokens) >= keep.numel():
        return keep, None
    return subsample_mask(keep, max_tokens, generator), max_tokens


def kernel_dtype(q: Tensor, k: Tensor, compute_dtype: ComputeDtype = "auto") -> torch.dtype:
    """The dtype of one call's logits and softmax in `kernel_sums` (its sums are float64 whatever this says).

    ``"auto"``: float64 on the CPU or when ``q`` or ``k`` is float64, else float32 (float64 matmuls
    run at a small fraction of the float32 rate on many GPUs); ``"float32"`` and ``"float64"`` as
    named. Never below float32.
    """
    if compute_dtype == "auto":
        return _F64 if q.dtype == _F64 or k.dtype == _F64 or q.device.type == "cpu" else torch.float32
    named = _NAMED_DTYPES.get(compute_dtype) if isinstance(compute_dtype, str) else None
    if named is None:  # a plain lookup: this runs on every kernel call of a measured step
        options = ("auto", *_NAMED_DTYPES)
        raise ValueError(f"compute_dtype must be one of {options}, got {compute_dtype!r}")
    return named


def kernel_sums(
    q: Tensor,
    k: Tensor,
    keep: Tensor,
    *,
    slots: int | None = None,
    scale: float | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    kv_map: Tensor | None = None,
    dtype: torch.dtype = _F64,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> KernelSums:
    """The per-head sums of one attention call's kernel statistics over its kept queries.

    Args:
        q: ``(B, H, T, d)`` queries as the kernel receives them (after rotary embeddings, q-norm).
        k: ``(B, H_k, S, d)`` keys.
        keep: ``(B*T,)`` bool, the queries to measure (see `check_kernel_call`; a subsample drawn by
            the caller).
        slots: how many query slots to work through: at least the number of True entries of
            ``keep`` (the kept queries first, the rest marked invalid; a fixed number, so no host
            sync is needed to count them); None: every query.
        scale: logit scale; default ``1 / sqrt(d)`` (SDPA's default).
        mask: the layer's own mask, broadcastable to ``(B, H, T, S)`` (see the module docstring).
        is_causal: the kernel's causal flag (key ``s`` allowed for query ``t`` when ``s <= t``).
        kv_map: ``(H,)`` key head of each query head (None: ``H_k == H``).
        dtype: dtype of the logits and the softmax (float32 or float64; sums are float64).
        chunk_bytes: bound on the temporaries of one chunk of queries.

    Returns:
        `KernelSums` on ``q``'s device: the sums of the entropies and of ``ln |A_t|``, the number of
        measured queries and the largest logit (``-inf`` where none), per query head.
    """
    b, h, t, d = q.shape
    bk, _, s, _ = k.shape
    device = q.device
    sums = [torch.zeros(h, dtype=_F64, device=device) for _ in range(2)]
    count = torch.zeros(h, dtype=torch.int64, device=device)
    top = torch.full((h,), -math.inf, dtype=_F64, device=device)
    m = b * t if slots is None else min(slots, b * t)
    if m == 0 or s == 0:
        return sums[0], sums[1], count, top
    # a fixed number of query slots (no host sync): the kept ones first, the rest marked invalid
    picked = (
        torch.topk(keep.to(torch.float32), m, sorted=False).indices if m < b * t else torch.arange(m, device=device)
    )
    valid = keep[picked]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    allowed = allowed_keys(mask, is_causal, (b, h, t, s), device)
    bias = None if mask is None or mask.dtype == torch.bool else torch.broadcast_to(mask.to(device), (b, h, t, s))
    per_query = h * s * (d * (dtype.itemsize + 1) + 4 * dtype.itemsize + 2)
    chunk = max(1, chunk_bytes // per_query)
    with no_autocast(), ieee_float32_matmul():
        for start in range(0, m, chunk):
            idx = picked[start : start + chunk]
            bi, ti = idx // t, idx % t
            qc = q[bi, :, ti].to(dtype)  # (c, H, d)
            kc = k[bi if bk == b else torch.zeros_like(bi)].to(dtype)  # (c, H_k, S, d)
            if kv_map is not None:
                kc = kc.index_select(1, kv_map)  # (c, H, S, d)
            raw = torch.einsum("chd,chsd->chs", qc, kc) * scale
            ok = allowed[bi, :, ti]  # (c, H, S)
            logits = raw if bias is None else raw + bias[bi, :, ti].to(dtype)
            logits = torch.where(ok, logits, -math.inf)
            rows = ok.any(-1) & valid[start : start + chunk, None]  # (c, H)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            p = torch.exp(logits - torch.where(rows[..., None], lse, 0.0))
            plogp = torch.where(ok, p * (logits - lse), 0.0).sum(-1)
            n_ok = ok.sum(-1)
            sums[0] += torch.where(rows, -plogp, 0.0).sum(0).to(_F64)
            sums[1] += torch.where(rows, torch.log(n_ok.clamp_min(1).to(_F64)), 0.0).sum(0)
            count += rows.sum(0)
            peak = torch.where(ok & rows[..., None], raw, -math.inf).amax(dim=-1).amax(dim=0)
            top = torch.maximum(top, peak.to(_F64))
    return sums[0], sums[1], count, top


def kernel_results(sums: Sequence[KernelSums]) -> list[KernelStatsResult]:
    """Results of many layers' sums with one host transfer per device. A head without a measured
    query gets NaN statistics and a zero count."""
    by_device: dict[torch.device, list[int]] = {}
    for i, st in enumerate(sums):
        by_device.setdefault(st[0].device, []).append(i)
    host: dict[int, Tensor] = {}
    for idx in by_device.values():
        packed = torch.cat([torch.stack([sums[i][0], sums[i][1], sums[i][2].to(_F64), sums[i][3]]) for i in idx], 1)
        packed = packed.cpu()  # the one device-to-host transfer for this device
        pos = 0
        for i in idx:
            h = sums[i][0].shape[0]
            host[i] = packed[:, pos : pos + h]
            pos += h
    out = []
    for i in range(len(sums)):
        ent, ref, n, top = host[i].unbind(0)
        empty = n == 0
        nan = torch.full_like(ent, math.nan)
        div = n.clamp_min(1.0)
        out.append(
            KernelStatsResult(
                entropy=torch.where(empty, nan, ent / div),
                uniform_entropy=torch.where(empty, nan, ref / div),
                max_logit=torch.where(empty, nan, top),
                num_queries=n.round().to(torch.int64),
            )
        )
    return out


def attention_kernel_stats(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    query_keep: Tensor | None = None,
    kv_head_map: Tensor | Sequence[int] | None = None,
    max_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> KernelStatsResult:
    """One-shot kernel statistics of one attention call (see `kernel_sums`; with ``max_tokens``, at
    most that many of the kept queries, chosen with ``generator``: never a global generator).

    Example:
        ```python
        g = torch.Generator().manual_seed(0)      # a private generator: no global draw
        q = torch.randn(2, 8, 16, 32, generator=g)  # (batch, heads, queries, d)
        k = torch.randn(2, 2, 16, 32, generator=g)  # two key heads: grouped-query attention
        res = attention_kernel_stats(q, k, is_causal=True)
        res.entropy, res.uniform_entropy, res.max_logit  # (8,) each, float64
        ```
    """
    keep, kv_map = check_kernel_call(q, k, mask=mask, query_keep=query_keep, kv_head_map=kv_head_map)
    keep, slots = subsample_queries(keep, max_tokens, generator)
    sums = kernel_sums(
        q, k, keep, slots=slots, scale=scale, mask=mask, is_causal=is_causal, kv_map=kv_map, dtype=kernel_dtype(q, k)
    )
    return kernel_results([sums])[0]
