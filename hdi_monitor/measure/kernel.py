"""Kernel statistics of a measured step: `KernelStatsAccumulator` and `KernelStatsCapture`.

The math (entropy, uniform level, largest logit of one attention call) is in
`hdi_monitor.functional.kernel`; what each watched layer feeds its kernel is read by
`hdi_monitor.models.kernel_capture.KernelCapture`. This module keeps one layer's sums (declared
`hdi_monitor.measure.accumulators.Accumulator` states: the entropy and uniform-level sums and the
query counts add, the largest logit is a running maximum) and routes captured calls into them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor._validation import check_choice, check_instance, check_int
from hdi_monitor.functional.kernel import (
    DEFAULT_CHUNK_BYTES,
    ComputeDtype,
    KernelStatsResult,
    check_kernel_call,
    kernel_dtype,
    kernel_results,
    kernel_sums,
    subsample_queries,
)
from hdi_monitor.measure.accumulators import Accumulator, StateSpec
from hdi_monitor.models.base import AttentionLayer, ErrorHandler, TraceSignal
from hdi_monitor.models.kernel_capture import KernelCall, KernelCapture

__all__ = ["ComputeDtype", "KernelStatsAccumulator", "KernelStatsCapture", "compute_kernel_results"]

_F64 = torch.float64


class KernelStatsAccumulator(Accumulator):
    """Mergeable sums for one attention layer's kernel statistics.

    The state is four ``(H,)`` tensors on one device: float64 sums of the entropies and of the
    uniform levels, int64 query counts, and the float64 running maximum of the logits. States
    combine exactly (`merge`, `hdi_monitor.measure.accumulators.sync_accumulators`): several
    micro-batches, calls or ranks.

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

    STATE_NAMES = ("entropy_sum", "uniform_sum", "num_queries", "max_logit")

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
        super().__init__(device)
        self.num_heads = check_int("num_heads", num_heads)
        self.max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens)
        check_instance("generator", generator, torch.Generator, optional=True)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.chunk_bytes = check_int("chunk_bytes", chunk_bytes)
        self.compute_dtype: ComputeDtype = check_choice("compute_dtype", compute_dtype, ComputeDtype)

    def _specs(self) -> dict[str, StateSpec]:
        h = (self.num_heads,)
        return {
            "entropy_sum": StateSpec(h, _F64, "sum"),
            "uniform_sum": StateSpec(h, _F64, "sum"),
            "num_queries": StateSpec(h, torch.int64, "sum"),
            "max_logit": StateSpec(h, _F64, "max", fill=-math.inf),
        }

    def _compatible(self) -> tuple[Any, ...]:
        return (self.num_heads,)

    def _compatible_dict(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads}

    def _describe(self) -> str:
        return f"{self.num_heads} heads"

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
        """Add one attention call's queries (see `hdi_monitor.functional.kernel.kernel_sums`).

        Args:
            q: ``(B, H, T, d)`` queries as the kernel receives them (after rotary embeddings, q-norm).
            k: ``(B, H_k, S, d)`` keys, ``H_k`` dividing ``H`` (or any ``H_k`` with ``kv_head_map``).
            scale: logit scale; default ``1 / sqrt(d)`` (SDPA's default).
            mask: the layer's own mask, broadcastable to ``(B, H, T, S)``.
            is_causal: the kernel's causal flag (key ``s`` allowed for query ``t`` when ``s <= t``).
            query_keep: None or a bool tensor broadcastable to ``(B, T)``; False queries (padding)
                are never measured.
            kv_head_map: ``(H,)`` key head of each query head; default ``h // (H / H_k)``.

        No host synchronisation; with ``max_tokens`` one ``randperm`` is drawn from the
        accumulator's generator (when the batch holds more than ``max_tokens`` queries).
        """
        self._check_open()
        keep, kv_map = check_kernel_call(q, k, mask=mask, query_keep=query_keep, kv_head_map=kv_head_map)
        if q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads, this accumulator measures {self.num_heads}")
        states = self._allocate(q.device)
        keep, slots = subsample_queries(keep, self.max_tokens, self.generator)
        ent, ref, count, top = kernel_sums(
            q, k, keep, slots=slots, scale=scale, mask=mask, is_causal=is_causal, kv_map=kv_map,
            dtype=kernel_dtype(q, k, self.compute_dtype), chunk_bytes=self.chunk_bytes,
        )  # fmt: skip
        dev = states["entropy_sum"].device
        states["entropy_sum"].add_(ent.to(dev))
        states["uniform_sum"].add_(ref.to(dev))
        states["num_queries"].add_(count.to(dev))
        torch.maximum(states["max_logit"], top.to(dev), out=states["max_logit"])

    def compute(self) -> KernelStatsResult:
        """The per-head statistics over every query so far (one device-to-host transfer).

        Heads without a measured query have NaN statistics and ``num_queries == 0``.
        """
        return compute_kernel_results([self])[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_heads={self.num_heads}, max_tokens={self.max_tokens}, device={self.device})"


