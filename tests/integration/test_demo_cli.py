"""The README's main job (`hdi-monitor demo`) and the LightningCLI config, shortened."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_events, scalar_series

from hdi_monitor.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "report", "allocate"):
        assert name in out


def _spectral_key_hdi(in_proj_weight: np.ndarray, num_heads: int) -> float:
    """Brute-force spectral key HDI from nn.MultiheadAttention's packed (3D, D) weight, in float64."""
    d_model = in_proj_weight.shape[1]
    d = d_model // num_heads
    w_k = in_proj_weight[d_model : 2 * d_model]  # rows of the key projection
    heads = [w_k[h * d : (h + 1) * d].T for h in range(num_heads)]  # W_h: (D, d)
    rho = np.empty((num_heads, num_heads))
    for i, wi in enumerate(heads):
        for j, wj in enumerate(heads):
            rho[i, j] = np.linalg.norm(wi.T @ wj) ** 2 / (np.linalg.norm(wi.T @ wi) * np.linalg.norm(wj.T @ wj))
    return 1.0 - rho[~np.eye(num_heads, dtype=bool)].mean()


def test_demo_writes_dashboards_and_a_checkpoint_the_report_reads(tmp_path, capsys):
    code = main(
        [
            "demo",
            "--out",
            str(tmp_path),
            "--steps",
            "6",
            "--every",
            "3",
            "--images-every",
            "3",
            "--d-model",
            "32",
            "--heads",
            "4",
            "--layers",
            "2",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "tensorboard --logdir" in out
    accs = read_events(tmp_path)
    series = scalar_series(accs, "hdi/key/encoder.layers.1.self_attn")
    assert sorted(series) == [0, 3]
    assert all(0.0 <= v <= 1.0 for v in series.values())
    assert "overlap/key" in {t for acc in accs for t in acc.Tags()["images"]}

    # The demo's suggested command, run exactly as printed, reads the checkpoint it saved.
    line = next(ln for ln in out.splitlines() if "hdi-monitor report" in ln)
    argv = shlex.split(line.split("hdi-monitor", 1)[1])
    ckpt = Path(argv[1])
    assert ckpt == tmp_path / "demo" / "version_0" / "checkpoints" / "last.ckpt" and ckpt.is_file()
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 6  # the weights after the last step
    for layer in report["layers"]:
        w = state["state_dict"][f"{layer['name']}.in_proj_weight"].double().numpy()
        assert layer["hdi"]["key"] == pytest.approx(_spectral_key_hdi(w, 4), abs=1e-5)


def test_demo_bad_arguments_exit_2(capsys):
    assert main(["demo", "--d-model", "30", "--heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "divisible" in err and "Traceback" not in err


@pytest.mark.slow
def test_lightning_cli_config(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "lightning_cli.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "null",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--model.init_args.d_model",
        "32",
        "--model.init_args.num_heads",
        "4",
        "--model.init_args.num_layers",
        "1",
        "--trainer.callbacks.init_args.every_n_steps",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = scalar_series(read_events(tmp_path), "hdi/query/encoder.layers.0.self_attn")
    assert sorted(series) == [0, 2]
    ckpt = tmp_path / "cli" / "version_0" / "checkpoints" / "last.ckpt"  # the path configs/demo.yaml names
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 4
