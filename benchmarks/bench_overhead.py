"""Training overhead of HDIMonitor: the same run with and without the callback, interleaved.

Model: causal 4-layer, 256-wide, 8-head encoder (``hdi_monitor.contrib.demo.CharLM``), sequence length 64,
batch 16, AdamW. Monitor: ``HDIMonitor(every_n_steps=50)`` with its defaults (all four projections,
activations on, early warnings on, pictures every 500 steps), logging to TensorBoard.

Each round trains a fresh model for ``--steps`` optimizer steps twice, once bare and once
monitored, in alternating order; the time counted is from ``on_train_start`` to ``on_train_end``
(no Trainer set-up). Reported: the ratio of total monitored to total bare time, the per-round
ratios, and the direct cost of one measurement (time inside the monitor's hooks per measured step).

    python benchmarks/bench_overhead.py --rounds 3 --steps 250 --out benchmarks/results/overhead.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from hdi_monitor import HDIMonitor
from hdi_monitor.contrib.demo import CharDataModule, CharLM

warnings.filterwarnings("ignore")


class _Clock(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


class _TimedMonitor(HDIMonitor):
    """HDIMonitor that also adds up the time spent inside its own hooks."""

    spent = 0.0

    def _timed(name):  # noqa: N805 - helper that builds methods
        def method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return getattr(HDIMonitor, name)(self, *args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0

        return method

    on_train_batch_start = _timed("on_train_batch_start")
    on_before_backward = _timed("on_before_backward")
    on_train_batch_end = _timed("on_train_batch_end")


def run(steps: int, monitored: bool, log_root: str, seed: int, accelerator: str = "cpu") -> tuple[float, float, int]:
    pl.seed_everything(seed, verbose=False)
    clock = _Clock()
    callbacks: list[pl.Callback] = [clock]
    monitor = None
    if monitored:
        monitor = _TimedMonitor(every_n_steps=50)
        callbacks.append(monitor)
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(log_root, name="monitored" if monitored else "bare"),
        callbacks=callbacks,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
        accelerator=accelerator,
        devices=1,
    )
    model = CharLM(d_model=256, num_heads=8, num_layers=4, seq_len=64)
    trainer.fit(model, datamodule=CharDataModule(seq_len=64, batch_size=16, train_samples=16 * (steps + 1)))
    measurements = len(monitor.history) if monitor else 0
    return clock.seconds, (monitor.spent if monitor else 0.0), measurements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu (default) or gpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bare, monitored, spent, counts = [], [], [], []
    with tempfile.TemporaryDirectory() as root:
        run(20, True, root, seed=123, accelerator=args.accelerator)  # warm-up (imports, allocator, TensorBoard writer)
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for mon in order:
                seconds, inside, n = run(args.steps, mon, root, seed=r, accelerator=args.accelerator)
                (monitored if mon else bare).append(seconds)
                if mon:
                    spent.append(inside)
                    counts.append(n)

    ratio = sum(monitored) / sum(bare)
    per_round = [m / b for m, b in zip(monitored, bare)]
    step_ms = 1000 * statistics.median(bare) / args.steps
    per_measure_ms = 1000 * sum(spent) / max(sum(counts), 1)
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"accelerator {args.accelerator}" + (f" ({torch.cuda.get_device_name()})" if args.accelerator == "gpu" else ""),
        "",
        "| quantity | value |",
        "|---|---|",
        f"| bare step time (median run) | {step_ms:.1f} ms |",
        f"| monitored / bare, total time ({args.rounds} interleaved rounds of {args.steps} steps) | **{ratio:.3f}** (goal <= 1.03) |",
        f"| per-round ratios | {', '.join(f'{x:.3f}' for x in per_round)} |",
        f"| time inside the monitor per measured step (4 projections, activations, TensorBoard) | {per_measure_ms:.1f} ms |",
        f"| implied overhead at every_n_steps=50 | {per_measure_ms / (50 * step_ms):.2%} |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
