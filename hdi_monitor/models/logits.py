"""How an attention layer forms its logits from its projections, as data: `LogitRule` (declared on
`hdi_monitor.models.layouts.LAYOUTS` entries and on `AttentionSpec`), `LogitForm` (resolved for one
layer: ``AttentionLayer.logit_form``) and the QK-norm classes whose gains are read (`QK_NORMS`).

The weight-only logit bound (DESIGN.md rule 9, `hdi_monitor.functional.bilinear`) needs three
facts about a layer that its weights do not carry, and this module is where they are declared:

* **position scheme**: ``rotary=False`` when queries and keys reach the product unrotated (absolute
  or no position embeddings; an additive position bias such as T5's or ALiBi is not part of the
  bilinear form and is left out), ``True`` when both are rotated by their positions (rotary
  embeddings, partial ones included), ``None`` when not known. Rotated or unknown, the bound is the
  product bound ``sigma_max(W_Q,h) sigma_max(W_K,g(h))``, which holds for any rotation of either;
  ``False`` is declared only where the family is known not to rotate.
* **scale**: the number the module multiplies ``<q, k>`` by, whether it passes it to the kernel or
  folds it into the queries (Whisper, OPT): a number, ``"1/sqrt(d)"`` (`INVERSE_SQRT_D`), or the
  name of the module attribute that holds it (transformers 5 attention modules keep it as
  ``scaling``; GPT-2's already includes ``scale_attn_weights`` and
  ``scale_attn_by_inverse_layer_idx``, Gemma's ``query_pre_attn_scalar``).
* **QK-norm**: a query norm and a key norm between the projections and the product. They are
  found by their child names (`QK_NORM_PAIRS`; a `LogitRule` may name them instead). Their gains
  are read only for the classes `QK_NORMS` lists (an RMSNorm or LayerNorm whose output is the
  normalised vector times ``weight``, or times ``1 + weight`` for Gemma 3 and Qwen3-Next style
  norms), over one head's ``d`` channels or over a whole projection's ``H d`` channels (OLMo 2).
  A child named like a QK-norm (`QK_NORM_LIKE`) that is not such a pair of known norms refuses the
  bound: it is never guessed.

Biases are left out everywhere: projection biases, the biases of LayerNorm QK-norms and
``nn.MultiheadAttention``'s ``bias_k``. A rotary layer whose configuration scales the rotary
``cos``/``sin`` (``rope_type`` ``"yarn"`` or ``"longrope"``, or an ``attention_factor``) is refused,
since that factor multiplies the logits and is not read.

A layer whose rule is not declared, or that cannot be read right (Multi-head Latent Attention, a
refused QK-norm, an unknown scale), has a `LogitForm` with a ``refusal``: the report then has no
bound for it and says why in the layer's notes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "INVERSE_SQRT_D",
    "PLAIN_ROPE_TYPES",
    "QK_NORMS",
    "QK_NORM_LIKE",
    "QK_NORM_PAIRS",
    "BoundRule",
    "LogitForm",
    "LogitRule",
    "NormGain",
    "QKNorm",
    "QKNormClass",
    "QKNormGains",
    "resolve_logit_form",
]

#: The scale ``1 / sqrt(d)`` (``d`` the query/key head width), for modules that pass no explicit scale.
INVERSE_SQRT_D = "1/sqrt(d)"

#: How a layer's logit bound is computed: the bilinear form, the rotary (product) bound, or QK-norm gains.
BoundRule = Literal["bilinear", "rotary", "qk_norm"]

#: A norm's gain: its ``weight`` (most RMSNorm / LayerNorm classes) or ``1 + weight`` (Gemma 3 style).
NormGain = Literal["weight", "1+weight"]

#: Rotary types whose ``cos``/``sin`` are not scaled (transformers' ``attention_factor`` is 1).
PLAIN_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3", "proportional"})

#: Child names of a query norm and a key norm, tried in order on the attention module (and on the
#: child holding its head counts).
QK_NORM_PAIRS: tuple[tuple[str, str], ...] = (
    ("q_norm", "k_norm"),
    ("q_layernorm", "k_layernorm"),
    ("query_norm", "key_norm"),
    ("query_layernorm", "key_layernorm"),
    ("q_ln", "k_ln"),
    ("norm_q", "norm_k"),
)

#: Child names that look like a norm of the queries or keys: such a child outside a readable pair
#: refuses the bound (``nn.Identity`` children, e.g. timm's ``q_norm`` without QK-norm, do not count).
QK_NORM_LIKE = re.compile(r"(q|k|qk|query|key)_?(norm|layernorm|layer_norm|ln|l2_?norm)|(norm|ln)_?(q|k|qk)", re.I)


@dataclass(frozen=True)
class QKNormClass:
    """A norm class whose gains are read for the QK-norm bound.

    Attributes:
        classes: regex that the class name must fully match.
        gain: ``"weight"`` (output = normalised x times ``weight``) or ``"1+weight"``.
        over: where the normalisation runs: ``"normalized_shape"`` (``torch.nn.LayerNorm`` /
            ``torch.nn.RMSNorm``: the last ``len(normalized_shape)`` dimensions; no ``weight`` is a
            gain of 1), ``"last"`` (the weight's last dimension: transformers' RMSNorm classes, and
            Cohere's per-head ``(H, d)`` LayerNorm) or ``"per_head"`` (a ``norms`` list of one
            ``torch.nn.LayerNorm`` per head: StableLM).
        module_prefix: the class's Python module must start with this.
        verified: how the entry was checked (for docs and errors).
    """

    classes: str
    gain: NormGain
    over: Literal["normalized_shape", "last", "per_head"]
    module_prefix: str
    verified: str = ""
    _pattern: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pattern", re.compile(self.classes))

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is of one of these classes."""
        cls = type(module)
        assert self._pattern is not None
        return bool(self._pattern.fullmatch(cls.__name__)) and cls.__module__.startswith(self.module_prefix)


