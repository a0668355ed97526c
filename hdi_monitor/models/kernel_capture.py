"""What each watched attention layer feeds its attention kernel, captured while a block is active.

Kernel statistics (`hdi_monitor.functional.kernel`) must come from the queries and keys the kernel
actually receives, after rotary embeddings and q/k norms, with the layer's own mask: never
recomputed from weights where something sits between the projections and the kernel. They are
read where the kernel is reachable:

* **transformers' attention-function registry** (``ALL_ATTENTION_FUNCTIONS``, which transformers 5
  modules call as ``fn(module, query, key, value, attention_mask, scaling=..., ...)`` with per-head
  ``(B, heads, T, d)`` tensors): every entry is wrapped. The ``"sdpa"`` entry is measured at the
  torch call it makes (below), with its own ``is_causal``, scale and mask, and its pre-packing
  query and key when it packs grouped heads for one-token decoding. Other entries (flash, flex,
  paged) are not measured: their masks are not dense tensors; the layer is named with the reason.
* **the eager path of transformers** (the modeling file's own ``eager_attention_forward``, which the
  registry does not hold): patched in the modeling module of each watched layer; its additive mask
  is the one the softmax sees, and key heads map to query heads as ``repeat_kv`` does
  (``h // (H / H_kv)``); a T5-style ``position_bias`` is added to the mask, as those functions
  add it to the logits. Calls with ``softcap``, attention sinks (``s_aux``, ``sinks``) or a
  ``head_mask`` are not measured and named.
* **``torch.nn.functional.scaled_dot_product_attention``** called inside a watched module (litgpt,
  custom modules, transformers' sdpa path): the call's own ``q``, ``k``, ``attn_mask``,
  ``is_causal``, ``scale`` and ``enable_gqa``.
* **``torch.nn.MultiheadAttention``**: its forward inputs are captured by a pre-hook and ``q``, ``k``
  recomputed from its ``in_proj`` (and ``bias_k``/``add_zero_attn``, ``attn_mask`` and
  ``key_padding_mask``): there is nothing between the projection and the kernel there, so this is
  exact. The hooks keep ``nn.TransformerEncoderLayer`` off its fused path; a nested batch from
  ``nn.TransformerEncoder`` in eval mode is read padded again, its padded queries left out (see
  `hdi_monitor.models.torch_mha.unnest_self_attention`). The global fast-path flag is never touched.

Each call is attributed to the watched layer whose forward is running (a forward pre-hook and an
always-called forward hook on each watched module keep a per-thread stack) or, for registry and
eager calls, to the layer holding the ``module`` argument. Layers whose forward ran but whose
kernel was never reached, or that were not measured for a stated reason, are listed by
`KernelCapture.unreachable`.

Nothing global stays changed: the registry entries, module functions and ``F.sdpa`` are wrapped
only while the forward of a watched layer runs (eagerly) inside the block, from the layer's forward
pre-hook to its always-called forward hook, and put back then (also on exceptions) and when the
block exits; the fast-path flag is restored, the hooks are removed, and no random number is drawn
(the statistics' query subsample uses a private generator). So a compiled graph traced outside a
layer's forward never sees a wrapper in the globals it guards on, and a cached compiled graph,
which does not run the hooks, never sees one at all.

Inside a Dynamo trace (the model called through a ``torch.compile`` region while the capture is
active) the hooks do nothing and the wrappers only call the original function; both tell the
capture's ``signal`` (`hdi_monitor.models.base.TraceSignal`), whose owner can take the capture off
and have Dynamo trace again without it.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hdi_monitor._validation import check_instance
from hdi_monitor.functional._numerics import no_autocast
from hdi_monitor.functional.kernel import MASKED_AT, default_kv_head_map
from hdi_monitor.models.base import AttentionLayer, ErrorHandler, TraceSignal, traced
from hdi_monitor.models.torch_mha import _MHA_ARGS, _keep_from_padding, mha_heads, unnest_self_attention

__all__ = ["NOT_RUN", "KernelCall", "KernelCapture"]

#: Keyword arguments of an attention function that change its softmax in ways the statistics do not
#: model; a call that passes one of them (not None) is not measured and its layer is named.
UNSUPPORTED_KWARGS: tuple[str, ...] = ("softcap", "s_aux", "sinks")

_EAGER = "eager_attention_forward"

#: The reason `KernelCapture.unreachable` gives for a layer whose forward never ran while the capture was on.
NOT_RUN = "the layer's forward did not run while the capture was active"


@dataclass(frozen=True)
class KernelCall:
    """One attention-kernel call of a watched layer, as the kernel received it (tensors detached).

    Attributes:
        layer: the watched layer's name.
        source: where it was read: ``"transformers:sdpa"``, ``"transformers:eager"``,
            ``"F.scaled_dot_product_attention"`` or ``"nn.MultiheadAttention"``.
        q: ``(B, H, T, d)`` queries.
        k: ``(B, H_k, S, d)`` keys (``H_k`` divides ``H``).
        scale: the logit scale the kernel applies.
        mask: None, a bool mask (True = allowed) or an additive float mask, broadcastable to
            ``(B, H, T, S)`` (SDPA's convention).
        is_causal: the kernel's causal flag (key ``s`` allowed for query ``t`` when ``s <= t``).
        kv_head_map: ``(H,)`` key head of each query head; None: ``h // (H / H_k)``.
        query_keep: ``(B, T)`` bool, the queries that are real tokens (None: all); set where the
            call itself knows its padding (a nested batch padded again).
    """

    layer: str
    source: str
    q: Tensor
    k: Tensor
    scale: float
    mask: Tensor | None
    is_causal: bool
    kv_head_map: Tensor | None = None
    query_keep: Tensor | None = None


@dataclass
class _Frame:
    """One active watched layer (or a registry call inside it) on the per-thread stack."""

    layer: str
    kind: str  # "layer", "mha", "registry"
    query: Tensor | None = None
    key: Tensor | None = None
    mask: Tensor | None = None
    reached: bool = False


def _layer_entries(layers: Any) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, Mapping):
        items = list(layers.items())
    elif isinstance(layers, Sequence) and not isinstance(layers, str):
        items = []
        for lay in layers:
            check_instance("layers item", lay, AttentionLayer)
            items.append((lay.name, lay.module))
    else:
        raise TypeError("layers must be a sequence of AttentionLayer or a mapping {name: nn.Module}")
    for name, mod in items:
        check_instance(f"layer {name!r}", mod, nn.Module)
    if len({n for n, _ in items}) != len(items):
        raise ValueError("layer names must be unique")
    return items


class KernelCapture:
    """Context manager: call ``on_call(KernelCall)`` for every attention-kernel call of the watched layers.

    Args:
        layers: the layers to watch: `AttentionLayer` objects (from `discover_attention`) or a
            mapping ``{name: module}``.
        on_call: receives each `KernelCall` while the forward pass runs (under ``no_grad``, autocast
            off). It must not keep the tensors longer than it needs them.
        on_error: receives an exception raised while reading a call (or inside ``on_call``) instead
            of the forward pass; None re-raises.
        signal: told when a hook or wrapper of the capture runs inside a Dynamo trace (see
            `hdi_monitor.models.base.TraceSignal`); settable until the block is entered.

    While active, the registry entries, the eager functions of the watched layers' modeling modules
    and ``F.scaled_dot_product_attention`` are wrapped whenever a watched layer's forward runs (each
    wrapper calls the original with the same arguments and returns its result untouched), and put
    back when it returns. All of it is restored on exit. The object is single-use per block but may
    be entered again.

    Example:
        ```python
        calls = []
        with KernelCapture(discover_attention(model).layers, calls.append) as cap:
            model(**batch)
        cap.unreachable  # [(layer name, reason), ...]
        ```
    """

    def __init__(
        self,
        layers: Sequence[AttentionLayer] | Mapping[str, nn.Module],
        on_call: Callable[[KernelCall], None],
        *,
        on_error: ErrorHandler | None = None,
        signal: TraceSignal | None = None,
    ) -> None:
        if not callable(on_call):
            raise TypeError("on_call must be callable")
        self._layers = _layer_entries(layers)
        self.on_call = on_call
        self.on_error = on_error
        self.signal = signal
        self._owner: dict[int, str] = {}
        for name, mod in self._layers:
            for sub in mod.modules():
                self._owner.setdefault(id(sub), name)
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []
        # (apply, undo) of each global wrapper: applied while a watched layer's forward runs
        self._patches: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._applied: list[Callable[[], None]] = []
        self._running = 0  # watched layer forwards running, in all threads
        self._patch_lock = threading.RLock()
        self.calls: dict[str, int] = {}
        self.forwards: dict[str, int] = {}
        self._reasons: dict[str, str] = {}
        self._active = False

    # ---------------------------------------------------------------- results
    @property
    def unreachable(self) -> list[tuple[str, str]]:
        """``(layer name, reason)`` for each watched layer that was not measured (so far).

        A layer is listed when some call was refused (the reason says why; statistics its other
        calls gave are then partial), when its forward ran but no reachable kernel was called inside
        it, or when its forward never ran.
        """
        out = []
        for name, _ in self._layers:
            if name in self._reasons:
                out.append((name, self._reasons[name]))
            elif self.calls.get(name, 0) == 0:
                if self.forwards.get(name, 0) == 0:
                    out.append((name, NOT_RUN))
                else:
                    out.append(
                        (
                            name,
                            "its attention kernel is not reachable: no call to transformers' attention "
                            "registry or eager function, F.scaled_dot_product_attention or nn.MultiheadAttention "
                            "inside it",
                        )
                    )
        return out

    # ---------------------------------------------------------------- frames
    def _stack(self) -> list[_Frame]:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def _top(self) -> _Frame | None:
        st = self._stack()
        return st[-1] if st else None

    def _layer_of(self, module: nn.Module) -> str | None:
        """The watched layer a kernel call on ``module`` belongs to: the layer that owns ``module``,
        else the innermost frame's on this thread (a shared function called inside a layer), else None."""
        layer = self._owner.get(id(module))
        if layer is None:
            top = self._top()
            layer = top.layer if top is not None else None
        return layer

    def _call_in_frame(self, frame: _Frame, original: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``original(*args, **kwargs)`` with ``frame`` on this thread's stack while it runs, so that
        the kernel calls inside it are read as ``frame`` says; popped after (if still on top: a
        watched layer's post-hook unwinds the frames an exception left behind)."""
        stack = self._stack()
        stack.append(frame)
        try:
            return original(*args, **kwargs)
        finally:
            if stack and stack[-1] is frame:
                stack.pop()

    def _emit(self, call: KernelCall) -> None:
        self.calls[call.layer] = self.calls.get(call.layer, 0) + 1
        self.on_call(call)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            with torch.no_grad(), no_autocast():
                fn()
        except Exception as err:  # noqa: BLE001 - monitoring must not break the forward pass
            if self.on_error is None:
                raise
            self.on_error(err)

    def _refuse(self, layer: str, reason: str) -> None:
        self._reasons.setdefault(layer, reason)

    # ---------------------------------------------------------------- hooks and patches
    def _hook_layers(self) -> None:
        for name, mod in self._layers:
            is_mha = isinstance(mod, nn.MultiheadAttention)

            def pre(_m: nn.Module, args: tuple, kwargs: dict, _n: str = name, _mha: bool = is_mha) -> None:
                if traced(self.signal):
                    return
                self.forwards[_n] = self.forwards.get(_n, 0) + 1
                self._stack().append(_Frame(_n, "mha" if _mha else "layer"))
                self._guard(self._layer_enters)
                if _mha:
                    self._guard(lambda: self._mha_call(_n, _m, args, kwargs))

            def post(_m: nn.Module, _args: tuple, _kwargs: dict, _out: Any, _n: str = name) -> None:
                if traced(self.signal):
                    return
                st = self._stack()
                if not any(f.layer == _n and f.kind in ("layer", "mha") for f in st):
                    return  # attached while this call was running: its pre-hook never ran
                while st:  # also unwinds frames an exception left behind
                    if st.pop().layer == _n:
                        break
                self._guard(self._layer_returns)

            h1 = mod.register_forward_pre_hook(pre, with_kwargs=True)
            h2 = mod.register_forward_hook(post, with_kwargs=True, always_call=True)
            self._undo.append(h1.remove)
            self._undo.append(h2.remove)

    def _layer_enters(self) -> None:
        """A watched layer's forward starts: the global wrappers go on if none was running."""
        with self._patch_lock:
            self._running += 1
            if self._running == 1:
                self._apply_patches()

    def _layer_returns(self) -> None:
        """A watched layer's forward returned (or raised): the wrappers come off if it was the last."""
        with self._patch_lock:
            self._running = max(0, self._running - 1)
            if self._running == 0:
                self._remove_patches()

    def _apply_patches(self) -> None:
        done: list[Callable[[], None]] = []
        try:
            for apply, undo in self._patches:
                apply()
                done.append(undo)
        except BaseException:
            for undo in reversed(done):
                undo()
            raise
        self._applied = done

    def _remove_patches(self) -> None:
        undo, self._applied = self._applied, []
        errors: list[BaseException] = []
        for fn in reversed(undo):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - put back everything else first
                errors.append(err)
        if errors:
            raise errors[0]

    def _mha_call(self, name: str, mha: nn.Module, args: tuple, kwargs: dict) -> None:
        assert isinstance(mha, nn.MultiheadAttention)
        call = dict(zip(_MHA_ARGS, args, strict=False))
        call.update(kwargs)
        call, real = unnest_self_attention(mha, call)  # nn.TransformerEncoder's nested batches, padded again
        kpm = call.get("key_padding_mask")
        if real is None and kpm is not None and call["query"] is call["key"]:
            # self-attention: the padded keys are padded queries too (never counted as queries)
            real = _keep_from_padding(kpm)
            real = real[None] if real.dim() == 1 else real
        q, k, _, mask = mha_heads(mha, call["query"], call["key"], None, kpm, call.get("attn_mask"))
        scale = 1.0 / math.sqrt(mha.head_dim)
        self._emit(KernelCall(name, "nn.MultiheadAttention", q, k, scale, mask, False, query_keep=real))

    def _patch_sdpa(self) -> None:
        original = F.scaled_dot_product_attention
        capture = self

        def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
            if traced(capture.signal):
                return original(query, key, value, *args, **kwargs)
            top = capture._top()
            if top is not None and top.kind in ("layer", "registry") and not top.reached:
                capture._guard(lambda: capture._sdpa_call(top, query, key, args, kwargs))
            return original(query, key, value, *args, **kwargs)

        name = "scaled_dot_product_attention"
        self._patches.append(
            (partial(setattr, F, name, scaled_dot_product_attention), partial(setattr, F, name, original))
        )

    def _sdpa_call(self, frame: _Frame, query: Tensor, key: Tensor, args: tuple, kwargs: dict) -> None:
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args, strict=False))
        call.update(kwargs)
        mask, is_causal, scale = call.get("attn_mask"), bool(call.get("is_causal", False)), call.get("scale")
        q, k = query, key
        source = "F.scaled_dot_product_attention"
        if frame.kind == "registry":
            frame.reached = True
            source = "transformers:sdpa"
            assert frame.query is not None and frame.key is not None
            if tuple(q.shape) != tuple(frame.query.shape):  # one-token decoding: heads packed into the query axis
                q, k, mask, is_causal = frame.query, frame.key, frame.mask, False
        if q.dim() != 4 or k.dim() != 4:
            self._refuse(
                frame.layer, f"F.scaled_dot_product_attention called with {q.dim()}-D inputs, not (B, H, T, d)"
            )
            return
        if k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1]:
            self._refuse(frame.layer, f"{k.shape[1]} key heads do not divide {q.shape[1]} query heads")
            return
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        kv_map = None if k.shape[1] == q.shape[1] else default_kv_head_map(q.shape[1], k.shape[1], q.device)
        self._emit(KernelCall(frame.layer, source, q.detach(), k.detach(), scale, _detach(mask), is_causal, kv_map))

    def _patch_registry(self) -> None:
        mu = sys.modules.get("transformers.modeling_utils")
        registry = getattr(mu, "ALL_ATTENTION_FUNCTIONS", None)
        local = getattr(registry, "_local_mapping", None)
        if registry is None or not isinstance(local, dict):
            return
        saved = dict(local)
        wrapped = {key: self._registry_wrapper(key, registry[key]) for key in list(registry.keys())}

        def restore() -> None:
            local.clear()
            local.update(saved)

        self._patches.append((partial(local.update, wrapped), restore))

    def _registry_wrapper(self, impl: str, original: Callable[..., Any]) -> Callable[..., Any]:
        capture = self

        def attention(
            module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if traced(capture.signal):
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            layer = capture._layer_of(module)
            if layer is None:
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            bad = [n for n in UNSUPPORTED_KWARGS if kwargs.get(n) is not None]
            if impl != "sdpa" or bad:
                why = f"takes {bad[0]!r}" if bad else "is not measured (only 'sdpa' and 'eager' are)"
                capture._refuse(layer, f"attention implementation {impl!r} {why}")
                frame = _Frame(layer, "blocked")
            else:
                frame = _Frame(layer, "registry", query, key, attention_mask)
            out = capture._call_in_frame(frame, original, module, query, key, value, attention_mask, *args, **kwargs)
            if frame.kind == "registry" and not frame.reached:
                capture._refuse(layer, "transformers' 'sdpa' function did not call F.scaled_dot_product_attention")
            return out

        return attention

    def _patch_eager(self) -> None:
        done: set[str] = set()
        for _name, mod in self._layers:
            for sub in mod.modules():
                modname = type(sub).__module__
                pymod = sys.modules.get(modname)
                fn = getattr(pymod, _EAGER, None)
                if modname in done or not callable(fn):
                    continue
                done.add(modname)
                wrapper = self._eager_wrapper(fn)
                self._patches.append((partial(setattr, pymod, _EAGER, wrapper), partial(setattr, pymod, _EAGER, fn)))

    def _eager_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        capture = self
        try:
            extra = [
                p
                for p in inspect.signature(original).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        except (TypeError, ValueError):
            extra = []
        positional = [p.name for p in extra][5:]  # after module, query, key, value, attention_mask

        def eager(
            module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if traced(capture.signal):
                return original(module, query, key, value, attention_mask, *args, **kwargs)
            layer = capture._layer_of(module)
            if layer is not None:
                named = dict(zip(positional, args, strict=False))
                named.update(kwargs)
                capture._guard(lambda: capture._eager_call(layer, query, key, attention_mask, named))
            frame = _Frame(layer or "", "blocked")  # an F.sdpa call inside the eager function is the same kernel
            return capture._call_in_frame(frame, original, module, query, key, value, attention_mask, *args, **kwargs)

        return eager

    def _eager_call(self, layer: str, query: Tensor, key: Tensor, mask: Any, named: dict[str, Any]) -> None:
        extra = sorted(n for n in named if n not in ("scaling", "dropout") and named[n] is not None)
        bad = [n for n in extra if n in (*UNSUPPORTED_KWARGS, "head_mask")]
        if bad:
            self._refuse(layer, f"eager attention takes {bad[0]!r}")
            return
        if query.dim() != 4 or key.dim() != 4 or query.shape[1] % key.shape[1]:
            self._refuse(layer, f"eager attention inputs of shapes {tuple(query.shape)}, {tuple(key.shape)}")
            return
        scale = named.get("scaling")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        if isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[-1] > key.shape[2]:
            mask = mask[..., : key.shape[2]]  # what the eager functions that slice their mask do
        elif mask is not None and not isinstance(mask, Tensor):
            self._refuse(layer, f"eager attention mask of type {type(mask).__name__}")
            return
        bias = named.get("position_bias")
        if isinstance(bias, Tensor):  # T5-style relative position bias, added to the logits before the mask
            if bias.dim() == 4 and bias.shape[-1] > key.shape[2]:
                bias = bias[..., : key.shape[2]]
            if mask is None:
                mask = bias
            elif mask.dtype == torch.bool:
                mask = torch.where(mask, bias, -math.inf)
            else:  # a masked key stays masked whatever the bias adds (a -1e4 mask plus a positive bias)
                mask = torch.where(mask > MASKED_AT, bias + mask, -math.inf)
        kv_map = (
            None if key.shape[1] == query.shape[1] else default_kv_head_map(query.shape[1], key.shape[1], query.device)
        )
        self._emit(
            KernelCall(layer, "transformers:eager", query.detach(), key.detach(), scale, _detach(mask), False, kv_map)
        )

    # ---------------------------------------------------------------- context
    def __enter__(self) -> KernelCapture:
        if self._active:
            raise RuntimeError("this KernelCapture is already active")
        self._undo, self._patches, self._running = [], [], 0
        try:
            self._patch_registry()  # the wrappers, put on while a watched layer runs
            self._patch_eager()
            self._patch_sdpa()
            self._hook_layers()
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _restore(self) -> None:
        errors: list[BaseException] = []
        with self._patch_lock:  # a layer still running (the capture taken off inside a forward)
            self._running = 0
            try:
                self._remove_patches()
            except Exception as err:  # noqa: BLE001 - restore everything else first
                errors.append(err)
        for fn in reversed(self._undo):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - restore everything else first
                errors.append(err)
        self._undo = []
        self._local = threading.local()
        if errors:
            raise errors[0]

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self._restore()


def _detach(t: Any) -> Tensor | None:
    return t.detach() if isinstance(t, Tensor) else None
