"""How one declarative `Layout` entry reads an attention module: head counts (`resolve_heads`),
fused row layouts (`split_fused`), padding-mask keys, and `build_layer`, the one place where a
table entry becomes an `AttentionLayer`; the refusals (`class_refusal`, `fused_refusal`) and
`layout_adapters`, which turns a table into registry adapters. The entries themselves are the
data-only table in `hdi_monitor.models.layouts`.

Fused row layouts (``nn.Linear`` rows, ``H`` query heads, ``H_kv`` key/value heads, width ``d``):

* ``"contiguous"``: ``[q (H d) | k (H_kv d) | v (H_kv d)]``, each head-major (GPT-2, Phi-3, litgpt,
  timm, ``nn.MultiheadAttention``).
* ``"interleaved"``: ``(H, 3, d)``: head ``h``'s q, k, v rows next to each other (GPT-NeoX, Bloom,
  GPTBigCode without multi-query, Falcon old architecture without multi-query).
* ``"grouped"``: ``(H_kv, H / H_kv + 2, d)``: per key/value group its query heads, then its key and
  value (Falcon new decoder architecture).
* ``"multi_query"``: ``[q (H d) | k (d) | v (d)]``, ``H_kv = 1`` (GPTBigCode and Falcon with
  multi-query).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models.base import Adapter, AdapterMismatch, AttentionLayer, KVMap, WeightSource
from hdi_monitor.models.heads import DIM_ATTRS, HEADS_ATTRS, KV_ATTRS, get_path, holders, lookup, resolve_heads
from hdi_monitor.models.logits import LogitRule, resolve_logit_form
from hdi_monitor.models.tensor_parallel import fused_tp_refusal, tensor_parallel_of
from hdi_monitor.models.weights import base_layer, in_features, is_projection, linear_weight, out_features

__all__ = [
    "DIM_ATTRS",
    "FUSED_NAMES",
    "HEADS_ATTRS",
    "KV_ATTRS",
    "PACKINGS",
    "Layout",
    "Packing",
    "Splitter",
    "build_layer",
    "class_refusal",
    "default_mask_key",
    "fused_refusal",
    "is_vision_module",
    "layout_adapters",
    "resolve_heads",
    "split_fused",
]

Packing = Literal["contiguous", "interleaved", "grouped", "multi_query"]
PACKINGS: tuple[Packing, ...] = get_args(Packing)

#: ``split(module, fused_weight, H, H_kv, d) -> (q, k, v)``, each ``nn.Linear`` layout, head-major.
Splitter = Callable[[nn.Module, Tensor, int, int, int], tuple[Tensor, Tensor, Tensor]]

#: Child names that hold a fused q/k/v projection in some family.
FUSED_NAMES = ("qkv", "c_attn", "query_key_value", "qkv_proj", "Wqkv", "W_pack", "to_qkv", "in_proj", "qkv_linear")

_VISION_CLASS = re.compile(r"^(ViT|Vit|DeiT|Deit|Dinov2|Dinov2WithRegisters|\w*Vision)\w*Attention$")


def split_fused(w: Tensor, packing: Packing, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused q/k/v weight ``((H + 2 H_kv) d, D_in)`` into head-major q, k, v weights.

    Returns ``(H d, D_in)``, ``(H_kv d, D_in)``, ``(H_kv d, D_in)`` in ``nn.Linear`` layout, rows
    ``[h d:(h+1) d]`` being head ``h`` (query head ``h`` of group ``h // (H / H_kv)``).
    """
    if packing in ("contiguous", "multi_query"):
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        return w[:q_rows], w[q_rows : q_rows + kv_rows], w[q_rows + kv_rows :]
    if packing == "interleaved":
        parts = rearrange(w, "(h three d) m -> three (h d) m", three=3, d=head_dim)
        return parts[0], parts[1], parts[2]
    if packing == "grouped":
        g = heads // kv_heads
        parts = rearrange(w, "(k s d) m -> s k d m", s=g + 2, d=head_dim)
        q = rearrange(parts[:g], "s k d m -> (k s d) m")
        return q, rearrange(parts[g], "k d m -> (k d) m"), rearrange(parts[g + 1], "k d m -> (k d) m")
    raise ValueError(f"unknown packing {packing!r}; choose from {PACKINGS}")


