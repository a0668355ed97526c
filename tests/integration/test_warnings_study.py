"""The warnings study's quick mode runs end to end and writes a results file of the documented
structure (the claims themselves come from the full study, not from this smoke run)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_quick_study_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    block = "<!-- warnings-study:begin -->\nstale text\n<!-- warnings-study:end -->\n"
    page, readme = tmp_path / "docs" / "page.md", tmp_path / "README.md"
    page.parent.mkdir()
    page.write_text("# Page\n\n" + block + "after\n")
    readme.write_text("# Readme\n\n" + block)
    script = str(ROOT / "benchmarks" / "warnings_study.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick", "--out", str(tmp_path), "--docs", str(page), "--readme", str(readme)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "warnings_study.json").read_text())
    with gzip.open(tmp_path / "warnings_study_runs.json.gz", "rt") as f:
        series = json.load(f)
    assert results["command"].startswith("python benchmarks/warnings_study.py")
    assert results["seeds"] == [0]
    names = {"baseline", "narrow_heads", "wide_heads", "high_lr", "high_lr_qk_norm", "shuffled"}
    assert set(results["configurations"]) == names
    assert len(series) == results["runs"] == len(names)
    for row in results["configurations"].values():
        assert row["seeds"] == 1
        assert row["final_held_out"] is None or math.isfinite(row["final_held_out"])
    keys = ("saturation/hdi", "collapse/hdi", "redundancy/hdi", "redundancy/effective_heads",
            "entropy_collapse/attention_entropy", "logit_blowup/max_attention_logit")  # fmt: skip
    for key in keys:
        row = results["overall"][key]
        for field in ("fired", "precision", "baseline_precision", "median_lead_steps"):
            assert field in row, (key, field)
        assert isinstance(row["fired"], int) and row["fired"] >= 0
    for key in ("redundancy/hdi", "redundancy/effective_heads"):
        assert set(results["overall"][key]["ablation_loss_increase"]) == {"mean", "std", "seeds"}
        assert set(results["overall"][key]["random_ablation_loss_increase"]) == {"mean", "std", "seeds"}
    # every event in the series is a measured step of its run, and the held-out loss sits beside it
    for run in series:
        assert len(run["steps"]) == len(run["held_out"]) > 0
        assert all(e["step"] in run["steps"] for e in run["events"])
    # the replayed detector grids: every kind, each row scored like the live events
    assert set(results["detector_grid"]) == set(results["chosen"]) == set(results["used_settings"])
    assert set(results["detector_grid"]) == {"saturation", "collapse", "entropy_collapse", "logit_blowup"}
    for kind, rows in results["detector_grid"].items():
        assert rows and all({"fired", "scored", "precision", "baseline_precision"} <= set(r) for r in rows), kind
        used = results["used_settings"][kind]
        assert sum(all(r[k] == v for k, v in used.items()) for r in rows) == 1, kind  # the used setting is a row
    assert results["replay_check"] is True  # replaying with the used settings gives the live events
    for run in series:  # the kernel series sit beside every measured step
        assert run["kernel"] and all(len(v) == len(run["steps"]) for v in run["kernel"].values())
    assert (tmp_path / "warnings_study.png").stat().st_size > 0
    text = page.read_text()
    assert "stale text" not in text and "Measured by" in text and text.endswith("after\n")
    assert "](img/warnings_study.png)" in text and (page.parent / "img" / "warnings_study.png").stat().st_size > 0
    assert "| event (metric) |" in readme.read_text()
    # --rescore scores the recorded runs again without training: the same scores, the command kept
    again = subprocess.run(
        [sys.executable, script, "--rescore", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    rescored = json.loads((tmp_path / "warnings_study.json").read_text())
    assert rescored["command"] == results["command"] and rescored["rescored_by"].endswith(
        "--rescore --out " + str(tmp_path)
    )
    assert rescored["overall"] == results["overall"] and rescored["detector_grid"] == results["detector_grid"]
    assert (tmp_path / "warnings_study.md").read_text().startswith("Measured by")
