"""Per-head kernel statistics: attention entropy, its uniform level and the maximum attention logit.

Pure tensor math plus one small mergeable accumulator (no ``nn.Module``, no Lightning, no logging).

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

Cost: with ``max_tokens`` set, each `KernelStatsAccumulator.update` keeps at most that many queries
(chosen uniformly at random from the kept ones with a private generator, never the global one)
and works through them in chunks whose temporaries fit `DEFAULT_CHUNK_BYTES`, so memory is
bounded whatever the sequence length; no call synchronises with the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from hdi_monitor._validation import check_choice, check_instance, check_int
from hdi_monitor.functional._numerics import ieee_float32_matmul, no_autocast
from hdi_monitor.functional.covariance import subsample_mask

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MASKED_AT",
    "KernelStatsAccumulator",
    "KernelStatsResult",
    "allowed_keys",
    "attention_kernel_stats",
    "compute_kernel_results",
    "default_kv_head_map",
    "sync_kernel_accumulators",
]

#: `KernelStatsAccumulator.update` takes queries in chunks whose temporaries (each query's keys
#: for every head, the logits and their mask) stay within about this many bytes (32 MiB).
DEFAULT_CHUNK_BYTES: int = 32 << 20

#: An additive float mask entry at or below this masks its key out (``-inf``, ``finfo.min``, ``-1e9``,
#: ``-1e4``): the key's softmax weight is at most ``exp(-1e4)`` of the others', which is exactly 0 in
#: float32 and float64 alike. The one threshold wherever a float mask is read (kernel statistics,
#: ``nn.MultiheadAttention``'s key padding, a batch's token mask).
MASKED_AT: float = -1e4

_F64 = torch.float64

ComputeDtype = Literal["auto", "float32", "float64"]


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


def _check_map(kv_head_map: Tensor | Sequence[int] | None, h: int, hk: int, device: torch.device) -> Tensor | None:
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


class KernelStatsAccumulator:
    """Mergeable sums for one attention layer's kernel statistics.

    The state is four ``(H,)`` tensors on one device: float64 sums of the entropies and of the
    uniform levels, int64 query counts, and the float64 running maximum of the logits. States add
    (`merge`, `sync_kernel_accumulators`): several micro-batches, calls or ranks combine exactly.

    Args:
        num_heads: query heads ``H``.
        max_tokens: if set, each `update` keeps at most this many of its kept queries (over the
            whole batch), chosen uniformly at random without replacement (`subsample_mask`).
        generator: the generator for that choice; it may live on another device. None: a private
            CPU generator seeded with 0, owned by the accumulator (the global one is never used).
        device: where the state lives; default: the device of the first ``q``.
        chunk_bytes: bound on the temporaries of one chunk of queries.
        compute_dtype: dtype of the logits and the softmax: ``"auto"`` (float64 on the CPU or for
            float64 inputs, float32 otherwise), ``"float32"`` or ``"float64"``. Never below float32;
            sums are float64 whatever this says.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        max_tokens: int | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        compute_dtype: ComputeDtype = "auto",
    ) -> None:
        self.num_heads = check_int("num_heads", num_heads)
        self.max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens)
        check_instance("generator", generator, torch.Generator, optional=True)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.chunk_bytes = check_int("chunk_bytes", chunk_bytes)
        self.compute_dtype: ComputeDtype = check_choice("compute_dtype", compute_dtype, ComputeDtype)
        self._device = torch.device(device) if device is not None else None
        self._state: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self._synced = False

    # ---------------------------------------------------------------- state
    @property
    def device(self) -> torch.device | None:
        """Where the state lives (None before the first update without a ``device``)."""
        return self._state[0].device if self._state is not None else self._device

    def _init_state(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = self.num_heads
        self._state = (
            torch.zeros(h, dtype=_F64, device=device),
            torch.zeros(h, dtype=_F64, device=device),
            torch.zeros(h, dtype=torch.int64, device=device),
            torch.full((h,), -math.inf, dtype=_F64, device=device),
        )
        return self._state

    def reset(self) -> None:
        """Forget every query (the generator keeps its position)."""
        self._state = None
        self._synced = False

    # ---------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        q: Tensor,
        k: Tensor,
        *,
        scale: float | None = None,
        mask: Tensor | None = None,
        is_causal: bool = False,
        query_keep: Tensor | None = None,
        kv_head_map: Tensor | Sequence[int] | None = None,
    ) -> None:
        """Add one attention call's queries.

        Args:
            q: ``(B, H, T, d)`` queries as the kernel receives them (after rotary embeddings, q-norm).
            k: ``(B, H_k, S, d)`` keys, ``H_k`` dividing ``H`` (or any ``H_k`` with ``kv_head_map``).
            scale: logit scale; default ``1 / sqrt(d)`` (SDPA's default).
            mask: the layer's own mask, broadcastable to ``(B, H, T, S)`` (see the module docstring).
            is_causal: the kernel's causal flag (key ``s`` allowed for query ``t`` when ``s <= t``).
            query_keep: None or a bool tensor broadcastable to ``(B, T)``; False queries (padding)
                are never measured.
            kv_head_map: ``(H,)`` key head of each query head; default ``h // (H / H_k)``.

        No host synchronisation; with ``max_tokens`` one ``randperm`` is drawn from the
        accumulator's generator (when the batch holds more than ``max_tokens`` queries).
        """
        if self._synced:
            raise RuntimeError("this accumulator holds a synced all-rank total; call reset() before updating")
        for name, x in (("q", q), ("k", k)):
            if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim != 4:
                raise TypeError(f"{name} must be a 4-D real floating tensor (batch, heads, tokens, d)")
        b, h, t, d = q.shape
        bk, hk, s, dk = k.shape
        if h != self.num_heads:
            raise ValueError(f"q has {h} heads, this accumulator measures {self.num_heads}")
        if dk != d or bk not in (b, 1):
            raise ValueError(f"k of shape {tuple(k.shape)} does not match q of shape {tuple(q.shape)}")
        device = q.device
        kv_map = _check_map(kv_head_map, h, hk, device)
        if kv_map is None and hk != h:
            raise ValueError(f"k has {hk} heads for {h} query heads")
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
            try:
                torch.broadcast_shapes(mask.shape, (b, h, t, s))
            except RuntimeError as err:
                raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, t, s)}") from err
        keep = torch.ones(b * t, dtype=torch.bool, device=device)
        if query_keep is not None:
            if not isinstance(query_keep, Tensor) or query_keep.dtype != torch.bool:
                raise TypeError("query_keep must be a bool tensor (True = real query token)")
            try:
                keep = torch.broadcast_to(query_keep.to(device), (b, t)).reshape(-1)
            except RuntimeError as err:
                raise ValueError(
                    f"query_keep of shape {tuple(query_keep.shape)} does not broadcast to {(b, t)}"
                ) from err
        state = self._state if self._state is not None else self._init_state(self._device or device)
        if b * t == 0 or s == 0:
            return
        m = b * t
        if self.max_tokens is not None and self.max_tokens < m:
            keep = subsample_mask(keep, self.max_tokens, self.generator)
            m = self.max_tokens
        # a fixed number of query slots (no host sync): the kept ones first, the rest marked invalid
        slots = (
            torch.topk(keep.to(torch.float32), m, sorted=False).indices if m < b * t else torch.arange(m, device=device)
        )
        valid = keep[slots]
        wide = q.dtype == _F64 or k.dtype == _F64 or device.type == "cpu"
        dtype = {"auto": _F64 if wide else torch.float32, "float32": torch.float32, "float64": _F64}[self.compute_dtype]
        allowed = allowed_keys(mask, is_causal, (b, h, t, s), device)
        bias = None if mask is None or mask.dtype == torch.bool else torch.broadcast_to(mask.to(device), (b, h, t, s))
        per_query = h * s * (d * (dtype.itemsize + 1) + 4 * dtype.itemsize + 2)
        chunk = max(1, self.chunk_bytes // per_query)
        with no_autocast(), ieee_float32_matmul():
            sums = [torch.zeros(h, dtype=_F64, device=device) for _ in range(2)]
            count = torch.zeros(h, dtype=torch.int64, device=device)
            top = torch.full((h,), -math.inf, dtype=_F64, device=device)
            for start in range(0, m, chunk):
                idx = slots[start : start + chunk]
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
        dev = state[0].device
        state[0].add_(sums[0].to(dev))
        state[1].add_(sums[1].to(dev))
        state[2].add_(count.to(dev))
        torch.maximum(state[3], top.to(dev), out=state[3])

    # ---------------------------------------------------------------- combine
    @torch.no_grad()
    def merge(self, other: KernelStatsAccumulator) -> None:
        """Add ``other``'s queries to this accumulator (exact); ``other`` is unchanged."""
        if not isinstance(other, KernelStatsAccumulator):
            raise TypeError(f"other must be a KernelStatsAccumulator, got {type(other).__name__}")
        if other.num_heads != self.num_heads:
            raise ValueError(f"cannot merge {other.num_heads} heads into {self.num_heads}")
        if self._synced:
            raise RuntimeError("this accumulator holds a synced all-rank total; call reset() before merging")
        if other._state is None:
            return
        mine = self._state if self._state is not None else self._init_state(self._device or other._state[0].device)
        dev = mine[0].device
        for i in range(3):
            mine[i].add_(other._state[i].to(dev))
        torch.maximum(mine[3], other._state[3].to(dev), out=mine[3])

    def sync(self, group: Any = None) -> None:
        """Combine the state over the ranks of ``group``: ``sync_kernel_accumulators([self], group)``."""
        sync_kernel_accumulators([self], group)

    # ---------------------------------------------------------------- results
    def compute(self) -> KernelStatsResult:
        """The per-head statistics over every query so far (one device-to-host transfer).

        Heads without a measured query have NaN statistics and ``num_queries == 0``.
        """
        out = compute_kernel_results([self])[0]
        assert out is not None
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict state with tensor copies (``None`` tensors before the first update)."""
        names = ("entropy_sum", "uniform_sum", "num_queries", "max_logit")
        st = self._state
        return {
            "num_heads": self.num_heads,
            "synced": self._synced,
            **{n: None if st is None else st[i].clone() for i, n in enumerate(names)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`."""
        if not isinstance(state, dict) or state.get("num_heads") != self.num_heads:
            raise ValueError(f"state must be a state_dict() of a {self.num_heads}-head KernelStatsAccumulator")
        if state.get("entropy_sum") is None:
            self.reset()
            return
        dev = self._device or state["entropy_sum"].device
        tensors = [state[n] for n in ("entropy_sum", "uniform_sum", "num_queries", "max_logit")]
        if any(tuple(x.shape) != (self.num_heads,) for x in tensors):
            raise ValueError(f"state tensors must have shape ({self.num_heads},)")
        self._state = (
            tensors[0].to(dev, _F64).clone(),
            tensors[1].to(dev, _F64).clone(),
            tensors[2].to(dev, torch.int64).clone(),
            tensors[3].to(dev, _F64).clone(),
        )
        self._synced = bool(state.get("synced", False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_heads={self.num_heads}, max_tokens={self.max_tokens}, device={self.device})"


def compute_kernel_results(accumulators: Sequence[KernelStatsAccumulator]) -> list[KernelStatsResult]:
    """Results of many accumulators (e.g. every layer) with one host transfer per device.

    An accumulator that never saw a query gives all-NaN statistics with zero counts.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, acc in enumerate(accumulators):
        check_instance("accumulator", acc, KernelStatsAccumulator)
        dev = acc._state[0].device if acc._state is not None else torch.device("cpu")
        by_device.setdefault(dev, []).append(i)
    host: dict[int, Tensor] = {}
    for dev, idx in by_device.items():
        rows = []
        for i in idx:
            acc = accumulators[i]
            st = acc._state
            if st is None:  # no query yet: zero sums and counts (the accumulator is left as it is)
                rows.append(torch.zeros(4, acc.num_heads, dtype=_F64, device=dev))
            else:
                rows.append(torch.stack([st[0], st[1], st[2].to(_F64), st[3]]))
        packed = torch.cat(rows, dim=1).cpu() if rows else None
        pos = 0
        for i in idx:
            h = accumulators[i].num_heads
            assert packed is not None
            host[i] = packed[:, pos : pos + h]
            pos += h
    out = []
    for i in range(len(accumulators)):
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


def sync_kernel_accumulators(accumulators: Sequence[KernelStatsAccumulator], group: Any = None) -> None:
    """Combine many accumulators over the ranks of ``group`` in two ``all_reduce`` calls.

    A collective: call it on **every** rank with the same accumulators in the same order. One
    ``SUM`` of every accumulator's entropy sums, uniform-level sums and counts (packed, float64),
    one ``MAX`` of the logit maxima. No-op without an initialised process group or with one rank.
    Afterwards every rank holds the all-rank state; `KernelStatsAccumulator.update` and ``merge``
    raise until ``reset``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    todo = [acc for acc in accumulators if not acc._synced]
    if not todo:
        return
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    for acc in todo:
        if acc._state is None:
            acc._init_state(acc._device or device)
    states = [acc._state for acc in todo]
    sums = torch.cat([torch.stack([s[0], s[1], s[2].to(_F64)]).to(device).reshape(-1) for s in states if s])
    tops = torch.cat([s[3].to(device) for s in states if s])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
    pos = 0
    for acc in todo:
        h = acc.num_heads
        st = acc._state
        assert st is not None
        block = sums[3 * pos : 3 * (pos + h)].view(3, h).to(st[0].device)
        st[0].copy_(block[0])
        st[1].copy_(block[1])
        st[2].copy_(block[2].round().to(torch.int64))
        st[3].copy_(tops[pos : pos + h].to(st[0].device))
        acc._synced = True
        pos += h


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
    """One-shot kernel statistics of one attention call (see `KernelStatsAccumulator.update`).

    Example:
        ```python
        g = torch.Generator().manual_seed(0)      # a private generator: no global draw
        q = torch.randn(2, 8, 16, 32, generator=g)  # (batch, heads, queries, d)
        k = torch.randn(2, 2, 16, 32, generator=g)  # two key heads: grouped-query attention
        res = attention_kernel_stats(q, k, is_causal=True)
        res.entropy, res.uniform_entropy, res.max_logit  # (8,) each, float64
        ```
    """
    heads = q.shape[1] if isinstance(q, Tensor) and q.ndim == 4 else 1  # update() reports a bad q
    acc = KernelStatsAccumulator(heads, max_tokens=max_tokens, generator=generator)
    acc.update(q, k, scale=scale, mask=mask, is_causal=is_causal, query_keep=query_keep, kv_head_map=kv_head_map)
    return acc.compute()