# A data table, kept as written: each class's forward was compared with its formula on random
# weights (tests/unit/models/test_logits.py::test_qk_norm_classes_compute_their_declared_formula).
# fmt: off
QK_NORMS: tuple[QKNormClass, ...] = (
    QKNormClass(r"LayerNorm|RMSNorm", "weight", "normalized_shape", "torch.nn.", "torch.nn.LayerNorm, torch.nn.RMSNorm"),
    QKNormClass(r"(Llama|Qwen3|Qwen3Moe|Qwen3VLText|Qwen3VLMoeText|Olmo2|Olmo3|Olmoe|FlexOlmo|Granite|"
                r"Exaone4|Glm4Moe|Dots1|Apertus|Lfm2|Lfm2Moe|MiniMaxM2|Afmoe|Doge|Blt|"
                r"MllamaText|Molmo2|Gemma3n|Gemma4)RMSNorm",
                "weight", "last", "transformers.", "normalised x times weight"),
    QKNormClass(r"CohereLayerNorm", "weight", "last", "transformers.", "per-head (H, d) LayerNorm over d"),
    QKNormClass(r"(Gemma3|Qwen3Next|Qwen3_5|Qwen3_5Moe|T5Gemma2)RMSNorm", "1+weight", "last", "transformers.",
                "normalised x times (1 + weight)"),
    QKNormClass(r"StableLmLayerNormPerHead", "weight", "per_head", "transformers.", "one LayerNorm(d) per head"),
)
# fmt: on


