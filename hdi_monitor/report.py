"""The diversity report: `DiversityReport` of `LayerDiversity` records, and `compute_report`, which
makes one from the layers' weights.

`compute_report` reads each projection's per-head weights once (`weight_groups`: sharded layers one
at a time, the others batched by shape), computes the overlap matrices and HDIs batched over all
layers of one shape on the weights' device, and returns a frozen `DiversityReport` (a table when
printed, JSON-ready with `DiversityReport.to_dict`). The measured step
(`hdi_monitor.measure.step.MeasuredStep`) adds the head-output and kernel statistics of a forward
pass as new records; `hdi_monitor.head_diversity` is the one-shot entry point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from hdi_monitor._validation import check_bool, check_choice, check_choices
from hdi_monitor.exceptions import AdapterMismatch
from hdi_monitor.functional.bilinear import gram_factor, logit_bound, qk_norm_logit_bound
from hdi_monitor.functional.diversity import (
    Weighting,
    chance_hdi,
    head_diversity_index,
    invalid_heads,
    max_hdi,
    pairwise_principal_angles,
    subspace_overlap,
)
from hdi_monitor.models import AttentionLayer, SkippedModule
from hdi_monitor.models.base import PROJECTIONS
from hdi_monitor.models.sharding import full_weights, gathers_weights

__all__ = [
    "ACTIVATIONS",
    "AngleWork",
    "DiversityReport",
    "LayerDiversity",
    "Progress",
    "Projection",
    "WeightTap",
    "compute_angles",
    "compute_report",
    "weight_groups",
]

#: A projection of an attention layer (the values of `PROJECTIONS`).
Projection = Literal["query", "key", "value", "output"]
#: A progress hook: called with the number of work units just done (``tqdm.update`` fits).
Progress = Callable[[int], Any]
#: Receives each weight group of `compute_report` as it is read: ``(projection, layer indices, (L, H, D_in, d))``.
WeightTap = Callable[[str, list[int], Tensor], Any]

#: The key of ``LayerDiversity.invalid_heads`` for the heads dead in the head outputs (activations).
ACTIVATIONS = "activations"
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
        """Largest ``max_attention_logit`` over heads; None when not measured."""
        t = self.max_attention_logit
        if t is None:
            return None
        finite = t[torch.isfinite(t)]
        return float(finite.max()) if finite.numel() else None

    @property
    def logit_bound_max(self) -> float | None:
        """Largest finite ``logit_bound`` over heads; None when not computed or no head has one."""
        t = self.logit_bound
        if t is None:
            return None
        finite = t[torch.isfinite(t)]
        return float(finite.max()) if finite.numel() else None

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
    if t is None:
        return None
    finite = t[torch.isfinite(t)]
    return float(finite.double().mean()) if finite.numel() else None


def _nested(t: Tensor) -> list:
    return [[_finite_or_none(x) for x in row] for row in t.double().tolist()]


def _check_projections(projections: Sequence[str] | str) -> tuple[Projection, ...]:
    return cast("tuple[Projection, ...]", check_choices("projections", projections, PROJECTIONS, allow_str=True))


def _read(layer: AttentionLayer, projection: Projection) -> Tensor:
    w = layer.head_weights(projection)
    if w.is_meta:
        raise ValueError(
            f"{layer.name}: {projection} weights are on the meta device; materialise the model before "
            "measuring it (find_attention_layers skips such layers with a warning)"
        )
    return w


def weight_groups(
    layers: Sequence[AttentionLayer],
    projections: Sequence[Projection],
    *,
    fsdp_root: nn.Module | None = None,
    sharded: Sequence[bool] | None = None,
) -> Iterator[tuple[Projection, list[int], Tensor]]:
    """The head weights of ``layers``, batched: yields ``(projection, layer indices, weights)``
    with ``weights`` of shape ``(L, H, D_in, d)`` for the ``L`` layers listed.

    Sharded layers come first, one at a time: reading their weights is a collective (DTensor
    parameters under FSDP2 are gathered; FSDP1 units are unsharded, see `full_weights`), so
    each such layer is gathered once for all its projections, yielded with ``L = 1`` one
    projection after the other, and freed when the iteration moves on: peak memory stays at one
    layer (one FSDP1 unit). Use each group before asking for the next and drop it. Every rank
    must iterate the same layers in the same order, to the end.

    The other layers are then stacked per projection by ``(H, D_in, d, dtype, device)``: one
    group per shape, so that the math runs once per group on the weights' own device.
    """
    if sharded is None:
        sharded = [gathers_weights(lay, fsdp_root) for lay in layers]
    for i, lay in enumerate(layers):
        if sharded[i]:
            with full_weights(lay, fsdp_root):  # one layer's full weights at a time
                for proj in projections:
                    yield proj, [i], _read(lay, proj)[None]
    for proj in projections:
        groups: dict[tuple[Any, ...], list[tuple[int, Tensor]]] = {}
        for i, lay in enumerate(layers):
            if not sharded[i]:
                w = _read(lay, proj)
                groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append((i, w))
        for members in groups.values():
            yield proj, [i for i, _ in members], torch.stack([w for _, w in members])


def compute_report(
    layers: list[AttentionLayer],
    projections: Sequence[Projection] | Projection = PROJECTIONS,
    weighting: Weighting = "spectral",
    *,
    fsdp_root: nn.Module | None = None,
    skipped: Sequence[SkippedModule] = (),
    progress: Progress | None = None,
    angles: bool | list[AngleWork] = False,
    logit_bounds: bool = True,
    tap: WeightTap | None = None,
    sharded: Sequence[bool] | None = None,
) -> DiversityReport:
    """Weight-based diversity of already-found attention layers.

    The layers' head weights come batched from `weight_groups`: per projection, the layers of
    one shape, stacked, so `subspace_overlap` and `head_diversity_index` run once per group on
    the weights' device; sharded layers (FSDP1 / FSDP2) one at a time, gathered and freed before
    the next one. Results are copied to the CPU once per device at the end. Every rank must call
    this with the same layers in the same order.

    Args:
        layers: from `find_attention_layers`.
        projections: which of ``"query"``, ``"key"``, ``"value"``, ``"output"`` to measure.
        weighting: ``"spectral"`` or ``"uniform"``.
        fsdp_root: for FSDP1 (``FullyShardedDataParallel``) models, the root FSDP module (in
            Lightning ``trainer.strategy.model``); ignored otherwise.
        skipped: the modules discovery left out (`Discovery.skipped`), carried into the report.
        progress: called with the number of layers measured after each group, for one
            projection (``len(layers) * len(projections)`` in all); ``tqdm(total=...).update``
            fits.
        angles: also compute the principal angles of every head pair (`LayerDiversity.angles`)
            from the same weights, while they are read (gathered) for the overlaps: the weights
            are read once whatever is asked. A list instead of True defers the work for weights
            that live whole on the CPU: their groups are appended to it as `AngleWork` (a CPU copy
            of the weights, taken now, at most `ANGLE_COPY_BYTES` in all), to be finished later, on
            another thread, with `compute_angles` (the record is not changed: the angles are their
            own result); sharded (gathered) and accelerator weights, and groups past that size, are
            done at once, into ``LayerDiversity.angles``.
        sharded: per layer, whether reading its weights is a collective (`gathers_weights`), when the
            caller knows it already (the measured step finds it once per set of layers).
        tap: called with every weight group as it is read, ``tap(projection, layer indices,
            weights)`` (``(L, H, D_in, d)``; a gathered layer's weights are freed after it returns),
            for statistics that need the weights themselves from this one read (the update
            entropy of the measured step).
        logit_bounds: also compute each layer's logit bound (`LayerDiversity.logit_bound`, DESIGN.md
            rule 9) from the same weight read, when ``"query"`` and ``"key"`` are both measured:
            each query and key group is reduced at once to ``d x d`` factors of its heads
            (`hdi_monitor.functional.bilinear.gram_factor`, so no weights are held past their
            group and gathered ones are freed as before), QK-norm gains are read with the query
            weights (inside a sharded layer's gather), and the bounds run batched per group of
            layers of one shape once every group is read. Layers whose logit form is not declared
            or cannot be read (``layer.logit_form.refusal``) get None and a note.
    """
    checked = _check_projections(projections)
    check_choice("weighting", weighting, Weighting)
    if not all(isinstance(lay, AttentionLayer) for lay in layers):
        raise TypeError("layers must be a list of AttentionLayer (see find_attention_layers)")
    if not all(isinstance(s, SkippedModule) for s in skipped):
        raise TypeError("skipped must be a sequence of SkippedModule (see discover_attention)")
    fields: list[dict[str, Any]] = [
        {
            "chance_hdi": {},
            "max_hdi": {},
            "hdi": {},
            "overlap": {},
            "invalid_heads": {},
            "angles": {},
            "notes": tuple(getattr(lay, "notes", ())),
        }
        for lay in layers
    ]
    check_bool("logit_bounds", logit_bounds)
    bounds = _LogitBounds(layers, fields) if logit_bounds and {"query", "key"} <= set(checked) else None
    # (projection, layer indices, overlap (L, h, h), hdi (L,), invalid (L, h)) on the weights' device
    pending: list[tuple[str, list[int], Tensor, Tensor, Tensor]] = []
    with torch.no_grad():
        if sharded is None:
            sharded = [gathers_weights(lay, fsdp_root) for lay in layers]
        for proj, idx, stacked in weight_groups(layers, checked, fsdp_root=fsdp_root, sharded=sharded):
            _, heads, d_in, d = stacked.shape
            for i in idx:
                fields[i]["chance_hdi"][proj] = chance_hdi(model_dim=d_in, head_dim=d, weighting=weighting)
                fields[i]["max_hdi"][proj] = max_hdi(num_heads=heads, head_dim=d, model_dim=d_in)
            overlap = subspace_overlap(stacked, weighting)
            pending.append((proj, idx, overlap, head_diversity_index(overlap), invalid_heads(stacked)))
            if angles is not False and heads >= 2:
                deferred = (
                    isinstance(angles, list)
                    and stacked.device.type == "cpu"
                    and not sharded[idx[0]]
                    and sum(w.weights.nbytes for w in angles) + stacked.nbytes <= ANGLE_COPY_BYTES
                )
                if deferred:
                    cast("list[AngleWork]", angles).append(AngleWork(proj, tuple(idx), stacked.detach().clone()))
                else:
                    for i, row in zip(idx, _pair_angles(stacked), strict=True):
                        fields[i]["angles"][proj] = row
            if bounds is not None:
                bounds.add(proj, idx, stacked)
            if tap is not None:
                tap(proj, idx, stacked)
            del stacked  # a gathered layer is freed before the next one
            if progress is not None:
                progress(len(idx))
        bound_groups = bounds.compute() if bounds is not None else []
    _collect(pending, fields, bound_groups)
    results = [
        LayerDiversity(
            name=lay.name,
            family=lay.family,
            num_heads=lay.num_heads,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            model_dim=lay.model_dim,
            **f,
        )
        for lay, f in zip(layers, fields, strict=True)
    ]
    return DiversityReport(layers=results, projections=checked, weighting=weighting, skipped=list(skipped))


#: Most bytes of CPU weights copied per measured step for angles finished later (past it: at once).
ANGLE_COPY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class AngleWork:
    """Principal angles left to compute (see `compute_report`'s ``angles``): a CPU copy of the
    ``(L, H, D, d)`` weights of the layers ``indices`` (positions in the report) for one
    projection."""

    projection: str
    indices: tuple[int, ...]
    weights: Tensor


def compute_angles(report: DiversityReport, work: Sequence[AngleWork]) -> dict[str, dict[str, Tensor]]:
    """The principal angles of a report's layers, per projection and layer name: those computed with
    the report (``LayerDiversity.angles``) and the deferred ones of ``work``, finished now (on any
    thread: nothing is written into the report)."""
    out: dict[str, dict[str, Tensor]] = {p: {} for p in report.projections}
    for lay in report.layers:
        for p, row in lay.angles.items():
            out.setdefault(p, {})[lay.name] = row
    with torch.no_grad():
        for item in work:
            for i, row in zip(item.indices, _pair_angles(item.weights), strict=True):
                out.setdefault(item.projection, {})[report.layers[i].name] = row
    return out


def _pair_angles(stacked: Tensor) -> list[Tensor]:
    """Principal angles in degrees of every head pair ``i < j``, per layer of ``stacked`` (``(L, H,
    D, d)``): CPU float32, flattened, NaN (invalid heads) dropped."""
    angles = pairwise_principal_angles(stacked)  # (L, H, H, d)
    h = angles.shape[1]
    i, j = torch.triu_indices(h, h, offset=1, device=angles.device)
    picked = torch.rad2deg(angles[:, i, j].flatten(1)).float().cpu()
    return [row[~torch.isnan(row)] for row in picked]


class _LogitBounds:
    """The logit bounds of `compute_report` (DESIGN.md rule 9), fed the weight groups as they are read.

    Each query and key group is reduced at once to ``(L, H, d, d)`` factors with the heads' Gram
    matrices (`gram_factor`): the weights themselves are not held past their group. QK-norm layers
    need no weights: their gains are read with their query group (inside a sharded layer's
    gather). `compute` then groups the layers whose factors (or gains) have one shape, position
    rule, key-head map and device, and runs one batched bound per group.
    """

    def __init__(self, layers: Sequence[AttentionLayer], fields: list[dict[str, Any]]) -> None:
        self.layers = layers
        self.fields = fields
        self.factors: dict[tuple[int, str], Tensor] = {}  # (layer, "query" | "key") -> (H, d, d)
        self.gains: dict[int, tuple[Tensor, Tensor, float, float]] = {}  # QK-norm layers
        self.wanted: set[int] = set()
        for i, (lay, res) in enumerate(zip(layers, fields, strict=True)):
            form = lay.logit_form
            d_q, d_k = lay.projection_dims["query"], lay.projection_dims["key"]
            if form.refusal is not None:
                res["notes"] = (*res["notes"], f"logit bound not computed: {form.refusal}")
            elif d_q != d_k:
                res["notes"] = (
                    *res["notes"],
                    f"logit bound not computed: query heads of width {d_q}, key heads of {d_k}",
                )
            else:
                res["notes"] = (*res["notes"], *form.notes)
                self.wanted.add(i)

    def add(self, projection: str, indices: list[int], stacked: Tensor) -> None:
        """Take what the bounds need from one weight group (``(L, H, D_in, d)`` of the layers
        ``indices``) while it is read."""
        if projection not in ("query", "key"):
            return
        rows = [(j, i) for j, i in enumerate(indices) if i in self.wanted]
        by_weights = [(j, i) for j, i in rows if self.layers[i].logit_form.qk_norm is None]
        if by_weights:
            sel = [j for j, _ in by_weights]
            factor = gram_factor(stacked if len(sel) == len(indices) else stacked[sel])
            for n, (_, i) in enumerate(by_weights):
                self.factors[(i, projection)] = factor[n]
        if projection == "query":
            for _, i in rows:
                if self.layers[i].logit_form.qk_norm is not None:
                    self._read_gains(i, stacked.device)

    def _read_gains(self, i: int, device: torch.device) -> None:
        lay = self.layers[i]
        try:
            gains = lay.qk_norm_gains()
        except AdapterMismatch as exc:  # the full gains do not fit the heads: no bound, said so
            self.wanted.discard(i)
            self.fields[i]["notes"] = (*self.fields[i]["notes"], f"logit bound not computed: {exc}")
            return
        self.gains[i] = (gains.query.to(device), gains.key.to(device), gains.radius_query, gains.radius_key)

    def compute(self) -> list[tuple[list[int], Tensor]]:
        """``(layer indices, (L, H) bounds)`` per group, on the weights' device; sets each
        computed layer's ``logit_bound_rule``."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i in sorted(self.wanted):
            lay, form = self.layers[i], self.layers[i].logit_form
            rotary = form.rotary is not False
            if i in self.gains:
                gq, gk, rq, rk = self.gains[i]
                key: tuple[Any, ...] = ("qk_norm", tuple(gq.shape), tuple(gk.shape), gq.dtype, gk.dtype, gq.device)
                key += (rotary, lay.kv_map, rq, rk)
            elif (i, "query") in self.factors and (i, "key") in self.factors:
                fq, fk = self.factors[(i, "query")], self.factors[(i, "key")]
                key = ("weights", tuple(fq.shape), tuple(fk.shape), fq.dtype, fk.dtype, fq.device, rotary, lay.kv_map)
            else:
                continue
            groups.setdefault(key, []).append(i)
        out = []
        for key, members in groups.items():
            rotary, kv_map = (key[6], key[7])
            if key[0] == "qk_norm":
                gq = torch.stack([self.gains[i][0] for i in members])
                gk = torch.stack([self.gains[i][1] for i in members])
                raw = qk_norm_logit_bound(
                    gq, gk, radius_q=key[8], radius_k=key[9], rotary=rotary, kv_map=kv_map, scale=1.0
                )
            else:
                fq = torch.stack([self.factors[(i, "query")] for i in members])
                fk = torch.stack([self.factors[(i, "key")] for i in members])
                raw = logit_bound(fq, fk, rotary=rotary, kv_map=kv_map, scale=1.0)
            scales = torch.tensor(
                [self.layers[i].logit_form.scale for i in members], dtype=raw.dtype, device=raw.device
            )
            out.append((members, raw * scales[:, None]))
            for i in members:
                self.fields[i]["logit_bound_rule"] = self.layers[i].logit_form.rule
        return out


def _collect(
    pending: list[tuple[str, list[int], Tensor, Tensor, Tensor]],
    fields: list[dict[str, Any]],
    bound_groups: Sequence[tuple[list[int], Tensor]] = (),
) -> None:
    """Copy all group results (and the logit bounds) to the CPU with one transfer per device into
    each layer's fields."""
    by_device: dict[torch.device, list[int]] = {}
    for n, (_, _, overlap, _, _) in enumerate(pending):
        by_device.setdefault(overlap.device, []).append(n)
    bounds_by_device: dict[torch.device, list[int]] = {}
    for n, (_, values) in enumerate(bound_groups):
        bounds_by_device.setdefault(values.device, []).append(n)
        by_device.setdefault(values.device, [])
    host: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    host_bounds: dict[int, Tensor] = {}
    for device, members in by_device.items():
        parts = []
        for n in members:
            _, _, overlap, hdi, bad = pending[n]
            parts += [overlap.reshape(-1).double(), hdi.reshape(-1).double(), bad.reshape(-1).double()]
        bound_members = bounds_by_device.get(device, [])
        parts += [bound_groups[n][1].reshape(-1).double() for n in bound_members]
        flat = torch.cat(parts).cpu()  # the one host sync for this device
        offset = 0
        for n in members:
            _, _, overlap, hdi, bad = pending[n]
            chunks = []
            for t in (overlap, hdi, bad):
                chunks.append(flat[offset : offset + t.numel()].reshape(t.shape))
                offset += t.numel()
            host[n] = (chunks[0].float(), chunks[1], chunks[2].bool())
        for n in bound_members:
            values = bound_groups[n][1]
            host_bounds[n] = flat[offset : offset + values.numel()].reshape(values.shape)
            offset += values.numel()
    for n, (proj, idx, _, _, _) in enumerate(pending):
        overlap, hdi, bad = host[n]
        for j, i in enumerate(idx):
            value = float(hdi[j])
            fields[i]["hdi"][proj] = value if math.isfinite(value) else None
            fields[i]["overlap"][proj] = overlap[j].clone()
            fields[i]["invalid_heads"][proj] = torch.nonzero(bad[j]).flatten().tolist()
    for n, (idx, _) in enumerate(bound_groups):
        for j, i in enumerate(idx):
            fields[i]["logit_bound"] = host_bounds[n][j].clone()
