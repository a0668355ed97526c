"""Head outputs of torch.compile'd models without touching the compiled graph.

Hooks present when Dynamo traces a module are traced into its graph (extra graphs and graph
breaks for the rest of the run); hooks added later are not seen at all. So the monitor never
hooks a compiled forward. Instead, each compiled unit of the model (a ``torch.compile(m)``
wrapper, an ``m.compile()``'d module) gets, on measured steps only, an eager interception of
its call: the call's arguments are taken, and before the compiled call runs, a **side forward**
of the unit's original (uncompiled) module runs on them under ``no_grad``, in eval mode (no
dropout; each module's flag restored after), inside ``torch.random.fork_rng`` (no generator
moves), with the head-output hooks attached only for that side forward. Then the compiled call
runs untouched: same graph, no break, no recompilation, bit-identical training.

Cost: one extra forward (no backward) of each compiled unit per measured micro-batch.

How each kind is intercepted:

* ``torch.compile(m)`` (an ``OptimizedModule``, at the root or as a submodule): a forward
  pre-hook on the wrapper, which runs eagerly before the compiled call.
* ``m.compile()`` (in place): the module's ``_compiled_call_impl`` is wrapped for the measured
  step only (the wrapper runs eagerly; the compiled function itself is the same object).

* a model compiled *outside* the tracker's view (the Hugging Face Trainer / accelerate call
  ``torch.compile(model)`` and hand callbacks the uncompiled ``model``): the integration names the
  wrapper the model is called through with `called_through`, and `compiled_units(model)` then
  reports one ``"wrapper"`` unit at the root whose original is ``model`` itself (so a side forward
  never runs through a DDP wrapper between the two). The tracker needs no other change.

A LightningModule compiled whole (``trainer.fit(torch.compile(module))``: Lightning compiles its
``forward`` and ``training_step``) has no eager call boundary around its forward; it is reported
by `compiled_units` as not interceptable, and the tracker measures it from weights only, with a
warning.

A compile region **around** the watched model that the monitor cannot see (``torch.compile(model)``
made after the monitor got ``model``, a compiled function or train step calling it,
``torch.compile(DDP(model))``) is found when Dynamo traces one of the monitor's hooks: every hook
does nothing inside a trace and tells the measured step (`hdi_monitor.models.base.TraceSignal`),
which takes all its hooks off at trace time and has Dynamo trace again without them, so the graph
is the one of the run without the monitor. From then on the training forward is not hooked (the
weights are still measured) and `compiled_outside_message` is said once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from hdi_monitor.models.base import TraceSignal, traced
from hdi_monitor.models.hooks import eval_mode

__all__ = [
    "CompiledUnit",
    "called_through",
    "capture_side_forward",
    "compiled_outside_message",
    "compiled_units",
    "intercept",
    "never_fired_message",
    "side_forward",
]

_PASS_THE_WRAPPER = (
    "give the monitor the compiled module that you call, HDITracker(torch.compile(model)) (for DDP: "
    "compiled = torch.compile(DDP(model)); HDITracker(compiled)), or in a LightningModule keep the compiled "
    "network as a submodule (self.net = torch.compile(self.net)): the monitor then measures it with an eager "
    "side forward and leaves its graph alone. A compiled function that calls the model cannot be measured: "
    "compile the model instead of the function"
)


def compiled_outside_message(step: int, kernel_stats: bool) -> str:
    """What a measured step says once when Dynamo traced the monitor's hooks: the model runs inside a
    torch.compile region the monitor was not given (see the module docstring)."""
    what = "activation statistics (covariance, effective heads)" + (" and kernel statistics" if kernel_stats else "")
    return (
        f"hdi-monitor: at step {step} the watched model ran inside a torch.compile region that the monitor was "
        "not given (torch.compile(model) made after the monitor got the model, model.forward = "
        "torch.compile(model.forward), a compiled function or train step calling the model, or "
        "torch.compile(DDP(model))), and Dynamo was tracing the monitor's hooks into your training graph. They "
        "were taken off before the graph was made, so the graph and the training are those of a run without "
        f"the monitor, and the training forward is no longer hooked: {what} are not measured from now on; the "
        f"weight-based HDI is. To measure them, {_PASS_THE_WRAPPER}. (Said once.)"
    )


def never_fired_message(step: int, what: str) -> str:
    """What a measured step says once when no watched layer ran while its capture was on (``what``:
    the statistics it has none of)."""
    return (
        f"hdi-monitor: at step {step} no watched layer ran while the capture was on, so this step has no "
        f"{what}. Either the model was not called while the capture was on (inside tracker.capture(), between "
        "begin() and stop_capture(), in the training step of a callback), or it runs inside a torch.compile "
        "region that the monitor was not given and that was compiled before this step (its graph never calls "
        f"the monitor's hooks). Call the model while the capture is on; for a compiled model, {_PASS_THE_WRAPPER}. "
        "(Said once.)"
    )


# model -> the compiled wrapper it is called through, for wrappers made outside the model (see
# `called_through`); weak keys: a model that is gone takes its entry with it
_OUTER: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


@dataclass
class CompiledUnit:
    """A compiled part of the model.

    Attributes:
        path: its qualified name in the model (``""`` for the root).
        module: the module the model calls (the wrapper for ``torch.compile(m)``).
        original: the uncompiled module whose forward the side forward runs.
        kind: ``"wrapper"`` (``torch.compile(m)``), ``"inplace"`` (``m.compile()``) or
            ``"lightning"`` (a whole LightningModule compiled by Lightning: not interceptable).
    """

    path: str
    module: nn.Module
    original: nn.Module
    kind: str

    @property
    def interceptable(self) -> bool:
        return self.kind != "lightning"

    def contains(self, path: str) -> bool:
        """True if the module at qualified name ``path`` lies inside this unit."""
        return self.path == "" or path == self.path or path.startswith(self.path + ".")


def compiled_units(model: nn.Module) -> list[CompiledUnit]:
    """The outermost compiled units of ``model`` (a unit inside another is run by the outer one's
    side forward)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without Dynamo
        return []
    outer = _OUTER.get(model)
    if outer is not None:
        return [CompiledUnit("", outer, model, "wrapper")]
    units: list[CompiledUnit] = []
    if getattr(model, "_compiler_ctx", None):
        return [CompiledUnit("", model, model, "lightning")]
    for path, module in model.named_modules():
        if any(u.contains(path) for u in units):
            continue
        if isinstance(module, OptimizedModule):
            units.append(CompiledUnit(path, module, module._orig_mod, "wrapper"))
        elif getattr(module, "_compiled_call_impl", None) is not None:
            units.append(CompiledUnit(path, module, module, "inplace"))
    return units


