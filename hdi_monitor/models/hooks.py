"""Running a model on batches: how a batch is called, iterated, put in eval mode, and where each
call's token mask is (`CallMasks`: the mask the call itself received, the ``mask_key`` argument
of the outermost running module above the layer that takes one, each sub-model's and each of
several calls' own; else the batch's ``batch[mask_key]``).

Shared by the measured step (`hdi_monitor.measure`), `hdi_monitor.head_diversity` and the
ablation tools. Routing head outputs into accumulators is the measured step's job
(`hdi_monitor.measure.capture`).
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
from hdi_monitor.models.base import AttentionLayer, TraceSignal, traced

__all__ = ["CallMasks", "batch_mask", "call_model", "eval_mode", "iter_batches", "untied_mask_message"]


def batch_mask(batch: Any, key: str | None) -> Tensor | None:
    """The token mask ``batch[key]`` when the batch is a mapping holding a tensor there."""
    if key is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    return mask if isinstance(mask, Tensor) else None


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
    the model; they read arguments only (no tensor op), and do nothing while Dynamo traces (they
    tell the ``signal`` given to `hooks`, see `hdi_monitor.models.base.TraceSignal`).

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
        self._signal: TraceSignal | None = None
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

    def hooks(
        self, on_error: Callable[[Exception], None] | None = None, signal: TraceSignal | None = None
    ) -> list[Any]:
        """Attach the hooks that follow the running calls; returns their handles (``.remove()``).
        With ``on_error``, an exception inside them goes there instead of into the forward pass;
        inside a Dynamo trace they do nothing and tell ``signal``."""
        self._on_error = on_error
        self._signal = signal
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
        if traced(self._signal):
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
        if traced(self._signal):
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
