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
    CARD_PX,
    NAN_RGB,
    ImageJob,
    MapPanel,
    TilePanel,
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
    assert rgb.shape[1] == CARD_PX  # as wide as TensorBoard's Images card: shown pixel for pixel there
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
    # cells of at least 4 px, 3 steps across half the card or more; the picture as wide as the card
    assert bottom - top >= min(num_layers * 4, 100) and right - left >= CARD_PX // 2
    assert rgb.shape[1] == CARD_PX and min(rgb.shape[:2]) >= 256

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


def _solid_blocks(rgb: np.ndarray, colour: tuple) -> list[tuple[int, int, int, int]]:
    """The connected regions of exactly ``colour``, each as (top, left, height, width); every one
    must be a filled rectangle (no pixel of another colour inside its box)."""
    from scipy import ndimage

    mask = (rgb == np.array(colour, dtype=rgb.dtype)).all(axis=-1)
    labels, _ = ndimage.label(mask)
    blocks = []
    for box in ndimage.find_objects(labels):
        height, width = box[0].stop - box[0].start, box[1].stop - box[1].start
        assert mask[box].all(), (colour, box)  # a uniform block
        blocks.append((box[0].start, box[1].start, height, width))
    return blocks


@pytest.mark.parametrize("num_layers, min_cell", [(1, 48), (2, 32), (3, 32), (4, 32), (16, 12)])
def test_small_head_matrices_are_large_whole_pixel_blocks_in_the_card(num_layers, min_cell):
    # what the dashboards log (render_job) for layers of 4 heads: decoded independently of the
    # drawing code, every cell of every tile must be a uniform square block, all of one size (a
    # whole-pixel, nearest-neighbour upscale), of the colour matplotlib's viridis gives the value;
    # the picture as wide as TensorBoard's Images card (shown there pixel for pixel: the card is
    # 350 px wide whatever the image, so a wider one is shrunk) and at least 256 px high.
    from matplotlib import colormaps

    bar = {round(255 * k / 63) for k in range(64)}  # the colour bar's own entries (see _bar)
    entries = [k for k in range(8, 250, 7) if k not in bar][:16]
    matrix = torch.tensor(entries, dtype=torch.float64).reshape(4, 4) / 255  # one table entry per cell
    panel = TilePanel(
        tag="overlap/query",
        matrices=tuple(matrix.clone() for _ in range(num_layers)),
        titles=tuple(f"layers.{i}.self_attn\nHDI 0.5{i:02d}" for i in range(num_layers)),
        vmin=0.0,
        vmax=1.0,
        cmap="viridis",
        title="query subspace overlap of head pairs",
        colorbar_label="overlap",
    )
    steps = (0, 25, 50, 75, 100, 125, 150, 175)
    values = torch.rand(num_layers, len(steps), generator=torch.Generator().manual_seed(0))
    names = tuple(f"layers.{i}.self_attn" for i in range(num_layers))
    chart = MapPanel("diversity_map/query", values, names, steps, 0.8, "HDI (query) by layer and measured step")
    images = render_job(ImageJob(step=175, maps=(chart,), tiles=(panel,)))
    rgb = _pixels(images["overlap/query"])
    height, width = rgb.shape[:2]
    assert width == CARD_PX and height >= 256
    sides = set()
    corners = {}
    for k, entry in enumerate(entries):
        expected = tuple(int(round(255 * c)) for c in colormaps["viridis"](entry)[:3])
        blocks = _solid_blocks(rgb, expected)
        assert len(blocks) == num_layers, (entry, len(blocks))  # one cell per tile, nothing else of its colour
        sides |= {(h, w) for _, _, h, w in blocks}
        corners[divmod(k, 4)] = sorted(blocks)[0][:2]  # the first tile's cell (row, column)
    assert len(sides) == 1
    ((side, other),) = sides
    assert side == other >= min_cell  # square cells of min_cell px or more, on screen too
    for i in range(4):  # the cells sit on a grid in the matrix's order, one cell (and a line) apart
        for j in range(4):
            top, left = corners[i, j]
            assert (top - corners[0, 0][0], left - corners[0, 0][1]) in {
                (i * side, j * side),
                (i * (side + 1), j * (side + 1)),
            }
    diversity = _pixels(images["diversity_map/query"])
    assert diversity.shape[1] == CARD_PX and diversity.shape[0] >= 256
