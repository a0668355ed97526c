"""Write a :class:`~hdi_monitor.report.DiversityReport` as pictures and a self-contained HTML page.

:func:`write_report` writes, into one folder:

* ``overlap_<projection>_<NN>_<layer>.png``: the ``(heads, heads)`` subspace-overlap matrix of every
  layer and projection (colour scale fixed to [0, 1], head indices on the edges; rendered by
  :func:`hdi_monitor.render.heatmap`, no figure per picture);
* ``correlation_<NN>_<layer>.png``: the head-output correlation matrix (scale [-1, 1]) when the
  report was made with inputs;
* ``hdi_by_layer.png``: HDI per layer for every projection, with the chance level (random heads)
  and, where it is below 1, the frame-bound maximum (matplotlib, Agg canvas, no pyplot state);
* ``index.html``: one page showing the table and every picture. The pictures are embedded as
  ``data:`` URIs and the style is inline, so the page can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from hdi_monitor.render import colorbar_lut, heatmap
from hdi_monitor.report import DiversityReport

__all__ = ["ReportFiles", "write_report", "save_png", "plot_hdi_by_layer", "figure_count", "layer_labels"]

Progress = Callable[[int], object]


@dataclass
class ReportFiles:
    """Paths written by :func:`write_report`.

    Attributes:
        html: the page (``index.html``).
        plot: the HDI-by-layer plot.
        overlap: ``(layer name, projection) -> PNG`` of each overlap heatmap.
        correlation: ``layer name -> PNG`` of each head-output correlation heatmap.
    """

    html: Path
    plot: Path
    overlap: dict[tuple[str, str], Path] = field(default_factory=dict)
    correlation: dict[str, Path] = field(default_factory=dict)

    def all(self) -> list[Path]:
        """Every file, the page last."""
        return [*self.overlap.values(), *self.correlation.values(), self.plot, self.html]


def save_png(image: Tensor, path: str | Path) -> Path:
    """Save a ``(3, H, W)`` uint8 image (as :func:`~hdi_monitor.render.heatmap` returns) as a PNG."""
    from PIL import Image

    if not isinstance(image, Tensor) or image.ndim != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"image must be a (3, H, W) uint8 tensor, got {getattr(image, 'shape', type(image))}")
    path = Path(path)
    Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy(), mode="RGB").save(path, optimize=True)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name or "root").strip("_") or "root"


def _has_matrix(matrix: Tensor | None) -> bool:
    return matrix is not None and matrix.ndim == 2 and matrix.shape[-1] >= 2


def figure_count(report: DiversityReport) -> int:
    """How many files :func:`write_report` writes for ``report`` (for progress bars)."""
    n = 2  # plot + page
    for layer in report.layers:
        n += sum(_has_matrix(layer.overlap.get(p)) for p in report.projections)
        n += _has_matrix(layer.correlation)
    return n


def layer_labels(names: Sequence[str]) -> tuple[list[str], str]:
    """Short tick labels for layer names, and the pattern they fill in.

    The longest common dotted prefix and suffix are cut: ``encoder.layer.0.attention``,
    ``encoder.layer.1.attention`` give labels ``0``, ``1`` and pattern ``encoder.layer.*.attention``.
    """
    names = [n or "<root>" for n in names]
    if len(names) < 2:
        return names, ""
    parts = [n.split(".") for n in names]
    pre = 0
    while all(len(p) > pre + 1 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    suf = 0
    while all(len(p) > pre + suf + 1 for p in parts) and len({p[-1 - suf] for p in parts}) == 1:
        suf += 1
    labels = [".".join(p[pre : len(p) - suf]) for p in parts]
    if len(set(labels)) != len(labels) or (pre == 0 and suf == 0):
        return names, ""
    pattern = ".".join([*parts[0][:pre], "*", *(parts[0][len(parts[0]) - suf :] if suf else [])])
    return labels, pattern


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
        color = colors.get(p, None)
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
    shown = [v for line in ax.get_lines() for v in line.get_ydata() if not math.isnan(v)]
    low = min(shown, default=0.0)
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
    fig.savefig(path, format="png")
    return path


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _gradient(cmap: str) -> str:
    lut = colorbar_lut(cmap)
    stops = [lut[round(i * (len(lut) - 1) / 10)].tolist() for i in range(11)]
    return "linear-gradient(to right, " + ", ".join(f"rgb({r},{g},{b})" for r, g, b in stops) + ")"


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "&ndash;"
    return f"{value:.{digits}f}"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:1.4em;margin-bottom:.2em} h2{font-size:1.15em;margin-top:1.6em}
.meta{color:#555;font-size:.9em} table{border-collapse:collapse;font-size:.85em}
th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right} th{background:#f4f4f4}
td.name,th.name{text-align:left;font-family:monospace} td.low{color:#b22}
.grid td{vertical-align:top;text-align:center;border:none;padding:4px}
.grid img{image-rendering:pixelated;border:1px solid #ccc}
.scroll{overflow-x:auto}
.bar{display:inline-block;width:180px;height:12px;vertical-align:middle;border:1px solid #aaa}
.note{font-size:.85em;color:#444;max-width:900px}
"""


