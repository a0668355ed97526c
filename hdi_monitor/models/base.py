"""The attention-layer abstraction, the user spec and the adapter registry.

An `AttentionLayer` is one attention module found in a model. It knows the head counts,
how to read each head's weights as ``(heads, D_in, d)`` tensors and where to hook the concatenated
per-head outputs. Family adapters (one module each in this package) recognise modules by their class
and attribute structure and build layers; `AttentionSpec` lets a user describe any other
attention module in a few lines. Nothing outside ``hdi_monitor.models`` knows about model families.

Conventions (see the README, "Attention discovery"):

* ``head_weights("query" | "key" | "value")`` gives ``W_h`` in ``R^{D_in x d}`` with head ``h``'s
  projection ``x @ W_h (+ bias)``; the columns span what the head reads.
* ``head_weights("output")`` gives ``W_O,h`` in ``R^{D x d}`` with ``c_h = W_O,h o_h`` the head's
  contribution to the layer output (columns ``[h*d:(h+1)*d]`` of the out-projection weight).
* Key and value have ``num_kv_heads`` heads (fewer than ``num_heads`` under grouped-query attention);
  query head ``h`` uses key/value head ``layer.kv_head(h)``, ``h // (num_heads // num_kv_heads)``
  except for x-transformers (``h % num_kv_heads``).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor._validation import check_choice, check_int
from hdi_monitor.exceptions import AdapterMismatch
from hdi_monitor.models._parametrize import parametrization_buffers, preserved_parametrizations
from hdi_monitor.models.logits import LogitForm, QKNormGains
from hdi_monitor.models.tensor_parallel import full_weight

__all__ = [
    "PROJECTIONS",
    "KVMap",
    "Projection",
    "Adapter",
    "AdapterMismatch",
    "AttentionLayer",
    "SkippedModule",
    "HookHandle",
    "TraceSignal",
    "OutputHook",
    "WeightSource",
    "check_projection",
    "linear_sources",
    "register_adapter",
    "registered_adapters",
    "split_in_features",
    "split_out_features",
    "traced",
]

Projection = Literal["query", "key", "value", "output"]
PROJECTIONS: tuple[Projection, ...] = ("query", "key", "value", "output")

KVMap = Literal["block", "modulo"]
"""How query heads share key/value heads: ``h // (H / H_kv)`` (``"block"``) or ``h % H_kv`` (``"modulo"``)."""

OutputHook = Callable[[Tensor, "Tensor | None"], None]
"""``fn(o, keep_mask)``: ``o`` is ``(..., num_heads * head_dim)``, ``keep_mask`` None or bool."""

TokenSelect = Callable[[Tensor], "tuple[Tensor, Tensor | None]"]
"""``select(o) -> (rows, keep)``: the tokens of ``o`` (``(..., width)``) to use, as ``(n, width)``
rows and their bool flags (None: every row); under tensor parallelism it runs before the gather."""

ErrorHandler = Callable[[Exception], None]
"""``on_error(err)``: receives an exception raised inside an output hook instead of the forward pass."""


# ------------------------------------------------------------------------ hooks inside a Dynamo trace
#
# A hook of the monitor runs inside a Dynamo trace when the model is called through a torch.compile
# region the monitor does not know of (``torch.compile(model)`` made after the monitor got ``model``,
# ``model.forward = torch.compile(model.forward)``, a compiled train step, ``torch.compile(DDP(model))``).
# Whatever the hook did there would be compiled into the training graph: graph breaks, guards on
# the hooks (a recompilation each time they come and go), its Python side effects replayed on every
# call. So each hook of the monitor starts with ``if traced(signal): return``.

_SIGNALS: weakref.WeakValueDictionary[int, TraceSignal] = weakref.WeakValueDictionary()
_SIGNAL_KEYS = itertools.count(1)
_assume_constant = getattr(torch.compiler, "assume_constant_result", None)


