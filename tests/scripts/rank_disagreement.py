"""Two gloo ranks whose monitors disagree: a script for tests/unit/test_robustness_round3.py.

    python tests/scripts/rank_disagreement.py OUT.json

Spawns 2 processes (gloo, CPU). Each builds the same two-layer encoder and, for each case, an
``HDITracker`` whose settings differ between the ranks, and calls ``setup()``: the agreement
check (one ``all_gather``) must raise on both ranks, naming the setting. A last case with equal
settings must pass and measure one step. Every collective is bounded by a 60 s timeout, so a
deadlock fails the test instead of hanging it. Rank r writes ``{case: error text or "ok"}`` to
``OUT.json.r``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

CASES = {
    # layers of the same shape, but not the same ones: both ranks used to log one summed value
    "same shape, other layers": ({"layers": r"layers\.0\.self_attn$"}, {"layers": r"layers\.1\.self_attn$"}),
    # a different schedule deadlocked until the process group timed out
    "every_n_steps": ({"every_n_steps": 10}, {"every_n_steps": 20}),
    # a different number of layers aborted inside gloo
    "number of layers": ({}, {"layers": r"layers\.0\.self_attn$"}),
    # a layers filter that matches nothing on one rank: that rank raised before the agreement
    # check, and the other waited in it until the process group timed out
    "no layer on rank 1": ({}, {"layers": r"nothing_is_called_this$"}),
    "agree": ({}, {}),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def run(rank: int, port: int, out: str) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    scenario(out)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    exit_after_barrier()


def scenario(out: str) -> None:
    """Every case on this rank of an initialised group of 2; writes ``OUT.r``."""
    from hdi_monitor import HDITracker

    rank = dist.get_rank()

    results = {}
    for name, settings in CASES.items():
        kw = {"every_n_steps": 10, "log_images_every_n_steps": 0, "strict": True, **settings[rank]}
        tracker = HDITracker(model(), **kw)
        try:
            tracker.setup()
            x = torch.randn(2, 5, 16)
            with tracker.capture(x):
                tracker.model(x)
            m = tracker.step()
            results[name] = f"ok {len(m.report.layers) if m else 0}"
        except ValueError as err:
            results[name] = str(err)
    with open(f"{out}.{rank}", "w", encoding="utf-8") as f:
        json.dump(results, f)


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, sys.argv[1]), nprocs=2, join=True)


if __name__ == "__main__":
    main()
