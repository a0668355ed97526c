"""Two gloo ranks train ``torch.compile(DDP(net))`` without and with the monitor (issue 30 item 1).

Usage: ``python compile_ddp.py OUT_DIR [--unused] [--kernel-stats]``. Both ranks build the same small
model (two blocks of custom attention through ``F.scaled_dot_product_attention``, dropout 0.2; with
``--unused``, an auxiliary head whose output the loss never uses, under DDP's default
``find_unused_parameters=False``) and train it for 5 SGD steps on their own batches
through ``torch.compile(DDP(net), backend="aot_eager")``, three times in one process group, from the
same seeds: ``plain`` (no monitor), ``net`` (``HDITracker(net)``: the compiled wrapper is one the
monitor was not given) and ``wrapper`` (``HDITracker(compiled)``: the wrapper the loop calls, which
is what the monitor's warning advises). Each rank writes ``OUT_DIR/rank{r}.pt``: per run, Dynamo's
graph and graph-break counts (``torch._dynamo.utils.counters``), every trained weight, the
monitor's ``MonitoringWarning`` texts and its history rows.
"""

from __future__ import annotations

import argparse
import os
import socket
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
STEPS, EVERY, BATCH, SEQ, VOCAB, WIDTH, HEADS = 5, 2, 4, 8, 64, 32, 4
RUNS = ("plain", "net", "wrapper")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, HEADS, -1).transpose(1, 2) for lin in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.drop = nn.Dropout(0.2)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm(x)))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.aux = nn.Linear(WIDTH, 2) if unused else None  # an output the loss never uses

    def forward(self, tokens: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = x @ self.embed.weight.T
        return logits if self.aux is None else (logits, self.aux(x))


def spec():
    from hdi_monitor import AttentionSpec

    return AttentionSpec(
        modules=r"(.*\.)?blocks\.\d+\.attn", query="wq", key="wk", value="wv", output="wo", num_heads=4
    )


def batches(rank: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(run: str, rank: int, unused: bool, kernel_stats: bool) -> dict:
    from torch._dynamo.utils import counters

    from hdi_monitor import HDITracker
    from hdi_monitor.exceptions import MonitoringWarning

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net(unused)
    compiled = torch.compile(DDP(net), backend="aot_eager")
    watched = {"plain": None, "net": net, "wrapper": compiled}[run]
    tracker = None
    if watched is not None:
        tracker = HDITracker(
            watched,
            every_n_steps=EVERY,
            spec=spec(),
            log_images_every_n_steps=0,
            max_tokens=None,
            kernel_stats=kernel_stats,
            detector=None,
            strict=True,
        )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(rank):
            with tracker.capture(x) if tracker is not None else torch.enable_grad():
                out = compiled(x)
                logits = out[0] if isinstance(out, tuple) else out
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            if tracker is not None:
                tracker.step()
            optimizer.step()
            optimizer.zero_grad()
        if tracker is not None:
            tracker.close()
    result = {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": sum(counters["graph_break"].values()),
        "weights": {n: p.detach().clone() for n, p in net.named_parameters()},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)],
        "history": [dict(row) for row in tracker.history] if tracker is not None else [],
        "layers": [la.name for la in tracker.layers] if tracker is not None else [],
    }
    torch._dynamo.reset()
    return result


def scenario(out: str, unused: bool = False, kernel_stats: bool = False) -> None:
    """The three runs on this rank of an initialised group of 2; writes ``OUT/rank{r}.pt``."""
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for run in RUNS:
        try:
            results[run] = train(run, rank, unused, kernel_stats)
        except Exception as err:  # noqa: BLE001 - recorded: the test names the run that failed
            results[run] = {"error": f"{type(err).__name__}: {err}"}
            dist.barrier()  # a rank whose run failed waits for the other before the next run
    torch.save(results, Path(out) / f"rank{rank}.pt")


def worker(rank: int, port: int, out: str, unused: bool, kernel_stats: bool) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        scenario(out, unused, kernel_stats)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--unused", action="store_true")
    parser.add_argument("--kernel-stats", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.out, args.unused, args.kernel_stats), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
