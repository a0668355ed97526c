"""The HTML page of `hdi_monitor.cli.html.write_report`, read back with html.parser."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from hdi_monitor import head_diversity
from hdi_monitor.cli._load import TrainingStep
from hdi_monitor.cli.html import write_report
from hdi_monitor.monitor.render import colour_table, tiled_heatmaps

EVIL = "<script>alert('x')</script>&\"q\""


class Page(HTMLParser):
    """Tags, attributes and text of a page, and the text of each table row and section heading."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.rows: list[list[str]] = []  # cells of every <tr>
        self.h2: list[str] = []
        self.h3: list[str] = []
        self.figcaption: list[str] = []
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag in ("h2", "h3", "figcaption"):
            self._heading = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag in ("h2", "h3", "figcaption") and self._heading is not None:
            getattr(self, tag).append("".join(self._heading).strip())
            self._heading = None

    def handle_data(self, data):
        self.text.append(data)
        for buf in (self._cell, self._heading):
            if buf is not None:
                buf.append(data)

    def images(self) -> list[dict[str, str | None]]:
        return [a for t, a in self.tags if t == "img"]


def _spectral_hdi(w: torch.Tensor, heads: int) -> float:
    """HDI of the spectrally weighted overlap, from one projection's (H*d, D) weight, by hand."""
    blocks = w.detach().double().reshape(heads, -1, w.shape[1])  # head h: rows h*d .. (h+1)*d - 1
    total, pairs = 0.0, 0
    for i in range(heads):
        for j in range(heads):
            if i != j:
                cross = torch.linalg.matrix_norm(blocks[i] @ blocks[j].T) ** 2
                norm_i = torch.linalg.matrix_norm(blocks[i] @ blocks[i].T)
                norm_j = torch.linalg.matrix_norm(blocks[j] @ blocks[j].T)
                total += float(cross / (norm_i * norm_j))
                pairs += 1
    return 1.0 - total / pairs


