"""The warnings study: the baselines' math against hand-computed cases and brute-force loops, and
its quick mode end to end, writing a results file of the documented structure (the claims
themselves come from the full study, not from this smoke run)."""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import warnings_study as ws  # noqa: E402

SIGNALS = {"saturation/hdi", "saturation/effective_heads", "collapse/hdi", "collapse/effective_heads",
           "entropy_collapse", "logit_blowup", "logit_bound", "update_entropy", "redundancy"}  # fmt: skip


def _noise(n: int) -> list[float]:
    """A deterministic wiggle around 2.0 (standard deviation about 0.007)."""
    return [2.0 + 0.01 * math.sin(1.7 * t) for t in range(n)]


# ------------------------------------------------------------------------------ baselines' math
def test_olmo_rule_finds_a_known_spike() -> None:
    values = _noise(300)
    values[200] = 2.5  # far above mean + 6 std of the 128 before it
    values[250] = 2.03  # about 4 std: below OLMo's 6
    assert ws.olmo_spikes(values) == [200]
    assert ws.olmo_spikes(values[:128] + [9.0]) == [128]  # fires once 128 values are there
    assert ws.olmo_spikes([9.0] * 10 + [float("nan")]) == [10]  # a non-finite loss fires


def test_olmo_rule_matches_hand_computation() -> None:
    # window 4, 1 std: history [1, 2, 3, 4] has mean 2.5 and sample std 1.2910; 3.8 is above 3.79
    assert ws.olmo_spikes([1, 2, 3, 4, 3.8], window=4, stds=1.0) == [4]
    assert ws.olmo_spikes([1, 2, 3, 4, 3.7], window=4, stds=1.0) == []


def test_llmc_zscore_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    values = (2 + 0.1 * rng.standard_normal(400)).tolist()
    values[300] += 1.0
    got = ws.zscores(values)
    for t, x in enumerate(values):
        if t < 128:
            assert got[t] == 0.0
            continue
        past = np.array(values[t - 128 : t])
        assert got[t] == pytest.approx((x - past.mean()) / past.std(), rel=1e-9, abs=1e-12)
    assert 300 in ws.zscore_spikes(values)
    assert all(got[t] > 3 for t in ws.zscore_spikes(values))


def test_zclip_ema_zscore_matches_brute_force_loop() -> None:
    rng = np.random.default_rng(1)
    values = (1 + 0.05 * rng.standard_normal(200)).tolist()
    values[120] = 3.0  # a spike: clipped before it updates the EMAs
    alpha, z, warm = 0.97, 2.5, 25
    mu, var = float(np.mean(values[:warm])), float(np.var(values[:warm]))
    expected = [0.0] * warm
    for x in values[warm:]:
        score = (x - mu) / math.sqrt(var)
        expected.append(score)
        x_used = mu + z * math.sqrt(var) if score > z else x
        mu = alpha * mu + (1 - alpha) * x_used
        var = alpha * var + (1 - alpha) * (x_used - mu) ** 2
    got = ws.ema_zscores(values)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert 120 in ws.ema_spikes(values)


def test_steps_map_to_the_latest_measurement() -> None:
    run = ws.Run("c", 0, steps=[0, 10, 20, 30])
    assert ws.steps_to_measurements(run, [0, 5, 9, 10, 25, 31]) == [0, 1, 2, 3]


def test_power_law_extrapolation_on_an_exact_power_law() -> None:
    steps = list(range(10, 1010, 10))
    for c, plateau in ((0.001, True), (0.5, False)):
        held = [5.0 * s**-c for s in steps]
        i = 60  # predicted improvement over 10 measurements: 1 - (710 / 610)^-c
        assert 1 - (710 / 610) ** -c < ws.PLATEAU_REL if plateau else 1 - (710 / 610) ** -c > ws.PLATEAU_REL
        assert ws.power_law_plateau(held, i, 10, steps) is plateau


def test_bootstrap_interval_contains_the_point_estimate() -> None:
    num = np.array([3.0, 1.0, 0.0, 4.0, 2.0, 5.0])
    den = np.array([5.0, 4.0, 2.0, 6.0, 3.0, 8.0])
    interval = ws.bootstrap_interval(num, den)
    assert interval is not None
    lo, hi = interval
    assert lo <= num.sum() / den.sum() <= hi and lo < hi
    again = ws.bootstrap_interval(num, den)
    assert again == [lo, hi]  # a private generator: the same interval every time
    # every run with the same ratio: no spread
    assert ws.bootstrap_interval(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])) == [0.5, 0.5]
    assert ws.bootstrap_interval(np.array([1.0, 0.0]), np.array([2.0, 0.0])) is None  # one run with events


def test_auc_matches_pair_counting() -> None:
    rng = np.random.default_rng(2)
    scores = np.round(rng.standard_normal(60), 1)  # ties on purpose
    labels = (rng.random(60) < 0.3).astype(float)
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert ws.auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert ws.auc(scores, np.zeros(60)) is None


def test_logistic_regression_separates_a_separable_case() -> None:
    x = np.array([[-2.0], [-1.0], [-0.5], [0.5], [1.0], [2.0]])
    y = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    w = ws.fit_logistic(x, y)
    assert w[0] > 0 and ws.auc(x[:, 0] * w[0] + w[1], y) == 1.0


