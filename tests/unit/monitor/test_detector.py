"""Tests for the early-warning detector (hdi_monitor.monitor.detector).

References: analytic series (constant, linear, step, exponential approach), scipy's Theil-Sen
estimator, a brute-force double loop for redundant pairs, and an uninterrupted run for resume.
"""

from __future__ import annotations

import io
import json
import math
import random
from pathlib import Path

import pytest
import torch
from scipy import stats

from hdi_monitor.events import DiversityEvent
from hdi_monitor.evidence import backed
from hdi_monitor.exceptions import DiversityWarning
from hdi_monitor.monitor.detector import SaturationDetector, redundant_pairs, resolve_detectors, theil_sen_slope
from hdi_monitor.monitor.kernel_detector import KernelDetector

LAYER = "encoder.layer.3.attention.self"
CHANCE = 0.923


def feed(detector, values, *, start=0, interval=100, layer=LAYER, projection="key", **kwargs):
    """Feed ``values`` at steps ``start, start + interval, ...``; return all events."""
    events = []
    for k, v in enumerate(values):
        events.extend(detector.update(start + k * interval, layer, projection, v, **kwargs))
    return events


def kinds(events):
    return [(e.kind, e.step) for e in events]


# ---------------------------------------------------------------------------- helpers


def test_theil_sen_matches_scipy():
    rng = random.Random(0)
    for n in (2, 3, 6, 11, 30):
        x = sorted(rng.sample(range(0, 5000), n))
        y = [0.3 + 1e-4 * xi + rng.gauss(0, 0.01) for xi in x]
        y[rng.randrange(n)] += 5.0  # an outlier
        assert theil_sen_slope([float(v) for v in x], y) == pytest.approx(stats.theilslopes(y, x)[0], rel=1e-12)


