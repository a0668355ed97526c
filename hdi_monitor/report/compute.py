"""`compute_report`: the weight-based diversity of already-found attention layers, from one read
of their weights (`weight_groups`), batched over the layers of one shape, on the weights' device;
principal angles from the same read, now or left for another thread (`AngleWork`,
`compute_angles`); the logit bounds (`hdi_monitor.report._bounds`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from hdi_monitor._validation import check_bool, check_choice, check_choices
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
from hdi_monitor.report._bounds import LogitBounds
from hdi_monitor.report.records import DiversityReport, LayerDiversity, Progress, Projection, WeightTap

__all__ = ["ANGLE_COPY_BYTES", "AngleWork", "compute_angles", "compute_report", "weight_groups"]


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
    bounds = LogitBounds(layers, fields) if logit_bounds and {"query", "key"} <= set(checked) else None
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
    results = [LayerDiversity.of(lay, **f) for lay, f in zip(layers, fields, strict=True)]
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
