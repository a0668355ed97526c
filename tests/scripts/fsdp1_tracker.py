"""HDITracker on an FSDP1 (``FullyShardedDataParallel``) model, two gloo ranks on CPU: a script for the tests.

Usage: ``python tests/scripts/fsdp1_tracker.py OUTPUT.pt [--pg-timeout S]``.

Each rank builds the same seeded :func:`build_model` (embedding, a 2-layer ``nn.TransformerEncoder``
whose layers differ, a linear head), wraps it with FSDP1 (one unit per ``nn.TransformerEncoderLayer``
through ``ModuleWrapPolicy``, the root holding the embedding and head), once with
``use_orig_params=False`` and once with ``True``, and trains :data:`NUM_STEPS` steps of a plain loop
at ``lr=0`` (the weights never change) with ``HDITracker(model, fsdp_root=fsdp_model)`` measuring
every step (``capture()`` / ``step()``, ``max_tokens=None``, pictures every step). Rank ``r`` trains
on samples ``r, r + 2, ...`` of global batch ``s`` (:func:`global_batches`) at step ``s``, so the two
ranks together see exactly that global batch. The first measurement runs before the first forward
pass, i.e. before FSDP1's lazy initialisation.

``FullyShardedDataParallel.summon_full_params`` is wrapped to record how many FSDP units were
unsharded at the same time: open summon calls (the root and the other units counted apart), and
encoder-layer units whose flat parameters were full while a summon was open.

Rank 0 writes ``OUTPUT.pt``: per configuration (``"orig_params=False"``, ``"orig_params=True"``)
the layer names, per step the HDIs, effective heads and covariances of the measurement, both ranks'
effective heads, the principal-angle histograms of step 0, the summon statistics, the training
losses, and the error text of a tracker that was not told the root. :func:`build_model` and
:func:`global_batches` are importable so the test can rebuild the unsharded model and the batches.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

WORLD_SIZE = 2
NUM_STEPS = 3
GLOBAL_BATCH = 4
SEQ_LEN = 6
VOCAB = 32
D_MODEL, HEADS, FF, NUM_LAYERS = 16, 4, 32, 2
PROJECTIONS = ("query", "key", "value", "output")


class TinyEncoder(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, NUM_LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def build_model(seed: int = 0) -> TinyEncoder:
    """The same weights for the same seed; every encoder layer's attention different."""
    torch.manual_seed(seed)
    model = TinyEncoder()
    for layer in model.encoder.layers:  # nn.TransformerEncoder deep-copies one layer: make them differ
        layer.self_attn._reset_parameters()
        layer.self_attn.out_proj.reset_parameters()  # _reset_parameters leaves W_O alone
    return model


