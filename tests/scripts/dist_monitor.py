"""HDIMonitor under Lightning's distributed strategies, on CPU (gloo): a script for the tests.

Run it as a script, never inside pytest (``strategy="ddp"`` re-runs the command that started it)::

    python tests/scripts/dist_monitor.py --strategy ddp   --out DIR
    python tests/scripts/dist_monitor.py --strategy fsdp2 --out DIR   # ModelParallelStrategy + fully_shard
    python tests/scripts/dist_monitor.py --strategy single --out DIR  # one process, the whole global batch

Every strategy trains the same tiny causal :class:`~hdi_monitor.contrib.demo.CharLM` (seeded, so every rank
builds the same weights; ``lr=0``, so the weights never change) on the same fixed global batches:
``--strategy single`` takes global batch ``s`` at step ``s`` in one process; with two ranks a
``DistributedSampler(shuffle=False)`` hands rank ``r`` the samples ``r, r + 2, ...`` of it, so the
two ranks together see exactly that global batch (Lightning's automatic sampler would shuffle).
``HDIMonitor(max_tokens=None)`` keeps every token, and a ``TensorBoardLogger`` under
``OUT/tb/version_0`` receives what rank 0 logs.

Outputs under ``--out``:

* ``rank{R}.json`` for each rank that finished: the input tokens it trained on at each measured
  step, its monitor history, the steps it measured, the per-layer token counts of its last
  measurement, the ``MonitoringWarning`` messages it saw, whether the weights were DTensors and,
  under fsdp2, how many ``DTensor.full_tensor()`` gathers ran and the most encoder layers whose
  gathered weights were alive at the same time;
* ``measurement.pt`` (rank 0): per measured step and layer, the covariance, effective heads and
  HDIs of the step's report.

Fault injection (tests of "a failure on one rank must not hang the others"): ``--fail-rank R
--fail-step S --fail-where report|hook|compute`` makes monitoring raise on rank R at step S, either while
the weights are measured (``compute_report``) or inside the head-output hook during the forward
pass. ``--pg-timeout`` bounds every collective, so a desynchronised run errors out instead of
hanging.

The model and data builders (:func:`build_model`, :func:`global_batches`) are importable so the
tests can rebuild the unsharded model and the global batches in their own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WORLD_SIZE = 2
PROJECTIONS = ("query", "key", "value", "output")
MODEL_KW = {"d_model": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16, "lr": 0.0}
VOCAB = 128


def build_model(seed: int = 0, *, fsdp2: bool = False):
    """The tiny CharLM every run trains (same weights for the same seed; every layer different)."""
    from hdi_monitor.contrib.demo import CharLM

    torch.manual_seed(seed)
    cls = _fsdp2_class() if fsdp2 else CharLM
    model = cls(**MODEL_KW)
    for layer in model.encoder.layers:  # nn.TransformerEncoder deep-copies one layer: make them differ
        layer.self_attn._reset_parameters()
    return model


def _fsdp2_class():
    from hdi_monitor.contrib.demo import CharLM

    class FSDP2CharLM(CharLM):
        """CharLM whose encoder layers, then the root, are sharded with FSDP2 ``fully_shard``."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.encoder.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    return FSDP2CharLM


