"""The warnings study's quick mode runs end to end and writes a results file of the documented
structure (the claims themselves come from the full study, not from this smoke run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_quick_study_writes_results(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "warnings_study.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "warnings_study.json").read_text())
    assert results["command"].startswith("python benchmarks/warnings_study.py")
    assert results["seeds"] == [0]
    names = {"baseline", "narrow_heads", "wide_heads", "high_lr", "high_lr_qk_norm", "shuffled"}
    assert set(results["configurations"]) == names
    assert len(results["series"]) == results["runs"] == len(names)
    for row in results["configurations"].values():
        assert row["seeds"] == 1
        assert row["final_held_out"] is None or math.isfinite(row["final_held_out"])
    for key in ("saturation/hdi", "collapse/hdi", "redundancy/hdi", "redundancy/effective_heads"):
        row = results["overall"][key]
        for field in ("fired", "precision", "baseline_precision", "median_lead_steps"):
            assert field in row, (key, field)
        assert isinstance(row["fired"], int) and row["fired"] >= 0
    for key in ("redundancy/hdi", "redundancy/effective_heads"):
        assert set(results["overall"][key]["ablation_loss_increase"]) == {"mean", "std", "seeds"}
        assert set(results["overall"][key]["random_ablation_loss_increase"]) == {"mean", "std", "seeds"}
    # every event in the series is a measured step of its run, and the held-out loss sits beside it
    for run in results["series"]:
        assert len(run["steps"]) == len(run["held_out"]) > 0
        assert all(e["step"] in run["steps"] for e in run["events"])
    assert (tmp_path / "warnings_study.png").stat().st_size > 0
    assert (tmp_path / "warnings_study.md").read_text().startswith("Measured by")