@dataclass(frozen=True)
class LogitRule:
    """How the attention modules of one layout entry (or one `AttentionSpec`) form their logits.

    Attributes:
        classes: regex that the attention module's class name must fully match; None: every
            module the entry (or spec) matches.
        module_prefix: the class's Python module must start with this (e.g. ``"transformers."``).
        rotary: True: queries and keys are rotated by their positions (rotary embeddings); False:
            they are not (absolute or no position embeddings, an additive position bias); None:
            not known. True and None give the product bound, which holds for any rotation.
        scale: the logit scale: a number, `INVERSE_SQRT_D`, or the name of the attribute holding it
            (read on the child holding the head counts, then on the module). None: the bound is
            refused (unknown scale).
        qk_norm: the child paths ``(query norm, key norm)``; None: looked for by `QK_NORM_PAIRS`.
        refusal: a reason this family's logits are not bounded by its weights (no bound).
        note: what the bound leaves out for these modules (e.g. a relative-position bias), copied
            into the layer's notes.
    """

    classes: str | None = None
    module_prefix: str | None = None
    rotary: bool | None = None
    scale: float | str | None = None
    qk_norm: tuple[str, str] | None = None
    refusal: str | None = None
    note: str = ""
    _pattern: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rotary not in (True, False, None):
            raise TypeError(f"LogitRule.rotary must be True, False or None, got {self.rotary!r}")
        s = self.scale
        if isinstance(s, bool) or not (s is None or isinstance(s, (int, float, str))):
            raise TypeError(
                f"LogitRule.scale must be a number, {INVERSE_SQRT_D!r}, an attribute name or None, got {s!r}"
            )
        if isinstance(s, (int, float)) and not (math.isfinite(s) and s > 0):
            raise ValueError(f"LogitRule.scale must be a finite number > 0, got {s!r}")
        if self.qk_norm is not None and (
            not isinstance(self.qk_norm, tuple)
            or len(self.qk_norm) != 2
            or not all(isinstance(p, str) for p in self.qk_norm)
        ):
            raise TypeError(
                f"LogitRule.qk_norm must be a pair of child paths (query norm, key norm), got {self.qk_norm!r}"
            )
        if self.classes is not None:
            object.__setattr__(self, "_pattern", re.compile(self.classes))

    def matches(self, module: nn.Module) -> bool:
        """Whether this rule describes ``module``."""
        cls = type(module)
        if self._pattern is not None and not self._pattern.fullmatch(cls.__name__):
            return False
        return self.module_prefix is None or cls.__module__.startswith(self.module_prefix)


@dataclass(frozen=True)
class QKNormGains:
    """One reading of a layer's QK-norm: per-head gains and the largest norm of a normalised head.

    Attributes:
        query: ``(H, d)`` query gains (float32 at least).
        key: ``(H_kv, d)`` key gains.
        radius_query: the largest norm of one head's normalised query before its gain:
            ``sqrt(d)`` for a norm over one head, ``sqrt(H d)`` for a norm over the whole projection.
        radius_key: the same for the keys (``sqrt(d)`` or ``sqrt(H_kv d)``).
    """

    query: Tensor
    key: Tensor
    radius_query: float
    radius_key: float


@dataclass(frozen=True)
class QKNorm:
    """A layer's QK-norm: the two norm modules and how to read their gains.

    Attributes:
        query: child path of the query norm.
        key: child path of the key norm.
        query_over: ``"head"`` (over one head's ``d`` channels) or ``"projection"`` (over all
            ``H d``), as far as known from the modules' shapes at discovery (None where a sharded
            parameter hides it; `read` checks it again on the full gains).
        key_over: the same for the key norm.
        reader: reads the gains (see `read`).
    """

    query: str
    key: str
    query_over: Literal["head", "projection"] | None
    key_over: Literal["head", "projection"] | None
    reader: Callable[[], QKNormGains] = field(repr=False, compare=False)

    def read(self) -> QKNormGains:
        """The gains as the next forward pass uses them (detached, DTensors gathered; copies, so
        that the module's own parameters are never held). Call it where the layer's weights are
        readable (inside a sharded layer's gather; ``AttentionLayer.qk_norm_gains`` also keeps
        parametrizations as they were).

        Raises:
            hdi_monitor.exceptions.AdapterMismatch: the full gains do not fit the layer's heads.
        """
        return self.reader()


