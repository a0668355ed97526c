"""Two-rank check of HeadCovarianceAccumulator.sync (gloo, CPU).

Usage: ``python ddp_covariance.py INPUTS.pt OUTPUT.pt``. ``INPUTS.pt`` holds ``batches`` (a list of
``(o, keep_mask or None)`` pairs), ``assignment`` (the rank that takes each batch), ``num_heads``,
``head_dim`` and ``w_out``. The script spawns two gloo processes on a free local port; each rank
accumulates only its own batches, calls ``sync()`` and ``compute()``. Rank 0 writes ``OUTPUT.pt``
with the synced results, each rank's local token count, and flags from the collective edge cases
(a rank with no tokens at all, a repeated sync, update after sync).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, inputs_path: str, output_path: str) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        scenario(inputs_path, output_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_barrier()


def scenario(inputs_path: str, output_path: str) -> None:
    """This rank's part of the accumulation and syncs (in an initialised group of 2); rank 0 saves the results."""
    from hdi_monitor.measure.covariance import HeadCovarianceAccumulator

    rank = dist.get_rank()
    data = torch.load(inputs_path, weights_only=False)
    h, d, w_out = data["num_heads"], data["head_dim"], data["w_out"]

    acc = HeadCovarianceAccumulator(h, d, w_out=w_out)
    for (o, keep), owner in zip(data["batches"], data["assignment"], strict=True):
        if owner == rank:
            acc.update(o, keep)
    local_tokens = acc.num_tokens
    acc.sync()
    result = acc.compute()
    tokens_after_first = acc.num_tokens
    acc.sync()  # repeated sync must not count the other rank twice
    repeat_equal = bool(torch.equal(acc.compute().covariance, result.covariance))
    try:
        acc.update(data["batches"][0][0])
        update_after_sync_raised = False
    except RuntimeError:
        update_after_sync_raised = True

    # Rank 1 sees nothing: its lazily created zero state must still take part.
    lonely = HeadCovarianceAccumulator(h, d, w_out=w_out)
    if rank == 0:
        for o, keep in data["batches"]:
            lonely.update(o, keep)
    lonely.sync()
    lonely_result = lonely.compute()

    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, local_tokens)
    if rank == 0:
        torch.save(
            {
                "covariance": result.covariance,
                "num_tokens": result.num_tokens,
                "tokens_after_first": tokens_after_first,
                "local_tokens": gathered,
                "repeat_equal": repeat_equal,
                "update_after_sync_raised": update_after_sync_raised,
                "lonely_covariance": lonely_result.covariance,
                "lonely_tokens": lonely_result.num_tokens,
            },
            output_path,
        )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    mp.spawn(_worker, args=(port, argv[0], argv[1]), nprocs=WORLD_SIZE, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