def compute_kernel_results(accumulators: Sequence[KernelStatsAccumulator]) -> list[KernelStatsResult]:
    """Results of many accumulators (e.g. every layer) with one host transfer per device.

    An accumulator that never saw a query gives all-NaN statistics with zero counts (it is left
    as it is).
    """
    sums = []
    for acc in accumulators:
        check_instance("accumulator", acc, KernelStatsAccumulator)
        if acc.allocated:
            st = acc.states()
            sums.append((st["entropy_sum"], st["uniform_sum"], st["num_queries"], st["max_logit"]))
        else:
            h = acc.num_heads
            zeros = torch.zeros(h, dtype=_F64)
            sums.append((zeros, zeros, torch.zeros(h, dtype=torch.int64), torch.full((h,), -math.inf, dtype=_F64)))
    return kernel_results(sums)


class KernelStatsCapture:
    """Kernel statistics of the watched layers over every forward pass run while the block is active.

    A `KernelCapture` whose calls go into one `KernelStatsAccumulator` per layer.

    Args:
        layers: `AttentionLayer` objects or ``{name: module}``.
        max_tokens: at most this many queries per kernel call (None: all).
        generator: private generator for the query subsample (None: a CPU generator seeded with 0;
            never the global one).
        query_mask: optional ``(B, T)`` bool mask of real query tokens (the batch's padding mask),
            or a callable ``layer name -> mask or None`` asked at each call (each layer's own mask,
            each call's own: `hdi_monitor.models.hooks.CallMasks.query_mask`); applied to calls whose
            queries are ``(B, ·, T, ·)``. Change it between batches with `set_query_mask`.
        on_error, signal: as for `KernelCapture`.

    Example:
        ```python
        with KernelStatsCapture(layers, max_tokens=256, query_mask=batch["attention_mask"].bool()) as cap:
            model(**batch)
        results = cap.results()   # {layer name: KernelStatsResult}
        cap.unreachable           # [(layer name, reason)]
        ```
    """

    def __init__(
        self,
        layers: Sequence[AttentionLayer] | Mapping[str, nn.Module],
        *,
        max_tokens: int | None = None,
        generator: torch.Generator | None = None,
        query_mask: Tensor | Callable[[str], Tensor | None] | None = None,
        on_error: ErrorHandler | None = None,
        signal: TraceSignal | None = None,
    ) -> None:
        self.max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens)
        check_instance("generator", generator, torch.Generator, optional=True)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.accumulators: dict[str, KernelStatsAccumulator] = {}
        self.set_query_mask(query_mask)
        self._capture = KernelCapture(layers, self._on_call, on_error=on_error, signal=signal)

    def set_query_mask(self, query_mask: Tensor | Callable[[str], Tensor | None] | None) -> None:
        """Use ``query_mask`` for the following calls: a ``(B, T)`` bool tensor (True = real token) for
        every layer, a callable ``layer name -> (B, T) bool tensor or None`` asked at each call, or None."""
        if isinstance(query_mask, Tensor):
            if query_mask.dtype != torch.bool:
                raise TypeError("query_mask must be a bool tensor (True = real token), a callable or None")
        elif query_mask is not None and not callable(query_mask):
            raise TypeError("query_mask must be a bool tensor (True = real token), a callable or None")
        self.query_mask = query_mask

    def _on_call(self, call: KernelCall) -> None:
        b, h, t, _ = call.q.shape
        acc = self.accumulators.get(call.layer)
        if acc is None:
            acc = self.accumulators[call.layer] = KernelStatsAccumulator(
                h, max_tokens=self.max_tokens, generator=self.generator
            )
        keep = self.query_mask(call.layer) if callable(self.query_mask) else self.query_mask
        if keep is not None and tuple(keep.shape) != (b, t):
            keep = None
        if call.query_keep is not None:
            keep = call.query_keep if keep is None else keep & call.query_keep
        acc.update(
            call.q,
            call.k,
            scale=call.scale,
            mask=call.mask,
            is_causal=call.is_causal,
            query_keep=keep,
            kv_head_map=call.kv_head_map,
        )

    @property
    def unreachable(self) -> list[tuple[str, str]]:
        """See `KernelCapture.unreachable`."""
        return self._capture.unreachable

    def results(self) -> dict[str, KernelStatsResult]:
        """``{layer: KernelStatsResult}`` for the layers measured so far (one host transfer per device)."""
        names = list(self.accumulators)
        return dict(zip(names, compute_kernel_results([self.accumulators[n] for n in names]), strict=True))

    def __enter__(self) -> KernelStatsCapture:
        self._capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._capture.__exit__(*exc)
