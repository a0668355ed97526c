"""Capture for one measured forward pass: head outputs into covariance accumulators, kernel calls
into kernel accumulators, and how often each layer ran.

Family knowledge stays in the adapters: each `AttentionLayer` knows how to deliver its
concatenated head outputs ``o`` and a keep-mask (`AttentionLayer.attach_output_hook`); this module
only routes them, adding each call's token mask (`hdi_monitor.models.hooks.CallMasks`: the mask
the call received, else the batch's ``batch[mask_key]``) where its shape matches the hooked
tokens (a mask that does not fit is not applied, and said once per layer).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.measure.covariance import HeadCovarianceAccumulator
from hdi_monitor.measure.kernel import KernelStatsCapture
from hdi_monitor.models import AttentionLayer
from hdi_monitor.models.base import TraceSignal, traced
from hdi_monitor.models.hooks import CallMasks

__all__ = [
    "CallCounts",
    "attach_capture",
    "attach_output_hooks",
    "mask_mismatch_message",
    "output_accumulator",
]


#: Layers already warned about a mask that does not fit their tokens (once per layer object).
_MASK_WARNED: weakref.WeakSet[AttentionLayer] = weakref.WeakSet()


def mask_mismatch_message(layer: str, key: str, mask_shape: tuple[int, ...], token_shape: tuple[int, ...]) -> str:
    """What `attach_output_hooks` says when ``batch[key]`` does not fit a layer's hooked tokens."""
    return (
        f"hdi-monitor: {layer}: the batch's token mask {key!r} has shape {mask_shape} but the layer's head "
        f"outputs cover tokens of shape {token_shape} (the model may prepend tokens, or the mask belongs to "
        "another tower or sub-model). The mask is not applied to this layer: its activation statistics count "
        "every one of its tokens, padding included. Give the layer its own mask with "
        "AttentionSpec(mask_key=...), or mask_key=None to silence this. (Said once per layer.)"
    )


class CallCounts:
    """How often each layer's attention module and its head-output hook ran while attached.

    A layer whose module ran but whose hook never did calls its output projection's weight directly
    (``F.linear(x, self.out_proj.weight)``) or not at all: its statistics are missing for a reason
    the caller should name (see `silent_layers`).
    """

    def __init__(self) -> None:
        self.module_calls: dict[str, int] = {}
        self.output_calls: dict[str, int] = {}

    def silent_layers(self) -> list[str]:
        """Layers whose module ran while their head-output hook never fired."""
        return [n for n, c in self.module_calls.items() if c > 0 and self.output_calls.get(n, 0) == 0]


def _with_mask(mask: Tensor | None, layer: AttentionLayer, o: Tensor, keep: Tensor | None) -> Tensor | None:
    """``keep`` and the batch's token mask, where the mask fits the hooked tokens (else said once)."""
    if mask is None:
        return keep
    if tuple(mask.shape) == tuple(o.shape[:-1]):
        mask = mask.to(device=o.device, dtype=torch.bool)
        return mask if keep is None else keep & mask
    if layer not in _MASK_WARNED:
        _MASK_WARNED.add(layer)
        warnings.warn(
            mask_mismatch_message(layer.name, str(layer.mask_key), tuple(mask.shape), tuple(o.shape[:-1])),
            MonitoringWarning,
            stacklevel=3,
        )
    return keep


def _on_output(
    acc: HeadCovarianceAccumulator,
    masks: CallMasks | None,
    layer: AttentionLayer,
    counts: CallCounts | None,
    o: Tensor,
    keep: Tensor | None,
) -> None:
    if counts is not None:
        counts.output_calls[layer.name] = counts.output_calls.get(layer.name, 0) + 1
    mask = None if masks is None else masks.mask(layer)
    acc.update(o.detach(), _with_mask(mask, layer, o, keep))