def global_batches(seed: int = 1) -> Tensor:
    """``(NUM_STEPS, GLOBAL_BATCH, SEQ_LEN)`` fixed token ids; step ``s`` trains on ``[s]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (NUM_STEPS, GLOBAL_BATCH, SEQ_LEN), generator=g)


# ------------------------------------------------------------------------------------ summon accounting

_SUMMONS: dict[str, Any] = {
    "open_units": 0,
    "open_root": 0,
    "peak_units": 0,
    "peak_total": 0,
    "peak_unsharded": 0,
    "calls": 0,
    "root": None,
}


def _unsharded_units(root: nn.Module) -> int:
    """How many non-root FSDP units hold their full flat parameter now (FSDP1 internals: a sharded
    flat parameter has the size of its local shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for unit in root.modules():
        handle = getattr(unit, "_handle", None)
        if isinstance(unit, FSDP) and unit is not root and handle is not None:
            count += handle.flat_param.numel() != handle.flat_param._local_shard.numel()
    return count


def _track_summons() -> Callable[[], None]:
    """Wrap ``summon_full_params`` to count the FSDP units that are unsharded at the same time: by
    the open summon calls, and by the units whose flat parameters are full while one is open.
    Returns what puts the original back."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original = FSDP.__dict__["summon_full_params"]
    real = FSDP.summon_full_params

    @contextlib.contextmanager
    def summon(module: nn.Module, *args: Any, **kwargs: Any):
        s = _SUMMONS
        key = "open_root" if module is s["root"] else "open_units"
        with real(module, *args, **kwargs):
            s[key] += 1
            s["calls"] += 1
            s["peak_units"] = max(s["peak_units"], s["open_units"])
            s["peak_total"] = max(s["peak_total"], s["open_units"] + s["open_root"])
            s["peak_unsharded"] = max(s["peak_unsharded"], _unsharded_units(s["root"]))
            try:
                yield
            finally:
                s[key] -= 1

    FSDP.summon_full_params = staticmethod(summon)  # type: ignore[method-assign]

    def undo() -> None:
        FSDP.summon_full_params = original  # type: ignore[method-assign]

    return undo


def _reset_summons(root: nn.Module) -> None:
    _SUMMONS.update(open_units=0, open_root=0, peak_units=0, peak_total=0, peak_unsharded=0, calls=0, root=root)


# --------------------------------------------------------------------------------------------- the run


def _one_config(rank: int, use_orig_params: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from hdi_monitor import HDITracker
    from hdi_monitor.monitor.sinks import MemorySink
    from hdi_monitor.monitor.tracker import MonitoringWarning

    fsdp = FSDP(
        build_model(),
        auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    _reset_summons(fsdp)

    # a tracker on the wrapped inner module (like Lightning's LightningModule) that is not told the root:
    # the measurement is dropped with a warning that says what to pass (and nothing is unsharded)
    blind = HDITracker(fsdp.module, every_n_steps=1, projections=PROJECTIONS, log_images_every_n_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MonitoringWarning)
        blind_result = blind.step()
    blind_warnings = [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]
    blind_calls = _SUMMONS["calls"]

    sink = MemorySink()
    tracker = HDITracker(
        fsdp.module,
        fsdp_root=fsdp,
        every_n_steps=1,
        projections=PROJECTIONS,
        max_tokens=None,
        log_images_every_n_steps=1,
        sinks=[sink],
        strict=True,
    )
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.0)
    batches = global_batches()
    steps, losses, calls_per_step = [], [], []
    for s in range(NUM_STEPS):
        local = batches[s][rank::WORLD_SIZE]
        before = _SUMMONS["calls"]
        with tracker.capture(local):
            loss = fsdp(local).float().logsumexp(-1).mean()
        loss.backward()
        measurement = tracker.step()
        optimizer.step()
        optimizer.zero_grad()
        calls_per_step.append(_SUMMONS["calls"] - before)
        losses.append(float(loss.detach()))
        assert measurement is not None, f"step {s} was not measured"
        effective = [lay.effective_heads for lay in measurement.report.layers]
        both: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(both, effective)
        steps.append(
            {
                "hdi": {lay.name: dict(lay.hdi) for lay in measurement.report.layers},
                "logit_bound": {lay.name: lay.logit_bound for lay in measurement.report.layers},
                "effective_heads": effective,
                "effective_heads_by_rank": both,
                "covariance": [lay.covariance for lay in measurement.report.layers],
                "num_tokens": [lay.num_tokens for lay in measurement.report.layers],
            }
        )
    tracker.flush()  # pictures and histograms are written by the background worker: wait for it
    histograms = {tag: values for step, tag, values in sink.histograms if step == 0}
    return {
        "layer_names": [lay.name for lay in tracker.layers],
        "steps": steps,
        "losses": losses,
        "histograms": histograms,
        "peak_units": _SUMMONS["peak_units"],
        "peak_total": _SUMMONS["peak_total"],
        "peak_unsharded": _SUMMONS["peak_unsharded"],
        "unsharded_after": _unsharded_units(fsdp),
        "summons_per_step": calls_per_step,
        "blind_result_is_none": blind_result is None,
        "blind_warnings": blind_warnings,
        "blind_summons": blind_calls,
    }


def scenario(output_path: str) -> None:
    """Both configurations on this rank of an initialised group of 2; rank 0 saves the results."""
    rank = dist.get_rank()
    undo = _track_summons()
    try:
        results = {f"orig_params={flag}": _one_config(rank, flag) for flag in (False, True)}
    finally:
        undo()
    if rank == 0:
        torch.save(results, output_path)


def _worker(rank: int, port: int, output_path: str, pg_timeout: float) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=pg_timeout),
    )
    try:
        scenario(output_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_barrier()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="seconds before a collective gives up")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(_free_port(), args.output, args.pg_timeout), nprocs=WORLD_SIZE, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
