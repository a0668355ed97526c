"""The TensorBoard dashboards, read back from the event files (hdi_monitor.monitor._dashboard).

References are independent of the drawing code: the scalar events (what the HDI was), the text
events (what fired), matplotlib's own colour map for the pixels of the diversity map, and
counts derived from the model's shape for the histograms.
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from conftest import read_events, scalar_series
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from hdi_monitor.monitor._dashboard import Dashboard
from hdi_monitor.monitor.detector import SaturationDetector
from hdi_monitor.monitor.render import ImageJob, diversity_map, render_job
from hdi_monitor.monitor.tracker import HDITracker

PROJECTIONS = ("query", "key", "value", "output")
D, HEADS = 16, 4  # head width 4: H * d = D, so the frame bound is 1 (does not bind)


def _encoder(num_layers: int, seed: int = 0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)


def _train(tmp_path, num_layers: int, *, steps: int = 5, images_every: int = 2, detector=None, dashboard=None):
    """A plain training loop with the tracker measuring every step (images every ``images_every``);
    the loop logs its own loss as ``train/loss``."""
    model = _encoder(num_layers)
    writer = SummaryWriter(str(tmp_path))
    jobs: list[ImageJob] = []

    def renderer(job: ImageJob) -> dict[str, bytes]:  # the seam: keep what was drawn, draw as usual
        jobs.append(job)
        return render_job(job)

    tracker = HDITracker(
        model,
        every_n_steps=1,
        log_images_every_n_steps=images_every,
        writer=writer,
        strict=True,
        detector=detector,
        activation_detector=None,
        max_tokens=None,
        renderer=renderer,
    )
    if dashboard is not None:
        tracker.dashboard = dashboard
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 6, D, generator=g)
        with tracker.capture(x):
            loss = model(x).pow(2).mean()
        loss.backward()
        tracker.step()
        writer.add_scalar("train/loss", float(loss.detach()), step)
        optimizer.step()
        optimizer.zero_grad()
    tracker.close()
    writer.close()
    tracker.jobs = jobs  # type: ignore[attr-defined]
    return model, tracker, read_events(tmp_path)


def _layout(accs):
    from tensorboard.plugins.custom_scalar import layout_pb2

    found = []
    for acc in accs:
        if "custom_scalars__config__" in acc.Tags()["tensors"]:
            for ev in acc.Tensors("custom_scalars__config__"):
                layout = layout_pb2.Layout()
                layout.ParseFromString(ev.tensor_proto.string_val[0])
                found.append(layout)
    return found


def _png(event):
    from PIL import Image

    picture = Image.open(io.BytesIO(event.encoded_image_string))
    picture.load()
    return picture


def _job(tracker, step):
    (job,) = [j for j in tracker.jobs if j.step == step]
    return job


def _images(accs):
    return {tag: acc.Images(tag) for acc in accs for tag in acc.Tags()["images"]}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("two"), 2)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("deep"), 24)


def test_margin_layout_written_once_and_every_tag_exists(small):
    _, _, accs = small
    layouts = _layout(accs)
    assert len(layouts) == 1
    scalars = {t for acc in accs for t in acc.Tags()["scalars"]}
    charts = {c.title: (cat, c) for cat in layouts[0].category for c in cat.chart}
    margins = [c for _, c in charts.values() if c.HasField("margin")]
    assert len(margins) == len(PROJECTIONS) + 2  # one per projection, effective heads, head correlation
    for chart in margins:
        for series in chart.margin.series:
            for tag in (series.value, series.lower, series.upper):
                assert tag in scalars, (chart.title, tag)
                assert sorted(scalar_series(accs, tag)) == [0, 1, 2, 3, 4]  # a point at every measured step
    # the band is the min and max over the layers, around the mean
    names = [f"layers.{i}.self_attn" for i in range(2)]
    for p in PROJECTIONS:
        per_layer = [scalar_series(accs, f"hdi/{p}/{n}") for n in names]
        low, high = scalar_series(accs, f"hdi/{p}/min"), scalar_series(accs, f"hdi/{p}/max")
        for step in range(5):
            assert low[step] == pytest.approx(min(s[step] for s in per_layer), abs=1e-7)
            assert high[step] == pytest.approx(max(s[step] for s in per_layer), abs=1e-7)
    # per-layer lines in a collapsed category; the loss chart finds the loop's own loss tag
    cat, chart = charts["HDI (key) per layer"]
    assert cat.closed
    # TensorBoard selects a multiline chart's tags with re.match
    assert all(any(re.match(r, f"hdi/key/{n}") for r in chart.multiline.tag) for n in names)
    cat, chart = charts["training loss"]
    assert not cat.closed
    assert [t for t in scalars if any(re.match(r, t) for r in chart.multiline.tag)] == ["train/loss"]
    assert all(re.match(chart.multiline.tag[0], t) for t in ("train_loss", "loss", "train_loss_step"))


def test_given_loss_tag_is_charted_exactly(tmp_path):
    _, _, accs = _train(tmp_path, 1, steps=1, images_every=0, dashboard=Dashboard(loss_tag="train/loss"))
    (layout,) = _layout(accs)
    chart = next(c for cat in layout.category for c in cat.chart if c.title == "training loss")
    assert list(chart.multiline.tag) == [r"^train/loss$"]
    with pytest.raises(ValueError, match="loss_tag"):
        Dashboard(loss_tag="")
    with pytest.raises(ValueError, match="max_image_layers"):
        Dashboard(max_image_layers=0)


def test_image_tags_per_image_step_do_not_grow_with_depth(small, deep):
    counts = []
    for _, _, accs in (small, deep):
        images = _images(accs)
        per_step: dict[int, int] = {}
        for events in images.values():
            for ev in events:
                per_step[ev.step] = per_step.get(ev.step, 0) + 1
        assert sorted(per_step) == [0, 2, 4]
        assert len(set(per_step.values())) == 1
        counts.append(per_step[0])
    assert (
        counts[0] == counts[1] == 2 * len(PROJECTIONS) + 1
    )  # a map and an overlap image per projection, 1 correlation


def test_deep_overlap_image_shows_the_layers_that_moved_most(deep):
    _, tracker, accs = deep
    k = tracker.dashboard.max_image_layers
    events = _images(accs)["overlap/key"]
    assert [e.step for e in events] == [0, 2, 4]
    names = [f"layers.{i}.self_attn" for i in range(24)]
    series = {n: scalar_series(accs, f"hdi/key/{n}") for n in names}
    first = next(t for t in _job(tracker, 0).tiles if t.tag == "overlap/key")
    evenly = [names[round(i * 23 / (k - 1))] for i in range(k)]
    assert [t.split("\n")[0] for t in first.titles] == evenly
    second = next(t for t in _job(tracker, 2).tiles if t.tag == "overlap/key")  # step 2 against step 0
    moved = sorted(names, key=lambda n: -abs(series[n][2] - series[n][0]))[:k]
    assert [t.split("\n")[0] for t in second.titles] == [n for n in names if n in moved]
    for title in second.titles:
        name, value = title.split("\n")
        assert float(value.split()[1]) == pytest.approx(series[name][2], abs=5e-4)


def test_diversity_map_has_a_row_per_layer_and_a_column_per_measured_step(deep):
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    _, tracker, accs = deep
    events = _images(accs)["diversity_map/key"]
    assert [e.step for e in events] == [0, 2, 4]
    picture = _png(events[-1])
    assert not picture.text  # no data payload in production PNGs
    (panel,) = [m for m in _job(tracker, 4).maps if m.tag == "diversity_map/key"]
    names = [f"layers.{i}.self_attn" for i in range(24)]
    assert list(panel.layers) == names
    assert list(panel.steps) == [0, 1, 2, 3, 4]
    chance = scalar_series(accs, "hdi_chance/key")[4]
    assert panel.chance == pytest.approx(chance)
    # the same panel drawn again gives the same PNG, and tells where the map body lies
    geometry: dict = {}
    again = diversity_map(
        panel.values, layers=panel.layers, steps=panel.steps, chance=panel.chance, title=panel.title, geometry=geometry
    )
    assert again == events[-1].encoded_image_string
    # the pixel at the centre of every cell has the colour of that layer's HDI at that step
    left, top, right, bottom = geometry["body_px"]
    width, height = (right - left) / 5, (bottom - top) / 24
    assert width >= 10 and height >= 10
    rgb = picture.convert("RGB")
    cmap, norm = colormaps["RdBu"], TwoSlopeNorm(vmin=0.0, vcenter=chance, vmax=1.0)
    for i, name in enumerate(names):
        series = scalar_series(accs, f"hdi/key/{name}")
        for j in range(5):
            pixel = rgb.getpixel((int(left + (j + 0.5) * width), int(top + (i + 0.5) * height)))
            expected = [round(255 * c) for c in cmap(norm(series[j]))[:3]]
            assert max(abs(a - b) for a, b in zip(pixel, expected, strict=True)) <= 3, (name, j, pixel, expected)


def test_histograms_per_layer_group(deep, small):
    _, _, accs = deep
    hists = {t: acc.Histograms(t) for acc in accs for t in acc.Tags()["histograms"]}
    groups = [f"layers_{a}-{a + 2}" for a in range(0, 24, 3)]  # 24 layers in the default 8 groups
    assert set(hists) == {f"principal_angles_deg/{p}/{g}" for p in PROJECTIONS for g in groups}
    pairs = math.comb(HEADS, 2) * (D // HEADS)  # angles per layer
    for events in hists.values():
        assert [e.step for e in events] == [0, 2, 4]
        assert events[0].histogram_value.num == 3 * pairs
    _, _, accs = small
    tags = {t for acc in accs for t in acc.Tags()["histograms"]}
    assert tags == {f"principal_angles_deg/{p}/layers.{i}.self_attn" for p in PROJECTIONS for i in range(2)}


@pytest.mark.filterwarnings("ignore::hdi_monitor.DiversityWarning")  # the events it counts
def test_event_counts_have_a_point_at_every_measured_step(tmp_path):
    # a detector that calls every measurement after the first a plateau: saturation fires
    detector = SaturationDetector(patience=1, min_delta=10.0, warmup_steps=0, collapse_delta=10.0)
    _, tracker, accs = _train(tmp_path, 2, steps=4, images_every=0, detector=detector)
    texts: dict[tuple[str, int], int] = {}
    for acc in accs:
        for tag in acc.Tags()["tensors"]:
            if tag.startswith("diversity_events/"):
                kind = tag.split("/")[1]
                for ev in acc.Tensors(tag):
                    texts[kind, ev.step] = texts.get((kind, ev.step), 0) + 1
    assert any(texts.values())  # events did fire
    for kind in ("saturation", "collapse", "redundancy"):
        counts = scalar_series(accs, f"diversity_events/{kind}")
        assert sorted(counts) == [0, 1, 2, 3]
        assert counts == {step: float(texts.get((kind, step), 0)) for step in range(4)}
    assert scalar_series(accs, "diversity_events/saturation")[0] == 0.0  # nothing to compare with yet


def test_frame_bound_kept_out_of_scalars_and_levels_written_once(small):
    _, _, accs = small
    scalars = {t for acc in accs for t in acc.Tags()["scalars"]}
    assert not any(t.startswith("hdi_max/") for t in scalars)  # H * d = D: the bound is 1 everywhere
    texts = [
        ev
        for acc in accs
        if "hdi_levels/text_summary" in acc.Tags()["tensors"]
        for ev in acc.Tensors("hdi_levels/text_summary")
    ]
    assert len(texts) == 1
    text = texts[0].tensor_proto.string_val[0].decode()
    d = D // HEADS
    assert f"| key | {1 - d / (D + d + 1):.4f} | 1.0000 (does not bind) |" in text
