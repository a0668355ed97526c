"""The dashboard pictures (hdi_monitor.monitor.render), decoded and read back pixel by pixel.

References are independent of the drawing code: matplotlib's own colour maps for the colour tables,
an analytic overlap matrix (heads planted as coordinate subspaces: overlaps 1, 0.5 and 0, and a
zeroed head, NaN) for the overlap pictures, the logged scalars (what the HDI was) for the diversity
map, and the record's correlation matrices for the correlation picture; the colour of a value is
computed here from the documented rule, not by the renderer.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from hdi_monitor.monitor.render import (
    NAN_RGB,
    ImageJob,
    colour_table,
    diversity_map,
    heatmap,
    render_job,
    tiled_heatmaps,
)
from hdi_monitor.monitor.sinks import MemorySink
from hdi_monitor.monitor.tracker import HDITracker

D, HEADS = 16, 4
HEAD_DIM = D // HEADS
PROJECTIONS = ("query", "key", "value", "output")
#: the planted query heads' overlap matrix (spectral and uniform alike, the heads being orthonormal):
#: head 0 = span(e0..e3), head 1 = span(e0, e1, e4, e5), head 2 = span(e8..e11), head 3 = 0 (invalid)
NAN = math.nan
PLANTED = [[1.0, 0.5, 0.0, NAN], [0.5, 1.0, 0.0, NAN], [0.0, 0.0, 1.0, NAN], [NAN, NAN, NAN, NAN]]


def _expected_rgb(value: float, table: str, vmin: float, vmax: float, centre: float | None = None) -> tuple:
    """The documented colour of ``value``: entry round(255 t) of the table, grey for NaN."""
    if math.isnan(value):
        return NAN_RGB
    if centre is None:
        t = (value - vmin) / (vmax - vmin)
    elif value <= centre:
        t = 0.5 * (value - vmin) / (centre - vmin)
    else:
        t = 0.5 + 0.5 * (value - centre) / (vmax - centre)
    return tuple(int(c) for c in colour_table(table)[int(np.rint(min(max(t, 0.0), 1.0) * 255))])


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as picture:
        assert picture.format == "PNG"
        return np.asarray(picture.convert("RGB"))


def _cell(rgb: np.ndarray, left: int, top: int, pitch: tuple[int, int] | int, cell, i: int, j: int) -> tuple:
    """Colour at the centre of cell (i, j); every pixel of the cell must share it."""
    px, py = (pitch, pitch) if isinstance(pitch, int) else pitch
    cw, ch = (cell, cell) if isinstance(cell, int) else cell
    block = rgb[top + i * py : top + i * py + ch, left + j * px : left + j * px + cw]
    assert block.size and (block == block[0, 0]).all(), (i, j)  # a flat block: nothing drawn over a cell
    return tuple(int(c) for c in block[0, 0])


def _planted_encoder(num_layers: int, planted: tuple[int, ...]) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
    eye = torch.eye(D)
    rows = [eye[0:4], eye[[0, 1, 4, 5]], eye[8:12], torch.zeros(HEAD_DIM, D)]
    with torch.no_grad():
        for k, block in enumerate(model.layers):
            block.self_attn._reset_parameters()  # the layers are deep copies of one: make them differ
            if k in planted:  # query head h reads span(rows[h]) (in_proj rows h*d..(h+1)*d are W_h^T)
                block.self_attn.in_proj_weight[:D] = torch.cat(rows)
    return model


def _run(num_layers: int, planted: tuple[int, ...]):
    """Three measured steps, images at every one; the jobs drawn, the PNGs written, the scalars."""
    model = _planted_encoder(num_layers, planted)
    sink = MemorySink()
    jobs: list[ImageJob] = []

    def renderer(job: ImageJob) -> dict[str, bytes]:  # the seam: keep the job, draw as usual
        jobs.append(job)
        return render_job(job)

    tracker = HDITracker(
        model, every_n_steps=1, log_images_every_n_steps=1, sinks=[sink], renderer=renderer, image_queue_size=8
    )
    g = torch.Generator().manual_seed(1)
    with pytest.warns(Warning, match="dead"):  # the planted zero head is reported
        for _ in range(3):
            x = torch.randn(2, 6, D, generator=g)
            with tracker.capture(x):
                model(x)
            tracker.step()
        tracker.close()
    scalars = {(step, tag): value for step, tag, value in sink.scalars}
    images = {(step, tag): png for step, tag, png in sink.images}
    return tracker, jobs, images, scalars


@pytest.fixture(scope="module", params=[2, 80], ids=["2-layers", "80-layers"])
def run(request):
    num_layers = request.param
    planted = (0, num_layers - 1)  # both shown at 80 layers too: the first image spaces its 16 layers evenly
    return (num_layers, planted, *_run(num_layers, planted))


def test_colour_tables_are_matplotlibs():
    from matplotlib import colormaps

    grid = np.linspace(0, 1, 256)
    for name in ("viridis", "RdBu", "RdBu_r"):
        expected = np.round(colormaps[name](grid)[:, :3] * 255).astype(np.uint8)
        np.testing.assert_array_equal(colour_table(name), expected)
        distance = np.sqrt(((colour_table(name).astype(float) - np.array(NAN_RGB)) ** 2).sum(axis=1))
        assert distance.min() > 60  # NaN grey is told apart from every colour of the scale
    with pytest.raises(ValueError, match="unknown colour table"):
        colour_table("jet")


def test_every_picture_kind_is_a_png_of_its_matrix(run):
    num_layers, planted, tracker, jobs, images, scalars = run
    names = [f"layers.{i}.self_attn" for i in range(num_layers)]
    assert sorted({step for step, _ in images}) == [0, 1, 2]
    expected_tags = {f"diversity_map/{p}" for p in PROJECTIONS} | {f"overlap/{p}" for p in PROJECTIONS}
    assert {tag for step, tag in images if step == 2} == expected_tags | {"correlation"}
    job = next(j for j in jobs if j.step == 0)

    # overlap/query: the planted layers' tiles show the analytic matrix, cell by cell
    panel = next(t for t in job.tiles if t.tag == "overlap/query")
    geometry: dict = {}
    png = tiled_heatmaps(
        panel.matrices,
        titles=panel.titles,
        vmin=panel.vmin,
        vmax=panel.vmax,
        cmap=panel.cmap,
        title=panel.title,
        colorbar_label=panel.colorbar_label,
        geometry=geometry,
    )
    assert png == images[0, "overlap/query"]  # what the sink got is this drawing
    rgb = _pixels(png)
    assert rgb.shape[1] >= 400  # wide enough to read in TensorBoard's card
    shown = [t.split("\n")[0] for t in panel.titles]
    assert len(shown) == min(num_layers, 16) and all(names[k] in shown for k in planted)
    for k in planted:
        tile = geometry["tiles"][shown.index(names[k])]
        for i in range(HEADS):
            for j in range(HEADS):
                got = _cell(rgb, tile["left"], tile["top"], tile["pitch"], tile["cell"], i, j)
                assert got == _expected_rgb(PLANTED[i][j], "viridis", 0.0, 1.0), (k, i, j, got)

    # correlation: every tile's cells are the record's correlations through the RdBu_r table
    panel = next(t for t in job.tiles if t.tag == "correlation")
    geometry = {}
    rgb = _pixels(
        tiled_heatmaps(
            panel.matrices,
            titles=panel.titles,
            vmin=-1.0,
            vmax=1.0,
            cmap="RdBu_r",
            title=panel.title,
            colorbar_label=panel.colorbar_label,
            geometry=geometry,
        )
    )
    for tile, matrix in zip(geometry["tiles"], panel.matrices, strict=True):
        for i in range(HEADS):
            for j in range(HEADS):
                got = _cell(rgb, tile["left"], tile["top"], tile["pitch"], tile["cell"], i, j)
                assert got == _expected_rgb(float(matrix[i, j]), "RdBu_r", -1.0, 1.0), (i, j)
        assert _cell(rgb, tile["left"], tile["top"], tile["pitch"], tile["cell"], 0, 0) == (103, 0, 31)  # +1: red

    # diversity_map/query at the last step: a row per layer, a column per measured step, coloured by
    # the logged HDI around the logged chance level
    panel = next(m for m in jobs[-1].maps if m.tag == "diversity_map/query")
    geometry = {}
    png = diversity_map(
        panel.values, layers=panel.layers, steps=panel.steps, chance=panel.chance, title=panel.title, geometry=geometry
    )
    assert png == images[2, "diversity_map/query"]
    rgb = _pixels(png)
    left, top, right, bottom = geometry["body_px"]
    assert list(panel.layers) == names and list(panel.steps) == [0, 1, 2]
    chance = scalars[2, "hdi_chance/query"]
    for i, name in enumerate(names):
        for j in range(3):
            got = _cell(rgb, left, top, geometry["pitch"], geometry["cell"], i, j)
            assert got == _expected_rgb(scalars[j, f"hdi/query/{name}"], "RdBu", 0.0, 1.0, centre=chance), (i, j)
    assert bottom - top >= min(num_layers * 4, 100) and right - left >= 250  # cells of at least 4 px

    # the HTML report's picture of one matrix: the analytic matrix again
    geometry = {}
    matrix = tracker.last_measurement.report.layers[planted[0]].overlap["query"]
    rgb = heatmap(matrix, geometry=geometry).permute(1, 2, 0).numpy()
    for i in range(HEADS):
        for j in range(HEADS):
            got = _cell(rgb, geometry["left"], geometry["top"], geometry["pitch"], geometry["cell"], i, j)
            assert got == _expected_rgb(PLANTED[i][j], "viridis", 0.0, 1.0)


def test_more_colours_than_a_palette_holds_give_the_same_pixels():
    # 256 distinct values: the cells alone use every table entry, so the PNG falls back to RGB
    values = torch.arange(256, dtype=torch.float64).reshape(16, 16) / 255
    values[3, 5] = math.nan
    geometry: dict = {}
    png = tiled_heatmaps(
        [values], titles=["one"], vmin=0.0, vmax=1.0, cmap="viridis", title="t", colorbar_label="c", geometry=geometry
    )
    rgb = _pixels(png)
    (tile,) = geometry["tiles"]
    for i in range(16):
        for j in range(16):
            got = _cell(rgb, tile["left"], tile["top"], tile["pitch"], tile["cell"], i, j)
            assert got == (NAN_RGB if (i, j) == (3, 5) else tuple(colour_table("viridis")[16 * i + j]))


def test_pictures_are_small_and_flat_in_size():
    # the byte size of an image step does not grow with the values, and stays small (no data payload)
    torch.manual_seed(0)
    matrices = [torch.rand(8, 8) for _ in range(16)]
    png = tiled_heatmaps(
        matrices, titles=[f"l.{i}.a" for i in range(16)], vmin=0, vmax=1, cmap="viridis", title="t", colorbar_label="c"
    )
    assert len(png) < 40_000
    big = diversity_map(
        torch.rand(80, 512), layers=[f"l.{i}" for i in range(80)], steps=range(512), chance=0.9, title="t"
    )
    assert len(big) < 120_000


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="vmax"):
        heatmap(torch.zeros(2, 2), vmin=1.0, vmax=1.0)
    with pytest.raises(ValueError, match="2-D"):
        heatmap(torch.zeros(2))
    with pytest.raises(ValueError, match="chance"):
        diversity_map(torch.zeros(1, 1), layers=["a"], steps=[0], chance=1.0, title="t")
    with pytest.raises(ValueError, match="expected"):
        diversity_map(torch.zeros(2, 1), layers=["a"], steps=[0], chance=0.5, title="t")
    with pytest.raises(ValueError, match="titles"):
        tiled_heatmaps([torch.zeros(2, 2)], titles=[], vmin=0, vmax=1, cmap="viridis", title="t", colorbar_label="c")


def test_drawing_imports_no_matplotlib():
    code = (
        "import sys, torch\n"
        "import hdi_monitor, hdi_monitor.monitor.tracker, hdi_monitor.cli.html\n"
        "from hdi_monitor.monitor.render import ImageJob, MapPanel, TilePanel, render_job, heatmap\n"
        "m = TilePanel('o', (torch.eye(3),), ('a',), 0.0, 1.0, 'viridis', 't', 'c')\n"
        "p = MapPanel('d', torch.full((2, 3), 0.5), ('a', 'b'), (0, 1, 2), 0.4, 't')\n"
        "assert len(render_job(ImageJob(step=0, maps=(p,), tiles=(m,)))) == 2\n"
        "heatmap(torch.eye(3))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