class TraceSignal:
    """How the hooks of one owner (a measured step) tell it that Dynamo is tracing them.

    `traced` calls ``on_traced()`` **for real, at trace time**, through a function Dynamo runs
    while it traces instead of tracing it (``torch.compiler.assume_constant_result``): nothing of
    the call is left in the graph or replayed when the graph runs. The owner takes all its hooks
    off there (and puts back whatever it patched) and returns True; the signal then asks Dynamo to
    trace the frame again from its start (``torch._dynamo.exc.UnspecializeRestartAnalysis``, which
    Dynamo raises itself when a module changes under its trace; it restarts with an empty
    speculation log). The second trace sees the model as it is without the monitor: the same graph,
    the same guards, no recompilation later. ``on_traced()`` returning False lets the trace go on
    (the hook then does nothing in it): a hook that is itself the frame being compiled (a root
    module's hook, called by the eager ``Module.__call__`` inside the compiled wrapper) is traced
    again after a restart, and is compiled into a function that does nothing.

    Without ``assume_constant_result`` the hooks still do nothing inside a trace, but their owner
    is not told; without the restart exception, the owner takes its hooks off but the graph traced
    with them keeps guards on them (one recompilation when they are gone).

    Args:
        on_traced: see above; called once per trace of a hook holding this signal.
        on_error: receives an exception raised by ``on_traced`` instead of Dynamo's trace (None:
            the exception is dropped and the trace goes on).
    """

    def __init__(self, on_traced: Callable[[], bool], on_error: ErrorHandler | None = None) -> None:
        self.key = next(_SIGNAL_KEYS)  # what a hook passes to the trace-time call (a constant for Dynamo)
        self._on_traced: Callable[[], bool] | None = on_traced
        self._on_error = on_error
        _SIGNALS[self.key] = self

    def close(self) -> None:
        """Forget ``on_traced``: a later trace of a hook holding this signal tells no one."""
        self._on_traced = None
        _SIGNALS.pop(self.key, None)

    def _fire(self) -> bool:
        handler = self._on_traced
        if handler is None:
            return False
        try:
            return bool(handler())
        except Exception as err:  # noqa: BLE001 - never into Dynamo's trace (the training forward)
            if self._on_error is not None:
                self._on_error(err)
            return False


def _signal_traced(key: int) -> None:
    """Run by Dynamo at trace time (see `TraceSignal`), never traced and never left in a graph."""
    signal = _SIGNALS.get(key)
    if signal is None or not signal._fire():
        return
    import torch._dynamo.exc as dynamo_exc

    restart = getattr(dynamo_exc, "UnspecializeRestartAnalysis", None)
    if restart is not None:
        err = restart()
        err.restart_reason = "hdi-monitor took its hooks off the model"
        raise err


if _assume_constant is not None:
    _signal_traced = _assume_constant(_signal_traced)


def traced(signal: TraceSignal | None = None) -> bool:
    """True while Dynamo traces the calling hook, which must then return at once and do nothing;
    ``signal`` (see `TraceSignal`) is told first. False (at the cost of one check) in eager mode.

    Every hook and wrapper of the monitor starts with ``if traced(signal): return``."""
    if not torch.compiler.is_compiling():
        return False
    if signal is not None and _assume_constant is not None:
        _signal_traced(signal.key)
    return True


