"""The user's description of attention modules: `AttentionSpec`."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from hdi_monitor._validation import check_choice, check_instance, check_int, check_regex
from hdi_monitor.models.base import AttentionLayer, KVMap, WeightSource
from hdi_monitor.models.heads import resolve_heads
from hdi_monitor.models.layout import DIM_ATTRS, HEADS_ATTRS, PACKINGS, Packing, default_mask_key, split_fused
from hdi_monitor.models.logits import LogitRule, resolve_logit_form
from hdi_monitor.models.weights import is_projection, linear_weight

__all__ = ["AttentionSpec", "as_specs"]

Ref = str | Callable[[nn.Module], Tensor]


def _resolve(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(part)
        obj = getattr(obj, part)
    return obj


def _as_tensor(obj: Any, name: str, projection: str) -> Tensor:
    if not isinstance(obj, Tensor):
        raise TypeError(f"{name}: AttentionSpec.{projection} gave {type(obj).__name__}, expected a Tensor")
    return obj


@dataclass(frozen=True)
class AttentionSpec:
    """Describe attention modules that no built-in layout knows, or override one.

    Specs combine with the built-in families: ``spec=`` takes one spec or a list; a module that a
    spec matches is read with the spec (a spec wins where both match), every other module with the
    built-ins. Head counts and widths may differ per matched module: each one not given here is read
    from the module (``num_heads``, ``num_attention_heads``, ``head_dim``, ...), then its ``config``,
    then the model's ``config``, and checked against the weights' shapes.

    Example, separate projections (a block with ``wq, wk, wv, wo`` ``nn.Linear`` layers):

    ```python
    spec = AttentionSpec(
        modules=r"^blocks\\.\\d+\\.attn$",    # regex, re.search on the qualified module name
        query="wq", key="wk", value="wv", output="wo",
        num_heads=8, num_kv_heads=2,         # or leave them out to read them from the module
    )
    report = head_diversity(model, spec=spec)
    ```

    Example, a fused projection (its row layout must be declared: shapes cannot tell it):

    ```python
    AttentionSpec(modules=r"h\\.\\d+\\.attn", qkv="qkv", qkv_layout="interleaved", output="proj")
    ```

    Args:
        modules: which modules are attention layers: a regex searched in the qualified module name
            (``re.search``, the same meaning as ``layers=``; anchor it with ``^...$`` for an exact
            match), or a predicate ``(name, module) -> bool``. Modules are tried in module order and
            the descendants of a matched module are not searched, so ``r"blocks\\.\\d+\\.attn"``
            matches the attention blocks and not their ``attn.wq`` children (but it would also
            match a sibling named ``attn_norm``: anchor it, ``r"blocks\\.\\d+\\.attn$"``).
        query, key, value, output: each a dotted attribute path relative to the attention module,
            naming a projection module (``nn.Linear``, ``Conv1D``, a LoRA layer: its effective
            weight is read) or a tensor (``"wq.weight"``), or a callable ``module -> Tensor``.
            Tensors are in ``nn.Linear`` layout: ``(heads * d, D_in)`` for query/key/value and
            ``(D, num_heads * d)`` for output.
        num_heads: query heads (default: read per module).
        num_kv_heads: key/value heads (default: read per module, else from the key's width).
        head_dim: per-head width (default: read per module, else output width / num_heads).
        output_module: dotted path of the submodule whose input is the concatenated head output
            (for activation statistics). Default: ``output`` when that names a module.
        mask_key: batch-dict key of the ``(B, T)`` token mask for this layer's query tokens;
            ``"auto"`` (default) picks it per sub-model: none for vision towers,
            ``decoder_attention_mask`` in the decoder of an encoder-decoder model, else
            ``attention_mask``; None for no mask.
        family: family label written into the report.
        qkv: a fused q/k/v projection (path or callable), instead of ``query``/``key``/``value``.
        qkv_layout: the fused projection's row layout, required with ``qkv``: ``"contiguous"``
            ``[q|k|v]``, ``"interleaved"`` ``(H, 3, d)``, ``"grouped"`` ``(H_kv, H/H_kv + 2, d)`` or
            ``"multi_query"`` ``[q | k (d) | v (d)]``.
        kv_map: ``"block"`` (query head ``h`` reads key/value head ``h // (H/H_kv)``) or
            ``"modulo"`` (``h % H_kv``).
        logits: how the modules form their logits, for the weight-only logit bound
            (`hdi_monitor.models.logits.LogitRule`: position scheme, scale, QK-norm children), e.g.
            ``LogitRule(rotary=True, scale="1/sqrt(d)")``. None (default): no logit bound for these
            modules, and the report says so.
    """

    modules: str | Callable[[str, nn.Module], bool]
    query: Ref | None = None
    key: Ref | None = None
    value: Ref | None = None
    output: Ref | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    output_module: str | None = None
    mask_key: str | None = "auto"
    family: str = "spec"
    qkv: Ref | None = None
    qkv_layout: Packing | None = None
    kv_map: KVMap = "block"
    logits: LogitRule | None = None
    _pattern: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.modules, str):
            object.__setattr__(self, "_pattern", check_regex("AttentionSpec.modules", self.modules))
        elif not callable(self.modules):
            raise TypeError(
                "AttentionSpec.modules must be a regex string or a predicate (name, module) -> bool, "
                f"got {type(self.modules).__name__}"
            )
        separate = [p for p in ("query", "key", "value") if getattr(self, p) is not None]
        if self.qkv is not None:
            if separate:
                raise ValueError(
                    f"AttentionSpec: give either qkv or query/key/value, not both (got qkv and {separate})"
                )
            if self.qkv_layout not in PACKINGS:
                raise ValueError(
                    f"AttentionSpec.qkv needs qkv_layout, one of {PACKINGS} (got {self.qkv_layout!r}): the row "
                    "layout of a fused projection cannot be told from its shape"
                )
        elif len(separate) != 3:
            missing = [p for p in ("query", "key", "value") if getattr(self, p) is None]
            raise ValueError(f"AttentionSpec: {missing} missing; give query, key and value, or qkv with qkv_layout")
        elif self.qkv_layout is not None:
            raise ValueError("AttentionSpec.qkv_layout is only meaningful with qkv")
        if self.output is None:
            raise ValueError("AttentionSpec.output is required (the out-projection)")
        for proj in ("query", "key", "value", "output", "qkv"):
            ref = getattr(self, proj)
            if ref is not None and not (isinstance(ref, str) or callable(ref)):
                raise TypeError(
                    f"AttentionSpec.{proj} must be an attribute path (str) or a callable module -> Tensor, "
                    f"got {type(ref).__name__}"
                )
        for label in ("num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, label) is not None:
                check_int(f"AttentionSpec.{label}", getattr(self, label))
        if self.num_heads is not None and self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"AttentionSpec: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        check_choice("AttentionSpec.kv_map", self.kv_map, KVMap)
        check_instance("AttentionSpec.mask_key", self.mask_key, str, optional=True)
        check_instance("AttentionSpec.logits", self.logits, LogitRule, optional=True)

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module called ``name`` is an attention layer under this spec."""
        if self._pattern is not None:
            return self._pattern.search(name) is not None
        return bool(self.modules(name, module))  # type: ignore[operator]

    def _source(self, name: str, module: nn.Module, projection: str) -> WeightSource:
        ref = getattr(self, projection)
        if callable(ref) and not isinstance(ref, str):
            return lambda: _as_tensor(ref(module), name, projection)
        try:
            obj = _resolve(module, ref)
        except AttributeError as exc:
            raise ValueError(
                f"{name}: AttentionSpec.{projection}={ref!r} does not resolve: {type(module).__name__} has no "
                f"attribute {exc.args[0]!r}"
            ) from None
        if is_projection(obj):
            return lambda: linear_weight(_resolve(module, ref))
        if isinstance(obj, nn.Module):
            return lambda: _as_tensor(_resolve(module, ref).weight, name, projection)
        return lambda: _as_tensor(_resolve(module, ref), name, projection)

    def build(self, name: str, module: nn.Module, root_config: Any = None) -> AttentionLayer:
        """Build the `AttentionLayer` for one matched module, validating all shapes.

        Raises:
            ValueError: the spec does not fit the module. Where the regex matched only part of the
                name (``re.search``), the message says how to anchor it.
        """
        try:
            return self._build(name, module, root_config)
        except ValueError as exc:
            if self._pattern is None or self._pattern.fullmatch(name) is not None:
                raise
            pattern = self._pattern.pattern
            raise type(exc)(
                f"{exc}. The regex {pattern!r} matched part of {name!r} (modules= is searched with "
                f"re.search); anchor it, e.g. {anchored(pattern)!r}, to match whole names only"
            ) from None

    def _build(self, name: str, module: nn.Module, root_config: Any) -> AttentionLayer:
        out_src = self._source(name, module, "output")
        out_shape = tuple(out_src().shape)
        if len(out_shape) != 2:
            raise ValueError(f"{name}: output weight must be 2-D (nn.Linear layout), got shape {out_shape}")
        sources: dict[str, WeightSource]
        try:
            if self.qkv is not None:
                fused = self._source(name, module, "qkv")
                rows = fused().shape
                if len(rows) != 2:
                    raise ValueError(f"{name}: qkv weight must be 2-D (nn.Linear layout), got shape {tuple(rows)}")
                heads, kv, d = resolve_heads(
                    name,
                    module,
                    inner=out_shape[1],
                    fused_rows=rows[0],
                    packing=self.qkv_layout,
                    root_config=root_config,
                    num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim,
                )
                layout = self.qkv_layout

                def part(i: int) -> WeightSource:
                    return lambda: split_fused(fused(), layout, heads, kv, d)[i]  # type: ignore[arg-type]

                sources = {"query": part(0), "key": part(1), "value": part(2)}
            else:
                sources = {p: self._source(name, module, p) for p in ("query", "key", "value")}
                tensors = {p: sources[p]() for p in sources}
                for p, t in tensors.items():
                    if t.ndim != 2:
                        raise ValueError(
                            f"{name}: {p} weight must be 2-D (nn.Linear layout), got shape {tuple(t.shape)}"
                        )
                if tensors["key"].shape[0] != tensors["value"].shape[0]:
                    raise ValueError(
                        f"{name}: key weight has {tensors['key'].shape[0]} rows and value {tensors['value'].shape[0]}; "
                        "they must split into the same key/value heads"
                    )
                heads, kv, d = resolve_heads(
                    name,
                    module,
                    inner=out_shape[1],
                    kv_rows=tensors["key"].shape[0],
                    root_config=root_config,
                    num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim,
                )
                if tensors["query"].shape[0] != heads * d:
                    raise ValueError(
                        f"{name}: query weight has {tensors['query'].shape[0]} output features (rows), which does not "
                        f"split into {heads} heads of head_dim {d} (= {heads * d}); weights must be in nn.Linear "
                        "(out, in) layout"
                    )
                self._warn_if_packed(name, tensors)
        except ValueError as exc:  # AdapterMismatch included: a spec's mismatch is the user's error
            raise ValueError(f"{exc} (AttentionSpec(modules={self.modules!r}))") from None
        self._check_declared(name, module, heads, d, out_shape[1])
        sources["output"] = out_src
        out_mod = self._output_module(name, module)
        key = default_mask_key(name, module, root_config) if self.mask_key == "auto" else self.mask_key
        logit_form = resolve_logit_form(
            () if self.logits is None else (self.logits,),
            module,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=d,
            root_config=root_config,
            undeclared=(
                f"{type(module).__name__}: AttentionSpec(modules={self.modules!r}) declares no logits=LogitRule(...) "
                "(position scheme, scale, QK-norm) that matches it"
            ),
        )
        return AttentionLayer(
            name,
            module,
            family=self.family,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=d,
            model_dim=out_shape[0],
            weights=sources,
            output_module=out_mod,
            mask_key=key,
            kv_map=self.kv_map,
            logit_form=logit_form,
        )

    def _check_declared(self, name: str, module: nn.Module, heads: int, head_dim: int, inner: int) -> None:
        """Refuse a spec whose head count contradicts the one the module itself declares.

        Only a declaration that fits the weights counts (``declared heads x declared head_dim`` is
        the out-projection's input width, or one of them divides it): a count that sharding rewrote
        (tensor parallelism sets ``num_heads //= tp``) no longer fits the full weights and is left
        alone, as discovery does.
        """
        if self.num_heads is None and self.head_dim is None:
            return  # the counts were read from the module: nothing to contradict
        own_heads = next((v for n in HEADS_ATTRS if (v := _positive(getattr(module, n, None))) is not None), None)
        own_dim = next((v for n in DIM_ATTRS if (v := _positive(getattr(module, n, None))) is not None), None)
        if own_heads is None and own_dim is None:
            return
        if own_heads is not None and own_dim is not None:
            fits = own_heads * own_dim == inner
        else:
            fits = inner % (own_heads or own_dim or 1) == 0
        if not fits:
            return
        if own_heads is None:
            assert own_dim is not None
            own_heads = inner // own_dim
        own_dim = own_dim or inner // own_heads
        if (own_heads, own_dim) != (heads, head_dim):
            given = ", ".join(
                f"{label}={value}"
                for label, value in (("num_heads", self.num_heads), ("head_dim", self.head_dim))
                if value is not None
            )
            raise ValueError(
                f"{name}: AttentionSpec({given}) reads {heads} heads of width {head_dim}, but "
                f"{type(module).__name__} declares {own_heads} heads of width {own_dim} (its attributes fit "
                f"the weights: {own_heads} x {own_dim} = {inner}); remove num_heads/head_dim from the spec to "
                "read them from the module, or correct them"
            )

    def _warn_if_packed(self, name: str, tensors: dict[str, Tensor]) -> None:
        """Slices of one fused weight given as query/key/value: their layout cannot be checked."""
        ptrs = set()
        for t in tensors.values():
            try:
                ptrs.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # e.g. DTensor / meta
                return
        if len(ptrs) == 1:
            warnings.warn(
                f"hdi_monitor: {name}: AttentionSpec query, key and value are slices of one fused weight; whether "
                "the slices are the heads the module uses cannot be checked (GPT-NeoX, Bloom and GPTBigCode "
                "interleave heads as (H, 3, d)). Prefer AttentionSpec(qkv=..., qkv_layout=...), which says the layout",
                UserWarning,
                stacklevel=4,
            )

    def _output_module(self, name: str, module: nn.Module) -> nn.Module | None:
        out_path = self.output_module
        if out_path is None:
            if isinstance(self.output, str):
                target = _resolve(module, self.output)
                return target if isinstance(target, nn.Module) else None
            return None
        try:
            out_mod = _resolve(module, out_path)
        except AttributeError as exc:
            raise ValueError(
                f"{name}: AttentionSpec.output_module={out_path!r} does not resolve: no attribute {exc.args[0]!r}"
            ) from None
        if not isinstance(out_mod, nn.Module):
            raise ValueError(f"{name}: AttentionSpec.output_module={out_path!r} is not an nn.Module")
        return out_mod


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def anchored(pattern: str) -> str:
    """``pattern`` anchored to whole names: ``^...$``, an alternation grouped first
    (``'attn|mlp'`` -> ``'^(attn|mlp)$'``, which does not match ``attn_norm``)."""
    inner = pattern.removeprefix("^").removesuffix("$")
    if "|" in inner:
        inner = f"({inner})"
    return f"^{inner}$"


def as_specs(spec: AttentionSpec | Sequence[AttentionSpec] | None) -> tuple[AttentionSpec, ...]:
    """``spec=`` as a tuple of specs (one spec, a list or tuple of specs, or None).

    Raises:
        TypeError: anything else (a string such as ``"bert"`` included).
    """
    if spec is None:
        return ()
    if isinstance(spec, AttentionSpec):
        return (spec,)
    if isinstance(spec, (list, tuple)) and all(isinstance(s, AttentionSpec) for s in spec):
        return tuple(spec)
    raise TypeError(f"spec must be an AttentionSpec, a list of AttentionSpec or None, got {type(spec).__name__}")
