"""Long runs (issue 21): one record, bounded history, pictures off the training step.

References: `head_diversity` (the one-shot report) for the record; values that are functions of
the step (so every kept point can be checked) for the history; a hand-made 0.2 checkpoint; a
renderer that fails, blocks or records (the tracker's ``renderer`` seam) for the worker.
"""

from __future__ import annotations

import base64
import threading
import time
import warnings

import pytest
import torch
from torch import nn

from hdi_monitor import HDITracker, head_diversity
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.measure.measurement import Series
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.render import ImageJob, render_job
from hdi_monitor.monitor.sinks import MemorySink

PROJECTIONS = ("query", "key", "value", "output")
D, HEADS = 16, 4


def encoder(num_layers: int = 2) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
    for block in model.layers:  # the layers are deep copies of one: make them differ
        block.self_attn._reset_parameters()
    return model


def _monitoring(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]


# ------------------------------------------------------------------------------------- the record


def test_record_round_trips_what_head_diversity_reports():
    model = encoder()
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    reference = head_diversity(model, inputs=x)
    sink = MemorySink()
    tracker = HDITracker(model, every_n_steps=1, sinks=[sink], max_tokens=None, strict=True, log_images_every_n_steps=1)
    m = tracker.measure(x)
    tracker.close()
    assert m is not None and m.step == 0 and m.image_step
    row = tracker.history[-1]
    written = {tag: value for step, tag, value in sink.scalars if step == 0}
    histograms = {tag: value for step, tag, value in sink.histograms if step == 0}
    for ref, got in zip(reference.layers, m.report.layers, strict=True):
        assert got.name == ref.name
        for p in PROJECTIONS:
            assert got.hdi[p] == pytest.approx(ref.hdi[p], rel=1e-6)
            assert got.chance_hdi[p] == ref.chance_hdi[p] and got.max_hdi[p] == ref.max_hdi[p]
            assert got.invalid_heads[p] == ref.invalid_heads[p] == []
            torch.testing.assert_close(got.overlap[p], ref.overlap[p])
            # one value, three readers: the record, the history (typed key), the tags written
            assert tracker.history.column(Series("hdi", p, ref.name))[-1] == got.hdi[p]
            assert row[f"hdi/{p}/{ref.name}"] == written[f"hdi/{p}/{ref.name}"] == got.hdi[p]
            # angles from the same weight read, their own result (the record is not changed after it is
            # made): the worker's histogram of C(4, 2) pairs x 4 angles, all in [0, 90]
            angles = histograms[f"principal_angles_deg/{p}/{ref.name}"]
            assert angles.numel() == 6 * 4 and angles.min() >= 0 and angles.max() <= 90 + 1e-4
        assert got.effective_heads == pytest.approx(ref.effective_heads, rel=1e-6)
        assert got.mean_correlation == pytest.approx(ref.mean_correlation, rel=1e-6, abs=1e-7)
        assert got.variance_ratio == pytest.approx(ref.variance_ratio, rel=1e-6)
        assert got.num_tokens == ref.num_tokens == 15
        assert row[f"effective_heads/{ref.name}"] == got.effective_heads