class _Forget:
    """The handle of `called_through`: ``remove()`` drops the entry (idempotent)."""

    def __init__(self, model: nn.Module) -> None:
        self.model: weakref.ref[nn.Module] = weakref.ref(model)

    def remove(self) -> None:
        model = self.model()
        if model is not None:
            _OUTER.pop(model, None)


def called_through(model: nn.Module, wrapper: nn.Module) -> _Forget:
    """Declare that ``model`` is called through ``wrapper``, a ``torch.compile`` wrapper made
    outside it (``wrapper`` contains ``model``, possibly under a DDP wrapper). Until the returned
    handle's ``remove()``, `compiled_units(model)` reports ``wrapper`` as one unit at the root whose
    side forward calls ``model`` eagerly.

    Raises:
        TypeError: ``wrapper`` is not a ``torch.compile`` wrapper (``OptimizedModule``).
        ValueError: ``model`` is not inside ``wrapper``.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(wrapper, OptimizedModule):
        raise TypeError(f"wrapper must be a torch.compile wrapper (OptimizedModule), got {type(wrapper).__name__}")
    if not any(m is model for m in wrapper.modules()):
        raise ValueError(f"{type(model).__name__} is not inside the compiled wrapper it is said to be called through")
    _OUTER[model] = wrapper
    return _Forget(model)


def _cuda_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


def _is_cache(value: Any) -> bool:
    """A key/value cache that a forward appends to (transformers' ``Cache`` classes, duck-typed)."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def side_forward(
    unit: CompiledUnit,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    attach: Callable[[], list[Any]] | None = None,
) -> None:
    """Run the unit's original module eagerly on ``args``/``kwargs``: no grad, eval mode, every
    random generator restored afterwards. ``attach()`` puts hooks on once the module is in eval
    mode (a hook that looks at the module's mode sees the mode of the call) and returns their
    handles, removed after the forward.

    A key/value cache passed in (a transformers decoder layer compiled on its own receives the
    model's cache) is left out of the side forward, so the side forward never appends to the cache
    that the compiled call then reads; in training the layer's slot is empty before its call, so the
    attention is the same.
    """
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
    with (
        torch.no_grad(),
        torch.random.fork_rng(devices=_cuda_devices(unit.original)),
        eval_mode(unit.original),
    ):
        handles = attach() if attach is not None else []
        try:
            if unit.kind == "inplace":
                unit.original._call_impl(*args, **kwargs)  # the eager call, not _compiled_call_impl
            else:
                unit.original(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()


def capture_side_forward(
    unit: CompiledUnit,
    attach: Callable[[Any], list[Any]],
    batch: Any,
    on_error: Callable[[Exception], None],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    dropped: Callable[[], bool] | None = None,
) -> None:
    """The ``on_call`` of `intercept` on a measured step: in the side forward (eval mode, no grad),
    ``attach(source)`` puts the capture's hooks on (``source``: the call's keyword arguments, where
    a mask passed as a keyword is found, else the step's ``batch``), the unit's original module
    runs, the hooks come off. Nothing runs once ``dropped()`` is true (an earlier hook failed: the
    measurement is skipped). An error goes to ``on_error``, never into the training forward."""
    if dropped is not None and dropped():
        return
    try:
        side_forward(unit, args, kwargs, attach=partial(attach, kwargs if kwargs else batch))
    except Exception as err:  # noqa: BLE001 - never into the training forward
        on_error(err)


class _Restore:
    """A handle whose ``remove()`` puts an in-place compiled module's call back."""

    def __init__(self, module: nn.Module, compiled: Any) -> None:
        self.module, self.compiled = module, compiled

    def remove(self) -> None:
        if self.module is not None:
            self.module._compiled_call_impl = self.compiled
            self.module = None  # type: ignore[assignment]


def intercept(
    unit: CompiledUnit,
    on_call: Callable[[tuple[Any, ...], dict[str, Any]], None],
    signal: TraceSignal | None = None,
) -> Any:
    """Until the returned handle's ``remove()``, ``on_call(args, kwargs)`` runs eagerly before
    each call of the unit (then the compiled call runs as usual). Where the unit itself is called
    inside a Dynamo trace (a compiled function calling the model), the interception does nothing
    and tells ``signal`` (see `hdi_monitor.models.base.TraceSignal`)."""
    if unit.kind == "wrapper":

        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if traced(signal):
                return
            on_call(args, kwargs)

        return unit.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if unit.kind != "inplace":
        raise ValueError(f"{unit.path or '<root>'}: a {unit.kind} compiled unit cannot be intercepted")
    compiled: Callable[..., Any] = unit.module._compiled_call_impl  # type: ignore[assignment]

    def call(*args: Any, **kwargs: Any) -> Any:
        if not traced(signal):
            on_call(args, kwargs)
        return compiled(*args, **kwargs)

    unit.module._compiled_call_impl = call
    return _Restore(unit.module, compiled)
