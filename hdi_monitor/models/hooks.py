"""Capture head outputs of attention layers into covariance accumulators.

Shared by `hdi_monitor.head_diversity` (one-shot, ``inputs=``) and
`hdi_monitor.HDITracker` (during training). Family knowledge stays in the adapters: each
`AttentionLayer` knows how to deliver its concatenated head outputs
``o`` and a keep-mask; this module only routes them, adding each call's token mask (`CallMasks`):
the mask the call itself received (the ``mask_key`` argument of the outermost running module above
the layer that takes one: each sub-model's own, each of several calls its own), else the batch's
``batch[mask_key]``, applied where its shape matches the hooked tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.functional.covariance import HeadCovarianceAccumulator
from hdi_monitor.models import AttentionLayer
from hdi_monitor.models.kernel_capture import KernelStatsCapture

__all__ = [
    "CallCounts",
    "CallMasks",
    "attach_capture",
    "attach_output_hooks",
    "batch_mask",
    "call_model",
    "eval_mode",
    "iter_batches",
    "mask_mismatch_message",
    "output_accumulator",
]


def batch_mask(batch: Any, key: str | None) -> Tensor | None:
    """The token mask ``batch[key]`` when the batch is a mapping holding a tensor there."""
    if key is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    return mask if isinstance(mask, Tensor) else None


#: Layers already warned about a mask that does not fit their tokens (once per layer object).
_MASK_WARNED: weakref.WeakSet[AttentionLayer] = weakref.WeakSet()
#: Layers already warned about a batch mask that cannot be tied to each call (once per layer object).
_UNTIED_WARNED: weakref.WeakSet[AttentionLayer] = weakref.WeakSet()

_NO_ARG = object()  # a call that does not pass the argument and whose forward gives it no default


@dataclass(frozen=True)
class _Arg:
    """Where a ``forward`` takes one argument: its position (None: keyword-only) and its default."""

    index: int | None
    default: Any

    def read(self, args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        return self.default


def _takes(module: nn.Module, name: str) -> _Arg | None:
    """How ``module.forward`` takes an argument called ``name`` (not through ``**kwargs``), or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for p in params:
        if p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            default = None if p.default is p.empty else p.default
            index = positional.index(p) if p.kind == p.POSITIONAL_OR_KEYWORD else None
            return _Arg(index, default)
    return None


@dataclass
class _Call:
    """One running call of a mask source: the module and the values of the mask arguments it took."""

    module: nn.Module
    values: dict[str, Any]


def untied_mask_message(layer: str, key: str, calls: int) -> str:
    """What `CallMasks` says when the batch's mask is applied to a model that ran more than once."""
    return (
        f"hdi-monitor: {layer}: the model ran {calls} calls in this measured step and no module above the layer "
        f"takes the token mask as an argument named {key!r}, so the batch's {key!r} cannot be tied to each call: "
        "it is applied to every call whose tokens have its shape (a call with other inputs, a dual encoder's "
        "documents say, is then counted with the first batch's padding). Pass each call its mask as an argument "
        f"named {key!r}, or name the argument your model takes with AttentionSpec(mask_key=...). "
        "(Said once per layer.)"
    )


