"""Importing the package, with any extra's integration, prints nothing (issue 31): no line from
hdi-monitor, and none from what an extra pulls in (bitsandbytes' "gemm_4bit_forward" line came with
``lightning[pytorch-extra]``, which the ``cli`` extra no longer installs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a fresh interpreter per import set

#: what each extra brings, imported as a user would: the package, then the integration or library.
IMPORTS = {
    "core": ("hdi_monitor", "hdi_monitor.integrations.lightning", "hdi_monitor.cli"),
    "hf": ("hdi_monitor", "hdi_monitor.integrations.hf_trainer", "transformers"),
    "cli": ("hdi_monitor", "lightning.pytorch.cli", "jsonargparse"),
    "advisor": ("hdi_monitor", "hdi_monitor.contrib.allocation", "scipy"),
    "loggers": ("hdi_monitor", "hdi_monitor.integrations.loggers"),
    "all": (
        "hdi_monitor",
        "hdi_monitor.integrations.lightning",
        "hdi_monitor.integrations.hf_trainer",
        "hdi_monitor.integrations.loggers",
        "hdi_monitor.contrib.allocation",
        "hdi_monitor.contrib.demo",
        "lightning.pytorch.cli",
        "transformers",
    ),
}


@pytest.mark.parametrize("extra", sorted(IMPORTS))
def test_importing_prints_nothing(extra):
    modules = IMPORTS[extra]
    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")
    code = "; ".join(f"import {m}" for m in modules)
    # the user's environment: no test-only warning filters, default warning display
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONWARNINGS", "PYTEST"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout, proc.stderr) == ("", ""), f"`python -c '{code}'` printed:\n{proc.stdout}{proc.stderr}"