def _select_tokens(
    acc: HeadCovarianceAccumulator, masks: CallMasks, layer: AttentionLayer, o: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Under tensor parallelism, before the gather: the rows of this rank's share that ``acc`` would
    use (the batch mask, then its token budget drawn from its generator: the same draw on every TP
    rank, which all see the same tokens), as at most ``max_tokens`` rows and their keep flags, so
    that the gather moves at most ``max_tokens`` tokens of every head. The chosen rows come first;
    rows that pad a short selection are flagged False. No host sync (the row count is fixed)."""
    keep = _with_mask(masks.mask(layer), layer, o, None)
    flat = o.reshape(-1, o.shape[-1])
    n = flat.shape[0]
    chosen, cap = acc.select_tokens(None if keep is None else keep.reshape(-1), n)
    if chosen is None or cap >= n:
        return flat, chosen
    rows = torch.topk(chosen.to(torch.float32), cap, sorted=False).indices
    return flat[rows], chosen[rows]


def _count_module_call(signal: TraceSignal | None, counts: CallCounts, name: str, *_: Any) -> None:
    if traced(signal):
        return
    counts.module_calls[name] = counts.module_calls.get(name, 0) + 1


def attach_output_hooks(
    layers: Sequence[AttentionLayer],
    accumulators: Sequence[HeadCovarianceAccumulator | None],
    batch: Any = None,
    on_error: Callable[[Exception], None] | None = None,
    counts: CallCounts | None = None,
    masks: CallMasks | None = None,
    signal: TraceSignal | None = None,
) -> list[Any]:
    """Feed every layer's head outputs into its accumulator; returns handles to ``.remove()``.

    Each call's tokens are masked with that call's token mask (`CallMasks`: the mask the call
    received, else ``batch[layer.mask_key]``). A mask whose shape is not the shape of the layer's
    hooked tokens is not applied, and a `MonitoringWarning` says so once per layer, naming both
    shapes. With ``on_error``, an exception inside a hook goes to ``on_error(err)`` instead of the
    forward pass. With ``counts``, the calls of each layer's module and of its head-output hook are
    counted there (a counting forward pre-hook on the attention module, removed with the others).
    ``masks``: a `CallMasks` whose hooks the caller attaches (`attach_capture` shares one with the
    kernel statistics); None: one for ``layers`` and ``batch``, attached here. Inside a Dynamo
    trace every hook does nothing and tells ``signal`` (`hdi_monitor.models.base.TraceSignal`).
    """
    handles: list[Any] = []
    try:
        if masks is None:
            masks = CallMasks([la for la, acc in zip(layers, accumulators, strict=True) if acc is not None], batch)
            handles += masks.hooks(on_error, signal)
        for layer, acc in zip(layers, accumulators, strict=True):
            if acc is not None:
                if getattr(layer, "tensor_parallel", None) is not None:
                    # the call's mask and the subsample are applied to this rank's share, before the gather
                    select = partial(_select_tokens, acc, masks, layer)
                    fn = partial(_on_output, acc, None, layer, counts)
                    handles.append(layer.attach_output_hook(fn, on_error=on_error, select=select, signal=signal))
                else:
                    fn = partial(_on_output, acc, masks, layer, counts)
                    handles.append(layer.attach_output_hook(fn, on_error=on_error, signal=signal))
                if counts is not None:
                    counts.module_calls.setdefault(layer.name, 0)
                    counter = partial(_count_module_call, signal, counts, layer.name)
                    handles.append(layer.module.register_forward_pre_hook(counter))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


class _Entered:
    """Keeps a `KernelStatsCapture` entered until ``remove()`` (the hook-handle protocol)."""

    def __init__(self, capture: KernelStatsCapture) -> None:
        self.capture: KernelStatsCapture | None = capture
        capture.__enter__()

    def remove(self) -> None:
        capture, self.capture = self.capture, None
        if capture is not None:
            capture.__exit__(None, None, None)


def attach_capture(
    layers: Sequence[AttentionLayer],
    accumulators: Sequence[HeadCovarianceAccumulator | None],
    batch: Any = None,
    kernel: KernelStatsCapture | None = None,
    on_error: Callable[[Exception], None] | None = None,
    counts: CallCounts | None = None,
    signal: TraceSignal | None = None,
) -> list[Any]:
    """Everything one measured forward pass captures: the head-output hooks of `attach_output_hooks`
    and, with ``kernel``, that kernel-statistics capture entered with each layer's query mask: the
    same `CallMasks` as the head outputs (each call's own mask, each sub-model's own key). Returns
    handles to ``.remove()``; on an error, those already attached are removed. Inside a Dynamo
    trace every hook does nothing and tells ``signal`` (the kernel capture tells its own)."""
    masks = CallMasks(layers, batch)
    handles = masks.hooks(on_error, signal)
    try:
        handles += attach_output_hooks(
            layers, accumulators, batch, on_error=on_error, counts=counts, masks=masks, signal=signal
        )
        if kernel is not None:
            kernel.set_query_mask(masks.query_mask)
            handles.append(_Entered(kernel))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def output_accumulator(layer: AttentionLayer, *, calls: int = 1, **kwargs: Any) -> HeadCovarianceAccumulator:
    """A covariance accumulator for ``layer`` that reads the layer's own ``W_O`` in every update
    (inside the forward pass: the weights that produced the head outputs); ``kwargs`` go to
    `HeadCovarianceAccumulator`, except ``max_tokens``, which caps the tokens of all updates
    together (``total_tokens``): a layer called several times per forward pass (ALBERT) or over
    several micro-batches takes at most ``max_tokens`` tokens per accumulator (per measured step).
    With ``calls`` > 1 (the number of updates expected, e.g. counted at the previous measured
    step), each update keeps at most ``ceil(max_tokens / calls)`` of them, so that the budget is
    shared between the calls instead of being filled by the first."""
    if "max_tokens" in kwargs:  # a cap per layer for the accumulator's whole life (a measured step)
        total = kwargs.pop("max_tokens")
        kwargs["total_tokens"] = total
        if total is not None and calls > 1:
            kwargs["max_tokens"] = -(-total // calls)  # each call's share
    return HeadCovarianceAccumulator(
        layer.num_heads,
        layer.head_dim,
        w_out=partial(layer.head_weights, "output"),
        model_dim=layer.model_dim,
        **kwargs,
    )