def test_a_layer_named_mean_does_not_collide_with_the_summaries():
    """Top-level attention modules called ``mean`` and ``max``: their tags are ``<name>_layer``;
    the mean, min and max over layers stay what they are, in the tags and in the history."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"mean": nn.MultiheadAttention(D, HEADS), "max": nn.MultiheadAttention(D, HEADS)})
    reference = {la.name: la.hdi["key"] for la in head_diversity(model, projections="key").layers}
    assert set(reference) == {"mean", "max"}
    tracker = HDITracker(model, every_n_steps=1, projections=("key",), activations=False, strict=True)
    m = tracker.step()
    assert m is not None
    assert m.scalars["hdi/key/mean_layer"] == pytest.approx(reference["mean"], rel=1e-6)
    assert m.scalars["hdi/key/max_layer"] == pytest.approx(reference["max"], rel=1e-6)
    assert m.scalars["hdi/key/mean"] == pytest.approx(sum(reference.values()) / 2, rel=1e-6)
    assert m.scalars["hdi/key/min"] == pytest.approx(min(reference.values()), rel=1e-6)
    assert m.scalars["hdi/key/max"] == pytest.approx(max(reference.values()), rel=1e-6)
    names, values, steps = tracker.history.layer_matrix("hdi", "key")
    assert names == ["mean", "max"] and steps == [0]
    assert values[:, 0].tolist() == pytest.approx([reference["mean"], reference["max"]], rel=1e-6)
    assert tracker.history.column(Series("hdi", "key", stat="mean"))[0] == m.scalars["hdi/key/mean"]


# ------------------------------------------------------------------------------------ the history


def _value(step: int) -> float:
    return 1.0 / (1.0 + step)


def test_history_stays_within_its_budget_and_keeps_the_recent_window_whole():
    budget = 16
    history = History(budget)
    key, other = Series("hdi", "key", "a"), Series("hdi", "key", stat="mean")
    sizes = []
    for step in range(0, 5000, 5):
        history.append(step, {key: _value(step), other: -_value(step)})
        assert len(history) <= budget
        if step in (500, 4995):
            state = history.state_dict()
            sizes.append((history.nbytes, len(state["steps"]), [len(c[-1]) for c in state["columns"]]))
    steps = history.steps
    assert steps[0] == 0 and steps == sorted(steps) and len(set(steps)) == len(steps)
    recent = list(range(4995 - 5 * (budget // 2 - 1), 5000, 5))
    assert steps[-len(recent) :] == recent  # the newest budget // 2 steps, every one
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert gaps == sorted(gaps, reverse=True)  # older points sparser, never the other way round
    # every kept point is the value measured at its step
    assert history.column(key).tolist() == [_value(s) for s in steps]
    assert history.column(other).tolist() == [-_value(s) for s in steps]
    assert sizes[0][0] == sizes[1][0]  # memory flat once full
    for _, rows, encoded in sizes:  # the checkpoint holds at most budget rows per column
        assert rows <= budget and all(n == len(base64.b64encode(bytes(8 * rows))) for n in encoded)
    restored = History.from_state(history.state_dict(), budget)
    assert restored == history and restored.steps == steps


@pytest.mark.filterwarnings("ignore::hdi_monitor.DiversityWarning")  # saturation events on the way
def test_tracker_history_is_bounded_and_resumes(tmp_path):
    model = encoder(1)
    tracker = HDITracker(model, every_n_steps=1, projections=("key",), activations=False, history_budget=8)
    for _ in range(40):
        tracker.step()
    assert len(tracker.history) == 8 and tracker.history.steps[-4:] == [36, 37, 38, 39]
    path = tmp_path / "state.pt"
    torch.save(tracker.state_dict(), path)
    resumed = HDITracker(model, every_n_steps=1, projections=("key",), activations=False, history_budget=8)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.history == tracker.history and resumed.current_step == 40
    assert resumed.step().step == 40 and len(resumed.history) <= 8


def test_a_0_2_checkpoint_history_is_converted_or_refused():
    rows = [
        {
            "step": float(s),
            "hdi/key/mean": 0.5 + s,
            "hdi/key/min": 0.1,
            "hdi/key/enc.0": 0.6 + s,
            "effective_heads/enc.0": 3.0,
        }
        for s in range(0, 30, 3)
    ]
    history = History.from_state(rows, budget=4)
    assert len(history) <= 4 and history.steps[0] == 0 and history.steps[-1] == 27
    names, values, steps = history.layer_matrix("hdi", "key")
    assert names == ["enc.0"] and values[0].tolist() == [0.6 + s for s in steps]
    assert history[-1]["hdi/key/min"] == 0.1 and history[-1]["effective_heads/enc.0"] == 3.0
    with pytest.raises(ValueError, match="unsupported history state"):
        History.from_state({"version": 99})


# ---------------------------------------------------------------------------- pictures off the step


def _run(tracker: HDITracker, model: nn.Module, steps: int) -> list[float]:
    """A plain loop; returns how long each ``tracker.step()`` took."""
    held = []
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(2, 5, D, generator=g)
        with tracker.capture(x):
            model(x).sum().backward()
        start = time.perf_counter()
        tracker.step()
        held.append(time.perf_counter() - start)
    return held


def test_last_measured_step_gets_its_images():
    model = encoder(1)
    sink = MemorySink()
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=4, sinks=[sink], strict=True)
    _run(tracker, model, 6)  # image steps 0 and 4; the last measured step is 5
    tracker.close()
    steps = sorted({s for s, _, _ in sink.images})
    assert steps == [0, 4, 5]
    assert sorted({s for s, _, _ in sink.histograms}) == [0, 4]  # angles only where the weights were read
    last = {tag for s, tag, _ in sink.images if s == 5}
    assert last == {*(f"diversity_map/{p}" for p in PROJECTIONS), *(f"overlap/{p}" for p in PROJECTIONS), "correlation"}
    tracker.close()  # a second close draws nothing twice
    assert sorted({s for s, _, _ in sink.images}) == [0, 4, 5]


def test_a_failing_renderer_costs_the_images_only():
    def broken(job: ImageJob) -> dict[str, bytes]:
        raise RuntimeError("no display")

    model = encoder(1)
    sink = MemorySink()
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=2, sinks=[sink], renderer=broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(tracker, model, 4)
        tracker.close()
    assert sink.images == [] and len(tracker.history) == 4
    assert sorted({s for s, _, _ in sink.scalars}) == [0, 1, 2, 3]
    messages = _monitoring(caught)
    assert messages and all("no display" in m for m in messages)
    assert any("drawing the images of step 0" in m for m in messages)


def test_a_slow_renderer_never_holds_the_step_and_a_full_queue_drops_with_one_warning():
    gate, started = threading.Event(), threading.Event()
    drawn: list[int] = []

    def slow(job: ImageJob) -> dict[str, bytes]:
        started.set()
        gate.wait(timeout=30)
        drawn.append(job.step)
        return render_job(job)

    model = encoder(1)
    sink = MemorySink()
    tracker = HDITracker(
        model, every_n_steps=1, log_images_every_n_steps=1, sinks=[sink], renderer=slow, image_queue_size=1
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = _run(tracker, model, 1)  # step 0 is being drawn (blocked) ...
        assert started.wait(timeout=10)
        held += _run(tracker, model, 3)  # ... step 1 waits in the queue, steps 2 and 3 find it full
    assert max(held) < 5.0  # the renderer blocks for up to 30 s: the steps never waited for it
    dropped = [m for m in _monitoring(caught) if "dropped" in m]
    assert len(dropped) == 2 and "step 2:" in dropped[0] and "step 3:" in dropped[1]
    assert all(m.count("hdi-monitor step") == 1 for m in dropped)  # one warning per measured step
    gate.set()
    tracker.close()
    assert drawn == [0, 1, 3]  # step 3, the last measured step, is drawn at close()
    assert sorted({s for s, _, _ in sink.images}) == [0, 1, 3]