@dataclass(frozen=True)
class LogitForm:
    """How one attention layer forms its logits (``AttentionLayer.logit_form``).

    The logit of query head ``h`` for a query input ``x`` and a key input ``y`` is, biases left
    out, ``scale * (R_t x W_Q,h) . (R_s y W_K,g(h))`` with ``R_t`` the position rotation (identity
    unless ``rotary``); with ``qk_norm``, the query and key heads are normalised and multiplied by
    the norms' gains before the rotation.

    Attributes:
        rotary: True / False / None (unknown) as in `LogitRule`.
        scale: the logit scale; None only with a ``refusal``.
        qk_norm: the layer's QK-norm, or None.
        refusal: why no bound is computed for this layer (None: it is).
        notes: what the bound leaves out or assumes for this layer (shown in the report).
    """

    rotary: bool | None = None
    scale: float | None = None
    qk_norm: QKNorm | None = None
    refusal: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.refusal is None and (self.scale is None or not math.isfinite(self.scale) or self.scale <= 0):
            raise ValueError(f"LogitForm needs a finite scale > 0 or a refusal, got scale={self.scale!r}")

    @classmethod
    def refused(cls, reason: str) -> LogitForm:
        """A form with no bound, for ``reason``."""
        return cls(refusal=reason)

    @property
    def rule(self) -> BoundRule | None:
        """``"qk_norm"`` (the gains bound the logit whatever the input), ``"bilinear"`` (not
        rotated: ``scale * sigma_max(W_Q,h W_K,g^T)`` per unit-norm inputs), ``"rotary"`` (rotated
        or unknown: ``scale * sigma_max(W_Q,h) sigma_max(W_K,g)`` per unit-norm inputs), or None
        (refused)."""
        if self.refusal is not None:
            return None
        if self.qk_norm is not None:
            return "qk_norm"
        return "bilinear" if self.rotary is False else "rotary"


# ---------------------------------------------------------------------------------------- reading


def _get(module: Any, path: str) -> Any:
    obj = module
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _config(module: nn.Module, holder: Any, root_config: Any) -> Any:
    for obj in (module, holder):
        cfg = getattr(obj, "config", None)
        if cfg is not None and not isinstance(cfg, nn.Module):
            return cfg
    return root_config


def _rope_refusal(config: Any) -> str | None:
    """Why the rotary ``cos``/``sin`` of this config are scaled (their factor multiplies the logits),
    or None where they are not (or the config says nothing about them)."""
    found: list[Mapping] = []
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, Mapping):
            nested = [v for v in params.values() if isinstance(v, Mapping)]
            found += nested if nested and len(nested) == len(params) else [params]
    for params in found:
        kind = params.get("rope_type", params.get("type", "default"))
        factor = params.get("attention_factor")
        if kind not in PLAIN_ROPE_TYPES:
            return (
                f"rope_type {kind!r} scales the rotary cos/sin by an attention factor that multiplies the logits "
                "and is not read"
            )
        if factor is not None and factor != 1:
            return f"the rotary cos/sin are scaled by attention_factor={factor!r}, which is not read"
    return None


def _scale(rule: LogitRule, module: nn.Module, holder: Any, head_dim: int) -> float | str:
    """The scale, or the refusal message."""
    s = rule.scale
    if s is None:
        return "the logit scale of this class is not declared"
    if isinstance(s, (int, float)):
        return float(s)
    if s == INVERSE_SQRT_D:
        return 1.0 / math.sqrt(head_dim)
    for obj in (holder, module):
        v = getattr(obj, s, None)
        if isinstance(v, Tensor) and v.numel() == 1 and not v.is_meta:
            v = float(v.detach().float().cpu())  # a 0-d buffer (read once, at discovery)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            return float(v)
    return f"{type(module).__name__} has no positive number {s!r} (its logit scale)"


def _norm_class(norm: nn.Module, table: tuple[QKNormClass, ...]) -> QKNormClass | None:
    return next((c for c in table if c.matches(norm)), None)


def _norm_size(norm: nn.Module, kind: QKNormClass) -> tuple[int, tuple[int, ...]] | None:
    """``(normalised size, gain shape)`` from the norm's attributes and logical shapes, or None
    where they are not readable (a sharded placeholder: checked again on the full gains)."""
    from hdi_monitor.models.tensor_parallel import logical_shape

    if kind.over == "normalized_shape":
        shape = tuple(int(n) for n in getattr(norm, "normalized_shape", ()))
        if not shape:
            return None
        return math.prod(shape), shape
    if kind.over == "per_head":
        norms = getattr(norm, "norms", None)
        if not isinstance(norms, nn.ModuleList) or not len(norms):
            return None
        sizes = {tuple(getattr(n, "normalized_shape", ())) for n in norms}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            return None
        d = next(iter(sizes))[0]
        return d, (len(norms), d)
    w = getattr(norm, "weight", None)
    if not isinstance(w, Tensor):
        return None
    shape = tuple(logical_shape(w))
    if not shape or math.prod(shape) == 0:
        return None
    return shape[-1], shape