class CallMasks:
    """The ``(B, T)`` token mask of each watched layer's call, read while the call runs.

    For a layer with a ``mask_key``, the mask of a call is, in this order:

    1. the value of the ``mask_key`` argument of the **outermost running** module above the layer whose
       ``forward`` takes an argument of that name (`AttentionLayer.ancestors`; a Hugging Face model's
       ``attention_mask``, the ``decoder_attention_mask`` of an encoder-decoder model for its decoder
       layers): the mask the call itself received, so each sub-model and each of several calls of one
       model (a dual encoder's queries and documents) has its own. A call that passes none (None) has no
       padding: all its tokens are real;
    2. where no such module is running, the batch's ``batch[mask_key]`` (`batch_mask`). If the model
       (the outermost ancestor) ran more than once while attached, that mask cannot be tied to each
       call: it is applied to every call it fits, and a `MonitoringWarning` names the layer, once.

    `hooks` puts a forward pre-hook and an always-called forward hook on each module in (1) and on
    the model; they read arguments only (no tensor op), and do nothing while Dynamo traces.

    Args:
        layers: the layers measured with these masks.
        batch: the step's batch (a mapping holding ``mask_key`` tensors), or anything else.
    """

    def __init__(self, layers: Sequence[AttentionLayer], batch: Any) -> None:
        self.batch = batch
        self._local = threading.local()
        self._layers = {layer.name: layer for layer in layers}
        self._watch: dict[int, tuple[nn.Module, dict[str, _Arg]]] = {}  # id -> (module, {key: where})
        self._sources: dict[str, frozenset[int]] = {}  # layer name -> ids of its mask sources
        self._root: dict[str, int] = {}  # layer name -> id of its model
        self._calls: dict[int, int] = {}
        self._on_error: Callable[[Exception], None] | None = None
        for layer in layers:
            key = layer.mask_key
            if key is None or not layer.ancestors:
                continue
            ids = set()
            for module in layer.ancestors:
                where = _takes(module, key)
                if where is not None:
                    self._watch.setdefault(id(module), (module, {}))[1][key] = where
                    ids.add(id(module))
            self._sources[layer.name] = frozenset(ids)
            root = layer.ancestors[0]
            self._watch.setdefault(id(root), (root, {}))
            self._root[layer.name] = id(root)

    def _stack(self) -> list[_Call]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def hooks(self, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Attach the hooks that follow the running calls; returns their handles (``.remove()``).
        With ``on_error``, an exception inside them goes there instead of into the forward pass."""
        self._on_error = on_error
        handles: list[Any] = []
        try:
            for module, args in self._watch.values():
                pre = partial(self._enter, args)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(self._leave, with_kwargs=True, always_call=True))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _failed(self, err: Exception) -> None:
        if self._on_error is None:
            raise err
        self._on_error(err)

    def _enter(self, where: dict[str, _Arg], module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            self._calls[id(module)] = self._calls.get(id(module), 0) + 1  # read for the models only
            values = {key: arg.read(args, kwargs, key) for key, arg in where.items()}
            self._stack().append(_Call(module, values))
        except Exception as err:  # noqa: BLE001 - monitoring must not break the forward pass
            self._failed(err)

    def _leave(self, module: nn.Module, *_: Any) -> None:
        # ``*_``: (args, kwargs, output), or (args, output) when the handle was removed while torch was
        # already running the module's forward hooks (a hook that stops the capture runs before this one)
        if torch.compiler.is_compiling():
            return
        try:
            stack = self._stack()
            if not any(call.module is module for call in stack):
                return  # attached while this call was running: its pre-hook never ran
            while stack:  # also unwinds calls an exception left behind
                if stack.pop().module is module:
                    break
        except Exception as err:  # noqa: BLE001 - monitoring must not break the forward pass
            self._failed(err)

    def mask(self, layer: AttentionLayer) -> Tensor | None:
        """The token mask of ``layer``'s running call (see the class docstring), or None."""
        key = layer.mask_key
        if key is None:
            return None
        sources = self._sources.get(layer.name, frozenset())
        for call in self._stack():  # outermost first
            if id(call.module) in sources:
                value = call.values.get(key, _NO_ARG)
                if value is None or isinstance(value, Tensor):
                    return value
        mask = batch_mask(self.batch, key)
        root = self._root.get(layer.name)
        calls = self._calls.get(root, 0) if root is not None else 0
        if mask is not None and calls > 1 and layer not in _UNTIED_WARNED:
            _UNTIED_WARNED.add(layer)
            warnings.warn(untied_mask_message(layer.name, key, calls), MonitoringWarning, stacklevel=2)
        return mask

    def query_mask(self, name: str) -> Tensor | None:
        """`mask` of the layer called ``name`` as a bool mask (True = real token), for the kernel
        statistics (`KernelStatsCapture.set_query_mask`)."""
        layer = self._layers.get(name)
        mask = None if layer is None else self.mask(layer)
        return None if mask is None else mask.to(torch.bool)


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


def _count_module_call(counts: CallCounts, name: str, *_: Any) -> None:
    counts.module_calls[name] = counts.module_calls.get(name, 0) + 1


def attach_output_hooks(
    layers: Sequence[AttentionLayer],
    accumulators: Sequence[HeadCovarianceAccumulator | None],
    batch: Any = None,
    on_error: Callable[[Exception], None] | None = None,
    counts: CallCounts | None = None,
    masks: CallMasks | None = None,
) -> list[Any]:
    """Feed every layer's head outputs into its accumulator; returns handles to ``.remove()``.

    Each call's tokens are masked with that call's token mask (`CallMasks`: the mask the call
    received, else ``batch[layer.mask_key]``). A mask whose shape is not the shape of the layer's
    hooked tokens is not applied, and a `MonitoringWarning` says so once per layer, naming both
    shapes. With ``on_error``, an exception inside a hook goes to ``on_error(err)`` instead of the
    forward pass. With ``counts``, the calls of each layer's module and of its head-output hook are
    counted there (a counting forward pre-hook on the attention module, removed with the others).
    ``masks``: a `CallMasks` whose hooks the caller attaches (`attach_capture` shares one with the
    kernel statistics); None: one for ``layers`` and ``batch``, attached here.
    """
    handles: list[Any] = []
    try:
        if masks is None:
            masks = CallMasks([la for la, acc in zip(layers, accumulators, strict=True) if acc is not None], batch)
            handles += masks.hooks(on_error)
        for layer, acc in zip(layers, accumulators, strict=True):
            if acc is not None:
                if getattr(layer, "tensor_parallel", None) is not None:
                    # the call's mask and the subsample are applied to this rank's share, before the gather
                    select = partial(_select_tokens, acc, masks, layer)
                    fn = partial(_on_output, acc, None, layer, counts)
                    handles.append(layer.attach_output_hook(fn, on_error=on_error, select=select))
                else:
                    fn = partial(_on_output, acc, masks, layer, counts)
                    handles.append(layer.attach_output_hook(fn, on_error=on_error))
                if counts is not None:
                    counts.module_calls.setdefault(layer.name, 0)
                    counter = partial(_count_module_call, counts, layer.name)
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
) -> list[Any]:
    """Everything one measured forward pass captures: the head-output hooks of `attach_output_hooks`
    and, with ``kernel``, that kernel-statistics capture entered with each layer's query mask: the
    same `CallMasks` as the head outputs (each call's own mask, each sub-model's own key). Returns
    handles to ``.remove()``; on an error, those already attached are removed."""
    masks = CallMasks(layers, batch)
    handles = masks.hooks(on_error)
    try:
        handles += attach_output_hooks(layers, accumulators, batch, on_error=on_error, counts=counts, masks=masks)
        if kernel is not None:
            kernel.set_query_mask(masks.query_mask)
            handles.append(_Entered(kernel))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run one batch: a mapping as ``model(**batch)``, a tuple/list as ``model(*batch)``, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def iter_batches(inputs: Any) -> Iterable[Any]:
    """``inputs`` as an iterable of batches: a tensor, mapping or tuple is one batch; a list of
    mappings/tensors/tuples, a DataLoader or any other iterable is many."""
    if isinstance(inputs, (Tensor, Mapping, tuple)):
        return [inputs]
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], (Tensor, Mapping, tuple, list)):
        return [inputs]
    if isinstance(inputs, Iterable):
        return inputs
    raise TypeError(
        f"inputs must be a batch (tensor, dict, tuple) or an iterable of batches, got {type(inputs).__name__}"
    )


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every module of ``model`` in eval mode (no dropout) and restore each one's flag after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


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
