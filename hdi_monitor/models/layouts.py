"""Family knowledge as data: one `Layout` entry per attention layout, and the code that reads one.

A layout entry names the children of an attention module that hold its projections (separate
``query``/``key``/``value`` children or one fused ``qkv`` child), how a fused projection packs its
rows (`Packing`), the out-projection child, and where the head counts live. `LAYOUTS`
is the built-in table; `build_layer` turns a matched module into an
`AttentionLayer`, reading head counts from the module (or the child
named by ``heads_at``), then its ``config``, then the model's ``config`` (only for modules without
one), and checking every count against the weights' shapes.

Fused layouts differ by family and cannot be told apart by shape, so a fused entry is always tied
to module classes; a module with a fused child that no entry knows is refused (see
`fused_refusal`), never guessed.

Size: about 300 of the module's lines are the `LAYOUTS` data table (one entry per layout, kept
one field per line); the code that reads an entry is the rest.

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

import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, get_args

from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models.base import Adapter, AdapterMismatch, AttentionLayer, KVMap, WeightSource
from hdi_monitor.models.weights import base_layer, in_features, is_conv1d, is_projection, linear_weight, out_features

__all__ = [
    "FUSED_NAMES",
    "KVMap",
    "LAYOUTS",
    "Layout",
    "PACKINGS",
    "Packing",
    "ROOT_CONFIG",
    "REFUSED",
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

#: Attribute names that hold head counts and widths, tried in order (module, then its config).
HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_query_groups")
DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "dim_head", "d_kv")

#: Child names that hold a fused q/k/v projection in some family.
FUSED_NAMES = ("qkv", "c_attn", "query_key_value", "qkv_proj", "Wqkv", "W_pack", "to_qkv", "in_proj", "qkv_linear")

_VISION_CLASS = re.compile(r"^(ViT|Vit|DeiT|Deit|Dinov2|Dinov2WithRegisters|\w*Vision)\w*Attention$")


def _get(module: nn.Module, path: str | None) -> Any:
    obj: Any = module
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _lookup(holders: list[Any], names: tuple[str, ...]) -> tuple[int | None, str]:
    for holder, where in holders:
        if holder is None:
            continue
        for n in names:
            v = _positive_int(getattr(holder, n, None))
            if v is not None:
                return v, f"{where}.{n}"
    return None, ""


def _from_config(where: str | None) -> bool:
    """Whether a `_lookup` location is a config (the module's own or the model's), not the module."""
    return where is not None and where.startswith(("config.", "model.config."))


def _holders(module: nn.Module, heads_at: str, root_config: Any) -> list[tuple[Any, str]]:
    holder = _get(module, heads_at) if heads_at else module
    out: list[tuple[Any, str]] = [(holder, type(holder).__name__)]
    if holder is not module:
        out.append((module, type(module).__name__))
    own = getattr(holder, "config", None) or getattr(module, "config", None)
    if own is not None and not isinstance(own, nn.Module):
        out.append((own, "config"))
    elif root_config is not None:
        out.append((root_config, "model.config"))
    return out


def resolve_heads(
    name: str,
    module: nn.Module,
    *,
    inner: int,
    kv_rows: int | None = None,
    fused_rows: int | None = None,
    packing: Packing | None = None,
    heads_at: str = "",
    root_config: Any = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> tuple[int, int, int]:
    """``(H, H_kv, d)`` of one attention module, from the given values, the module, or ``config``.

    ``inner`` is ``H * d`` (the out-projection's input width); ``kv_rows`` is ``H_kv * d`` for
    separate key/value projections, ``fused_rows`` the fused projection's row count with its
    ``packing``. Every count found is checked against these widths.

    Raises:
        AdapterMismatch: no head count is known, or the counts do not fit the weights.
    """
    holders = _holders(module, heads_at, root_config)
    where = {}
    if head_dim is None:
        head_dim, where["head_dim"] = _lookup(holders, DIM_ATTRS)
    if num_heads is None:
        num_heads, where["num_heads"] = _lookup(holders, HEADS_ATTRS)
    if num_kv_heads is None:
        num_kv_heads, where["num_kv_heads"] = _lookup(holders, KV_ATTRS)
    cls = type(module).__name__
    if head_dim is not None and inner % head_dim == 0:
        heads = inner // head_dim
        if (
            num_heads is not None
            and num_heads != heads
            and _from_config(where.get("num_heads"))
            and not _from_config(where.get("head_dim"))
        ):
            # the module's own head_dim against a count from the config it shares with its siblings
            # (a pruned Llama layer has fewer heads than config.num_attention_heads): the module wins
            num_heads = heads
        elif num_heads is not None and num_heads != heads and where.get("head_dim"):
            # a head_dim read from config may describe another width (e.g. a partial rotary dim)
            if inner % num_heads:
                raise AdapterMismatch(
                    f"{name}: {cls} has {inner} head-output features, which fit neither "
                    f"{num_heads} heads ({where.get('num_heads') or 'given'}) nor head_dim {head_dim}"
                )
            heads, head_dim = num_heads, inner // num_heads
        elif num_heads is not None and num_heads != heads:
            raise AdapterMismatch(
                f"{name}: {cls}: {num_heads} heads x head_dim {head_dim} != {inner} head-output features"
            )
    elif num_heads is None and head_dim is not None:
        raise AdapterMismatch(f"{name}: {cls}: {inner} head-output features are not a multiple of head_dim {head_dim}")
    elif num_heads is not None:
        if inner % num_heads:
            raise AdapterMismatch(f"{name}: {cls}: {inner} head-output features do not split into {num_heads} heads")
        heads, head_dim = num_heads, inner // num_heads
    else:
        raise AdapterMismatch(
            f"{name}: {cls} has no head count: none of the attributes {HEADS_ATTRS + DIM_ATTRS} on the module or "
            "its config; pass AttentionSpec(num_heads=...)"
        )
    if fused_rows is not None:
        if packing == "interleaved":
            kv = heads
        elif packing == "multi_query":
            kv = 1
        else:
            rest = fused_rows - heads * head_dim
            kv = rest // (2 * head_dim) if rest > 0 and rest % (2 * head_dim) == 0 else 0
        if kv < 1 or fused_rows != (heads + 2 * kv) * head_dim:
            raise AdapterMismatch(
                f"{name}: {cls}: fused projection has {fused_rows} rows, which is not the {packing} packing of "
                f"{heads} query heads of width {head_dim}"
            )
    elif kv_rows is not None:
        if kv_rows % head_dim:
            raise AdapterMismatch(f"{name}: {cls}: key/value width {kv_rows} is not a multiple of head_dim {head_dim}")
        kv = kv_rows // head_dim
    else:
        kv = num_kv_heads or heads
    if (
        num_kv_heads is not None
        and num_kv_heads != kv
        and not where.get("num_kv_heads", "").startswith(("config.", "model.config."))
    ):
        # given, or an attribute of the module itself: a contradiction. (A config attribute that the
        # module does not use, e.g. num_key_value_heads of an encoder-decoder, yields to the weights.)
        raise AdapterMismatch(f"{name}: {cls}: {num_kv_heads} key/value heads given, the weights have {kv}")
    if heads % kv:
        raise AdapterMismatch(f"{name}: {cls}: {heads} query heads are not a multiple of {kv} key/value heads")
    return heads, kv, head_dim


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
    _classes: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        separate = (self.query, self.key, self.value)
        if self.qkv is None and not all(separate):
            raise ValueError(f"Layout {self.family}: give query, key and value, or qkv")
        if self.qkv is not None and self.packing not in PACKINGS:
            raise ValueError(f"Layout {self.family}: a fused qkv needs packing in {PACKINGS}")
        if self.qkv is not None and self.classes is None:
            raise ValueError(f"Layout {self.family}: a fused layout must name its classes (shape cannot tell it)")
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
        if not all(is_projection(_get(module, p)) for p in self.children()):
            return False
        if self.vision is not None and is_vision_module(name, module) != self.vision:
            return False
        return self.when is None or bool(self.when(module))

    def build(self, name: str, module: nn.Module, root_config: Any = None, **given: Any) -> AttentionLayer:
        """The `AttentionLayer` of a matched module (head counts resolved and checked)."""
        return build_layer(self, name, module, root_config=root_config, **given)


def _source(module: nn.Module, path: str | None) -> WeightSource:
    return lambda: linear_weight(_get(module, path))


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
    """Build the layer of ``module`` under ``layout`` (see `resolve_heads` for the head counts)."""
    out_mod = _get(module, layout.output)
    inner = in_features(out_mod)
    weights: dict[str, WeightSource]
    dims: dict[str, int] | None = None
    if layout.qkv is None:
        paths = (layout.query, layout.key, layout.value)
        q, k, v = (_get(module, p) for p in paths)
        if out_features(v) != out_features(k) or out_features(q) != inner:
            heads, kv, d, dims = _split_widths(
                name, module, layout, q, k, v, inner, root_config, num_heads, num_kv_heads
            )
        else:
            heads, kv, d = resolve_heads(
                name,
                module,
                inner=inner,
                kv_rows=out_features(k),
                heads_at=layout.heads_at,
                root_config=root_config,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
            )
        weights = {p: _source(module, path) for p, path in zip(("query", "key", "value"), paths, strict=True)}
    elif layout.cross_query is not None:
        fused_rows = out_features(_get(module, layout.qkv))
        if out_features(_get(module, layout.cross_query)) != inner or fused_rows % 2:
            raise AdapterMismatch(f"{name}: {type(module).__name__}: cross-attention widths do not fit")
        heads, kv, d = resolve_heads(
            name,
            module,
            inner=inner,
            kv_rows=fused_rows // 2,
            heads_at=layout.heads_at,
            root_config=root_config,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        half = kv * d
        qkv_path = layout.qkv
        weights = {
            "query": _source(module, layout.cross_query),
            "key": lambda: linear_weight(_get(module, qkv_path))[:half],
            "value": lambda: linear_weight(_get(module, qkv_path))[half:],
        }
    else:
        packing = layout.packing
        assert packing is not None
        fused = _get(module, layout.qkv)
        heads, kv, d = resolve_heads(
            name,
            module,
            inner=inner,
            fused_rows=out_features(fused),
            packing=packing,
            heads_at=layout.heads_at,
            root_config=root_config,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        qkv_path = layout.qkv

        def part(i: int) -> WeightSource:
            return lambda: split_fused(linear_weight(_get(module, qkv_path)), packing, heads, kv, d)[i]

        weights = {"query": part(0), "key": part(1), "value": part(2)}
    weights["output"] = _source(module, layout.output)
    if mask_key == "auto":
        mask_key = default_mask_key(name, module, root_config) if layout.masked else None
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
        heads, _ = _lookup(_holders(module, layout.heads_at, root_config), HEADS_ATTRS)
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


#: Classes that look like a known layout but compute attention differently: refused with the reason.
REFUSED: tuple[tuple[str, str], ...] = (
    (
        r"\w*(Delta|Linear|Lightning)\w*Attention",
        "linear attention (no softmax kernel over q/k); its heads are not "
        "the Nadaraya-Watson heads the HDI describes. Not measured",
    ),
    (
        r"DiffLlama\w*Attention",
        "differential attention pairs heads (two softmax maps per value head); its heads are "
        "not q/k/v row blocks. Not measured; describe the heads you mean with an AttentionSpec",
    ),
)


def class_refusal(module: nn.Module) -> str | None:
    """The refusal message for a class known not to fit its look-alike layout, else None."""
    cls = type(module).__name__
    for pattern, reason in REFUSED:
        if re.fullmatch(pattern, cls):
            return f"{cls}: {reason}"
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


# ------------------------------------------------------------------------------------------ the table


def _cfg(module: nn.Module, attr: str) -> bool:
    cfg = getattr(module, "config", None)
    return bool(getattr(module, attr, getattr(cfg, attr, False)))


def _cross(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False))


def _has_n_head(module: nn.Module) -> bool:
    return _positive_int(getattr(module, "n_head", None)) is not None


# A data table, one compact entry per layout: kept as written, not reformatted.
# fmt: off
LAYOUTS: tuple[Layout, ...] = (
    Layout("timm_vit", "proj", qkv="qkv", packing="contiguous", classes=r"Attention|AttentionRope",
           when=lambda m: _positive_int(getattr(m, "num_heads", None)) is not None, masked=False,
           used_by="timm Attention / AttentionRope (ViT, DeiT, EVA, ...)"),
    Layout("timm_vit", "proj", "q_proj", "k_proj", "v_proj", classes=r"AttentionRope", masked=False,
           used_by="timm AttentionRope(qkv_fused=False)"),
    Layout("vit", "o_proj", "q_proj", "k_proj", "v_proj", vision=True,
           used_by="ViT, DeiT, Dinov2 and other vision towers with q_proj/k_proj/v_proj/o_proj"),
    Layout("vit", "output.dense", "attention.query", "attention.key", "attention.value", vision=True,
           heads_at="attention", used_by="ViT-style attention of transformers 4.x"),
    Layout("bert", "output.dense", "self.query", "self.key", "self.value", heads_at="self",
           used_by="BERT, RoBERTa, ELECTRA, XLM-R, Camembert, ... (self- and cross-attention)"),
    Layout("deberta", "output.dense", "self.query_proj", "self.key_proj", "self.value_proj", heads_at="self",
           used_by="DeBERTa, DeBERTa-v2/v3 (content projections)"),
    Layout("gpt2", "c_proj", cross_query="q_attn", qkv="c_attn", packing="contiguous",
           classes=r"(GPT2|DecisionTransformerGPT2|ImageGPT)Attention", when=_cross,
           used_by="GPT-2 cross-attention (query in q_attn, [k|v] in c_attn)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: is_conv1d(base_layer(getattr(m, "c_attn", None))) and not _cross(m),
           used_by="GPT-2 and its copies (Conv1D c_attn, transposed weights)"),
    Layout("gpt2", "c_proj", qkv="c_attn", packing="contiguous", classes=r"\w+",
           when=lambda m: _has_n_head(m) and isinstance(getattr(m, "c_attn", None), nn.Module) and not _cross(m),
           used_by="nanoGPT-style c_attn/c_proj nn.Linear with n_head"),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="multi_query", classes=r"GPTBigCode\w*Attention",
           when=lambda m: _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode / StarCoder, multi_query=True"),
    Layout("gpt_bigcode", "c_proj", qkv="c_attn", packing="interleaved", classes=r"GPTBigCode\w*Attention",
           when=lambda m: not _cfg(m, "multi_query") and not _cross(m), used_by="GPTBigCode, multi_query=False"),
    Layout("falcon", "dense", qkv="query_key_value", packing="grouped", classes=r"Falcon\w*Attention",
           when=lambda m: _cfg(m, "new_decoder_architecture"), used_by="Falcon, new decoder architecture (GQA)"),
    Layout("falcon", "dense", qkv="query_key_value", packing="multi_query", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and _cfg(m, "multi_query"),
           used_by="Falcon, old architecture with multi-query"),
    Layout("falcon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Falcon\w*Attention",
           when=lambda m: not _cfg(m, "new_decoder_architecture") and not _cfg(m, "multi_query"),
           used_by="Falcon, old architecture without multi-query"),
    Layout("gpt_neox", "dense", qkv="query_key_value", packing="interleaved", classes=r"GPTNeoX\w*Attention",
           used_by="GPT-NeoX, Pythia"),
    Layout("bloom", "dense", qkv="query_key_value", packing="interleaved", classes=r"Bloom\w*Attention",
           used_by="Bloom"),
    Layout("phi3", "o_proj", qkv="qkv_proj", packing="contiguous", classes=r"Phi3\w*Attention",
           used_by="Phi-3 (fused qkv_proj, GQA)"),
    Layout("phi3", "o_proj", qkv="qkv_proj", packing="contiguous", classes=r"Phi4MultimodalAttention",
           used_by="Phi-4-multimodal language model"),
    Layout("mpt", "out_proj", qkv="Wqkv", packing="contiguous", classes=r"MptAttention", used_by="MPT"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", classes=r"Exaone4_5_VisionAttention|MgpstrAttention",
           masked=False, used_by="EXAONE 4.5 vision tower (split [q|k|v]), MGP-STR"),
    Layout("vision_qkv", "output.dense", qkv="attention.qkv", packing="contiguous", classes=r"TimeSformerAttention",
           heads_at="attention", masked=False, used_by="TimeSformer"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", module_prefix="transformers.", masked=False,
           classes=r"(CohereCompass|Dots3Note|Ernie4_5_VLMoe|Glm4vMoe|Glm4v|Glm5Next|GlmImage|GlmOcr|Qwen2_5_VL|"
                   r"Qwen3OmniMoe|Qwen3VLMoe|Qwen3VL|Qwen3_5Moe|Qwen3_5|Qwen4Exp)VisionAttention|Sam2MultiScaleAttention|"
                   r"VitDetAttention|\w*SamVision(Sdpa)?Attention|SamHQVision(Sdpa)?Attention|GotOcr2Vision(Sdpa)?Attention|"
                   r"SegGptAttention",
           used_by="Qwen2/2.5/3-VL, GLM-4V, SAM, SAM-HQ, SAM 2, GOT-OCR2, SegGPT and VitDet vision towers "
                   "(qkv reshaped (3, H, d))"),
    Layout("vision_qkv", "proj", qkv="qkv", packing="contiguous", classes=r"VisionAttention",
           module_prefix="transformers.models.qwen2_vl", masked=False, used_by="Qwen2-VL vision tower"),
    Layout("blip", "projection", qkv="qkv", packing="contiguous", classes=r"(Blip2|InstructBlip|InstructBlipVideo)Attention",
           masked=False, used_by="BLIP-2 / InstructBLIP vision towers"),
    Layout("modernbert", "Wo", qkv="Wqkv", packing="contiguous", classes=r"ModernBert\w*Attention",
           used_by="ModernBERT (Wqkv viewed (3, H, d))"),
    Layout("persimmon", "dense", qkv="query_key_value", packing="interleaved", classes=r"Persimmon\w*Attention",
           used_by="Persimmon, Fuyu"),
    Layout("litgpt", "proj", qkv="qkv", packing="contiguous", classes=r"CausalSelfAttention",
           module_prefix="litgpt", used_by="litgpt GPT (n_query_groups GQA)"),
    Layout("t5", "o", "q", "k", "v", used_by="T5, mT5, UMT5 (encoder, decoder self- and cross-attention)"),
    Layout("llama", "o_proj", "q_proj", "k_proj", "v_proj",
           used_by="Llama, Mistral, Mixtral, Qwen2/3, Gemma 1/2/3, OLMo 1/2, DeepSeek (MHA), ..."),
    Layout("bart", "out_proj", "q_proj", "k_proj", "v_proj",
           used_by="BART, mBART, Marian, Pegasus, Whisper, Wav2Vec2, OPT, GPT-J, CLIP, SigLIP, ..."),
    Layout("phi", "dense", "q_proj", "k_proj", "v_proj", used_by="Phi-1/1.5/2"),
    Layout("vit", "proj", "q_proj", "k_proj", "v_proj", used_by="vision towers with q_proj/k_proj/v_proj/proj (Kimi-K2.5, ...)"),
    Layout("vit", "projection_layer", "q_proj", "k_proj", "v_proj", used_by="InternVL, Janus vision towers"),
    Layout("modernbert", "Wo", "q_proj", "k_proj", "v_proj", used_by="ModernBERT decoder"),
    Layout("conformer", "linear_out", "linear_q", "linear_k", "linear_v",
           used_by="Wav2Vec2-Conformer, Wav2Vec2-BERT, SeamlessM4T, FastSpeech2-Conformer (content projections)"),
    Layout("ctrl", "dense", "Wq", "Wk", "Wv", used_by="CTRL"),
    Layout("bert_attention", "output.dense", "attention.query", "attention.key", "attention.value",
           heads_at="attention", used_by="FLAVA and other attention.{query,key,value} + output.dense modules"),
    Layout("distilbert", "out_lin", "q_lin", "k_lin", "v_lin", used_by="DistilBERT"),
    Layout("albert", "dense", "query", "key", "value", used_by="ALBERT (one module shared by all layers)"),
    Layout("x_transformers", "to_out", "to_q", "to_k", "to_v", classes=r"Attention", module_prefix="x_transformers",
           kv_map="modulo", used_by="x-transformers Attention (GQA maps query head h to h % H_kv)"),
    Layout("wqkvo", "wo", "wq", "wk", "wv", used_by="Meta-reference style wq/wk/wv/wo"),
)
# fmt: on
from hdi_monitor.models.layouts_more import MORE_REFUSED, merged  # noqa: E402  (its entries need Layout)

LAYOUTS, REFUSED = merged(LAYOUTS), REFUSED + MORE_REFUSED


#: The model config of the discovery under way (for modules without a config of their own).
ROOT_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("hdi_monitor_root_config", default=None)


def _matches_any(first: Callable[[str, nn.Module], Layout | None], name: str, module: nn.Module) -> bool:
    return first(name, module) is not None


def layout_adapters(layouts: tuple[Layout, ...] = LAYOUTS) -> list[Adapter]:
    """The layout table as registry `Adapter` objects: one per family label, in table order,
    trying that family's entries in order."""
    families: dict[str, list[Layout]] = {}
    for lay in layouts:
        families.setdefault(lay.family, []).append(lay)
    out = []
    for family, entries in families.items():

        def first(name: str, module: nn.Module, _entries: list[Layout] = entries) -> Layout | None:
            return next((e for e in _entries if e.matches(name, module)), None)

        def build(name: str, module: nn.Module, _first=first) -> AttentionLayer:
            entry = _first(name, module)
            if entry is None:
                raise AdapterMismatch(f"{name}: {type(module).__name__} does not match its layout any more")
            return entry.build(name, module, ROOT_CONFIG.get())

        out.append(
            Adapter(
                family=family,
                classes="; ".join(e.used_by or ", ".join(e.children()) for e in entries),
                match=partial(_matches_any, first),
                build=build,
            )
        )
    return out