def _over(size: int, gain_shape: tuple[int, ...], heads: int, d: int) -> Literal["head", "projection"] | None:
    """Whether a norm of ``size`` channels with gains of ``gain_shape`` is over one head of ``d``
    channels (gains ``(d,)`` shared, or ``(heads, d)``) or over all ``heads * d`` (gains
    ``(heads * d,)``); None if neither."""
    if size == d and gain_shape in ((d,), (heads, d)):
        return "head"
    if size == heads * d and gain_shape in ((heads * d,), (heads, d)):
        return "projection"
    return None


def _gains(norm: nn.Module, kind: QKNormClass, heads: int, d: int, where: str) -> tuple[Tensor, float]:
    """``(heads, d)`` gains of one norm (float32 at least, a copy) and the largest norm of one
    normalised head (``sqrt`` of the number of channels normalised together)."""
    from hdi_monitor.exceptions import AdapterMismatch
    from hdi_monitor.models.tensor_parallel import full_weight

    g: Tensor
    if kind.over == "per_head":
        subs = list(getattr(norm, "norms", ()))
        if not subs or any(not isinstance(getattr(n, "weight", None), Tensor) for n in subs):
            raise AdapterMismatch(f"{where}: {type(norm).__name__} has no per-head LayerNorm weights")
        g, size = torch.stack([full_weight(n.weight) for n in subs]), d
    elif kind.over == "normalized_shape":
        shape = tuple(int(n) for n in getattr(norm, "normalized_shape", ()))
        w = getattr(norm, "weight", None)
        g = torch.ones(shape) if w is None else full_weight(w)
        size = math.prod(shape)
    else:
        w = getattr(norm, "weight", None)
        if not isinstance(w, Tensor):
            raise AdapterMismatch(f"{where}: {type(norm).__name__} has no weight tensor")
        g = full_weight(w)
        size = g.shape[-1] if g.ndim else 0
    over = _over(size, tuple(g.shape), heads, d)
    if over is None:
        raise AdapterMismatch(
            f"{where}: {type(norm).__name__} normalises {size} channels with gains of shape {tuple(g.shape)}, which "
            f"is neither one head ({d}) nor the {heads} heads ({heads * d}) of the projection"
        )
    dtype = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
    g = g.detach().to(dtype=dtype, copy=True)
    if kind.gain == "1+weight":
        g = g + 1.0
    return g.reshape(-1, d).expand(heads, d).clone() if g.numel() == d else g.reshape(heads, d), math.sqrt(size)


