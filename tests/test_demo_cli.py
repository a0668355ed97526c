"""The README's main job (`hdi-monitor demo`) and the LightningCLI config, shortened."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_events, scalar_series
from hdi_monitor.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "report", "allocate"):
        assert name in out


def test_demo_writes_dashboards(tmp_path, capsys):
    code = main(["demo", "--out", str(tmp_path), "--steps", "6", "--every", "3", "--images-every", "3",
                 "--d-model", "32", "--heads", "4", "--layers", "2", "--no-progress"])
    assert code == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    accs = read_events(tmp_path)
    series = scalar_series(accs, "hdi/key/encoder.layers.1.self_attn")
    assert sorted(series) == [0, 3]
    assert all(0.0 <= v <= 1.0 for v in series.values())
    assert any(t.startswith("overlap/key/") for acc in accs for t in acc.Tags()["images"])


def test_demo_bad_arguments_exit_2(capsys):
    assert main(["demo", "--d-model", "30", "--heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "divisible" in err and "Traceback" not in err


def test_lightning_cli_config(tmp_path):
    cmd = [
        sys.executable, str(ROOT / "examples" / "lightning_cli.py"), "fit",
        "--config", str(ROOT / "configs" / "demo.yaml"),
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "null", "--trainer.limit_val_batches", "0",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
        "--model.init_args.d_model", "32", "--model.init_args.num_heads", "4", "--model.init_args.num_layers", "1",
        "--trainer.callbacks.init_args.every_n_steps", "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = scalar_series(read_events(tmp_path), "hdi/query/encoder.layers.0.self_attn")
    assert sorted(series) == [0, 2]
