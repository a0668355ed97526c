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
# one thread per pytest-xdist worker (two workers share CI's two cores), at most two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # and one for the interpreters the tests start (the CLI, the docs' blocks, the examples, the
    # quick studies): an OpenMP team of two beside the other worker spins on a busy core
    os.environ.setdefault("OMP_NUM_THREADS", "1")

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*GPU available but not used.*")


# ----------------------------------------------------------------------------- test tiers
# The folder sets the tier (tests/README.md). tests/unit/ is the quick loop, ``pytest -m "not slow"``;
# tests/integration/ (end-to-end runs, subprocesses, the documentation pages) and tests/distributed/
# (several processes) are the slow tier, which CI runs with everything else (``pytest`` without ``-m``).
# A test on the gloo rank pools is a distributed test wherever it sits. No test ids are listed here.
_SLOW_FOLDERS = ("integration", "distributed")
_POOLS = ("gloo2", "gloo4")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier by folder, and the tests on the rank pools wherever they sit."""
    here = Path(__file__).parent
    for item in items:
        try:
            top = item.path.relative_to(here).parts[0]
        except ValueError:
            continue
        if top in _SLOW_FOLDERS or any(pool in getattr(item, "fixturenames", ()) for pool in _POOLS):
            item.add_marker(pytest.mark.slow)


def _uses_pools(path: Path) -> bool:
    """Whether the test file at ``path`` names a rank pool fixture."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    return any(pool in text for pool in _POOLS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n 2``), one work unit per test file, so a file's module fixtures (a
    trained 24-layer model, the distributed runs) are built once, and one unit for every file that
    uses the rank pools, so each pool starts once, in one worker. (xdist 3.8's own ``loadgroup``
    cannot regroup under pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class FilesAndPools(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "rank pools" if _uses_pools(root / path) else path

    return FilesAndPools(config, log)


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
