"""Shared test helpers: the tiny Lightning model, its data and Trainer, and TensorBoard event-file readers."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from hdi_monitor import HDIMonitor
    from hdi_monitor.contrib.demo import CharLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*GPU available but not used.*")


# ----------------------------------------------------------------------------- test tiers
# The quick loop, ``pytest -m "not slow"``, keeps the math, the discovery tables, the detector and
# the config against their references, and the callbacks' main paths; the tests below (and those
# marked ``slow`` in their own files: subprocesses, several processes, logging backends) are the
# slow tier, which CI runs with everything else (``pytest`` without ``-m``).
_SLOW_FILES = {
    "test_compile_checkpoint.py": "torch.compile traces (Dynamo) of several models",
    "test_training_unchanged.py": "bit-for-bit training comparisons, with and without the monitor",
    "test_demo_cli.py": "the demo and the LightningCLI config, end to end",
    "test_allocation.py": "the allocation advisor (contrib): law fits and sweeps against their references",
}
_SLOW_FIXTURES = {
    ("test_dashboard.py", "deep"): "a 24-layer model trained for the depth checks",
    ("test_integrations.py", "hf_run"): "a Hugging Face Trainer run with gradient accumulation and references",
}
_SLOW_TESTS = {
    "test_integrations.py::test_example_hf_trainer_runs": "runs the example script",
    "test_integrations.py::test_example_plain_loop_runs": "runs the example script",
    "test_integrations.py::test_hf_default_tensorboard_report_is_one_run_with_the_loss": "two Trainer runs",
    "test_callback.py::test_runs_of_different_depth_share_every_custom_scalars_chart": "two Trainer runs",
    "test_kernel_tracker.py::test_two_data_parallel_ranks_sum_to_the_single_process_measurement": "2 gloo processes",
    "test_kernel_stats.py::test_sync_over_two_gloo_ranks": "2 gloo processes",
    "test_kernel_tracker.py::test_compiled_model_kernel_stats_from_the_side_forward": "a torch.compile trace",
    "test_kernel_tracker.py::test_hf_trainer_bit_identical_with_kernel_stats": "bit-for-bit Trainer runs",
    "test_kernel_tracker.py::test_lightning_training_bit_identical_with_kernel_stats_on_torch_mha": "bit-for-bit runs",
    "test_early_warning.py::test_resumed_run_warns_exactly_like_an_uninterrupted_one": "two Trainer runs",
    # doc pages whose run repeats a quick test (README quick start; test_callback's EarlyStopping)
    "test_docs.py::test_page_blocks_run[docs/index.md]": "the README quick start again",
    "test_docs.py::test_page_blocks_run[docs/early-warnings.md]": "test_callback's EarlyStopping run again",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier (see ``_SLOW_FILES``); markers only, so tests added elsewhere stay quick
    unless their file or id is listed here or they mark themselves."""
    for item in items:
        name = item.path.name
        test_id = f"{name}::{item.name.split('[')[0]}"
        full_id = f"{name}::{item.name}"
        fixtures = getattr(item, "fixturenames", ())
        if (
            name in _SLOW_FILES
            or test_id in _SLOW_TESTS
            or full_id in _SLOW_TESTS
            or any((name, f) in _SLOW_FIXTURES for f in fixtures)
        ):
            item.add_marker(pytest.mark.slow)


# ----------------------------------------------------------------------------- persistent gloo groups
# The multi-process tests run their scenarios on ranks started once per session (tests/helpers/pool.py)
# instead of launching a fresh group of interpreters per test.


@pytest.fixture(scope="session")
def gloo2(tmp_path_factory):
    """Two ranks in one gloo process group for the whole session (`helpers.pool.RankPool`)."""
    from helpers.pool import RankPool

    pool = RankPool(2, tmp_path_factory.mktemp("gloo2"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def gloo4(tmp_path_factory):
    """Four ranks in one gloo process group for the whole session (a 2 x 2 mesh)."""
    from helpers.pool import RankPool

    pool = RankPool(4, tmp_path_factory.mktemp("gloo4"))
    yield pool
    pool.close()


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


def tiny_lm(lr: float = 0.0) -> CharLM:
    """The demo's character LM at 2 layers of 4 heads (D = 32, d = 8), seeded: the same weights every call."""
    from hdi_monitor.contrib.demo import CharLM

    torch.manual_seed(0)
    return CharLM(d_model=32, num_heads=4, num_layers=2, seq_len=16, lr=lr)


def loader(n: int = 64, batch_size: int = 4) -> DataLoader:
    """``n`` fixed random sequences of 16 tokens (next-token targets), in order, ``batch_size`` a batch."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (n, 17), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=batch_size)


def trainer(tmp_path: Path, monitor: HDIMonitor | list, max_steps: int, logger: Any = None, **kw: Any) -> pl.Trainer:
    """A quiet CPU Trainer logging every step to TensorBoard under ``tmp_path`` (or to ``logger``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        max_steps=max_steps,
        logger=TensorBoardLogger(str(tmp_path), name="tb") if logger is None else logger,
        callbacks=monitor if isinstance(monitor, list) else [monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
        accelerator="cpu",
        **kw,
    )