def global_batches(num_steps: int, global_batch: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of ``num_steps * global_batch`` fixed token windows, in step order."""
    seq_len = MODEL_KW["seq_len"]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_steps * global_batch, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------------------------ fault injection

_FAULT: dict[str, Any] = {"rank": None, "step": None, "where": None, "now": None, "me": None}


def _fault_due(where: str) -> bool:
    f = _FAULT
    return f["where"] == where and f["me"] == f["rank"] and f["now"] == f["step"]


def _install_faults() -> None:
    """Wrap the monitor's weight measurement and head-output hook so they raise when due (until `_undo`)."""
    import hdi_monitor.measure.capture as capture
    import hdi_monitor.measure.step as tracker  # where the measured step reads weights and computes results

    real_report, real_output = tracker.compute_report, capture._on_output
    real_compute = tracker.compute_results

    def compute_report(*args: Any, **kwargs: Any):
        if _fault_due("report"):
            raise RuntimeError(f"injected failure in compute_report on rank {_FAULT['me']}")
        return real_report(*args, **kwargs)

    def on_output(*args: Any, **kwargs: Any) -> None:
        if _fault_due("hook"):
            raise RuntimeError(f"injected failure in the head-output hook on rank {_FAULT['me']}")
        real_output(*args, **kwargs)

    def compute(*args: Any, **kwargs: Any):
        if _fault_due("compute"):
            raise RuntimeError(f"injected failure in the covariance computation on rank {_FAULT['me']}")
        return real_compute(*args, **kwargs)

    tracker.compute_report = compute_report
    capture._on_output = on_output
    tracker.compute_results = compute

    def undo() -> None:
        tracker.compute_report, capture._on_output, tracker.compute_results = real_report, real_output, real_compute

    _UNDO.append(undo)


def _fault_clock():
    """A callback (listed before HDIMonitor) that tells the injected faults the rank and step."""
    import lightning.pytorch as pl

    class FaultClock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            _FAULT["me"] = trainer.global_rank
            _FAULT["now"] = trainer.fit_loop.epoch_loop._batches_that_stepped

    return FaultClock()


# ------------------------------------------------------------------------------ gather accounting

_GATHERS: dict[str, Any] = {"count": 0, "peak_layers": 0, "alive": []}


def _track_gathers(model: torch.nn.Module) -> None:
    """Count ``DTensor.full_tensor()`` calls and the most encoder layers whose gathered weights are
    alive at once (a gathered tensor stays alive while any view of it does; garbage in reference
    cycles is collected first, so the count is what the code holds, independent of GC timing)."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor

    real = DTensor.full_tensor
    names: dict[tuple, str] = {}

    def key(t: Any) -> tuple:  # a detached DTensor shares its parameter's local shard
        local = t.to_local()
        return (local.data_ptr(), tuple(local.shape))

    def layer_of(t: Any) -> str | None:
        if key(t) not in names:
            names.clear()
            for name, p in model.named_parameters():
                parts = name.split(".")
                if parts[:2] == ["encoder", "layers"] and isinstance(p, DTensor):
                    names[key(p)] = ".".join(parts[:3])
        return names.get(key(t))

    def full_tensor(self, *args: Any, **kwargs: Any) -> Tensor:
        out = real(self, *args, **kwargs)
        layer = layer_of(self)
        _GATHERS["count"] += 1
        if layer is not None:
            gc.collect()  # count what the code still references, not garbage waiting for the collector
            alive = [(n, r) for n, r in _GATHERS["alive"] if r() is not None]
            root = out if out._base is None else out._base  # views of ``out`` keep its root alive
            alive.append((layer, weakref.ref(root)))
            _GATHERS["alive"] = alive
            _GATHERS["peak_layers"] = max(_GATHERS["peak_layers"], len({n for n, _ in alive}))
        return out

    DTensor.full_tensor = full_tensor

    def undo() -> None:
        DTensor.full_tensor = real

    _UNDO.append(undo)


#: What `run` put in place that must come off when it returns (a persistent rank runs other scenarios next).
_UNDO: list[Any] = []


def _undo() -> None:
    while _UNDO:
        _UNDO.pop()()


# ----------------------------------------------------------------------------------------- the run


def _strategy(name: str, timeout_s: float):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    timeout = timedelta(seconds=timeout_s)
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    if name == "fsdp2":
        return ModelParallelStrategy(
            data_parallel_size=WORLD_SIZE, tensor_parallel_size=1, process_group_backend="gloo", timeout=timeout
        )
    return "auto"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train with HDIMonitor under ``args.strategy``; write the outputs; return this rank's summary."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from hdi_monitor import HDIMonitor
    from hdi_monitor.monitor.tracker import MonitoringWarning

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    distributed = args.strategy != "single"
    devices = WORLD_SIZE if distributed else 1
    per_rank = args.global_batch // devices
    x, y = global_batches(args.steps, args.global_batch, seed=args.data_seed)

    class Data(pl.LightningDataModule):
        """Rank r takes samples r, r + world_size, ... in order (Lightning's own distributed sampler
        always shuffles training data, so it is switched off and this one is used instead)."""

        def train_dataloader(self) -> DataLoader:
            dataset = TensorDataset(x, y)
            sampler = DistributedSampler(
                dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
            return DataLoader(dataset, batch_size=per_rank, sampler=sampler)

    _FAULT.update(rank=None, step=None, where=None, now=None, me=None)
    _GATHERS.update(count=0, peak_layers=0, alive=[])
    if args.fail_rank is not None:
        _FAULT.update(rank=args.fail_rank, step=args.fail_step, where=args.fail_where)
        _install_faults()

    pl.seed_everything(args.seed, verbose=False)
    model = build_model(args.seed, fsdp2=args.strategy == "fsdp2")
    if args.strategy == "fsdp2":
        _track_gathers(model)
    monitor = HDIMonitor(
        every_n_steps=args.every,
        log_images_every_n_steps=0,
        max_tokens=None,
        detector=None,
        strict=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(args.strategy, args.pg_timeout),
        max_steps=args.steps,
        logger=TensorBoardLogger(str(out), name="tb", version=0),
        callbacks=[_fault_clock(), monitor],
        log_every_n_steps=1,
        limit_val_batches=0,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    measurements: dict[int, list[dict[str, Any]]] = {}
    batches: dict[int, list] = {}

    class Keep(pl.Callback):  # record each measured step's batch and report (after HDIMonitor's work)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            if step % args.every == 0:
                batches[step] = batch[0].tolist()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = monitor.last_measurement
            if m is not None and m.step not in measurements:
                measurements[m.step] = [
                    {
                        "name": lay.name,
                        "hdi": dict(lay.hdi),
                        "covariance": lay.covariance,
                        "effective_heads": lay.effective_heads,
                    }
                    for lay in m.report.layers
                ]

    trainer.callbacks.append(Keep())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MonitoringWarning)
            trainer.fit(model, datamodule=Data())
    finally:
        _undo()

    rank = trainer.global_rank
    dtensor = False
    for p in model.parameters():
        dtensor = hasattr(p, "full_tensor")
        break
    summary = {
        "rank": rank,
        "world_size": trainer.world_size,
        "strategy": args.strategy,
        "measured_steps": sorted(measurements),
        "batches": batches,
        "history": list(monitor.history),  # rows as dicts (the history is a bounded columnar store)
        "token_counts": monitor.tracker.last_token_counts if monitor.tracker is not None else [],
        "monitoring_warnings": [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)],
        "dtensor_parameters": dtensor,
        "gathers": _GATHERS["count"],
        "peak_gathered_layers": _GATHERS["peak_layers"],
        "finished": True,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    if rank == 0:
        torch.save(measurements, out / "measurement.pt")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--strategy", choices=("ddp", "fsdp2", "single"), required=True)
    p.add_argument("--out", required=True, help="output folder (event files, rank*.json, measurement.pt)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--every", type=int, default=2, help="HDIMonitor every_n_steps (default 2)")
    p.add_argument("--global-batch", type=int, default=4, help="samples per step over all ranks (even)")
    p.add_argument("--seed", type=int, default=0, help="model seed")
    p.add_argument("--data-seed", type=int, default=1, help="data seed")
    p.add_argument("--fail-rank", type=int, default=None, help="inject a monitoring failure on this rank")
    p.add_argument("--fail-step", type=int, default=0, help="... at this optimizer step")
    p.add_argument("--fail-where", choices=("report", "hook", "compute"), default="report", help="... in this place")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout in seconds")
    args = p.parse_args(argv)
    if args.global_batch % WORLD_SIZE:
        p.error(f"--global-batch must be a multiple of {WORLD_SIZE}")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