def _encoder(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def test_layer_names_and_title_are_escaped(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({EVIL: torch.nn.MultiheadAttention(16, 4, batch_first=True)})
    report = head_diversity(model, projections=("key",))
    assert report.layers[0].name == EVIL
    files = write_report(report, tmp_path, title="</title><script>t()</script>", source="<em>src</em>")
    text = files.html.read_text()
    page = Page(text)
    assert [t for t, _ in page.tags if t == "script"] == []  # nothing the model or the caller wrote became a tag
    assert not any(t == "em" for t, _ in page.tags)
    assert "<script>" not in text and "&lt;script&gt;" in text
    body = "".join(page.text)
    assert EVIL in body and "</title><script>t()</script>" in body and "<em>src</em>" in body  # shown as text
    summary = next(r for r in page.rows if r and r[0] == EVIL)
    # the HDI shown is the one computed by hand from the module's own key weight
    d_model = 16
    key_weight = model[EVIL].in_proj_weight[d_model : 2 * d_model]
    assert summary[6] == f"{_spectral_hdi(key_weight, 4):.3f}"
    # the chance column is the analytic spectral level 1 - d / (D + d + 1)
    assert summary[5] == f"{1 - 4 / (16 + 4 + 1):.3f}"
    assert page.h3 == [f"0 · {EVIL}"]
    assert f"key overlap of {EVIL}" in [i["alt"] for i in page.images()]  # attributes escaped and read back intact


@dataclass
class SkippedModule:
    """The fields of hdi_monitor's SkippedModule that the page shows."""

    name: str
    class_name: str
    reason: str


def test_not_measured_section_lists_skipped_modules(tmp_path):
    report = head_diversity(_encoder(), projections=("key",))
    skipped = [
        SkippedModule("blocks.3.attn", "FancyAttention", "unknown layout: no q/k/v projections found"),
        SkippedModule("blocks.<4>.attn", "Weird&Co", "fused QKV of unknown order"),
    ]
    report = dataclasses.replace(report, skipped=skipped)  # what DiversityReport.skipped holds
    page = Page(write_report(report, tmp_path / "a").html.read_text())
    assert "Not measured" in page.h2
    header = ["module", "class", "reason"]
    i = page.rows.index(header)
    assert page.rows[i + 1 : i + 3] == [[s.name, s.class_name, s.reason] for s in skipped]

    report = dataclasses.replace(report, skipped=[])
    page = Page(write_report(report, tmp_path / "b").html.read_text())
    assert "Not measured" in page.h2 and header not in page.rows
    assert "every attention-like module that was found is measured" in "".join(page.text)

    report = dataclasses.replace(report, skipped=None)  # a report made before the field existed: it claims nothing
    page = Page(write_report(report, tmp_path / "c").html.read_text())
    assert "Not measured" not in page.h2


def test_every_picture_on_the_page_is_a_written_png(tmp_path):
    model = _encoder(3)
    report = head_diversity(model, projections=("query", "key", "output"), inputs=torch.randn(2, 6, 16))
    files = write_report(report, tmp_path)
    page = Page(files.html.read_text())
    images = page.images()
    assert len(images) == 1 + 4 + 3 * 3 + 3  # plot, 4 overviews, 3 overlaps and 1 correlation per layer
    shown = []
    for img in images:
        src = img["src"] or ""
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        shown.append(data)
    written = [p.read_bytes() for p in files.all() if p.suffix == ".png"]
    assert sorted(shown) == sorted(written) and len(written) == len(images)
    # every layer at a glance first: one picture per projection and one of the correlations, whose
    # tiles are the layers' matrices (cell colours: the colour table at the report's values)
    overviews = [f"{p} overlap of every layer" for p in report.projections]
    assert [img["alt"] for img in images[1:5]] == [*overviews, "head-output correlation of every layer"]
    overview = np.asarray(Image.open(files.overview["key"]).convert("RGB"))
    geometry: dict = {}
    again = tiled_heatmaps(
        [la.overlap["key"] for la in report.layers],
        titles=[f"{la.name}\nHDI {la.hdi['key']:.3f}" for la in report.layers],
        vmin=0.0,
        vmax=1.0,
        cmap="viridis",
        title="key subspace overlap of head pairs, every layer",
        colorbar_label="overlap (1: same subspace)",
        max_columns=8,
        width=1100,
        geometry=geometry,
    )
    assert again == files.overview["key"].read_bytes()
    viridis = colour_table("viridis")
    for lay, tile in zip(report.layers, geometry["tiles"], strict=True):
        for i, j in ((0, 0), (0, 1), (2, 3)):
            x, y = tile["left"] + j * tile["pitch"], tile["top"] + i * tile["pitch"]
            expected = viridis[int(np.rint(float(lay.overlap["key"][i, j]) * 255))]
            assert tuple(overview[y, x]) == tuple(expected), (lay.name, i, j)
    # then the pictures layer by layer, in the order of the report, with their captions
    alts = [img["alt"] for img in images[5:]]
    expected = []
    for lay in report.layers:
        expected += [f"{p} overlap of {lay.name}" for p in report.projections]
        expected.append(f"head-output correlation of {lay.name}")
    assert alts == expected
    assert page.h3 == [f"{i} · {lay.name}" for i, lay in enumerate(report.layers)]
    # the caption under each picture; the query HDI computed by hand from the layer's own weight
    captions = iter(page.figcaption)
    for lay, module in zip(report.layers, model.layers, strict=True):
        hdi = _spectral_hdi(module.self_attn.in_proj_weight[:16], 4)
        assert next(captions) == f"query overlapHDI {hdi:.3f}"
        assert [next(captions) for _ in range(2)] == [f"{p} overlapHDI {lay.hdi[p]:.3f}" for p in ("key", "output")]
        assert next(captions) == f"head-output correlationHeff {lay.effective_heads:.2f}"


def test_page_keeps_its_legend_plot_and_scales_the_matrix_grid(tmp_path):
    report = head_diversity(_encoder(), projections=("key",), inputs=torch.randn(2, 6, 16))
    files = write_report(report, tmp_path)
    text = files.html.read_text()
    page = Page(text)
    assert [h for h in page.h2 if h != "Not measured"] == ["Summary", "HDI by layer", "Head-pair matrices"]
    bars = [a["style"] for t, a in page.tags if t == "span" and a.get("class") == "bar"]
    assert len(bars) == 2 and all(s.startswith("background:linear-gradient(to right, rgb(") for s in bars)
    assert page.images()[0]["alt"] == "HDI by layer"
    assert "chance" in page.rows[0]
    # the matrices sit in a CSS grid of auto-filled columns, each picture scaled to its column:
    # no fixed-width table row that a narrow window cuts off
    assert re.search(r"\.matrices\{display:grid;grid-template-columns:repeat\(auto-fill,", text)
    assert re.search(r"\.matrices img\{width:100%;height:auto", text)
    assert not any(t == "table" and a.get("class") == "grid" for t, a in page.tags)


def test_write_report_rejects_a_non_report(tmp_path):
    with pytest.raises(TypeError, match="DiversityReport"):
        write_report({"layers": []}, tmp_path)


def _deep_report(layers: int = 12) -> object:
    """All four projections and head-output statistics of a model with many layers and a long,
    unbroken layer name: what makes a wide table."""
    torch.manual_seed(0)
    long_name = "encoder_with_a_long_name_" * 6
    model = torch.nn.ModuleDict(
        {
            long_name: torch.nn.TransformerEncoder(
                torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0),
                layers,
                enable_nested_tensor=False,
            )
        }
    ).eval()
    module = model[long_name]
    report = head_diversity(module, projections=("query", "key", "value", "output"), inputs=torch.randn(2, 6, 16))
    layers_named = [dataclasses.replace(lay, name=f"{long_name}.{lay.name}") for lay in report.layers]
    skipped = [SkippedModule("a." * 40 + "attn", "Fancy" * 12, "unknown layout: " + "no q/k/v projections " * 10)]
    return dataclasses.replace(report, layers=layers_named, skipped=skipped)


def test_summary_table_has_one_column_per_projection(tmp_path):
    report = _deep_report()
    page = Page(write_report(report, tmp_path).html.read_text())
    header = page.rows[0]
    # layer, family, heads, d, D, chance once (the projections share it), one column per projection,
    # then H_eff, mean R, tokens: 13 columns, not 5 + 3 per projection + 3 (20)
    assert header == [
        "layer", "family", "heads", "d", "D", "chance", "query HDI", "key HDI", "value HDI", "output HDI",
        "Heff", "mean R", "tokens",
    ]  # fmt: skip
    for lay, row in zip(report.layers, page.rows[1 : 1 + len(report.layers)], strict=True):
        assert len(row) == len(header) and row[0] == lay.name
        assert row[5] == f"{lay.chance_hdi['key']:.3f}"
        assert row[6:10] == [f"{lay.hdi[p]:.3f}" for p in ("query", "key", "value", "output")]  # max is 1: not shown
    assert page.rows[1 + len(report.layers)][6:10] == [f"{report.mean_hdi(p):.3f}" for p in report.projections]

    # a frame bound below 1 is shown under its HDI; chance levels that differ go under each HDI
    first = report.layers[0]
    odd = dataclasses.replace(
        first,
        max_hdi={**first.max_hdi, "key": 0.875},
        chance_hdi={**first.chance_hdi, "value": 0.5},
    )
    report = dataclasses.replace(report, layers=[odd, *report.layers[1:]])
    page = Page(write_report(report, tmp_path / "odd").html.read_text())
    assert "chance" not in page.rows[0] and len(page.rows[0]) == 12
    row = page.rows[1]
    assert row[5:9] == [
        f"{odd.hdi['query']:.3f}chance {odd.chance_hdi['query']:.3f}",
        f"{odd.hdi['key']:.3f}chance {odd.chance_hdi['key']:.3f}max 0.875",
        f"{odd.hdi['value']:.3f}chance 0.500",
        f"{odd.hdi['output']:.3f}chance {odd.chance_hdi['output']:.3f}",
    ]


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


_MEASURE = """<script>addEventListener("load", () => {
  const d = document.documentElement;
  const scrolled = [...document.querySelectorAll("body *")]
    .filter(e => e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== "visible")
    .map(e => e.tagName);
  const beyond = [...document.querySelectorAll("body *")]
    .filter(e => e.getBoundingClientRect().right > d.clientWidth + 0.5).map(e => e.tagName);
  document.body.setAttribute("data-measured", JSON.stringify(
    {scrollWidth: d.scrollWidth, clientWidth: d.clientWidth, scrolled: scrolled, beyond: beyond}));
});</script>"""


@pytest.mark.skipif(_chromium() is None, reason="needs a headless Chromium (Debian package chromium)")
def test_page_fits_a_1200px_window_in_chromium(tmp_path):
    # the page of a deep report with all projections, head-output statistics, long unbroken names
    # and a long skipped-module reason, laid out by a real browser at a 1,200 px window: nothing is
    # wider than the window and nothing scrolls sideways (the old 20-column table did, in a scroll box)
    files = write_report(_deep_report(), tmp_path / "r", step=TrainingStep(1234, "global_step of the checkpoint"))
    probe = tmp_path / "probe.html"  # a copy with a measuring script: the page itself has none
    probe.write_text(files.html.read_text().replace("</body>", _MEASURE + "</body>"))
    proc = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,900",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    match = re.search(r'data-measured="([^"]*)"', proc.stdout)
    assert match, proc.stderr[-2000:]
    measured = json.loads(html.unescape(match.group(1)))
    assert 1100 <= measured["clientWidth"] <= 1200  # the window (less a scroll bar, if any)
    assert measured["scrollWidth"] <= measured["clientWidth"], measured
    assert measured["scrolled"] == [] and measured["beyond"] == [], measured


def test_page_states_the_training_step(tmp_path):
    report = head_diversity(_encoder(), projections=("key",))

    def step_line(**kwargs) -> str:
        text = write_report(report, tmp_path / str(len(list(tmp_path.iterdir()))), **kwargs).html.read_text()
        match = re.search(r'<p class="step">(.*?)</p>', text, re.S)
        assert match
        return re.sub(r"<[^>]+>", "", match.group(1))

    assert step_line(step=TrainingStep(1234, "global_step of the Lightning checkpoint")) == (
        "Training step 1234 · global_step of the Lightning checkpoint"
    )
    assert step_line(step=TrainingStep(None, "a state_dict records no step")) == (
        "Training step unknown · a state_dict records no step"
    )
    assert step_line(step=77) == "Training step 77 · given with the report"
    assert step_line() == "Training step unknown · none was given with the report"
    for bad in ("77", True, -1, 7.0):
        with pytest.raises(TypeError, match="step must be"):
            write_report(report, tmp_path / "bad", step=bad)
