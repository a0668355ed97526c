"""Shared fixtures: tiny models and TensorBoard event-file readers."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*GPU available but not used.*")


def read_events(log_dir: str | Path):
    """An EventAccumulator over every event file under ``log_dir``, keeping everything (size_guidance 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(log_dir).rglob("events.out.tfevents.*"))
    assert files, f"no event files under {log_dir}"
    accs = []
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"images": 0, "histograms": 0, "scalars": 0, "tensors": 0})
        acc.Reload()
        accs.append(acc)
    return accs


def scalar_series(accs, tag: str) -> dict[int, float]:
    """step -> value of a scalar tag across event files."""
    out: dict[int, float] = {}
    for acc in accs:
        if tag in acc.Tags()["scalars"]:
            for ev in acc.Scalars(tag):
                assert ev.step not in out, f"duplicate point for {tag} at step {ev.step}"
                out[ev.step] = ev.value
    return out


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