def _table(report: DiversityReport) -> str:
    has_act = any(lay.effective_heads is not None for lay in report.layers)
    head = ["<th class=name>layer</th><th>family</th><th>heads</th><th>d</th><th>D</th>"]
    for p in report.projections:
        head.append(f"<th>{p} HDI</th><th>chance</th><th>max</th>")
    if has_act:
        head.append("<th>H<sub>eff</sub></th><th>mean R</th><th>tokens</th>")
    rows = []
    for lay in report.layers:
        heads = f"{lay.num_heads}" if lay.num_kv_heads == lay.num_heads else f"{lay.num_heads}/{lay.num_kv_heads}"
        cells = [
            f"<td class=name>{html.escape(lay.name or '<root>')}</td><td>{html.escape(lay.family)}</td>"
            f"<td>{heads}</td><td>{lay.head_dim}</td><td>{lay.model_dim}</td>"
        ]
        for p in report.projections:
            value, chance = lay.hdi.get(p), lay.chance_hdi.get(p)
            low = value is not None and chance is not None and value < chance
            mark = "*" if lay.invalid_heads.get(p) else ""
            cells.append(
                f"<td class={'low' if low else 'ok'}>{_fmt(value)}{mark}</td><td>{_fmt(chance)}</td><td>{_fmt(lay.max_hdi.get(p))}</td>"
            )
        if has_act:
            tokens = "&ndash;" if lay.num_tokens is None else str(lay.num_tokens)
            cells.append(
                f"<td>{_fmt(lay.effective_heads, 2)}</td><td>{_fmt(lay.mean_correlation)}</td><td>{tokens}</td>"
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    mean = ["<td class=name><b>mean</b></td><td></td><td></td><td></td><td></td>"]
    for p in report.projections:
        mean.append(f"<td><b>{_fmt(report.mean_hdi(p))}</b></td><td></td><td></td>")
    if has_act:
        mean.append("<td></td><td></td><td></td>")
    rows.append("<tr>" + "".join(mean) + "</tr>")
    return "<table><tr>" + "".join(head) + "</tr>" + "".join(rows) + "</table>"


def _page(report: DiversityReport, files: ReportFiles, title: str, source: str | None) -> str:
    has_corr = bool(files.correlation)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    src = f" &middot; source: <code>{html.escape(source)}</code>" if source else ""
    header = "".join(f"<th>{p} overlap</th>" for p in report.projections) + (
        "<th>head-output correlation</th>" if has_corr else ""
    )
    grid_rows = []
    for i, lay in enumerate(report.layers):
        cells = [f"<td class=name style='text-align:left'>{i}<br>{html.escape(lay.name or '<root>')}</td>"]
        for p in report.projections:
            path = files.overlap.get((lay.name, p))
            if path is None:
                cells.append("<td>(one head)</td>")
            else:
                hdi = lay.hdi.get(p)
                cells.append(
                    f"<td><img alt='{p} overlap of {html.escape(lay.name)}' src='{_data_uri(path)}'><br>HDI {_fmt(hdi)}</td>"
                )
        if has_corr:
            path = files.correlation.get(lay.name)
            cells.append(
                "<td>&ndash;</td>"
                if path is None
                else f"<td><img alt='correlation' src='{_data_uri(path)}'><br>H<sub>eff</sub> {_fmt(lay.effective_heads, 2)}</td>"
            )
        grid_rows.append("<tr>" + "".join(cells) + "</tr>")
    legend = (
        f"overlap &rho;<sub>ij</sub>: 0 <span class=bar style='background:{_gradient('viridis')}'></span> 1"
        + (
            f" &nbsp;&nbsp; correlation: &minus;1 <span class=bar style='background:{_gradient('RdBu_r')}'></span> 1"
            if has_corr
            else ""
        )
        + " &nbsp;&nbsp; grey: invalid (all-zero or non-finite) head"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div class=meta>{report.weighting} subspace overlap &middot; {len(report.layers)} attention layer(s) &middot; written {stamp}{src}</div>
<p class=note>HDI = 1 &minus; mean overlap of head pairs (1: heads read/write orthogonal subspaces; 0: all heads share one
subspace). <i>chance</i> is the HDI of independent random heads (what initialisation gives); <i>max</i> is the
frame bound when H&middot;d &gt; D. HDI values below chance are shown in red. H<sub>eff</sub> (effective number
of heads, from head-output covariance) needs inputs.</p>
<h2>Summary</h2>
<div class=scroll>{_table(report)}</div>
<h2>HDI by layer</h2>
<img alt="HDI by layer" src="{_data_uri(files.plot)}" style="max-width:100%">
<h2>Head-pair matrices</h2>
<p class=note>{legend}</p>
<div class=scroll><table class=grid><tr><th class=name>layer</th>{header}</tr>
{"".join(grid_rows)}
</table></div>
</body></html>
"""


def write_report(
    report: DiversityReport,
    out_dir: str | Path,
    *,
    title: str | None = None,
    source: str | None = None,
    progress: Progress | None = None,
) -> ReportFiles:
    """Write heatmap PNGs, the HDI-by-layer plot and ``index.html`` for ``report`` into ``out_dir``.

    Args:
        report: a :class:`~hdi_monitor.report.DiversityReport` (from :func:`~hdi_monitor.head_diversity`).
        out_dir: the folder (created if missing; files of the same names are overwritten).
        title: page and plot title (default ``"Head diversity report"``).
        source: shown on the page (e.g. the model path).
        progress: called with ``1`` after each file (``tqdm.update`` fits), see :func:`figure_count`.

    Returns:
        A :class:`ReportFiles` with every path written.
    """
    if not isinstance(report, DiversityReport):
        raise TypeError(f"report must be a DiversityReport, got {type(report).__name__}")
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
    plot_hdi_by_layer(report, files.plot, title=title if title != "Head diversity report" else None)
    tick(1)
    files.html.write_text(_page(report, files, title, source), encoding="utf-8")
    tick(1)
    return files