def is_vision_module(name: str, module: nn.Module) -> bool:
    """A module of a vision tower: its ``config`` has ``image_size``/``patch_size``, or its class or
    qualified name says so."""
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "patch_size") and hasattr(cfg, "image_size"):
        return True
    if _VISION_CLASS.match(type(module).__name__):
        return True
    return any(part.startswith(("vision", "visual", "image_encoder")) for part in name.split("."))


def default_mask_key(name: str, module: nn.Module, root_config: Any) -> str | None:
    """The batch key of this layer's query-token mask: None for vision towers; the decoder's mask
    (``decoder_attention_mask``) for the decoder of an encoder-decoder model; else ``attention_mask``."""
    if is_vision_module(name, module):
        return None
    if bool(getattr(root_config, "is_encoder_decoder", False)):
        parts = name.split(".")
        if any(p == "decoder" or p.startswith("decoder_") for p in parts) or bool(getattr(module, "is_decoder", False)):
            return "decoder_attention_mask"
    return "attention_mask"


@dataclass(frozen=True)
class Layout:
    """One declarative family entry.

    Attributes:
        family: label written into reports.
        output: dotted path of the out-projection child (its input is the concatenated head output).
        query, key, value: dotted paths of separate projection children.
        qkv: dotted path of a fused q/k/v child (instead of ``query``/``key``/``value``).
        packing: how ``qkv`` packs its rows (`Packing`).
        cross_query: for cross-attention that keeps the query apart and packs ``[k | v]`` in ``qkv``.
        classes: regex that the module's class name must fully match; None for a structural entry
            (any class with these children). Fused entries always name their classes.
        module_prefix: the class's Python module must start with this (e.g. ``"litgpt"``).
        when: extra condition on the module (e.g. ``config.multi_query``).
        vision: True / False: only vision / only non-vision modules; None: both.
        heads_at: dotted path of the child holding the head-count attributes ("" = the module).
        kv_map: query head ``h`` reads key/value head ``h // (H / H_kv)`` (``"block"``) or
            ``h % H_kv`` (``"modulo"``, x-transformers).
        masked: False for families without token masks (timm vision models): ``mask_key`` is None.
        used_by: the models this entry covers, for errors and docs.
        split: for a fused ``qkv`` whose row order no `Packing` describes, the class's own order
            (`Splitter`); ``packing`` then only sets the check of the head counts against the rows
            (``"contiguous"`` for ``[q|k|v]``-sized fused rows).
        gated_query: separate children where ``query`` also holds an output gate, rows ``(H, 2, d)``
            per head ``[q_h | g_h]`` (Qwen3-Next: ``o * sigmoid(g)`` before ``o_proj``). The query heads
            are the ``q_h`` rows; the gate is not a projection the HDI reads, and the hooked head
            outputs are the gated ones (input of ``o_proj``).
        logits: how the modules of this entry form their logits, for the weight-only logit bound
            (`hdi_monitor.models.logits.LogitRule`, the first whose classes match); a module that
            none matches has no bound, and the report says so.
    """

    family: str
    output: str
    query: str | None = None
    key: str | None = None
    value: str | None = None
    qkv: str | None = None
    packing: Packing | None = None
    cross_query: str | None = None
    classes: str | None = None
    module_prefix: str | None = None
    when: Callable[[nn.Module], bool] | None = None
    vision: bool | None = None
    heads_at: str = ""
    kv_map: KVMap = "block"
    masked: bool = True
    used_by: str = ""
    split: Splitter | None = None
    gated_query: bool = False
    logits: tuple[LogitRule, ...] = ()
    _classes: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        separate = (self.query, self.key, self.value)
        if self.qkv is None and not all(separate):
            raise ValueError(f"Layout {self.family}: give query, key and value, or qkv")
        if self.qkv is not None and self.packing not in PACKINGS:
            raise ValueError(f"Layout {self.family}: a fused qkv needs packing in {PACKINGS}")
        if self.split is not None and self.qkv is None:
            raise ValueError(f"Layout {self.family}: split reads a fused qkv; give qkv")
        if self.gated_query and self.qkv is not None:
            raise ValueError(f"Layout {self.family}: gated_query needs separate query, key and value")
        if self.qkv is not None and self.classes is None:
            raise ValueError(f"Layout {self.family}: a fused layout must name its classes (shape cannot tell it)")
        if not isinstance(self.logits, tuple) or not all(isinstance(r, LogitRule) for r in self.logits):
            raise TypeError(f"Layout {self.family}: logits must be a tuple of LogitRule")
        if self.classes is not None:
            object.__setattr__(self, "_classes", re.compile(self.classes))

    def children(self) -> tuple[str, ...]:
        names = (self.qkv, self.cross_query) if self.qkv else (self.query, self.key, self.value)
        return tuple(n for n in names if n) + (self.output,)

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` has this layout (class, children and conditions; no weight values read)."""
        cls = type(module)
        if self._classes is not None and not self._classes.fullmatch(cls.__name__):
            return False
        if self.module_prefix is not None and not cls.__module__.startswith(self.module_prefix):
            return False
        if not all(is_projection(get_path(module, p)) for p in self.children()):
            return False
        if self.vision is not None and is_vision_module(name, module) != self.vision:
            return False
        return self.when is None or bool(self.when(module))

    def build(self, name: str, module: nn.Module, root_config: Any = None, **given: Any) -> AttentionLayer:
        """The `AttentionLayer` of a matched module (head counts resolved and checked); ``root_config``
        is the model's config, read for modules without one of their own."""
        return build_layer(self, name, module, root_config=root_config, **given)


def _source(module: nn.Module, path: str | None) -> WeightSource:
    return lambda: linear_weight(get_path(module, path))


def _gated(module: nn.Module, path: str | None, d: int) -> WeightSource:
    """The ``q_h`` rows of a query projection whose rows are ``(H, [q_h | g_h], d)``."""
    return lambda: rearrange(linear_weight(get_path(module, path)), "(h two d) m -> two (h d) m", two=2, d=d)[0]


def build_layer(
    layout: Layout,
    name: str,
    module: nn.Module,
    *,
    root_config: Any = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    mask_key: str | None | Literal["auto"] = "auto",
    family: str | None = None,
) -> AttentionLayer:
    """Build the layer of ``module`` under ``layout`` (see `resolve_heads` for the head counts;
    a fused q/k/v projection split by tensor parallelism is refused where its rows' global order is
    not known, see `hdi_monitor.models.tensor_parallel.fused_tp_refusal`)."""
    out_mod = get_path(module, layout.output)
    inner = in_features(out_mod)
    tp_split = tensor_parallel_of(module, name)
    tp = tp_split.size if tp_split is not None else 1
    notes: list[str] = []
    # (H, H_kv, d) from the rows each branch below knows, with this entry's and this module's counts
    resolve = partial(
        resolve_heads,
        name,
        module,
        inner=inner,
        heads_at=layout.heads_at,
        root_config=root_config,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tp=tp,
        notes=notes,
    )
    weights: dict[str, WeightSource]
    dims: dict[str, int] | None = None
    if layout.qkv is None and layout.gated_query:
        paths = (layout.query, layout.key, layout.value)
        q, k = get_path(module, paths[0]), get_path(module, paths[1])
        heads, kv, d = resolve(kv_rows=out_features(k))
        if out_features(q) != 2 * heads * d:
            raise AdapterMismatch(
                f"{name}: {type(module).__name__}: query rows {out_features(q)} are not (H={heads}, 2, d={d})"
            )
        weights = {
            "query": _gated(module, paths[0], d),
            "key": _source(module, paths[1]),
            "value": _source(module, paths[2]),
        }
    elif layout.qkv is None:
        paths = (layout.query, layout.key, layout.value)
        q, k, v = (get_path(module, p) for p in paths)
        if (out_features(v) != out_features(k) or out_features(q) != inner) and tp > 1:
            raise AdapterMismatch(
                f"{name}: {type(module).__name__}: query, key/value and out-projection widths differ and the layer is "
                f"split by {tp}-way tensor parallelism; such a layer's head counts are not read under tensor "
                "parallelism. Not measured"
            )
        if out_features(v) != out_features(k) or out_features(q) != inner:
            heads, kv, d, dims = _split_widths(
                name, module, layout, q, k, v, inner, root_config, num_heads, num_kv_heads
            )
        else:
            heads, kv, d = resolve(kv_rows=out_features(k))
        weights = {p: _source(module, path) for p, path in zip(("query", "key", "value"), paths, strict=True)}
    elif layout.cross_query is not None:
        fused_rows = out_features(get_path(module, layout.qkv))
        if out_features(get_path(module, layout.cross_query)) != inner or fused_rows % 2:
            raise AdapterMismatch(f"{name}: {type(module).__name__}: cross-attention widths do not fit")
        heads, kv, d = resolve(kv_rows=fused_rows // 2)
        if tp > 1:
            refusal = fused_tp_refusal(
                f"{name} ({type(module).__name__})",
                base_layer(get_path(module, layout.qkv)).weight,
                "kv",
                heads,
                kv,
                tp,
            )
            if refusal is not None:
                raise AdapterMismatch(refusal)
        half = kv * d
        qkv_path = layout.qkv
        weights = {
            "query": _source(module, layout.cross_query),
            "key": lambda: linear_weight(get_path(module, qkv_path))[:half],
            "value": lambda: linear_weight(get_path(module, qkv_path))[half:],
        }
    else:
        packing = layout.packing
        assert packing is not None
        fused = get_path(module, layout.qkv)
        heads, kv, d = resolve(fused_rows=out_features(fused), packing=packing)
        refusal = fused_tp_refusal(
            f"{name} ({type(module).__name__})", base_layer(fused).weight, packing, heads, kv, tp
        )
        if refusal is not None:
            raise AdapterMismatch(refusal)
        qkv_path, splitter = layout.qkv, layout.split

        def part(i: int) -> WeightSource:
            if splitter is not None:
                return lambda: splitter(module, linear_weight(get_path(module, qkv_path)), heads, kv, d)[i]
            return lambda: split_fused(linear_weight(get_path(module, qkv_path)), packing, heads, kv, d)[i]

        weights = {"query": part(0), "key": part(1), "value": part(2)}
    weights["output"] = _source(module, layout.output)
    if mask_key == "auto":
        mask_key = default_mask_key(name, module, root_config) if layout.masked else None
    d_qk = (dims or {}).get("query", d)
    logit_form = resolve_logit_form(
        layout.logits,
        module,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d_qk,
        heads_at=layout.heads_at,
        root_config=root_config,
    )
    return AttentionLayer(
        name,
        module,
        family=family or layout.family,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d,
        model_dim=out_features(out_mod),
        weights=weights,
        output_module=out_mod,
        mask_key=mask_key,
        kv_map=layout.kv_map,
        projection_dims=dims,
        notes=tuple(notes),
        logit_form=logit_form,
    )


def _split_widths(
    name: str,
    module: nn.Module,
    layout: Layout,
    q: nn.Module,
    k: nn.Module,
    v: nn.Module,
    inner: int,
    root_config: Any,
    num_heads: int | None,
    num_kv_heads: int | None,
) -> tuple[int, int, int, dict[str, int]]:
    """Query/key heads of width ``d_qk`` and value heads of width ``d_v != d_qk`` (MiMo, some speech
    encoders): ``H`` must be known (given or an attribute); ``d_v`` is the out-projection's input / H."""
    cls = type(module).__name__
    heads = num_heads
    if heads is None:
        heads, _ = lookup(holders(module, layout.heads_at, root_config), HEADS_ATTRS)
    q_rows, k_rows, v_rows = out_features(q), out_features(k), out_features(v)
    if heads is None or q_rows % heads or inner % heads:
        raise AdapterMismatch(
            f"{name}: {cls}: query ({q_rows}), key ({k_rows}), value ({v_rows}) and out-projection input ({inner}) "
            "widths differ and no head count splits them; pass AttentionSpec(num_heads=...)"
        )
    d_qk, d_v = q_rows // heads, inner // heads
    kv = k_rows // d_qk if k_rows % d_qk == 0 else 0
    if kv < 1 or v_rows != kv * d_v or heads % kv or (num_kv_heads is not None and num_kv_heads != kv):
        raise AdapterMismatch(
            f"{name}: {cls}: key ({k_rows}) and value ({v_rows}) widths do not split into the same key/value heads "
            f"for {heads} query heads of width {d_qk} and value width {d_v}"
        )
    return heads, kv, d_v, {"query": d_qk, "key": d_qk, "value": d_v, "output": d_v}


# ------------------------------------------------------------------------------- reading the table


def class_refusal(
    module: nn.Module, refused: tuple[tuple[str, str], ...], by_package: tuple[tuple[str, str], ...] = ()
) -> str | None:
    """The refusal message for a class that ``refused`` (``(class regex, reason)`` pairs, e.g.
    `hdi_monitor.models.layouts.REFUSED`) names, or an attention-like class from a package that
    ``by_package`` (``(module prefix, reason)`` pairs, `hdi_monitor.models.layouts.REFUSED_PACKAGES`)
    names, else None."""
    cls = type(module).__name__
    for pattern, reason in refused:
        if re.fullmatch(pattern, cls):
            return f"{cls}: {reason}"
    where = type(module).__module__
    for prefix, reason in by_package:
        if (where == prefix or where.startswith(prefix + ".")) and re.search("attention", cls, re.IGNORECASE):
            return f"{cls} ({where}): {reason}"
    return None


def fused_refusal(name: str, module: nn.Module) -> str | None:
    """The refusal message for a module with a fused q/k/v child whose layout no entry knows, else None."""
    for child in FUSED_NAMES:
        m = getattr(module, child, None)
        if is_projection(m) and out_features(m) > in_features(m):
            cls = type(module).__name__
            return (
                f"{cls} has a fused q/k/v projection {child!r} whose row layout is not known for this class "
                f"(it cannot be told from the shapes); not measured. Describe it with AttentionSpec("
                f"modules=..., qkv={child!r}, qkv_layout=..., output=...), qkv_layout one of {PACKINGS}"
            )
    return None


def _first(entries: list[Layout], name: str, module: nn.Module) -> Layout | None:
    return next((e for e in entries if e.matches(name, module)), None)


def _matches_any(entries: list[Layout], name: str, module: nn.Module) -> bool:
    return _first(entries, name, module) is not None


def _build_first(entries: list[Layout], name: str, module: nn.Module, root_config: Any = None) -> AttentionLayer:
    entry = _first(entries, name, module)
    if entry is None:
        raise AdapterMismatch(f"{name}: {type(module).__name__} does not match its layout any more")
    return entry.build(name, module, root_config)


def layout_adapters(layouts: tuple[Layout, ...]) -> list[Adapter]:
    """A layout table as registry `Adapter` objects: one per family label, in table order,
    trying that family's entries in order. Their ``build`` takes the model's config as
    ``root_config`` (see `Adapter`)."""
    families: dict[str, list[Layout]] = {}
    for lay in layouts:
        families.setdefault(lay.family, []).append(lay)
    return [
        Adapter(
            family=family,
            classes="; ".join(e.used_by or ", ".join(e.children()) for e in entries),
            match=partial(_matches_any, entries),
            build=partial(_build_first, entries),
        )
        for family, entries in families.items()
    ]
