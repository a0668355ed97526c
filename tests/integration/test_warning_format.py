"""Under LightningCLI the monitor's warnings keep their category name (issue 31). Lightning
replaces ``warnings.formatwarning`` with one that drops the category for every file whose path
contains "lightning" (meant for its own package); a user's ``lightning_cli.py`` matches, so
``MonitoringWarning:`` vanished from the line. Other warnings keep Lightning's format."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from hdi_monitor.exceptions import DiversityWarning, MonitoringWarning

ROOT = Path(__file__).resolve().parents[2]

CONFIG = textwrap.dedent(
    """
    seed_everything: 0
    trainer:
      max_steps: 2
      limit_val_batches: 0
      enable_progress_bar: false
      enable_model_summary: false
      enable_checkpointing: false
      logger:
        class_path: lightning.pytorch.loggers.CSVLogger   # scalars only: one MonitoringWarning says so
        init_args: {save_dir: runs}
      callbacks:
        - class_path: hdi_monitor.HDIMonitor
          init_args: {every_n_steps: 1}
    model:
      class_path: hdi_monitor.contrib.demo.CharLM
      init_args: {d_model: 32, num_heads: 4, num_layers: 1}
    data:
      class_path: hdi_monitor.contrib.demo.CharDataModule
      init_args: {train_samples: 64, val_samples: 16}
    """
)


@pytest.mark.slow
def test_lightning_cli_example_prints_the_category(tmp_path):
    pytest.importorskip("jsonargparse")
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_cli.py"), "fit", "--config", "tiny.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "CSVLogger takes scalars only" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"{ROOT / 'examples' / 'lightning_cli.py'}:")
    assert ": MonitoringWarning: hdi-monitor: CSVLogger takes scalars only" in lines[0]


@pytest.mark.parametrize("category", [DiversityWarning, MonitoringWarning])
def test_our_category_is_printed_whatever_formatter_is_installed(category, tmp_path):
    """In-process: a user file whose path contains "lightning", with Lightning's formatter
    installed (importing Lightning installs it); our warning's line names its category, and the
    installed formatter is back in place afterwards."""
    import lightning.pytorch  # noqa: F401 - installs Lightning's warnings.formatwarning

    installed = warnings.formatwarning
    user = tmp_path / "my_lightning_project" / "train.py"
    user.parent.mkdir()
    user.write_text(
        "from hdi_monitor.monitor._warnings import warn\n\n\ndef fit(category):\n    warn('hdi-monitor: hello', category)\n"
    )
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)  # noqa: S102 - the file above
    printed: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):  # what Python's printer formats
        printed.append(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        namespace["fit"](category)
    assert len(printed) == 1
    assert printed[0].startswith(f"{user}:5: {category.__name__}: hdi-monitor: hello\n")
    assert warnings.formatwarning is installed
    # a warning that is not ours keeps the installed (Lightning's) format: no category for a "lightning" path
    assert "UserWarning" not in installed("x", UserWarning, str(user), 5)
