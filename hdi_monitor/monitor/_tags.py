"""From a measurement record to scalar tags: the one place where values become tag names.

`record_series` turns a `DiversityReport` into typed series keys (`Series`) and values;
`scalar_tags` adds the dashboard's summaries and gives the ``tag -> value`` dict the sinks write.
The history (`hdi_monitor.monitor.history`) stores the typed keys, so readers ask it for
``Series("hdi", "key", layer=...)`` and never parse a tag.

Tag names:

* ``hdi/<projection>/<layer>``, ``invalid_heads/<projection>/<layer>``,
  ``effective_heads/<layer>``, ``head_correlation/<layer>``: per layer (with activations,
  ``invalid_heads/activations/<layer>`` counts the heads dead in the head outputs);
* ``hdi/<projection>/mean``, ``effective_heads/mean``, ``head_correlation/mean`` and their ``min`` /
  ``max`` (`scalar_tags`): over layers; ``diversity_events/<kind>``: the step's events;
* ``hdi_chance/<projection>``, ``hdi_max/<projection>``: reference levels (means over layers);
* kernel statistics (``kernel_stats=True``, layers where they were measured):
  ``attention_entropy/<layer>`` (mean over heads, nats), ``attention_entropy/mean`` (over layers),
  ``attention_entropy_uniform/mean`` (the uniform-attention reference ``ln(n_keys)``, mean over
  layers), ``max_attention_logit/<layer>`` (max over heads) and ``max_attention_logit/max`` (over
  layers);
* weight-only signals (`weight_signal_series`): ``logit_bound/<layer>`` and ``logit_bound/max``;
  with ``update_entropy=True``, ``update_entropy/<layer>`` and its mean, min and max.

A layer whose qualified name is ``mean``, ``min`` or ``max`` (a top-level module so named) would
collide with the summaries: its tags use ``<name>_layer`` instead (`layer_tag`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hdi_monitor.events import DIVERSITY_EVENT_KINDS, KERNEL_EVENT_KINDS, DiversityEvent
from hdi_monitor.measure.measurement import Series
from hdi_monitor.monitor._dashboard import Dashboard
from hdi_monitor.report import ACTIVATIONS, DiversityReport

__all__ = ["kernel_series", "record_series", "scalar_tags", "weight_signal_series"]


_KERNEL_FAMILIES = frozenset({"attention_entropy", "attention_entropy_uniform", "max_attention_logit"})


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def record_series(report: DiversityReport, *, projections: Sequence[str], activations: bool) -> dict[Series, float]:
    """The typed scalar values of one report: per layer and projection HDI and invalid-head
    counts, the mean HDI, chance and frame-bound means, and (``activations``) the effective heads
    and mean correlation per layer with their means, and the kernel statistics where measured
    (`kernel_series`). Non-finite values are left out (absent)."""
    out: dict[Series, float] = {}
    for p in projections:
        chance, cap, hdis = [], [], []
        for layer in report.layers:
            # on every measured step, so a dead or NaN head is never silent (0 when none)
            out[Series("invalid_heads", p, layer.name)] = float(len(layer.invalid_heads.get(p) or []))
            value = layer.hdi.get(p)
            if value is not None and math.isfinite(value):
                out[Series("hdi", p, layer.name)] = float(value)
                hdis.append(float(value))
                chance.append(layer.chance_hdi[p])
                if (top := layer.max_hdi.get(p)) is not None:
                    cap.append(top)
        if hdis:
            out[Series("hdi", p, stat="mean")] = _mean(hdis)
        if chance:
            out[Series("hdi_chance", p)] = _mean(chance)
        if cap:
            out[Series("hdi_max", p)] = _mean(cap)
    if activations:
        eff, corr = [], []
        for layer in report.layers:
            if layer.effective_heads is not None:  # measured: dead heads counted (0 when none)
                dead = layer.invalid_heads.get(ACTIVATIONS) or []
                out[Series("invalid_heads", ACTIVATIONS, layer.name)] = float(len(dead))
            if (heads := layer.effective_heads) is not None and math.isfinite(heads):
                out[Series("effective_heads", layer=layer.name)] = float(heads)
                eff.append(float(heads))
            if (r := layer.mean_correlation) is not None and math.isfinite(r):
                out[Series("head_correlation", layer=layer.name)] = float(r)
                corr.append(float(r))
        if eff:
            out[Series("effective_heads", stat="mean")] = _mean(eff)
        if corr:
            out[Series("head_correlation", stat="mean")] = _mean(corr)
    out.update(kernel_series(report))
    out.update(weight_signal_series(report))
    return out


def weight_signal_series(report: DiversityReport) -> dict[Series, float]:
    """The weight-only signals of one report: per layer the largest logit bound over heads
    (``logit_bound/<layer>``) and the mean update entropy over heads (``update_entropy/<layer>``,
    where computed); over layers the largest bound (``logit_bound/max``: over the layers bounded
    per unit-norm input, or over the QK-norm layers when every layer is one, since the two kinds of
    bound do not compare) and the mean update entropy (``update_entropy/mean``)."""
    out: dict[Series, float] = {}
    bounds: dict[bool, list[float]] = {True: [], False: []}  # QK-norm layer or not -> per-layer bounds
    entropy = []
    for layer in report.layers:
        if (b := layer.logit_bound_max) is not None:
            out[Series("logit_bound", layer=layer.name)] = b
            bounds[layer.logit_bound_rule == "qk_norm"].append(b)
        if layer.update_entropy is not None and (u := _nanmean(layer.update_entropy)) is not None:
            out[Series("update_entropy", layer=layer.name)] = u
            entropy.append(u)
    if bounds[False] or bounds[True]:
        out[Series("logit_bound", stat="max")] = max(bounds[False] or bounds[True])
    if entropy:
        out[Series("update_entropy", stat="mean")] = _mean(entropy)
    return out


def _nanmean(values: Tensor) -> float | None:
    finite = values[torch.isfinite(values)]
    return float(finite.double().mean()) if finite.numel() else None


def kernel_series(report: DiversityReport) -> dict[Series, float]:
    """The kernel-statistics series of one report (empty when they were not measured): per layer
    the mean attention entropy over heads and the largest logit over heads; over layers the mean
    entropy, the mean uniform level and the largest logit."""
    out: dict[Series, float] = {}
    ent, ref, top = [], [], []
    for layer in report.layers:
        if (h := layer.mean_attention_entropy) is not None:
            out[Series("attention_entropy", layer=layer.name)] = h
            ent.append(h)
        if (u := layer.mean_attention_entropy_uniform) is not None:
            ref.append(u)
        if (m := layer.max_attention_logit_max) is not None:
            out[Series("max_attention_logit", layer=layer.name)] = m
            top.append(m)
    if ent:
        out[Series("attention_entropy", stat="mean")] = _mean(ent)
    if ref:
        out[Series("attention_entropy_uniform", stat="mean")] = _mean(ref)
    if top:
        out[Series("max_attention_logit", stat="max")] = max(top)
    return out


#: Families summarised over layers (min and max beside the mean).
_SUMMARISED = ("effective_heads", "head_correlation", "update_entropy")


def scalar_tags(
    report: DiversityReport,
    events: Sequence[DiversityEvent],
    *,
    dashboard: Dashboard,
    projections: Sequence[str],
    activations: bool,
    detecting: bool,
) -> dict[Series, float]:
    """The series of one record, by typed key (`Series.tag` is what sinks write): `record_series`
    plus the summaries over layers.

    * ``<family>/min`` and ``/max`` beside each ``/mean`` (the HDI of each projection, the
      effective heads, the head correlation);
    * ``hdi_max/<projection>`` dropped where the frame bound does not bind (1: the heads can all be
      orthogonal);
    * ``invalid_heads/<projection>``: the dead or non-finite heads over all layers, on every
      measured step (0 when healthy). The per-layer counts are kept only for layers that have had
      an invalid head in this run (from the first such step on, 0 again once they recover; the
      layers are remembered in ``dashboard.unhealthy``), so a healthy model adds one chart per
      projection to the Scalars tab, not one per layer;
    * ``diversity_events/<kind>``: the step's events per kind (0 on a measured step without events
      when a detector runs; the kernel kinds only when the step has kernel statistics).
    """
    series = record_series(report, projections=projections, activations=activations)
    kernel = any(key.family in _KERNEL_FAMILIES for key in series)
    groups = [("hdi", p) for p in projections] + [(family, None) for family in _SUMMARISED]
    for family, projection in groups:
        values = [
            v for k, v in series.items() if k.family == family and k.projection == projection and k.layer is not None
        ]
        if values:
            series[Series(family, projection, stat="min")] = min(values)
            series[Series(family, projection, stat="max")] = max(values)
    for p in [*projections, ACTIVATIONS]:
        if series.get(Series("hdi_max", p), 0.0) >= 1.0:
            del series[Series("hdi_max", p)]
        per_layer = {
            k: v for k, v in series.items() if k.family == "invalid_heads" and k.projection == p and k.layer is not None
        }
        if per_layer:
            series[Series("invalid_heads", p)] = float(sum(per_layer.values()))
        for key, count in per_layer.items():
            if count:
                dashboard.unhealthy.add(key.tag)
            elif key.tag not in dashboard.unhealthy:
                del series[key]
    kinds = DIVERSITY_EVENT_KINDS + (KERNEL_EVENT_KINDS if kernel else ())
    counts = dict.fromkeys(kinds, 0.0) if detecting else {}
    for event in events:
        counts[event.kind] = counts.get(event.kind, 0.0) + 1.0
    series.update({Series("diversity_events", kind): n for kind, n in counts.items()})
    return series