def test_theil_sen_errors():
    with pytest.raises(ValueError, match="same length"):
        theil_sen_slope([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="distinct x"):
        theil_sen_slope([1.0, 1.0], [0.0, 2.0])


def _brute_force_pairs(matrix, threshold):
    h = len(matrix)
    return [
        (i, j, matrix[i][j])
        for i in range(h)
        for j in range(h)
        if i < j and not math.isnan(matrix[i][j]) and matrix[i][j] >= threshold
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_redundant_pairs_matches_double_loop(dtype):
    gen = torch.Generator().manual_seed(1)
    for h in (2, 5, 12):
        a = torch.rand(h, h, generator=gen, dtype=torch.float64)
        m = ((a + a.T) / 2).to(dtype)
        m.fill_diagonal_(1.0)
        m[h - 1, :] = float("nan")  # an invalid head
        m[:, h - 1] = float("nan")
        reference = _brute_force_pairs(m.to(torch.float64).tolist(), 0.6)
        got = redundant_pairs(m, 0.6)
        assert [(i, j) for i, j, _ in got] == [(i, j) for i, j, _ in reference]
        assert [v for *_, v in got] == pytest.approx([v for *_, v in reference], abs=0)
        assert all(isinstance(i, int) and isinstance(j, int) and isinstance(v, float) for i, j, v in got)


def test_redundant_pairs_reads_only_upper_triangle_and_threshold_is_inclusive():
    m = torch.tensor([[1.0, 0.5, 0.9], [0.99, 1.0, 0.2], [0.99, 0.99, 1.0]])
    assert redundant_pairs(m, 0.9) == [(0, 2, pytest.approx(0.9))]
    assert redundant_pairs(torch.ones(1, 1), 0.5) == []
    assert redundant_pairs(torch.full((3, 3), float("nan")), 0.5) == []


def test_redundant_pairs_errors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        redundant_pairs([[1.0]], 0.9)
    with pytest.raises(ValueError, match="square"):
        redundant_pairs(torch.ones(2, 3), 0.9)
    with pytest.raises(TypeError, match="real numbers"):
        redundant_pairs(torch.ones(2, 2, dtype=torch.bool), 0.9)
    with pytest.raises(ValueError, match="finite"):
        redundant_pairs(torch.ones(2, 2), float("nan"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_redundant_pairs_on_cuda_matches_cpu():
    a = torch.rand(16, 16, generator=torch.Generator().manual_seed(3))
    m = (a + a.T) / 2
    assert redundant_pairs(m.cuda(), 0.7) == redundant_pairs(m, 0.7)


def test_event_round_trips_through_json():
    event = DiversityEvent("redundancy", LAYER, "key", "hdi", 1200, 0.7, 0.75, CHANCE, ((2, 7, 0.96),), "m.")
    data = event.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert DiversityEvent.from_dict(data) == event


def test_one_warning_class_whatever_the_import_path():
    """A filter on `hdi_monitor.DiversityWarning` must catch what the tracker raises: one class object."""
    import hdi_monitor
    import hdi_monitor.exceptions
    import hdi_monitor.monitor._warnings

    assert DiversityWarning is hdi_monitor.DiversityWarning is hdi_monitor.exceptions.DiversityWarning
    assert hdi_monitor.monitor._warnings.DiversityWarning is DiversityWarning


# ---------------------------------------------------------------------------- saturation

#: The settings the analytic cases below are worked out for (the defaults before the held-out
#: study; today's defaults are checked against the study in
#: `test_defaults_are_the_settings_the_warnings_study_chose`).
PINNED = {"patience": 10, "min_delta": 0.002, "collapse_delta": 0.05}


def test_plateau_fires_after_warmup_plus_patience():
    det = SaturationDetector(**PINNED)  # patience=10 measurements after a warm-up of 10
    events = feed(det, [0.731] * 40, chance=CHANCE)
    # First counted measurement at step 1000; the window of patience + 1 = 11 is full at step 2000.
    assert kinds(events) == [("saturation", 2000)]
    e = events[0]
    assert (e.layer, e.projection, e.metric, e.value, e.best, e.chance) == (LAYER, "key", "hdi", 0.731, 0.731, CHANCE)
    msg = e.message
    assert LAYER in msg and "(key)" in msg and "0.002" in msg and "10 measurements" in msg
    assert "0.731" in msg and "0.923" in msg and "step 2000" in msg and "below the 0.923 chance level" in msg
    assert "\n" not in msg and msg.endswith(".")


def test_min_delta_zero_fires_on_an_exact_plateau_only():
    det = SaturationDetector(warmup_steps=0, patience=4, min_delta=0.0)
    assert feed(det, [0.5 + 1e-6 * k for k in range(30)]) == []  # any rise is progress
    det = SaturationDetector(warmup_steps=0, patience=4, min_delta=0.0)
    assert kinds(feed(det, [0.5] * 30)) == [("saturation", 400)]


def test_plateau_above_chance_does_not_say_below():
    det = SaturationDetector(warmup_steps=0, patience=3)
    (e,) = feed(det, [0.95] * 5, chance=CHANCE)
    assert "chance 0.923" in e.message and "below" not in e.message
    assert "diversity has saturated" in e.message


@pytest.mark.parametrize("patience,min_delta", [(10, 0.002), (5, 0.001), (3, 0.01)])
def test_linear_rise_fires_exactly_when_window_gain_at_most_min_delta(patience, min_delta):
    """Noise-free line with rate r per measurement: the window gain is r * patience exactly."""
    boundary = min_delta / patience
    slow = SaturationDetector(patience=patience, min_delta=min_delta, warmup_steps=0)
    assert feed(slow, [0.5 + 1.25 * boundary * k for k in range(200)]) == []
    flat = SaturationDetector(patience=patience, min_delta=min_delta, warmup_steps=0)
    assert kinds(feed(flat, [0.5 + 0.8 * boundary * k for k in range(200)])) == [("saturation", patience * 100)]


def test_slow_steady_rise_does_not_fire():
    # +0.0005 HDI per measurement (0.005 per 1000 steps): slow, but 2.5 times min_delta per window.
    det = SaturationDetector(**PINNED)
    assert feed(det, [0.6 + 0.0005 * k for k in range(300)]) == []


def test_noisy_rise_never_fires_and_noisy_plateau_always_does():
    """`PINNED` settings; rise 0.002 per measurement with Gaussian noise sigma = 0.004 (twice the trend).

    Over the 11-point window the true gain is 0.02 and the Theil-Sen gain has a standard deviation
    of about 0.004, so one window falls to min_delta=0.002 with probability ~3e-6 (4.5 sigma);
    over ~90 windows a run fires with probability < 1e-3 (0 of 5000 runs in a wider simulation).
    """
    false_alarms = 0
    for trial in range(200):
        rng = random.Random(trial)
        det = SaturationDetector(**PINNED)
        events = feed(det, [0.5 + 0.002 * k + rng.gauss(0, 0.004) for k in range(110)])
        false_alarms += any(e.kind == "saturation" for e in events)
    assert false_alarms == 0
    # Power: the same noise on a plateau is detected in every run, within 30 measurements after warmup.
    delays = []
    for trial in range(200):
        rng = random.Random(10_000 + trial)
        det = SaturationDetector(**PINNED)
        events = feed(det, [0.5 + rng.gauss(0, 0.004) for _ in range(60)])
        fired = [e.step for e in events if e.kind == "saturation"]
        assert fired, f"plateau trial {trial} never fired"
        delays.append((fired[0] - 1000) // 100)
    assert min(delays) >= 10 and max(delays) <= 50


def test_exponential_approach_matches_reference_rule():
    """v = 0.9 - 0.2 exp(-k / 15): fires at the first window where both the best-value improvement and
    the Theil-Sen projected gain (scipy) are at most min_delta, and only then."""
    patience, min_delta = 5, 0.002
    steps = [k * 100 for k in range(200)]
    values = [0.9 - 0.2 * math.exp(-k / 15) for k in range(200)]
    expected = None
    for k in range(patience, 200):
        window_x, window_y = steps[k - patience : k + 1], values[k - patience : k + 1]
        improvement = max(values[: k + 1]) - max(values[: k - patience + 1])
        gain = stats.theilslopes(window_y, window_x)[0] * (window_x[-1] - window_x[0])
        if improvement <= min_delta and gain <= min_delta:
            expected = steps[k]
            break
    assert expected is not None
    det = SaturationDetector(patience=patience, min_delta=min_delta, warmup_steps=0)
    assert kinds(feed(det, values)) == [("saturation", expected)]


def test_single_spike_delays_a_plateau_until_it_starts_the_window():
    # The spike at measurement 3 sets a new best (improvement 0.05 > min_delta) for every window that
    # starts before it; the window 3..8 has no improvement and a zero median slope.
    values = [0.7] * 3 + [0.75] + [0.7] * 20
    det = SaturationDetector(patience=5, warmup_steps=0, collapse_delta=0.2)
    assert kinds(feed(det, values)) == [("saturation", 800)]


def test_spike_does_not_stop_a_steady_rise_from_counting():
    """After a spike the best value stays above the series for ~50 measurements, so the best-value
    rule alone (or a two-point slope from the spike) would call it a plateau; the Theil-Sen gain
    of the window (0.001 * 10 = 0.01 > min_delta) keeps it quiet."""
    values = [0.6 + 0.001 * k for k in range(120)]
    values[30] += 0.049
    det = SaturationDetector(**PINNED)  # patience 10, min_delta 0.002, collapse_delta 0.05
    assert feed(det, values) == []
    assert det.best(LAYER, "key") == pytest.approx(0.6 + 0.001 * 119)


def test_saturation_rearms_after_improving_again():
    patience = 5
    plateau1 = [0.70] * 10
    rise = [0.70 + 0.01 * (k + 1) for k in range(10)]  # measurements 10..19, last value 0.80
    plateau2 = [0.80] * 15
    det = SaturationDetector(patience=patience, warmup_steps=0)
    events = feed(det, plateau1 + rise + plateau2)
    # First window full at measurement 5; the second plateau starts at measurement 19 (value 0.80),
    # so the first window with no gain is measurements 19..24.
    assert kinds(events) == [("saturation", 500), ("saturation", 2400)]
    assert events[1].best == pytest.approx(0.80)


def test_no_rearm_on_noise_alone():
    # Plateau with rare single spikes: the best moves up but the robust slope stays flat.
    values = [0.7] * 12
    for level in (0.71, 0.72, 0.73):
        values += [level] + [0.7] * 11
    det = SaturationDetector(patience=5, warmup_steps=0, collapse_delta=0.5)
    assert kinds(feed(det, values)) == [("saturation", 500)]


# ---------------------------------------------------------------------------- collapse


def test_collapse_fires_once_with_below_chance_wording():
    up = [0.80 + 0.01 * k for k in range(11)]  # best 0.90 at measurement 10
    down = [0.90 - 0.012 * (k + 1) for k in range(20)]  # 0.888, 0.876, ...
    det = SaturationDetector(warmup_steps=0, patience=5, collapse_delta=0.05)
    events = feed(det, up + down, chance=CHANCE)
    collapses = [e for e in events if e.kind == "collapse"]
    # best - value = 0.012 * (k + 1) > 0.05 first at k = 4 (fall 0.060), measurement 15.
    assert [(e.step, e.value, e.best) for e in collapses] == [(1500, pytest.approx(0.84), pytest.approx(0.90))]
    msg = collapses[0].message
    assert "fell by 0.060 from its best 0.900 to 0.840 at step 1500" in msg
    assert "below the 0.923 chance level of random heads: the heads are converging" in msg
    assert LAYER in msg and "0.05" in msg


def test_collapse_above_chance_has_no_below_wording():
    det = SaturationDetector(warmup_steps=0, patience=5)
    events = feed(det, [0.98, 0.99, 0.92], chance=0.5)
    (e,) = events
    assert e.kind == "collapse" and "chance 0.500" in e.message and "below" not in e.message
    det2 = SaturationDetector(warmup_steps=0, patience=5)
    (e2,) = feed(det2, [0.98, 0.99, 0.92])
    assert "chance" not in e2.message


def test_fall_of_exactly_collapse_delta_does_not_fire():
    det = SaturationDetector(warmup_steps=0, patience=50, collapse_delta=0.25)
    assert feed(det, [1.0, 0.75, 0.75]) == []  # exactly representable: a fall of 0.25 is not "more than"
    assert kinds(det.update(300, LAYER, "key", 0.7)) == [("collapse", 300)]


# ---------------------------------------------------------------------------- warmup, NaN, keys


def test_warmup_suppresses_events_and_does_not_set_the_reference():
    det = SaturationDetector(warmup_steps=1000, patience=5)
    # Before warmup: a high initial value, a crash and a plateau; none of it counts.
    early = feed(det, [0.95, 0.60, 0.60, 0.60, 0.60, 0.60, 0.60, 0.60, 0.60, 0.60], pairwise=torch.ones(3, 3))
    assert early == [] and det.best(LAYER, "key") is None and det.history(LAYER, "key") == []
    # From step 1000 on: a plateau at 0.6 fires after patience measurements, no collapse (0.95 was in warmup).
    late = feed(det, [0.60] * 10, start=1000)
    assert kinds(late) == [("saturation", 1500)]


def test_missing_values_are_ignored():
    values = [0.7, float("nan"), 0.7, None, 0.7, float("inf"), torch.tensor(0.7), 0.7, float("nan"), 0.7, 0.7]
    det = SaturationDetector(warmup_steps=0, patience=5)
    events = feed(det, values)
    # Six valid measurements (indices 0, 2, 4, 6, 7, 9): the window is full at index 9.
    assert kinds(events) == [("saturation", 900)]
    assert [s for s, _ in det.history(LAYER, "key")] == [200, 400, 600, 700, 900, 1000]  # last patience + 1
    assert det.update(1100, LAYER, "key", float("nan")) == []


def test_series_are_independent():
    det = SaturationDetector(warmup_steps=0, patience=3)
    ev = []
    for k in range(6):
        ev += det.update(k * 100, "a", "key", 0.5)
        ev += det.update(k * 100, "a", "query", 0.5 + 0.01 * k)
        ev += det.update(k * 100, "b", "key", 0.5 + 0.01 * k)
        ev += det.update(k * 100, "mean", "key", 0.5)
        ev += det.update(k * 100, "a", "activations", 8.0, metric="effective_heads")
    assert sorted((e.layer, e.projection, e.metric, e.step) for e in ev) == [
        ("a", "activations", "effective_heads", 300),
        ("a", "key", "hdi", 300),
        ("mean", "key", "hdi", 300),
    ]
    mean_event = next(e for e in ev if e.layer == "mean")
    assert mean_event.message.startswith("The model-mean HDI (key)")
    eff = next(e for e in ev if e.metric == "effective_heads")
    assert "effective number of heads of 'a' (activations)".lower() in eff.message.lower()


# ---------------------------------------------------------------------------- redundancy


def _overlap(h, pairs, value=0.95):
    m = torch.full((h, h), 0.1)
    m.fill_diagonal_(1.0)
    for i, j in pairs:
        m[i, j] = m[j, i] = value
    return m


def test_redundancy_lists_pairs_and_fires_only_when_the_set_grows():
    det = SaturationDetector(warmup_steps=0, patience=50)
    (e,) = det.update(0, LAYER, "key", 0.7, chance=CHANCE, pairwise=_overlap(8, [(2, 7)], 0.96))
    assert e.kind == "redundancy" and e.pairs == ((2, 7, pytest.approx(0.96)),)
    assert e.message.startswith(
        f"Layer '{LAYER}' key heads 2 and 7 have overlap 0.96 (>= 0.90 redundancy threshold; "
        "random heads overlap about 0.08; step 0)"
    )
    # pruning advice only where the study's redundancy ablation beat random heads (issue 33)
    assert ("consider pruning one of them" in e.message) == backed("redundancy")
    assert "docs/early-warnings.md" in e.message and "\n" not in e.message
    assert det.update(100, LAYER, "key", 0.7, pairwise=_overlap(8, [(2, 7)])) == []  # same set
    assert det.update(200, LAYER, "key", 0.7, pairwise=_overlap(8, [])) == []  # shrinks
    (e2,) = det.update(300, LAYER, "key", 0.7, pairwise=_overlap(8, [(2, 7), (1, 3)], 0.91))
    assert sorted(p[:2] for p in e2.pairs) == [(1, 3), (2, 7)]
    assert "1 and 3 (0.91)" in e2.message and ("one head of each pair" in e2.message) == backed("redundancy")
    assert det.update(400, LAYER, "key", 0.7, pairwise=_overlap(8, [(1, 3)])) == []  # already reported


def test_redundancy_message_caps_the_list_and_orders_strongest_first():
    det = SaturationDetector(warmup_steps=0)
    m = torch.full((6, 6), 0.91)
    m[0, 5] = m[5, 0] = 0.99
    (e,) = det.update(0, LAYER, "value", 0.2, pairwise=m)
    assert len(e.pairs) == 15 and e.pairs[0][:2] == (0, 5)
    assert e.message.count(" and ") == 7 and "and 9 more pairs" in e.message


def test_redundancy_with_correlation_and_missing_value():
    det = SaturationDetector(warmup_steps=0)
    r = torch.eye(4)
    r[0, 3] = r[3, 0] = 0.93
    r[1, :] = r[:, 1] = float("nan")
    (e,) = det.update(0, LAYER, "activations", None, metric="effective_heads", pairwise=r)
    assert e.pairs == ((0, 3, pytest.approx(0.93)),) and math.isnan(e.value)
    assert "activation correlation 0.93" in e.message


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"patience": 0}, ValueError, "patience"),
        ({"patience": 2.5}, TypeError, "patience"),
        ({"patience": True}, TypeError, "patience"),
        ({"min_delta": -0.001}, ValueError, "min_delta"),
        ({"min_delta": float("nan")}, ValueError, "min_delta"),
        ({"min_delta": "0.1"}, TypeError, "min_delta"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"collapse_delta": 0.0}, ValueError, "collapse_delta"),
        ({"collapse_delta": float("inf")}, ValueError, "collapse_delta"),
        ({"redundancy_threshold": 0.0}, ValueError, "redundancy_threshold"),
        ({"redundancy_threshold": 1.5}, ValueError, "redundancy_threshold"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        SaturationDetector(**kwargs)


def test_update_validation():
    det = SaturationDetector(warmup_steps=0)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        det.update(-1, LAYER, "key", 0.5)
    with pytest.raises(TypeError, match="step"):
        det.update(1.5, LAYER, "key", 0.5)
    with pytest.raises(TypeError, match="layer"):
        det.update(0, "", "key", 0.5)
    with pytest.raises(ValueError, match="projection"):
        det.update(0, LAYER, "keys", 0.5)
    with pytest.raises(ValueError, match="metric"):
        det.update(0, LAYER, "key", 0.5, metric="HDI")
    with pytest.raises(TypeError, match="value"):
        det.update(0, LAYER, "key", "0.5")
    with pytest.raises(ValueError, match="scalar"):
        det.update(0, LAYER, "key", torch.ones(2))
    with pytest.raises(ValueError, match="square"):
        det.update(0, LAYER, "key", 0.5, pairwise=torch.ones(3))
    with pytest.raises(ValueError, match="chance"):
        det.update(0, LAYER, "key", 0.5, chance=float("nan"))
    det.update(100, LAYER, "key", 0.5)
    with pytest.raises(ValueError, match="steps must increase"):
        det.update(100, LAYER, "key", 0.6)
    det.update(100, LAYER, "query", 0.6)  # another series has its own steps
    det.reset()
    assert det.update(0, LAYER, "key", 0.5) == [] and det.events == ()


# ---------------------------------------------------------------------------- state and resume


def _plain(obj):
    """True when obj holds only what torch.load(weights_only=True) and json can represent."""
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return obj is None or isinstance(obj, (bool, int, float, str))


def _stream(seed=0, n=150):
    """Interleaved measurements of several series: plateaus, rises, collapses, NaNs, redundancy."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(6, 6, generator=gen) * 0.3
    base = (base + base.T) / 2
    calls = []
    for k in range(n):
        step = 400 + 50 * k
        t = k / n
        calls.append((step, "enc.0.attn", "key", 0.92 - 0.3 * t + rng.gauss(0, 0.002), {"chance": CHANCE}))
        q = 0.7 + 0.1 * (1 - math.exp(-k / 20)) + rng.gauss(0, 0.001)
        calls.append((step, "enc.0.attn", "query", float("nan") if k % 13 == 0 else q, {}))
        m = base.clone()
        for p, (i, j) in enumerate([(0, 1), (2, 4), (3, 5)]):
            if k > 40 * (p + 1):
                m[i, j] = m[j, i] = 0.95
        m.fill_diagonal_(1.0)
        calls.append((step, "enc.1.attn", "value", 0.8 if k < 90 else 0.7, {"pairwise": m}))
        calls.append((step, "mean", "key", 0.85 + 0.0005 * k if k < 70 else 0.885, {}))
        calls.append((step, "enc.1.attn", "activations", 5.0 + rng.gauss(0, 0.05), {"metric": "effective_heads"}))
    return calls


def _nan_safe(events):
    return [json.dumps(e.to_dict(), sort_keys=True) for e in events]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


CONFIG = {"patience": 8, "min_delta": 0.002, "warmup_steps": 1000, "collapse_delta": 0.05, "redundancy_threshold": 0.9}


def test_state_dict_is_plain_and_roundtrips_through_torch_save():
    det = SaturationDetector(**CONFIG)
    for step, layer, proj, value, kw in _stream()[:300]:
        det.update(step, layer, proj, value, **kw)
    state = det.state_dict()
    assert _plain(state)
    loaded = _roundtrip(state)
    fresh = SaturationDetector(**CONFIG)
    fresh.load_state_dict(loaded)
    assert json.dumps(fresh.state_dict(), sort_keys=True) == json.dumps(state, sort_keys=True)
    assert _nan_safe(fresh.events) == _nan_safe(det.events)
    assert fresh.best("enc.0.attn", "key") == det.best("enc.0.attn", "key")


@pytest.mark.parametrize("splits", [(1,), (137, 138, 139), (50, 300, 301, 512, 700)])
def test_resume_issues_exactly_the_uninterrupted_events(splits):
    calls = _stream()
    whole = SaturationDetector(**CONFIG)
    expected = []
    for step, layer, proj, value, kw in calls:
        expected.extend(whole.update(step, layer, proj, value, **kw))
    assert {e.kind for e in expected} == {"saturation", "collapse", "redundancy"}  # the stream exercises all
    assert len([e for e in expected if e.kind == "redundancy"]) == 3

    got, state = [], None
    bounds = [0, *splits, len(calls)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        det = SaturationDetector(**CONFIG)
        if state is not None:
            det.load_state_dict(_roundtrip(state))
        for step, layer, proj, value, kw in calls[lo:hi]:
            got.extend(det.update(step, layer, proj, value, **kw))
        state = det.state_dict()
    assert _nan_safe(got) == _nan_safe(expected)
    assert _nan_safe(det.events) == _nan_safe(whole.events)


def test_load_state_dict_errors_and_shrinking_patience():
    det = SaturationDetector(warmup_steps=0, patience=10)
    feed(det, [0.5 + 0.01 * k for k in range(20)])
    state = det.state_dict()
    with pytest.raises(TypeError, match="dict"):
        det.load_state_dict([state])
    with pytest.raises(ValueError, match="version"):
        det.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        det.load_state_dict({**state, "series": [{"layer": "x"}]})
    short = SaturationDetector(warmup_steps=0, patience=3)
    short.load_state_dict(state)
    assert [s for s, _ in short.history(LAYER, "key")] == [1600, 1700, 1800, 1900]
    # The restored detector goes on: a plateau from here fires after 3 more measurements.
    assert kinds(feed(short, [0.69] * 4, start=2000)) == [("saturation", 2200)]


def test_defaults_are_the_settings_the_warnings_study_chose():
    """The detectors' defaults are the settings `benchmarks/warnings_study.py` chose on all its runs
    (``chosen_on_all_runs`` of its results file; warm-up counted in measurements, as the study
    did). A re-run of the study that chooses differently fails here until the defaults (and
    docs/early-warnings.md) follow it."""
    results = json.loads((Path(__file__).resolve().parents[3] / "benchmarks/results/warnings_study.json").read_text())
    on_all = results["chosen_on_all_runs"]
    sat, ker = SaturationDetector(), KernelDetector()
    hdi, act = resolve_detectors("default", "default")
    assert hdi is not None and act is not None
    for det, sig in ((hdi, "hdi"), (act, "effective_heads")):
        assert (det.patience, det.min_delta, det.warmup_measurements) == (
            on_all[f"saturation/{sig}"]["patience"],
            on_all[f"saturation/{sig}"]["min_delta"],
            on_all[f"saturation/{sig}"]["warmup_measurements"],
        )
        assert det.collapse_delta == on_all[f"collapse/{sig}"]["collapse_delta"]
        assert det.redundancy_threshold == on_all["redundancy"]["redundancy_threshold"]
    assert (sat.patience, sat.min_delta, sat.collapse_delta) == (hdi.patience, hdi.min_delta, hdi.collapse_delta)
    assert sat.warmup_steps is None and ker.warmup_steps is None  # warmup counted in measurements
    assert ker.entropy_fraction == on_all["entropy_collapse"]["entropy_fraction"]
    assert ker.warmup_measurements == on_all["entropy_collapse"]["warmup_measurements"]
    assert ker.warmup_measurements == on_all["logit_blowup"]["warmup_measurements"]
    assert (ker.logit_threshold, ker.logit_growth) == (
        on_all["logit_blowup"]["logit_threshold"],
        on_all["logit_blowup"]["logit_growth"],
    )