def guarded(
    pre_hook: Callable[..., None], on_error: ErrorHandler | None, signal: TraceSignal | None = None
) -> Callable[..., None]:
    """``pre_hook`` run with autocast off (measurements stay in float32/float64 under the caller's
    ``torch.autocast``), its exceptions passed to ``on_error`` (re-raised when ``on_error`` is None);
    inside a Dynamo trace it does nothing and tells ``signal`` (see `traced`)."""
    from hdi_monitor.functional._numerics import no_autocast

    def run(*args: Any, **kwargs: Any) -> None:
        if traced(signal):
            return
        try:
            with no_autocast():
                pre_hook(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - monitoring must not break the forward pass
            if on_error is None:
                raise
            on_error(err)

    return run


WeightSource = Callable[[], Tensor]
"""Returns one projection's weight in ``nn.Linear`` layout, gathered (not a DTensor shard).

For query/key/value: ``(heads * d, D_in)``; for output: ``(D, num_heads * d)``.
"""


@dataclass(frozen=True)
class SkippedModule:
    """An attention-like module that discovery found but does not measure.

    Attributes:
        name: qualified module name.
        class_name: the module's class name.
        reason: why it is not measured (and, where one exists, how to measure it).
    """

    name: str
    class_name: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        """``{"name", "class_name", "reason"}``."""
        return {"name": self.name, "class_name": self.class_name, "reason": self.reason}


def check_projection(projection: str) -> Projection:
    """Return ``projection`` if it is one of `PROJECTIONS`, else raise ValueError."""
    return check_choice("projection", projection, PROJECTIONS)


def split_out_features(weight: Tensor, heads: int) -> Tensor:
    """Split an ``nn.Linear``-layout weight ``(heads * d, D_in)`` into ``(heads, D_in, d)``.

    Row block ``h`` of the weight is head ``h``'s projection, so ``x @ W_h`` is that head's slice of
    the layer's output.
    """
    return rearrange(weight, "(h d) m -> h m d", h=heads)


def split_in_features(weight: Tensor, heads: int) -> Tensor:
    """Split an out-projection weight ``(D, heads * d)`` into ``(heads, D, d)`` (column blocks)."""
    return rearrange(weight, "m (h d) -> h m d", h=heads)


def linear_sources(query: nn.Module, key: nn.Module, value: nn.Module, output: nn.Module) -> dict[str, WeightSource]:
    """Weight sources for four ``nn.Linear``-layout modules; each reads ``.weight`` when called."""
    modules = {"query": query, "key": key, "value": value, "output": output}
    return {p: _weight_reader(m) for p, m in modules.items()}


def _weight_reader(m: nn.Module) -> WeightSource:
    def read() -> Tensor:
        w = m.weight
        if not isinstance(w, Tensor):
            raise AdapterMismatch(f"{type(m).__name__}.weight is a {type(w).__name__}, not a tensor")
        return w

    return read


def _check_divides(layer: str, projection: str, size: int, heads: int, head_dim: int, what: str) -> None:
    if size != heads * head_dim:
        raise AdapterMismatch(
            f"{layer}: {projection} weight has {size} {what}, expected {heads} heads x head_dim {head_dim} "
            f"= {heads * head_dim}"
        )


class HookHandle:
    """Removable handle for one or more hooks; ``remove()`` is idempotent.

    Also a context manager: ``with layer.attach_output_hook(fn): model(x)``.
    """

    def __init__(self, *handles: Any, on_remove: Callable[[], None] | None = None) -> None:
        self._handles = list(handles)
        self._on_remove = on_remove
        self._removed = False

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        for h in self._handles:
            h.remove()
        if self._on_remove is not None:
            self._on_remove()

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class AttentionLayer:
    """One attention module found in a model.

    Attributes:
        name: qualified module name (as in ``model.named_modules()``).
        module: the attention module.
        family: adapter family, e.g. ``"torch_mha"``, ``"bert"``, ``"llama"``, ``"spec"``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``H_kv`` (``< H`` under grouped-query attention).
        head_dim: per-head width ``d``.
        model_dim: model width ``D`` (the out-projection's output size).
        mask_key: batch-dict key holding the ``(B, T)`` token mask of this layer's query tokens, or
            None where there is none (vision models, plain torch modules).
        kv_map: how query heads share key/value heads (see `kv_head`).
        projection_dims: per-projection head width (``head_dim`` for all but Multi-head Latent
            Attention, whose query/key heads are wider or narrower than its value heads).
        notes: what the report should say about this layer (e.g. parts left out of the HDI, which
            head-count attribute is a tensor-parallel rank's share).
        tensor_parallel: how tensor parallelism splits this layer's heads over ranks
            (`hdi_monitor.models.tensor_parallel.TensorParallel`, read from its DTensor parameters),
            or None. Head counts are always the global ones.
        output_module: the module whose input is the concatenated head output (hooked for
            activation statistics).
        logit_form: how the layer forms its logits (position scheme, scale, QK-norm;
            `hdi_monitor.models.logits.LogitForm`), for the weight-only logit bound; a form with a
            ``refusal`` where it is not declared or cannot be read (the default for adapters that
            do not give one).
        ancestors: the modules above this one in the model it was discovered in, outermost (that
            model) first; empty for a layer built outside discovery. A measured call takes its
            token mask from the outermost running one whose ``forward`` takes ``mask_key`` as an
            argument (see `hdi_monitor.models.hooks.CallMasks`).

    Family adapters build layers from `WeightSource` callables (one per projection) and the
    module whose input is the concatenated head output; a subclass whose output projection never
    sees that input overrides `_output_pre_hook`, where the output hook goes and what it reads
    (``nn.MultiheadAttention`` does).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        family: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        model_dim: int,
        weights: Mapping[str, WeightSource],
        output_module: nn.Module | None = None,
        mask_key: str | None = None,
        kv_map: KVMap = "block",
        projection_dims: Mapping[str, int] | None = None,
        notes: tuple[str, ...] = (),
        logit_form: LogitForm | None = None,
    ) -> None:
        missing = [p for p in PROJECTIONS if p not in weights]
        if missing:
            raise ValueError(f"{name}: no weight source for projection(s) {missing}")
        for label, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(f"{name}: {label}", value)
        if num_heads % num_kv_heads:
            raise ValueError(f"{name}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        check_choice(f"{name}: kv_map", kv_map, KVMap)
        self.kv_map = kv_map
        self.projection_dims: dict[str, int] = {p: head_dim for p in PROJECTIONS}
        self.projection_dims.update(projection_dims or {})
        from hdi_monitor.models.tensor_parallel import tensor_parallel_of

        self.tensor_parallel = tensor_parallel_of(module, name)
        if self.tensor_parallel is not None and num_heads % self.tensor_parallel.size:
            raise AdapterMismatch(
                f"{name}: {num_heads} heads do not split evenly over {self.tensor_parallel.size} tensor-parallel ranks"
            )
        if self.tensor_parallel is not None and not any("tensor parallel" in n for n in notes):
            notes = (*notes, f"{self.tensor_parallel.describe()}: {num_heads} heads counted from the full weights")
        self.notes = tuple(notes)
        self.name = name
        self.module = module
        self.family = family
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_dim = model_dim
        self.mask_key = mask_key
        self._weights = dict(weights)
        self._output_module = output_module
        self._guard_reads: bool | None = None  # a read must restore parametrization buffers (spectral_norm)
        if logit_form is not None and not isinstance(logit_form, LogitForm):
            raise TypeError(f"{name}: logit_form must be a LogitForm, got {type(logit_form).__name__}")
        self.logit_form = logit_form or LogitForm.refused(
            f"family {family!r} declares no logit form (position scheme, scale, QK-norm)"
        )
        self.ancestors: tuple[nn.Module, ...] = ()

    def __repr__(self) -> str:
        kv = f"/{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return (
            f"AttentionLayer({self.name!r}, family={self.family!r}, heads={self.num_heads}{kv}, "
            f"head_dim={self.head_dim}, model_dim={self.model_dim})"
        )

    @property
    def output_module(self) -> nn.Module | None:
        """The module whose input is the concatenated head output (the out-projection), or None
        where there is none to hook (``nn.MultiheadAttention`` calls its ``out_proj`` weight directly)."""
        return self._output_module

    def kv_head(self, head: int) -> int:
        """The key/value head that query head ``head`` attends with: ``head // (H / H_kv)``
        (``kv_map="block"``, the usual grouped-query layout) or ``head % H_kv`` (``"modulo"``,
        x-transformers)."""
        if not 0 <= head < self.num_heads:
            raise ValueError(f"{self.name}: head must be in [0, {self.num_heads}), got {head}")
        if self.kv_map == "modulo":
            return head % self.num_kv_heads
        return head // (self.num_heads // self.num_kv_heads)

    def heads_for(self, projection: Projection) -> int:
        """Number of heads of ``projection``: ``num_kv_heads`` for key/value, else ``num_heads``."""
        check_projection(projection)
        return self.num_kv_heads if projection in ("key", "value") else self.num_heads

    def head_weights(self, projection: Projection) -> Tensor:
        """Per-head weights of one projection, ``(heads, D_in, d)``.

        Detached, in the parameter's own dtype and device (no copy to CPU); DTensor parameters are
        gathered. A parametrized weight (``torch.nn.utils.parametrizations``) is the one the next
        forward pass computes, and the read leaves every parametrization's buffers as they were
        (``spectral_norm``'s power iteration is not advanced). For query/key/value ``x @ W_h (+ bias)`` is head ``h``'s projection of
        ``x in R^{D_in}``; for output ``W_O,h in R^{D x d}`` maps head ``h``'s output to its
        contribution to the layer output.
        """
        heads = self.heads_for(projection)
        d = self.projection_dims[projection]
        if self._guard_reads is None:  # found once: a parametrization added later changes the layer (found again)
            self._guard_reads = bool(parametrization_buffers(self.module, self._output_module))
        if self._guard_reads:
            with preserved_parametrizations(self.module, self._output_module):  # spectral_norm: no power step kept
                w = full_weight(self._weights[projection]())
        else:
            w = full_weight(self._weights[projection]())
        if projection == "output":
            _check_divides(self.name, projection, w.shape[1], heads, d, "input features")
            return split_in_features(w, heads)
        _check_divides(self.name, projection, w.shape[0], heads, d, "output features")
        return split_out_features(w, heads)

    def qk_norm_gains(self) -> QKNormGains:
        """The gains of this layer's QK-norm (``logit_form.qk_norm``) as the next forward pass uses
        them: ``(H, d)`` query and ``(H_kv, d)`` key gains (copies, float32 at least; DTensors
        gathered; parametrizations left as they were) and the largest norm of one normalised head.

        Raises:
            ValueError: the layer has no QK-norm.
            AdapterMismatch: the full gains do not fit the layer's heads.
        """
        qk = self.logit_form.qk_norm
        if qk is None:
            raise ValueError(f"{self.name}: the layer has no QK-norm")
        with preserved_parametrizations(self.module):
            return qk.read()

    def attach_output_hook(
        self,
        fn: OutputHook,
        on_error: ErrorHandler | None = None,
        *,
        select: TokenSelect | None = None,
        signal: TraceSignal | None = None,
    ) -> HookHandle:
        """Call ``fn(o, keep_mask)`` on every forward of this layer while attached.

        ``o`` is ``(..., num_heads * head_dim)``, the concatenated per-head outputs before the output
        projection, head-major, detached; under tensor parallelism every head's, gathered over the TP
        group (`hdi_monitor.models.tensor_parallel.gather_heads`, a collective inside the forward).
        ``keep_mask`` is None here (token masks come from the batch, see `mask_key`). With
        ``on_error``, an exception inside the hook goes to ``on_error(err)`` and the forward pass
        goes on. Returns a handle with ``.remove()``.

        Under tensor parallelism, ``select`` (``o_share -> (rows, keep)``, the same choice on every
        TP rank) picks the tokens to gather before the collective, so that the gather is bounded by
        the number of rows it returns (the caller's ``max_tokens``) rather than by the batch; ``fn``
        then receives those rows of every head and their ``keep`` flags. Without tensor parallelism
        ``select`` is not used.

        Inside a Dynamo trace (the model called through a ``torch.compile`` region) the hook does
        nothing and tells ``signal`` (see `TraceSignal`): ``fn`` is only ever called eagerly.
        """
        module, pre_hook = self._output_pre_hook(fn, select)
        return HookHandle(module.register_forward_pre_hook(guarded(pre_hook, on_error, signal), with_kwargs=True))

    def _output_pre_hook(self, fn: OutputHook, select: TokenSelect | None) -> tuple[nn.Module, Callable[..., None]]:
        """Where `attach_output_hook` hooks, and the forward pre-hook that calls ``fn(o, keep_mask)``
        there (`attach_output_hook` guards it and registers it with kwargs).

        Here: the output module, whose input is ``o`` (this rank's heads gathered over the TP group
        under tensor parallelism, ``select`` first). A family whose output projection never sees
        ``o`` (``nn.MultiheadAttention``) overrides it.
        """
        if self._output_module is None:
            raise ValueError(
                f"{self.name}: no output module to hook; give AttentionSpec(output_module=...) the name of "
                "the submodule whose input is the concatenated head output"
            )

        split, width = self.tensor_parallel, self.num_heads * self.projection_dims["output"]

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            o = args[0] if args else next(iter(kwargs.values()))
            keep: Tensor | None = None
            if split is not None:  # this rank's heads: gather every head (a collective, first in the hook)
                from hdi_monitor.models.tensor_parallel import gather_heads, local_share

                o = local_share(o.detach(), split, width, self.name)
                if select is not None:
                    o, keep = select(o)
                o = gather_heads(o, split, width, self.name)
            fn(o.detach(), keep)

        return self._output_module, pre_hook


# ------------------------------------------------------------------------------------------ registry


class _Build(Protocol):
    def __call__(self, name: str, module: nn.Module, /) -> AttentionLayer: ...


@dataclass(frozen=True)
class Adapter:
    """A model-family adapter.

    Attributes:
        family: family label, e.g. ``"llama"``.
        classes: human-readable description of the classes it matches (for errors and docs).
        match: ``(name, module) -> bool`` from class/attribute structure only (no weight access, so it
            also works on meta-device or lazy modules).
        build: ``(name, module) -> AttentionLayer``, or ``(name, module, root_config) -> AttentionLayer``
            where it reads the model's config (for modules without one of their own); may raise
            `AdapterMismatch`. Call it through `build_layer`.
    """

    family: str
    classes: str
    match: Callable[[str, nn.Module], bool]
    build: _Build | Callable[[str, nn.Module, Any], AttentionLayer]

    def build_layer(self, name: str, module: nn.Module, root_config: Any = None) -> AttentionLayer:
        """``build(name, module)``, passing ``root_config`` (the model's config, or None) to a
        ``build`` that takes a third argument."""
        if _takes_config(self.build):
            return self.build(name, module, root_config)  # type: ignore[call-arg]
        return self.build(name, module)  # type: ignore[call-arg]


def _takes_config(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


_REGISTRY: list[Adapter] = []
_REGISTRY_LOCK = threading.Lock()


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Add a family adapter. ``first=True`` (default) tries it before the built-in ones.

    An adapter with the same family label replaces the registered one.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter expects an Adapter, got {type(adapter).__name__}")
    with _REGISTRY_LOCK:
        _REGISTRY[:] = [a for a in _REGISTRY if a.family != adapter.family]
        if first:
            _REGISTRY.insert(0, adapter)
        else:
            _REGISTRY.append(adapter)


def registered_adapters() -> tuple[Adapter, ...]:
    """The registered adapters, in the order they are tried."""
    with _REGISTRY_LOCK:
        return tuple(_REGISTRY)


def int_attr(obj: Any, *names: str) -> int | None:
    """First of ``names`` that ``obj`` (or its ``config``) has as a positive int, else None."""
    for holder in (obj, getattr(obj, "config", None)):
        if holder is None:
            continue
        for n in names:
            v = getattr(holder, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def is_linear(m: Any) -> bool:
    """An ``nn.Linear`` (lazy ones included)."""
    return isinstance(m, nn.Linear)
