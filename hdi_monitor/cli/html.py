"""Write a `DiversityReport` as pictures and a self-contained HTML page.

`write_report` writes, into one folder:

* ``overlap_<projection>_<NN>_<layer>.png``: the ``(heads, heads)`` subspace-overlap matrix of every
  layer and projection (colour scale fixed to [0, 1], head indices on the edges, grey for invalid
  heads; drawn by `hdi_monitor.monitor.render.heatmap` with the dashboards' colour tables, no figure);
* ``correlation_<NN>_<layer>.png``: the head-output correlation matrix (scale [-1, 1]) when the
  report was made with inputs;
* ``overview_<projection>.png`` and ``overview_correlation.png``: every layer's matrix in one tiled
  picture (`hdi_monitor.monitor.render.tiled_heatmaps`, the dashboards' own overlap and correlation
  pictures, here with every layer), so that 80 layers read at a glance;
* ``hdi_by_layer.png``: HDI per layer for every projection, with the chance level (random heads)
  and, where it is below 1, the frame-bound maximum (matplotlib, Agg canvas, no pyplot state);
* ``index.html``: one page showing the training step the weights are from (or that it is
  unknown), the table, the modules that were not measured (with ``DiversityReport.skipped``), the
  plot and every matrix, in a grid that wraps to the window. It fits a 1,200 px window without
  scrolling sideways: the table has one column per projection (the chance level once per layer
  when the projections share it, the frame bound under an HDI only where it is below 1), long
  names wrap, and the overview pictures are drawn 1,100 px wide. It is rendered from the jinja2
  template ``templates/report.html.j2`` with autoescaping, so model text (layer names, reasons) is
  always escaped. The pictures are embedded as ``data:`` URIs and the style is inline, so the page
  can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import jinja2
import numpy as np
import torch
from torch import Tensor

from hdi_monitor.cli._common import no_link
from hdi_monitor.cli._load import TrainingStep
from hdi_monitor.monitor.render import colorbar_lut, heatmap, layer_labels, tiled_heatmaps
from hdi_monitor.report import ACTIVATIONS, DiversityReport

__all__ = ["ReportFiles", "write_report", "save_png", "plot_hdi_by_layer", "figure_count", "layer_labels"]

Progress = Callable[[int], object]

# Width range of one matrix picture on the page: the grid fits as many columns as the window allows.
_CELL_MIN_PX, _CELL_MAX_PX = 170, 300
# Tiles per row of an overview picture, and its width: the page's content at a 1,200 px window
# (24 px margins) is 1,152 px, so the picture shows pixel for pixel there.
_OVERVIEW_COLUMNS, _OVERVIEW_PX = 8, 1100


@dataclass
class ReportFiles:
    """Paths written by `write_report`.

    Attributes:
        html: the page (``index.html``).
        plot: the HDI-by-layer plot.
        overlap: ``(layer name, projection) -> PNG`` of each overlap heatmap.
        correlation: ``layer name -> PNG`` of each head-output correlation heatmap.
        overview: ``projection`` (or ``"correlation"``) ``-> PNG`` of every layer's matrix in one picture.
    """

    html: Path
    plot: Path
    overlap: dict[tuple[str, str], Path] = field(default_factory=dict)
    correlation: dict[str, Path] = field(default_factory=dict)
    overview: dict[str, Path] = field(default_factory=dict)

    def all(self) -> list[Path]:
        """Every file, the page last."""
        return [*self.overview.values(), *self.overlap.values(), *self.correlation.values(), self.plot, self.html]


def save_png(image: Tensor, path: str | Path) -> Path:
    """Save a ``(3, H, W)`` uint8 image (as `heatmap` returns) as a PNG."""
    from PIL import Image

    if not isinstance(image, Tensor) or image.ndim != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"image must be a (3, H, W) uint8 tensor, got {getattr(image, 'shape', type(image))}")
    path = no_link(path)
    Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy(), mode="RGB").save(path, optimize=True)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name or "root").strip("_") or "root"


def _has_matrix(matrix: Tensor | None) -> TypeGuard[Tensor]:
    return matrix is not None and matrix.ndim == 2 and matrix.shape[-1] >= 2


def figure_count(report: DiversityReport) -> int:
    """How many files `write_report` writes for ``report`` (for progress bars)."""
    n = 2  # plot + page
    for layer in report.layers:
        n += sum(_has_matrix(layer.overlap.get(p)) for p in report.projections)
        n += _has_matrix(layer.correlation)
    n += sum(any(_has_matrix(la.overlap.get(p)) for la in report.layers) for p in report.projections)
    return n + any(_has_matrix(la.correlation) for la in report.layers)  # the overviews


def plot_hdi_by_layer(report: DiversityReport, path: str | Path, *, title: str | None = None) -> Path:
    """Line plot of HDI per layer for every projection, with the chance level and the maximum.

    Layers without an HDI for a projection (one head) are gaps. Uses a bare Agg canvas, so it
    touches no global matplotlib state and needs no display.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels, pattern = layer_labels([lay.name for lay in report.layers])
    x = list(range(len(report.layers)))
    width = min(12.0, max(6.0, 0.35 * len(x) + 3.0))
    fig = Figure(figsize=(width, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = {"query": "#1f77b4", "key": "#d62728", "value": "#2ca02c", "output": "#9467bd"}

    def series(values: list[float | None]) -> list[float]:
        return [math.nan if v is None else float(v) for v in values]

    chance_drawn: dict[tuple[float, ...], str] = {}
    for p in report.projections:
        color = colors.get(p)
        ax.plot(
            x,
            series([lay.hdi.get(p) for lay in report.layers]),
            marker="o",
            ms=4,
            lw=1.6,
            color=color,
            label=f"{p} HDI",
        )
        chance = tuple(round(lay.chance_hdi.get(p, math.nan), 9) for lay in report.layers)
        if chance not in chance_drawn:  # projections with the same reference level share one line
            chance_drawn[chance] = p
            ax.plot(
                x,
                list(chance),
                ls="--",
                lw=1.1,
                color="0.45",
                label="chance (random heads)" if len(chance_drawn) == 1 else None,
            )
        caps = series([lay.max_hdi.get(p) for lay in report.layers])
        if any(c < 1 - 1e-9 for c in caps if not math.isnan(c)):
            ax.plot(x, caps, ls=":", lw=1.2, color=color, label=f"{p} max (frame bound)")
    shown = np.concatenate([np.asarray(line.get_ydata(), dtype=np.float64).ravel() for line in ax.get_lines()])
    low = float(np.nanmin(shown)) if np.isfinite(shown).any() else 0.0
    ax.set_ylim(max(-0.02, low - 0.08 * (1.0 - low) - 0.02), 1.02)  # zoom in, keep 1 (orthogonal) visible
    ax.set_ylabel("HDI (1 = orthogonal heads)")
    ax.set_xlabel(f"layer ({pattern})" if pattern else "layer")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=0 if max((len(s) for s in labels), default=0) * len(x) < 60 else 60, fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", ncol=2)
    ax.set_title(title or f"Head diversity by layer ({report.weighting} overlap)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(no_link(path), format="png")
    return path


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _gradient(cmap: str) -> str:
    lut = colorbar_lut(cmap)
    stops = [lut[round(i * (len(lut) - 1) / 10)].tolist() for i in range(11)]
    return "linear-gradient(to right, " + ", ".join(f"rgb({r},{g},{b})" for r, g, b in stops) + ")"


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "\u2013"  # en dash
    return f"{value:.{digits}f}"


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hdi_monitor.cli", "templates"),
        autoescape=True,  # every value is text: layer names, module classes and reasons come from the model
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return env.get_template("report.html.j2")


def _shared_chance(report: DiversityReport) -> bool:
    """True when every layer's projections share one chance level (as shown), so that the table
    gives it once per layer; the usual case, every projection's heads being D x d."""
    return all(len({_fmt(lay.chance_hdi.get(p)) for p in report.projections}) == 1 for lay in report.layers)


def _summary_rows(report: DiversityReport, shared_chance: bool) -> list[dict[str, Any]]:
    """One row per layer: one cell per projection (its HDI; under it the chance level unless
    ``shared_chance``, and the frame bound where it is below 1)."""
    rows = []
    for lay in report.layers:
        cells = []
        for p in report.projections:
            value, chance, cap = lay.hdi.get(p), lay.chance_hdi.get(p), lay.max_hdi.get(p)
            refs = [] if shared_chance else [f"chance {_fmt(chance)}"]
            if cap is not None and not math.isnan(cap) and cap < 1 - 1e-9:
                refs.append(f"max {_fmt(cap)}")
            cells.append(
                {
                    "hdi": _fmt(value) + ("*" if lay.invalid_heads.get(p) else ""),
                    "low": value is not None and chance is not None and value < chance,
                    "refs": refs,
                }
            )
        first = report.projections[0] if report.projections else None
        rows.append(
            {
                "name": lay.name or "<root>",
                "chance": _fmt(lay.chance_hdi.get(first)) if first else "\u2013",
                "family": lay.family,
                "heads": f"{lay.num_heads}" + ("" if lay.num_kv_heads == lay.num_heads else f"/{lay.num_kv_heads}"),
                "head_dim": lay.head_dim,
                "model_dim": lay.model_dim,
                "projections": cells,
                "effective_heads": _fmt(lay.effective_heads, 2) + ("*" if lay.invalid_heads.get(ACTIVATIONS) else ""),
                "mean_correlation": _fmt(lay.mean_correlation),
                "tokens": "\u2013" if lay.num_tokens is None else str(lay.num_tokens),
            }
        )
    return rows


def _grid_rows(report: DiversityReport, files: ReportFiles) -> list[dict[str, Any]]:
    rows = []
    for i, lay in enumerate(report.layers):
        name = lay.name or "<root>"
        cells = []
        for p in report.projections:
            path = files.overlap.get((lay.name, p))
            cells.append(
                {
                    "src": None if path is None else _data_uri(path),
                    "alt": f"{p} overlap of {name}",
                    "empty": "(one head)",
                    "caption": f"{p} overlap",
                    "value_name": "HDI",
                    "value_sub": "",
                    "value": _fmt(lay.hdi.get(p)) if path is not None else "",
                }
            )
        if files.correlation:
            path = files.correlation.get(lay.name)
            cells.append(
                {
                    "src": None if path is None else _data_uri(path),
                    "alt": f"head-output correlation of {name}",
                    "empty": "\u2013",
                    "caption": "head-output correlation",
                    "value_name": "H",
                    "value_sub": "eff",
                    "value": _fmt(lay.effective_heads, 2),
                }
            )
        rows.append({"index": i, "name": name, "cells": cells})
    return rows


def _overview_rows(files: ReportFiles) -> list[dict[str, str]]:
    return [
        {
            "src": _data_uri(path),
            "alt": "head-output correlation of every layer"
            if key == "correlation"
            else f"{key} overlap of every layer",
        }
        for key, path in files.overview.items()
    ]


def _write_overviews(report: DiversityReport, out: Path, files: ReportFiles, tick: Progress) -> None:
    """One tiled picture per projection (and of the correlations) with every layer's matrix."""
    for p in report.projections:
        shown = [la for la in report.layers if _has_matrix(la.overlap.get(p))]
        if shown:
            png = tiled_heatmaps(
                [la.overlap[p] for la in shown],
                titles=[f"{la.name or '<root>'}\nHDI {_fmt(la.hdi.get(p))}" for la in shown],
                vmin=0.0,
                vmax=1.0,
                cmap="viridis",
                title=f"{p} subspace overlap of head pairs, every layer",
                colorbar_label="overlap (1: same subspace)",
                max_columns=_OVERVIEW_COLUMNS,
                width=_OVERVIEW_PX,
            )
            files.overview[p] = out / f"overview_{p}.png"
            no_link(files.overview[p]).write_bytes(png)
            tick(1)
    shown = [la for la in report.layers if _has_matrix(la.correlation)]
    if shown:
        png = tiled_heatmaps(
            [la.correlation for la in shown if la.correlation is not None],
            titles=[f"{la.name or '<root>'}\nH_eff {_fmt(la.effective_heads, 2)}" for la in shown],
            vmin=-1.0,
            vmax=1.0,
            cmap="RdBu_r",
            title="head-output correlation, every layer",
            colorbar_label="correlation",
            max_columns=_OVERVIEW_COLUMNS,
            width=_OVERVIEW_PX,
        )
        files.overview["correlation"] = out / "overview_correlation.png"
        no_link(files.overview["correlation"]).write_bytes(png)
        tick(1)


def _page(report: DiversityReport, files: ReportFiles, title: str, source: str | None, step: TrainingStep) -> str:
    """Render the page template (autoescaped) for ``report`` and the pictures in ``files``."""
    skipped = getattr(report, "skipped", None)  # DiversityReport.skipped: modules found but not measured
    shared_chance = _shared_chance(report)
    return _template().render(
        title=title,
        source=source,
        step="unknown" if step.step is None else str(step.step),
        step_source=step.source,
        stamp=_dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        weighting=report.weighting,
        num_layers=len(report.layers),
        projections=report.projections,
        has_activations=any(lay.effective_heads is not None for lay in report.layers),
        shared_chance=shared_chance,
        summary=_summary_rows(report, shared_chance),
        mean_hdi=[_fmt(report.mean_hdi(p)) for p in report.projections],
        skipped=None if skipped is None else list(skipped),
        plot_src=_data_uri(files.plot),
        has_correlation=bool(files.correlation),
        overlap_gradient=_gradient("viridis"),
        correlation_gradient=_gradient("RdBu_r"),
        grid=_grid_rows(report, files),
        overview=_overview_rows(files),
        cell_min_px=_CELL_MIN_PX,
        cell_max_px=_CELL_MAX_PX,
    )


def write_report(
    report: DiversityReport,
    out_dir: str | Path,
    *,
    title: str | None = None,
    source: str | None = None,
    step: TrainingStep | int | None = None,
    progress: Progress | None = None,
) -> ReportFiles:
    """Write heatmap PNGs, the HDI-by-layer plot and ``index.html`` for ``report`` into ``out_dir``.

    Args:
        report: a `DiversityReport` (from `head_diversity`).
        out_dir: the folder (created if missing; files of the same names are overwritten).
        title: page and plot title (default ``"Head diversity report"``).
        source: shown on the page (e.g. the model path).
        step: the training step the weights are from, stated under the title: a `TrainingStep`
            (where it was read, as ``hdi-monitor report`` finds it), or a step number the caller
            vouches for; None says the step is unknown.
        progress: called with ``1`` after each file (``tqdm.update`` fits), see `figure_count`.

    Returns:
        A `ReportFiles` with every path written.
    """
    if not isinstance(report, DiversityReport):
        raise TypeError(f"report must be a DiversityReport, got {type(report).__name__}")
    if step is None:
        step = TrainingStep(None, "none was given with the report")
    elif not isinstance(step, TrainingStep):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be a TrainingStep, a step number or None, got {step!r}")
        step = TrainingStep(step, "given with the report")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tick = progress or (lambda n: None)
    title = title or "Head diversity report"
    files = ReportFiles(html=out / "index.html", plot=out / "hdi_by_layer.png")
    for i, lay in enumerate(report.layers):
        stem = f"{i:02d}_{_slug(lay.name)}"
        for p in report.projections:
            matrix = lay.overlap.get(p)
            if _has_matrix(matrix):
                files.overlap[(lay.name, p)] = save_png(
                    heatmap(matrix, vmin=0.0, vmax=1.0), out / f"overlap_{p}_{stem}.png"
                )
                tick(1)
        if _has_matrix(lay.correlation):
            image = heatmap(lay.correlation, vmin=-1.0, vmax=1.0, cmap="RdBu_r")
            files.correlation[lay.name] = save_png(image, out / f"correlation_{stem}.png")
            tick(1)
    _write_overviews(report, out, files, tick)
    plot_hdi_by_layer(report, files.plot, title=title if title != "Head diversity report" else None)
    tick(1)
    no_link(files.html).write_text(_page(report, files, title, source, step), encoding="utf-8")
    tick(1)
    return files