def _qk_norm(
    rule: LogitRule,
    module: nn.Module,
    holder_path: str,
    heads: int,
    kv_heads: int,
    d: int,
    table: tuple[QKNormClass, ...],
) -> QKNorm | str | None:
    """The layer's QK-norm, None where it has none, or the refusal message."""
    prefixes = [""] + ([holder_path] if holder_path else [])
    like: dict[str, nn.Module] = {}
    for prefix in prefixes:
        holder = _get(module, prefix)
        if not isinstance(holder, nn.Module):
            continue
        for child, sub in holder.named_children():
            if QK_NORM_LIKE.fullmatch(child) and not isinstance(sub, nn.Identity):
                like[f"{prefix}.{child}" if prefix else child] = sub
    pair: tuple[str, str] | None = rule.qk_norm
    if pair is None:
        for q, k in QK_NORM_PAIRS:
            for prefix in prefixes:
                qp, kp = (f"{prefix}.{n}" if prefix else n for n in (q, k))
                if qp in like or kp in like:
                    pair = (qp, kp)
                    break
            if pair is not None:
                break
    if pair is None:
        if like:
            return (
                f"children {sorted(like)} look like a query/key norm but are not a known pair "
                f"{[p for p in QK_NORM_PAIRS]} (declare them with LogitRule(qk_norm=...))"
            )
        return None
    others = sorted(set(like) - set(pair))
    if others:
        return f"besides the QK-norm {pair}, children {others} look like a query/key norm"
    norms = [_get(module, p) for p in pair]
    for path, norm in zip(pair, norms, strict=True):
        if not isinstance(norm, nn.Module) or isinstance(norm, nn.Identity):
            return f"QK-norm child {path!r} is missing (its pair {pair} is not complete)"
    kinds = [_norm_class(n, table) for n in norms]
    for path, norm, kind in zip(pair, norms, kinds, strict=True):
        if kind is None:
            return (
                f"QK-norm {path!r} is a {type(norm).__name__} ({type(norm).__module__}), not a known plain "
                "RMSNorm/LayerNorm with a gain; its effect on the logits is not read"
            )
    overs: list[Literal["head", "projection"] | None] = []
    for path, norm, kind, n in zip(pair, norms, kinds, (heads, kv_heads), strict=True):
        assert kind is not None
        size = _norm_size(norm, kind)
        if size is None:
            overs.append(None)
            continue
        channels, gain_shape = size
        over = _over(channels, gain_shape, n, d)
        if over is None:
            return (
                f"QK-norm {path!r} ({type(norm).__name__}) normalises {channels} channels with gains {gain_shape}, "
                f"which is neither one head ({d}) nor all {n} heads ({n * d})"
            )
        overs.append(over)
    qn, kn = norms
    qk, kk = kinds
    assert qk is not None and kk is not None
    where = type(module).__name__

    def read() -> QKNormGains:
        gq, rq = _gains(qn, qk, heads, d, f"{where}.{pair[0]}")
        gk, rk = _gains(kn, kk, kv_heads, d, f"{where}.{pair[1]}")
        return QKNormGains(gq, gk, rq, rk)

    return QKNorm(pair[0], pair[1], overs[0], overs[1], read)


def resolve_logit_form(
    rules: tuple[LogitRule, ...],
    module: nn.Module,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    heads_at: str = "",
    root_config: Any = None,
    undeclared: str | None = None,
    norms: tuple[QKNormClass, ...] = QK_NORMS,
) -> LogitForm:
    """The `LogitForm` of one attention module under the first of ``rules`` that matches it.

    Args:
        rules: the entry's (or spec's) rules, tried in order.
        module: the attention module.
        num_heads, num_kv_heads, head_dim: the layer's ``H``, ``H_kv`` and query/key head width.
        heads_at: dotted path of the child that holds the head counts (and the scale attribute,
            and possibly the QK-norm children), "" for the module itself.
        root_config: the model's config, read for modules without one of their own.
        undeclared: the refusal message when no rule matches (default: names the class).
        norms: the QK-norm classes whose gains can be read.

    Returns:
        A `LogitForm`; one with a ``refusal`` when no rule matches, the rule refuses, the scale is
        not found, the rotary embeddings are scaled, or a QK-norm-like child cannot be read.
    """
    cls = type(module).__name__
    rule = next((r for r in rules if r.matches(module)), None)
    if rule is None:
        return LogitForm.refused(
            undeclared
            or f"{cls}: its logit form (position scheme, scale, QK-norm) is not declared. Declare it "
            "with AttentionSpec(logits=LogitRule(...))"
        )
    if rule.refusal is not None:
        return LogitForm.refused(f"{cls}: {rule.refusal}")
    holder = _get(module, heads_at) if heads_at else module
    scale = _scale(rule, module, holder, head_dim)
    if isinstance(scale, str):
        return LogitForm.refused(f"{cls}: {scale}")
    notes = [rule.note] if rule.note else []
    if rule.rotary is not False:
        refusal = _rope_refusal(_config(module, holder, root_config))
        if refusal is not None:
            return LogitForm.refused(f"{cls}: {refusal}")
    if rule.rotary is None:
        notes.append(
            "position scheme not declared: the logit bound is the rotary (product) bound, which holds for any "
            "rotation of queries and keys"
        )
    qk = _qk_norm(rule, module, heads_at, num_heads, num_kv_heads, head_dim, norms)
    if isinstance(qk, str):
        return LogitForm.refused(f"{cls}: {qk}")
    return LogitForm(rotary=rule.rotary, scale=scale, qk_norm=qk, notes=tuple(notes))
