"""benchmarks/allocation_transformers.py's quick mode runs end to end and writes a results file of the
documented structure; its TensorBoard runs are what ``hdi-monitor allocate --runs`` reads. The claims
themselves come from the full sweep, not from this smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hdi_monitor.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

KEYS = ["command", "corpus", "seeds", "widths", "sizes", "runs", "best", "law_prediction", "early_choice"]


def test_quick_sweep_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Page\n\n<!-- allocation-transformers:begin -->\nstale\n<!-- allocation-transformers:end -->\nafter\n"
    )
    logdir = tmp_path / "runs"
    script = str(ROOT / "benchmarks" / "allocation_transformers.py")
    argv = [sys.executable, script, "--quick", "--out", str(tmp_path), "--logdir", str(logdir), "--docs", str(page)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((tmp_path / "allocation_transformers_quick.json").read_text())
    assert list(res) == KEYS
    assert res["command"].startswith("python benchmarks/allocation_transformers.py")
    assert res["seeds"] == [0] and res["widths"] == [64] and len(res["sizes"]) == 2
    splits = {(r["H"], r["d_k"]) for r in res["runs"]}
    assert splits == {(16, 4), (8, 8), (4, 16), (2, 32), (1, 64)}
    assert len(res["runs"]) == len(splits) * len(res["sizes"])
    for r in res["runs"]:
        assert r["H"] * r["d_k"] == r["D"] and r["final_loss"] > 0
        assert {"key_hdi", "effective_heads", "head_correlation", "seed", "N"} <= set(r)
    assert {(b["D"], b["N"]) for b in res["best"]} == {(64, n) for n in res["sizes"]}
    assert {"best_d_k", "best_H", "within_noise_d_k", "mean_loss"} <= set(res["best"][0])
    lp = res["law_prediction"]
    assert lp["predicted_N"] == max(res["sizes"]) and set(lp["variants"]) == {"measured_correlation", "fitted_rho"}
    assert {"measured_d_k_star", "measured_H_star", "conventions"} <= set(lp["trends"])
    assert set(res["early_choice"]) == {"10%", "25%"}
    for scores in res["early_choice"].values():
        for method in ("law", "loss", "power_law"):
            assert set(scores[method]) == {"spearman", "regret", "cells"}
            assert {"mean", "low", "high"} <= set(scores[method]["regret"])

    text = page.read_text()
    assert "stale" not in text and "Quick run, not the result" in text and text.endswith("after\n")
    assert (tmp_path / "docs" / "img" / "allocation_transformers_quick.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "allocation_transformers_quick.md").is_file()

    # the sweep's own TensorBoard runs feed the advisor; it reads back the runs' splits and final losses
    out = tmp_path / "rec.json"
    rc = main(["allocate", "--runs", str(logdir / "D64"), "--metric", "final_val_loss", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    read = json.loads(out.read_text())["runs"]
    want = sorted((r["H"], r["N"], round(r["final_loss"], 5)) for r in res["runs"])
    assert sorted((r["num_heads"], r["n_train"], round(r["loss"], 5)) for r in read) == want