def test_scorer_counts_a_hand_built_run() -> None:
    # held-out loss: improving, then a spike at measurement 15 (10% above the best 1.0)
    held = [3.0 - 0.2 * i for i in range(11)] + [1.0] * 4 + [1.2, 1.0, 1.0, 1.0, 1.0, 1.0]
    run = ws.Run("c", 0, steps=list(range(0, 200, 10)), held_out=held)
    other = ws.Run("c", 1, steps=list(range(0, 200, 10)), held_out=[3.0 - 0.1 * i for i in range(20)])
    assert ws.spike_onsets(run) == [15]
    scorer = ws.Scorer([run, other], window=3)
    rows = scorer.rows([[12, 14], [12]], "spike")
    assert rows[0, ws.SCORED] == 2 and rows[0, ws.HITS] == 2  # 15 follows 12 and 14 within 3
    assert rows[0, ws.ONSETS] == 1 and rows[0, ws.CAUGHT] == 1
    assert rows[1, ws.SCORED] == 1 and rows[1, ws.HITS] == 0
    assert rows[0, ws.MATCH_NUM] == 0 and rows[0, ws.MATCH_DEN] == 2  # the other seed never spikes there


# ------------------------------------------------------------------------------ quick mode, end to end
@pytest.mark.slow
def test_quick_study_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Page\n\n<!-- warnings-study:begin (generated) -->\nstale text\n<!-- warnings-study:end -->\nafter\n"
    )
    script = str(ROOT / "benchmarks" / "warnings_study.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--out", str(tmp_path), "--docs", str(page)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "warnings_study.json").read_text())
    with gzip.open(tmp_path / "warnings_study_runs.json.gz", "rt") as f:
        series = json.load(f)
    assert results["command"].startswith("python benchmarks/warnings_study.py") and "--quick" in results["command"]
    assert results["seeds"] == [0, 1] and len(series) == results["runs"]
    assert {"machine", "seconds", "seeds", "configurations", "folds", "curves", "saturation_use"} <= set(results)
    folds = results["folds"]
    assert [f["test_seeds"] for f in folds["two_fold_by_seed"]] == [[1], [0]]
    assert {f["test_configuration"] for f in folds["leave_one_configuration_out"]} == set(results["configurations"])
    for scheme in ("out_of_sample", "leave_one_configuration_out"):
        assert set(results[scheme]) == SIGNALS
        for signal, row in results[scheme].items():
            assert {"outcome", "precision", "interval", "recall", "baselines", "best_baseline",
                    "best_baseline_precision", "default_on", "events", "runs_flagged"} <= set(row), signal  # fmt: skip
            assert isinstance(row["outcome"], str) and isinstance(row["default_on"], bool)
            assert isinstance(row["events"], int) and isinstance(row["runs_flagged"], int)
            assert row["interval"] is None or (len(row["interval"]) == 2 and row["interval"][0] <= row["interval"][1])
            assert isinstance(row["baselines"], dict) and row["baselines"]
            assert row["best_baseline"] is None or row["best_baseline"] in row["baselines"]
    spike_baselines = set(results["out_of_sample"]["logit_bound"]["baselines"])
    assert {"random_timing", "time_matched", "config_prior", "olmo_loss", "llmc_loss_z", "zclip_loss",
            "grad_norm_z", "update_norm_z", "persistence"} == spike_baselines  # fmt: skip
    assert {"power_law", "persistence", "config_prior"} <= set(results["out_of_sample"]["saturation/hdi"]["baselines"])
    assert set(results["defaults_on"]) <= SIGNALS
    assert all(results["out_of_sample"][s]["default_on"] for s in results["defaults_on"])
    ai = results["added_information"]
    assert isinstance(ai["outcome"], str)
    for key in ("without_head_signals", "with_head_signals"):
        assert {"auc", "interval"} <= set(ai[key])
    assert set(results["chosen_on_all_runs"]) == SIGNALS
    assert all(isinstance(v, dict) and v for v in results["chosen_on_all_runs"].values())
    for signal, curve in results["curves"].items():
        assert signal in SIGNALS and curve and all(len(point) == 3 for point in curve)
    assert "not run" in results["saturation_use"]["pruned_then_trained"]
    assert results["replay_check"] is True  # replaying with the runs' settings gives the live events
    for run in series:  # per step and per measurement series line up
        assert len(run["steps"]) == len(run["held_out"]) > 0
        assert len(run["step_loss"]) == len(run["grad_norm"]) >= len(run["update_norm"]) > 0
        assert all(len(v) == len(run["steps"]) for v in run["logit_bound"].values())
        assert all(len(v) == len(run["steps"]) for v in run["update_entropy"].values())
    md = (tmp_path / "warnings_study.md").read_text()
    assert md.startswith("| signal | outcome | held-out precision")
    text = page.read_text()
    assert "stale text" not in text and text.endswith("after\n")
    assert "<!-- warnings-study:begin (generated) -->\n| signal | outcome |" in text
    assert "](img/warnings_study.png)" in text and (page.parent / "img" / "warnings_study.png").stat().st_size > 0
    # --rescore scores the recorded runs again without training: the same scores, the command kept
    again = subprocess.run(
        [sys.executable, script, "--rescore", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    rescored = json.loads((tmp_path / "warnings_study.json").read_text())
    assert rescored["command"] == results["command"] and rescored["rescored_by"].endswith(
        "--rescore --out " + str(tmp_path)
    )
    assert rescored["out_of_sample"] == results["out_of_sample"]
    assert rescored["added_information"] == results["added_information"]


def test_statistics_helpers_used_by_the_hand_cases() -> None:
    # the hand case of test_olmo_rule_matches_hand_computation, spelled out
    assert statistics.fmean([1, 2, 3, 4]) + statistics.stdev([1, 2, 3, 4]) == pytest.approx(3.7910, abs=1e-4)
