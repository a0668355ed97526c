"""Head-diversity monitoring with the Hugging Face ``Trainer`` (from a checkout: ``pip install -e '.[hf]'``).

A small GPT-2 built from a config (no download) learns the source of a few standard-library modules,
one byte per token. With ``report_to="tensorboard"``, ``HDITrainerCallback`` writes through the
Trainer's own TensorBoard writer, so the loss and the HDI curves are one run on one step axis (the
Trainer's ``global_step``)::

    python examples/hf_trainer.py --out runs/hf --steps 200
    tensorboard --logdir runs/hf
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hdi_monitor.contrib.demo import stdlib_text
from hdi_monitor.integrations import HDITrainerCallback


class ByteWindows(Dataset):
    """Random windows of standard-library source, as GPT-2 language-modelling examples."""

    def __init__(self, seq_len: int = 64, size: int = 4096, seed: int = 0) -> None:
        self.data = torch.tensor(list(stdlib_text(200_000).encode("ascii")), dtype=torch.long)
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - seq_len, (size,), generator=g)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        ids = self.data[s : s + self.seq_len]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train(
    out_dir: str | Path = "runs/hf",
    *,
    steps: int = 200,
    every: int = 10,
    images_every: int = 50,
    d_model: int = 64,
    num_heads: int = 4,
    num_layers: int = 2,
    seq_len: int = 64,
    batch_size: int = 16,
    grad_accum: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
) -> HDITrainerCallback:
    """Train a small GPT-2 for ``steps`` optimizer updates; returns the callback (its ``history``)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=128,
        n_positions=seq_len,
        n_embd=d_model,
        n_layer=num_layers,
        n_head=num_heads,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    monitor = HDITrainerCallback(every_n_steps=every, log_images_every_n_steps=images_every)
    args = TrainingArguments(
        output_dir=str(out_dir),  # TensorBoard run: <out_dir>/runs/<date>_<host>
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        learning_rate=lr,
        logging_steps=every,  # loss points on the same steps as the HDI points
        save_strategy="no",
        report_to="tensorboard",  # the callback writes through this writer: one run with the loss
        use_cpu=not torch.cuda.is_available(),
        seed=seed,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ByteWindows(seq_len, seed=seed),
        callbacks=[monitor],
    )
    trainer.train()
    return monitor


def main(argv: Sequence[str] | None = None) -> HDITrainerCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--images-every", type=int, default=50)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args(argv)
    monitor = train(
        args.out, steps=args.steps, every=args.every, images_every=args.images_every, grad_accum=args.grad_accum
    )
    last = monitor.history[-1]
    print(
        f"{len(monitor.history)} measurements; last (step {last['step']:.0f}): mean key HDI {last.get('hdi/key/mean', float('nan')):.3f}"
    )
    print(f"tensorboard --logdir {args.out}")
    return monitor


if __name__ == "__main__":
    main()
