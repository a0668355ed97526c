"""Two gloo ranks measure kernel statistics with `HDITracker` on their half of one batch.

Usage: ``python kernel_tracker_ddp.py OUT_DIR``. Both ranks build the same tiny Llama (RoPE, GQA)
and each measures its rows of `full_batch` (rank 0: rows 0-1, rank 1: rows 2-3) with
``kernel_stats=True, max_tokens=None``; each writes ``rank{r}.pt`` with every layer's per-head
entropy, uniform level, maximum logit and query count, as the tracker recorded them (after the sum
over the data-parallel ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from hdi_monitor import HDITracker


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def full_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 60, (4, 10), generator=g)
    am = torch.ones(4, 10, dtype=torch.long)
    am[1, :4] = 0
    am[2, 7:] = 0
    return {"input_ids": ids, "attention_mask": am}


def run(rank: int, out: str) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2)
    scenario(out)
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    exit_after_barrier()


def scenario(out: str) -> None:
    """This rank's half of the batch, measured and synced, saved to ``OUT/rank{r}.pt`` (in an initialised group)."""
    rank = dist.get_rank()
    batch = {k: v[2 * rank : 2 * rank + 2] for k, v in full_batch().items()}
    tracker = HDITracker(build(), kernel_stats=True, max_tokens=None, strict=True)
    m = tracker.measure(batch)
    assert m is not None
    rows = [
        (la.attention_entropy, la.attention_entropy_uniform, la.max_attention_logit, la.kernel_queries)
        for la in m.report.layers
    ]
    torch.save({"layers": rows, "scalars": dict(m.scalars)}, f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    mp.spawn(run, args=(str(Path(sys.argv[1]).resolve()),), nprocs=2)
