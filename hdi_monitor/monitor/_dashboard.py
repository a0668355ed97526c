"""What the TensorBoard dashboards show, laid out so that they read the same at 4 layers and at 80.

The tracker measures; this module decides how the results are presented:

* a Custom Scalars layout (`Dashboard.layout`): per projection one margin chart (the mean HDI over
  layers, its min-max band, and the chance level), the training loss beside it, the head-output
  summaries and the event counts; per-layer lines in categories that start collapsed;
* the summary scalars those charts read (the min and max over layers, event counts that are 0 on
  measured steps without events, the frame bound only where it binds) are made with the record's
  other scalars, by `hdi_monitor.monitor._tags.scalar_tags`, which keeps in ``Dashboard.unhealthy``
  the layers whose invalid-head counts stay charted;
* pictures on image steps (`Dashboard.image_job`, drawn off the training step by
  `hdi_monitor.monitor.render.render_job`): per projection a diversity map (HDI by layer and
  measured step, its columns the bounded history's) and one tiled overlap image, plus one tiled
  correlation image; the number of image tags per image step is ``2 * projections + 1`` whatever
  the depth;
* principal-angle histograms per layer, or per group of layers past `max_histogram_layers`
  (`Dashboard.histograms`);
* the reference levels and the watched layers' shapes (heads, head width), once, as text
  (`Dashboard.levels_text`; `SHAPES_HEADER` heads the shapes table).

The layout is plain data (`Layout`); `hdi_monitor.monitor.sinks.layout_proto` turns it into
TensorBoard's protocol buffer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import Tensor

from hdi_monitor.config import DEFAULT_MAX_HISTOGRAM_LAYERS, DEFAULT_MAX_IMAGE_LAYERS
from hdi_monitor.measure.measurement import Series
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.render import ImageJob, MapPanel, TilePanel
from hdi_monitor.report import DiversityReport

__all__ = [
    "Dashboard",
    "Layout",
    "Category",
    "Chart",
    "LOSS_PATTERN",
    "SHAPES_HEADER",
    "image_tags",
]

#: Header row of the table of watched layers in the ``hdi_levels`` text: the split each layer
#: has, which `hdi_monitor.cli.allocate` reads back from a run's event files.
SHAPES_HEADER = "| layer | heads H | key/value heads | head width d_k | model width |"

#: Custom Scalars regex for the training loss when no tag is given: any scalar tag whose last part
#: is or contains a ``loss`` word (``train_loss``, ``loss``, ``train/loss``, ``train_loss_step``),
#: except validation, evaluation and test losses (``val_loss``, ``valid/loss``, ``eval/loss``,
#: ``test_loss``): the chart is the training loss only.
LOSS_PATTERN = r"^(?!(.*[/_.])?(val|valid|validation|eval|evaluation|test)[/_.])(.*[/_.])?loss([/_.].*)?$"
#: Scalar families summarised by a min and a max over layers (beside their ``/mean``).
_SUMMARISED = ("effective_heads", "head_correlation")
#: A layer name in a per-layer tag: anything but the ``mean``/``min``/``max`` summaries.
_LAYER = r"(?!(mean|min|max)$).+"


class Chart(TypedDict, total=False):
    """One Custom Scalars chart: ``multiline`` (tag regexes) or ``margin`` (exact tags, one
    ``(value, lower, upper)`` triple per series)."""

    title: str
    multiline: list[str]
    margin: list[tuple[str, str, str]]


class Category(TypedDict):
    """A Custom Scalars category; ``closed`` ones start collapsed."""

    title: str
    closed: bool
    charts: list[Chart]


class Layout(TypedDict):
    """A Custom Scalars layout as plain data."""

    categories: list[Category]


def image_tags(projections: Sequence[str], *, activations: bool) -> list[str]:
    """The image tags of one image step: the same list for 2 layers and for 80."""
    tags = [f"diversity_map/{p}" for p in projections] + [f"overlap/{p}" for p in projections]
    return tags + (["correlation"] if activations else [])


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _collapsed(title: str, charts: Mapping[str, str]) -> Category:
    """A Custom Scalars category, collapsed by default: one multiline chart per (title, regex)."""
    return {"title": title, "closed": True, "charts": [{"title": t, "multiline": [r]} for t, r in charts.items()]}


@dataclass
class Dashboard:
    """Layout, summary scalars and pictures of one run (one per tracker).

    Args:
        loss_tag: the scalar tag of the training loss to chart next to the HDI (e.g.
            ``"train_loss"``). None charts every tag matching `LOSS_PATTERN`, which finds what a
            LightningModule logs as ``self.log("train_loss", ...)`` or a Hugging Face Trainer as
            ``train/loss`` without knowing it in advance (at setup nothing is logged yet).
        max_image_layers: at most this many layers in a tiled overlap or correlation image. With
            more layers, the image shows the ones whose value moved most since the last image step
            (the first image step shows evenly spaced layers); the tile titles name them.
        max_histogram_layers: layers with their own principal-angle histogram; with more, adjacent
            layers are grouped into this many histograms.
    """

    loss_tag: str | None = None
    max_image_layers: int = DEFAULT_MAX_IMAGE_LAYERS
    max_histogram_layers: int = DEFAULT_MAX_HISTOGRAM_LAYERS
    layout_written: bool = False
    #: per-layer invalid-head tags that have been non-zero in this run (logged from then on)
    unhealthy: set[str] = field(default_factory=set, repr=False)
    _last_image_values: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.loss_tag is not None and (not isinstance(self.loss_tag, str) or not self.loss_tag):
            raise ValueError(f"loss_tag must be a non-empty scalar tag or None, got {self.loss_tag!r}")
        _check_count("max_image_layers", self.max_image_layers)
        _check_count("max_histogram_layers", self.max_histogram_layers)

    # ------------------------------------------------------------------ layout
    def layout(
        self,
        layer_names: Mapping[str, Sequence[str]],
        *,
        activations: bool,
        kernel: bool = False,
        bounds: bool = True,
        updates: bool = False,
    ) -> Layout:
        """The Custom Scalars layout.

        It names no layer and no layer count: TensorBoard merges the layouts of the runs in one log
        folder and shows a chart once only where the runs' charts are identical, so two models of
        different depth in one ``runs/`` folder share every chart. Per-layer charts match every
        layer tag of their family except the ``mean``, ``min`` and ``max`` summaries.

        Args:
            layer_names: projection -> names of the layers measured for it (the projections are
                charted; which layers is read from the tags).
            activations: add the head-output charts.
            kernel: add the kernel-statistics charts (attention entropy with its uniform level,
                maximum attention logit).
            bounds: add the logit-bound charts (largest over layers, per layer).
            updates: add the update-entropy charts (mean over layers with its min-max band, per layer).
        """
        loss = f"^{re.escape(self.loss_tag)}$" if self.loss_tag is not None else LOSS_PATTERN
        main: list[Chart] = [{"title": "training loss", "multiline": [loss]}]
        per_layer: list[Chart] = []
        for p in layer_names:
            main.append(
                {
                    "title": f"HDI ({p}): mean over layers, min-max band, chance level",
                    "margin": [(f"hdi/{p}/mean", f"hdi/{p}/min", f"hdi/{p}/max"), (f"hdi_chance/{p}",) * 3],
                }
            )
            per_layer.append(
                {
                    "title": f"HDI ({p}) per layer",
                    "multiline": [f"^hdi/{re.escape(p)}/{_LAYER}$", f"^hdi_chance/{re.escape(p)}$"],
                }
            )
        categories: list[Category] = [{"title": "HDI", "closed": False, "charts": main}]
        if activations:
            categories.append(
                {
                    "title": "Head outputs",
                    "closed": False,
                    "charts": [
                        {
                            "title": f"{family.replace('_', ' ')}: mean over layers, min-max band",
                            "margin": [(f"{family}/mean", f"{family}/min", f"{family}/max")],
                        }
                        for family in _SUMMARISED
                    ],
                }
            )
        categories.append(
            {
                "title": "Diversity events",
                "closed": False,
                "charts": [{"title": "events per measured step (0 = none)", "multiline": [r"^diversity_events/"]}],
            }
        )
        categories.append({"title": "HDI per layer", "closed": True, "charts": per_layer})
        if activations:
            per_family = {f"{f.replace('_', ' ')} per layer": f"^{f}/{_LAYER}$" for f in _SUMMARISED}
            categories.append(_collapsed("Head outputs per layer", per_family))
        if kernel:
            charts = {
                "attention entropy: mean over layers, uniform level": r"^attention_entropy(_uniform)?/mean$",
                "attention entropy per layer": f"^attention_entropy/{_LAYER}$",
                "maximum attention logit: per layer and max": r"^max_attention_logit/",
            }
            categories.append(_collapsed("Attention kernel (entropy, max logit)", charts))
        if bounds or updates:
            weights: list[Chart] = []
            if bounds:
                weights += [
                    {"title": "logit bound: largest over layers", "multiline": [r"^logit_bound/max$"]},
                    {"title": "logit bound per layer", "multiline": [f"^logit_bound/{_LAYER}$"]},
                ]
            if updates:
                weights += [
                    {
                        "title": "update entropy (nats): mean over layers, min-max band",
                        "margin": [("update_entropy/mean", "update_entropy/min", "update_entropy/max")],
                    },
                    {"title": "update entropy per layer", "multiline": [f"^update_entropy/{_LAYER}$"]},
                ]
            categories.append(
                {"title": "Weight signals (logit bound, update entropy)", "closed": True, "charts": weights}
            )
        health = {
            "invalid heads per projection (0 when healthy)": r"^invalid_heads/[a-z]+$",
            "invalid heads per layer (layers that had any)": r"^invalid_heads/[a-z]+/.+$",
        }
        categories.append(_collapsed("Head health (dead or non-finite heads)", health))
        return {"categories": categories}

    @staticmethod
    def levels_text(report: DiversityReport, projections: Sequence[str]) -> str:
        """The reference levels per projection, once, as a Markdown table (for the Text tab): the
        chance level and the frame bound (the largest HDI the shapes allow), with their caveats;
        then a table of the watched layers' shapes (`SHAPES_HEADER`: the split of each layer)."""
        rows = ["| projection | chance level (mean over layers) | frame bound (lowest layer) |", "|---|---|---|"]
        for p in projections:
            chance = [la.chance_hdi[p] for la in report.layers if la.hdi.get(p) is not None]
            caps = [cap for la in report.layers if (cap := la.max_hdi.get(p)) is not None]
            c = f"{sum(chance) / len(chance):.4f}" if chance else "not measured"
            b = "not measured" if not caps else f"{min(caps):.4f}" + (" (does not bind)" if min(caps) >= 1.0 else "")
            rows.append(f"| {p} | {c} | {b} |")
        shapes = [SHAPES_HEADER, "|---|---|---|---|---|"] + [
            f"| {la.name or '<root>'} | {la.num_heads} | {la.num_kv_heads} | {la.head_dim} | {la.model_dim} |"
            for la in report.layers
        ]
        return (
            "\n".join(rows)
            + (
                "\n\nThe chance level is the HDI of random Gaussian heads; with the spectral weighting it is "
                "slightly biased low at small D * d. The frame bound is exact for the uniform overlap and holds "
                "for the spectral one only for flat spectra. `hdi_max/<projection>` is logged only where it is "
                "below 1."
            )
            + "\n\nThe watched attention layers (what `hdi-monitor allocate --runs` reads as the split):\n\n"
            + "\n".join(shapes)
        )

    # ------------------------------------------------------------------ pictures
    def image_job(
        self,
        report: DiversityReport,
        history: History,
        *,
        step: int,
        projections: Sequence[str],
        activations: bool,
        angles: bool = True,
    ) -> ImageJob:
        """What the pictures of an image step need (tags: `image_tags`), copied so that they can
        be drawn off the training step (`hdi_monitor.monitor.render.render_job`). Cheap: it
        picks the layers, copies ``H x H`` matrices and the map's bounded columns.

        Args:
            report: this step's report (overlaps, correlations, angles).
            history: the bounded history, this step included: the diversity map's columns.
            step: the step.
            projections: the measured projections.
            activations: draw the correlation image.
            angles: add the principal-angle histograms (from ``report``'s angles).
        """
        maps: list[MapPanel] = []
        tiles: list[TilePanel] = []
        for p in projections:
            names, values, steps = history.layer_matrix("hdi", p)
            if names and steps:
                chance = float(history.column(Series("hdi_chance", p))[-1])
                if math.isfinite(chance) and 0.0 < chance < 1.0:
                    maps.append(
                        MapPanel(
                            tag=f"diversity_map/{p}",
                            values=values,
                            layers=tuple(names),
                            steps=tuple(steps),
                            chance=chance,
                            title=f"HDI ({p}) by layer and measured step (white: chance)",
                        )
                    )
            layers = [la for la in report.layers if p in la.overlap and la.overlap[p].shape[-1] >= 2]
            current = {la.name: float(v) for la in layers if (v := la.hdi.get(p)) is not None}
            picked = self._pick([la.name for la in layers], current, f"overlap/{p}")
            if picked:
                by_name = {la.name: la for la in layers}
                tiles.append(
                    TilePanel(
                        tag=f"overlap/{p}",
                        matrices=tuple(by_name[n].overlap[p].detach().to("cpu").clone() for n in picked),
                        titles=tuple(self._tile_title(n, current.get(n), "HDI", f"overlap/{p}") for n in picked),
                        vmin=0.0,
                        vmax=1.0,
                        cmap="viridis",
                        title=f"{p} subspace overlap of head pairs, step {step}{self._subset_note(picked, layers)}",
                        colorbar_label="overlap (1: same subspace)",
                    )
                )
        if activations:
            layers = [la for la in report.layers if la.correlation is not None and la.correlation.shape[-1] >= 2]
            current = {la.name: float(la.effective_heads) for la in layers if la.effective_heads is not None}
            picked = self._pick([la.name for la in layers], current, "correlation")
            if picked:
                matrices = {la.name: la.correlation for la in layers if la.correlation is not None}
                tiles.append(
                    TilePanel(
                        tag="correlation",
                        matrices=tuple(matrices[n].detach().to("cpu").clone() for n in picked),
                        titles=tuple(self._tile_title(n, current.get(n), "H_eff", "correlation") for n in picked),
                        vmin=-1.0,
                        vmax=1.0,
                        cmap="RdBu_r",
                        title=f"head-output correlation, step {step}{self._subset_note(picked, layers)}",
                        colorbar_label="correlation",
                    )
                )
        self._remember(report, projections)
        histograms: dict[str, Tensor] = {}
        if angles:
            per_projection = {p: {la.name: la.angles[p] for la in report.layers if p in la.angles} for p in projections}
            histograms = self.histograms(per_projection)
        return ImageJob(step=step, maps=tuple(maps), tiles=tuple(tiles), histograms=histograms)

    def _pick(self, names: list[str], current: Mapping[str, float], key: str) -> list[str]:
        """All layers, or the `max_image_layers` that moved most since the last image step (in
        depth order); evenly spaced ones when there is no earlier value."""
        k = self.max_image_layers
        if len(names) <= k:
            return names
        before = self._last_image_values.get(key, {})
        moved = {n: abs(current[n] - before[n]) for n in names if n in current and n in before}
        if moved:
            chosen = set(sorted(moved, key=lambda n: -moved[n])[:k])
        else:
            chosen = {names[round(i * (len(names) - 1) / (k - 1))] for i in range(k)} if k > 1 else {names[0]}
        return [n for n in names if n in chosen]

    def _tile_title(self, name: str, value: float | None, what: str, key: str) -> str:
        """``<layer name>\n<what> <value> (<change since the last image step>)``: the renderer
        shortens the names to what differs between the tiles."""
        if value is None:
            return name
        before = self._last_image_values.get(key, {}).get(name)
        change = f" ({value - before:+.2f})" if before is not None else ""
        digits = 2 if what == "H_eff" else 3  # an effective head count needs no third decimal
        return f"{name}\n{what} {value:.{digits}f}{change}"

    def _subset_note(self, picked: list[str], layers: Sequence[Any]) -> str:
        if len(picked) == len(layers):
            return ""
        moved = "that moved most since the last image" if self._last_image_values else "evenly spaced"
        return f" ({len(picked)} of {len(layers)} layers, {moved})"

    def _remember(self, report: DiversityReport, projections: Sequence[str]) -> None:
        for p in projections:
            self._last_image_values[f"overlap/{p}"] = {
                la.name: float(v) for la in report.layers if (v := la.hdi.get(p)) is not None
            }
        self._last_image_values["correlation"] = {
            la.name: float(la.effective_heads) for la in report.layers if la.effective_heads is not None
        }

    def histograms(self, angles: Mapping[str, Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """Principal-angle histograms: ``principal_angles_deg/<projection>/<layer>`` for up to
        `max_histogram_layers` layers, else ``principal_angles_deg/<projection>/layers_<a>-<b>``
        over adjacent layers ``a..b`` (indices in the model's layer order).

        Args:
            angles: projection -> layer name (in depth order) -> angles in degrees.
        """
        out: dict[str, Tensor] = {}
        for p, per_layer in angles.items():
            names = [n for n, v in per_layer.items() if v.numel()]
            if len(names) <= self.max_histogram_layers:
                out.update({f"principal_angles_deg/{p}/{n}": per_layer[n] for n in names})
                continue
            size = math.ceil(len(names) / self.max_histogram_layers)
            for start in range(0, len(names), size):
                group = names[start : start + size]
                tag = f"principal_angles_deg/{p}/layers_{start}-{start + len(group) - 1}"
                out[tag] = torch.cat([per_layer[n] for n in group])
        return out
