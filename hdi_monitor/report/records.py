"""The records of a diversity report: `LayerDiversity` (one attention layer) and `DiversityReport`
(a model), frozen, JSON-ready (`DiversityReport.to_dict`) and printable as a table."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from hdi_monitor.models import SkippedModule

__all__ = ["ACTIVATIONS", "DiversityReport", "LayerDiversity", "Progress", "Projection", "WeightTap"]

#: A projection of an attention layer (the values of `PROJECTIONS`).
Projection = Literal["query", "key", "value", "output"]
#: A progress hook: called with the number of work units just done (``tqdm.update`` fits).
Progress = Callable[[int], Any]
#: Receives each weight group of `compute_report` as it is read: ``(projection, layer indices, (L, H, D_in, d))``.
WeightTap = Callable[[str, list[int], Tensor], Any]

#: The key of ``LayerDiversity.invalid_heads`` for the heads dead in the head outputs (activations).
ACTIVATIONS = "activations"
#: What a record copies from its attention layer.
_IDENTITY = ("name", "family", "num_heads", "num_kv_heads", "head_dim", "model_dim")
_ACTIVATION_FIELDS = ("effective_heads", "mean_correlation", "variance_ratio", "num_tokens")
_KERNEL_FIELDS = ("attention_entropy", "attention_entropy_uniform", "max_attention_logit", "kernel_queries")


@dataclass(frozen=True)
class LayerDiversity:
    """Diversity of one attention layer (a frozen record: a later stage makes a new one with
    `dataclasses.replace`, as the measured step does when it adds the head-output and kernel
    statistics; the dicts and tensors it holds are not changed after it is made).

    Per-projection dicts are keyed by the projections the report was computed for. ``hdi`` and
    ``max_hdi`` are None where fewer than two valid heads exist; ``chance_hdi`` uses the
    projection's own input width (``kdim`` for keys of a cross-attention with ``kdim != D``).
    ``overlap`` holds CPU float32 ``(heads, heads)`` matrices with NaN rows/columns for invalid
    (all-zero or non-finite) heads. The activation fields are filled only when the report was made
    with ``inputs``; ``invalid_heads["activations"]`` then lists the heads whose contribution to the
    layer output had zero variance (dead heads: left out of ``effective_heads``, which is over the
    live heads); ``nonfinite_heads`` lists those of them whose outputs held a NaN or inf (said
    apart in the notes). ``angles`` (only when asked for, see `compute_report`) holds, per projection, the
    principal angles in degrees of every valid head pair ``i < j`` (CPU float32, flattened),
    computed from the same weight read as the overlaps.

    Kernel statistics (DESIGN.md rule 8; filled by the tracker on measured steps when
    ``MonitorConfig(kernel_stats=True)``, else None): ``attention_entropy`` (per query head, mean
    attention entropy over the measured queries, nats), ``attention_entropy_uniform`` (per head, the
    mean of ``ln(n_allowed_keys)``: uniform attention's entropy, the reference level),
    ``max_attention_logit`` (per head, the largest ``scale * <q, k>``) and ``kernel_queries`` (per
    head, the number of queries measured); CPU float64 ``(H,)`` tensors (int64 for the counts),
    NaN for a head without a measured query. A layer whose kernel was not reachable has them None.

    Logit bound (DESIGN.md rule 9; weights only, computed by `compute_report` from the same weight
    read as the HDI when both ``"query"`` and ``"key"`` are measured): ``logit_bound`` is a CPU
    float64 ``(H,)`` tensor, per query head, and ``logit_bound_rule`` says how it was computed:
    ``"bilinear"`` (``scale * sigma_max(W_Q,h W_K,g(h)^T)``) and ``"rotary"`` (rotated or unknown
    position scheme: ``scale * sigma_max(W_Q,h) sigma_max(W_K,g(h))``) bound the logit of a
    unit-norm query input and a unit-norm key input (multiply by the inputs' norms for a bound on
    the layer's logits; biases left out); ``"qk_norm"`` bounds the logit whatever the inputs, from
    the QK-norm gains (`hdi_monitor.functional.bilinear.qk_norm_logit_bound`). NaN for a head whose
    weights hold NaN or inf (an all-zero head has bound 0). Both None when the bound was not
    computed: query or key not measured, or the layer's logit form is not declared or cannot be read
    (the reason is then in ``notes``).

    Update entropy (DESIGN.md rule 10; opt-in, ``MonitorConfig(update_entropy=True)``, filled by the
    measured step): ``update_entropy`` is a CPU float64 ``(H,)`` tensor, per query head, the spectral
    entropy in nats of the first-order change of the head's bilinear form since the previous
    measured step (`hdi_monitor.functional.bilinear.update_entropy`); NaN where the form did not
    change; None on the first measured step and where it was not computed.

    More per-layer results are added as optional fields with a default (None or empty), so that
    every reader of a report (tags, dashboards, detector, CLI) keeps working when one is added.
    """

    name: str
    family: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_dim: int
    hdi: dict[str, float | None] = field(default_factory=dict)
    overlap: dict[str, Tensor] = field(default_factory=dict)
    chance_hdi: dict[str, float] = field(default_factory=dict)
    max_hdi: dict[str, float | None] = field(default_factory=dict)
    invalid_heads: dict[str, list[int]] = field(default_factory=dict)
    covariance: Tensor | None = None
    correlation: Tensor | None = None
    effective_heads: float | None = None
    mean_correlation: float | None = None
    variance_ratio: float | None = None
    num_tokens: int | None = None
    notes: tuple[str, ...] = ()
    angles: dict[str, Tensor] = field(default_factory=dict)
    attention_entropy: Tensor | None = None
    attention_entropy_uniform: Tensor | None = None
    max_attention_logit: Tensor | None = None
    kernel_queries: Tensor | None = None
    nonfinite_heads: tuple[int, ...] = ()
    logit_bound: Tensor | None = None
    logit_bound_rule: str | None = None
    update_entropy: Tensor | None = None

    @classmethod
    def of(cls, layer: Any, **fields: Any) -> LayerDiversity:
        """The record of an `hdi_monitor.models.AttentionLayer` (its name, family and shapes) with
        ``fields``."""
        return cls(**{name: getattr(layer, name) for name in _IDENTITY}, **fields)

    # ------------------------------------------------------------------ kernel statistics (opt-in)
    @property
    def mean_attention_entropy(self) -> float | None:
        """Mean over heads of ``attention_entropy`` (heads without a measured query left out);
        None when the kernel statistics were not measured or no head has a value."""
        return _nanmean(self.attention_entropy)

    @property
    def mean_attention_entropy_uniform(self) -> float | None:
        """Mean over heads of ``attention_entropy_uniform`` (the uniform-attention reference)."""
        return _nanmean(self.attention_entropy_uniform)

    @property
    def max_attention_logit_max(self) -> float | None:
        """Largest finite ``max_attention_logit`` over heads; None when not measured or no head has one."""
        return _finite_max(self.max_attention_logit)

    @property
    def logit_bound_max(self) -> float | None:
        """Largest finite ``logit_bound`` over heads; None when not computed or no head has one."""
        return _finite_max(self.logit_bound)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN becomes None)."""
        out: dict[str, Any] = {
            "name": self.name,
            "family": self.family,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "model_dim": self.model_dim,
            "hdi": dict(self.hdi),
            "chance_hdi": dict(self.chance_hdi),
            "max_hdi": dict(self.max_hdi),
            "invalid_heads": {p: list(v) for p, v in self.invalid_heads.items()},
            "overlap": {p: _nested(t) for p, t in self.overlap.items()},
        }
        if self.notes:
            out["notes"] = list(self.notes)
        if self.nonfinite_heads:
            out["nonfinite_heads"] = list(self.nonfinite_heads)
        if self.covariance is not None:
            out["covariance"] = _nested(self.covariance)
        if self.correlation is not None:
            out["correlation"] = _nested(self.correlation)
        for name in _ACTIVATION_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = _finite_or_none(value)
        for name in _KERNEL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = [_finite_or_none(x) for x in value.double().tolist()]
        if self.logit_bound is not None:
            out["logit_bound"] = [_finite_or_none(x) for x in self.logit_bound.double().tolist()]
            out["logit_bound_rule"] = self.logit_bound_rule
        if self.update_entropy is not None:
            out["update_entropy"] = [_finite_or_none(x) for x in self.update_entropy.double().tolist()]
        return out


@dataclass(frozen=True)
class DiversityReport:
    """Per-layer head diversity of a model (see `head_diversity`).

    Attributes:
        layers: one entry per measured attention layer.
        projections: the projections measured.
        weighting: ``"spectral"`` or ``"uniform"``.
        skipped: attention-like modules that were found but not measured, with the reason (see
            `discover_attention`).
    """

    layers: list[LayerDiversity]
    projections: tuple[str, ...]
    weighting: str
    skipped: list[SkippedModule] = field(default_factory=list)

    def mean_hdi(self, projection: str = "key") -> float | None:
        """Mean HDI of ``projection`` over the layers that have one (None if none has)."""
        if projection not in self.projections:
            raise ValueError(f"projection {projection!r} is not in this report; it has {self.projections}")
        values = [v for lay in self.layers if (v := lay.hdi.get(projection)) is not None]
        return float(sum(values) / len(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: weighting, projections, layers (see `LayerDiversity.to_dict`), mean_hdi,
        skipped (``[{"name", "class_name", "reason"}]``)."""
        return {
            "weighting": self.weighting,
            "projections": list(self.projections),
            "layers": [lay.to_dict() for lay in self.layers],
            "mean_hdi": {p: self.mean_hdi(p) for p in self.projections},
            "skipped": [s.to_dict() for s in self.skipped],
        }

    def format_table(self) -> str:
        """A readable fixed-width table: one row per layer, HDI / chance / max per projection; then the
        notes of layers and the modules not measured, with the reason."""
        has_act = any(lay.effective_heads is not None for lay in self.layers)
        has_bound = any(lay.logit_bound is not None for lay in self.layers)
        header = ["layer", "family", "heads", "d", "D"]
        for p in self.projections:
            header += [f"{p} HDI", "chance", "max"]
        if has_act:
            header += ["H_eff", "mean R"]
        if has_bound:
            header += ["logit bound"]
        rows = []
        for lay in self.layers:
            heads = f"{lay.num_heads}" if lay.num_kv_heads == lay.num_heads else f"{lay.num_heads}/{lay.num_kv_heads}"
            row = [lay.name or "<root>", lay.family, heads, str(lay.head_dim), str(lay.model_dim)]
            for p in self.projections:
                bad = lay.invalid_heads.get(p) or []
                mark = "*" if bad else ""
                row += [_fmt(lay.hdi.get(p)) + mark, _fmt(lay.chance_hdi.get(p)), _fmt(lay.max_hdi.get(p))]
            if has_act:
                dead = "*" if lay.invalid_heads.get(ACTIVATIONS) else ""
                row += [_fmt(lay.effective_heads, 2) + dead, _fmt(lay.mean_correlation)]
            if has_bound:
                mark = "^" if lay.logit_bound_rule == "qk_norm" else ""
                row += [_fmt(lay.logit_bound_max) + mark]
            rows.append(row)
        footer = ["mean", "", "", "", ""]
        for p in self.projections:
            footer += [_fmt(self.mean_hdi(p)), "", ""]
        if has_act:
            footer += ["", ""]
        if has_bound:
            footer += [""]
        widths = [max(len(r[i]) for r in [header, *rows, footer]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            padded = (c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
            return "  ".join(padded).rstrip()

        rule = "-" * len(line(header))
        lines = [f"head diversity ({self.weighting} overlap)", line(header), rule, *map(line, rows), rule, line(footer)]
        if any(lay.invalid_heads.get(p) for lay in self.layers for p in self.projections):
            lines.append("* layer has dead (all-zero) or non-finite heads, left out of its HDI")
        if any(lay.invalid_heads.get(ACTIVATIONS) for lay in self.layers):
            lines.append(
                "* (H_eff) heads that contributed nothing to the layer output, left out: H_eff is over the live heads"
            )
        if has_bound:
            lines.append(
                "logit bound: largest over heads of the largest logit for unit-norm query and key inputs (weights "
                "only, biases left out)"
                + (
                    "; ^ QK-norm layer: for any input"
                    if any(lay.logit_bound_rule == "qk_norm" for lay in self.layers)
                    else ""
                )
            )
        notes: dict[str, list[str]] = {}
        for lay in self.layers:
            for note in lay.notes:
                notes.setdefault(note, []).append(lay.name or "<root>")
        for note, names in notes.items():
            lines.append(f"note: {note} ({len(names)} layer{'s' if len(names) > 1 else ''})")
        if self.skipped:
            lines.append(
                f"not measured ({len(self.skipped)} attention-like module{'s' if len(self.skipped) > 1 else ''}):"
            )
            lines += [f"  {s.name or '<root>'} ({s.class_name}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _nanmean(t: Tensor | None) -> float | None:
    """Mean of the finite entries of ``t`` (in float64); None when ``t`` is None or has none."""
    if t is None:
        return None
    finite = t[torch.isfinite(t)]
    return float(finite.double().mean()) if finite.numel() else None


def _finite_max(t: Tensor | None) -> float | None:
    """Largest finite entry of ``t``; None when ``t`` is None or has none (NaN and inf left out)."""
    if t is None:
        return None
    finite = t[torch.isfinite(t)]
    return float(finite.max()) if finite.numel() else None


def _nested(t: Tensor) -> list:
    return [[_finite_or_none(x) for x in row] for row in t.double().tolist()]
