"""Two gloo ranks each accumulate their own queries; `sync_kernel_accumulators` must give the all-rank state.

Usage: ``python kernel_sync.py OUT_DIR``. Rank r uses the seed-r tensors of `rank_inputs`; each rank
writes ``rank{r}.pt`` with its synced results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hdi_monitor.measure.accumulators import sync_accumulators as sync_kernel_accumulators
from hdi_monitor.measure.kernel import KernelStatsAccumulator


def rank_inputs(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers' (q, k) for one rank: 4 heads, 2 key heads, rank-dependent lengths and values."""
    g = torch.Generator().manual_seed(rank)
    t = 5 + 3 * rank
    return [(torch.randn(2, 4, t, 8, generator=g) * (1 + rank), torch.randn(2, 2, t, 8, generator=g)) for _ in range(2)]


def run(rank: int, out: str) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2)
    scenario(out)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    exit_after_barrier()


def scenario(out: str) -> None:
    """This rank's accumulators, synced, saved to ``OUT/rank{r}.pt`` (in an initialised group of 2)."""
    rank = dist.get_rank()
    accs = [KernelStatsAccumulator(4) for _ in range(3)]  # the third sees no query on either rank
    for acc, (q, k) in zip(accs, rank_inputs(rank), strict=False):
        acc.update(q, k, is_causal=True)
    sync_kernel_accumulators(accs)
    res = [acc.compute() for acc in accs]
    torch.save([(r.entropy, r.uniform_entropy, r.max_logit, r.num_queries) for r in res], f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    mp.spawn(run, args=(str(Path(sys.argv[1]).resolve()),), nprocs=2)
