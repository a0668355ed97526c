"""What HDIMonitor costs a training run: the whole ``fit``, and the CPU of its pictures.

Model: causal 4-layer, 256-wide, 8-head encoder (``hdi_monitor.contrib.demo.CharLM``), sequence
length 64, batch 16, AdamW, on the CPU (``--accelerator gpu``: the model on the GPU).

1. **Whole fit.** ``trainer.fit`` timed from the call to its return (Trainer set-up, every step and
   the end of fit: the monitor's ``close`` draws the last measured step's pictures and waits for the
   image worker), three ways, interleaved round by round: no monitor; ``HDIMonitor(every_n_steps=50)``
   with its defaults (all four projections, head outputs, early warnings, pictures every 500 steps:
   here the image step 0 and the last measured step, drawn at the end), logging to TensorBoard;
   and the same monitor with ``log_images_every_n_steps=0``. Wall time and process CPU time
   (all threads).
2. **CPU of an image step.** ``HDITracker`` on a plain training loop (forward, backward, AdamW),
   every step measured, 10 measured steps with pictures at every one against 10 without, to a
   ``SummaryWriter``, ``image_queue_size=64`` (no image step dropped; the run checks that all 10 were
   written). Process CPU time (``time.process_time``: every thread, the image worker's included)
   from the first step through ``close()``.

The ratios are within one run on one machine, so its speed cancels out, but not its load: on a
shared machine they drift (see the results file's header for the load average during the run).

    PYTHONPATH=. python benchmarks/bench_overhead.py                       # both, writes the results file
    PYTHONPATH=. python benchmarks/bench_overhead.py --rounds 5 --steps 150
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from hdi_monitor import HDIMonitor
from hdi_monitor.contrib.demo import CharDataModule, CharLM
from hdi_monitor.monitor.tracker import HDITracker

warnings.filterwarnings("ignore")
OUT = Path(__file__).parent / "results" / "overhead.md"
MODEL = {"d_model": 256, "num_heads": 8, "num_layers": 4, "seq_len": 64}
BATCH = 16


def fit(steps: int, monitor: str, log_root: str, seed: int, accelerator: str = "cpu") -> tuple[float, float]:
    """One ``trainer.fit``: wall and process CPU seconds. ``monitor``: "none", "defaults", "no images"."""
    pl.seed_everything(seed, verbose=False)
    callbacks: list[pl.Callback] = []
    if monitor == "defaults":
        callbacks.append(HDIMonitor(every_n_steps=50))
    elif monitor == "no images":
        callbacks.append(HDIMonitor(every_n_steps=50, log_images_every_n_steps=0))
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(log_root, name=monitor.replace(" ", "_")),
        callbacks=callbacks,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
        accelerator=accelerator,
        devices=1,
    )
    model = CharLM(**MODEL)
    data = CharDataModule(seq_len=MODEL["seq_len"], batch_size=BATCH, train_samples=BATCH * (steps + 1))
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, datamodule=data)
    return time.perf_counter() - wall, time.process_time() - cpu


def image_steps(images: bool, steps: int, log_dir: str, seed: int, device: str = "cpu") -> tuple[float, float]:
    """``steps`` measured training steps (pictures at every one, or none) through ``close()``:
    process CPU and wall seconds. Raises if an image step was not written."""
    torch.manual_seed(seed)
    model = CharLM(**MODEL).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 128, (steps, BATCH, MODEL["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)
    writer = SummaryWriter(log_dir)
    tracker = HDITracker(
        model, every_n_steps=1, log_images_every_n_steps=1 if images else 0, writer=writer, image_queue_size=64
    )
    cpu, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        with tracker.capture(x):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        tracker.step()
        optimizer.step()
        optimizer.zero_grad()
    tracker.close()
    writer.flush()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    writer.close()
    if images:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(log_dir, size_guidance={"images": 0})
        acc.Reload()
        written = {e.step for tag in acc.Tags()["images"] for e in acc.Images(tag)}
        if written != set(range(steps)) or tracker.publisher.dropped:
            raise RuntimeError(f"image steps written {sorted(written)}, dropped {tracker.publisher.dropped}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each measurement")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of a whole fit")
    parser.add_argument("--image-steps", type=int, default=10, help="measured steps of the CPU-time runs")
    parser.add_argument("--skip-fit", action="store_true", help="only the CPU time of image steps")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu (default) or gpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    device = "cuda" if args.accelerator == "gpu" else "cpu"

    cpu: dict[bool, list[float]] = {True: [], False: []}
    wall_img: dict[bool, list[float]] = {True: [], False: []}
    kinds = ("none", "defaults", "no images")
    fits: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as root:
        image_steps(True, 2, f"{root}/warm", seed=99, device=device)  # warm-up: imports, fonts, allocator
        for r in range(args.rounds):
            for images in (True, False) if r % 2 == 0 else (False, True):
                c, w = image_steps(images, args.image_steps, f"{root}/img_{r}_{images}", seed=r, device=device)
                cpu[images].append(c)
                wall_img[images].append(w)
                print(f"round {r}: {'images' if images else 'no images'}: {c:.2f} s CPU, {w:.2f} s wall", flush=True)
        if not args.skip_fit:
            fit(20, "defaults", root, seed=123, accelerator=args.accelerator)  # warm-up
            for r in range(args.rounds):
                order = kinds if r % 2 == 0 else kinds[::-1]
                for kind in order:
                    fits[kind].append(fit(args.steps, kind, root, seed=r, accelerator=args.accelerator))
                    w, c = fits[kind][-1]
                    print(f"round {r}: fit, monitor {kind}: {w:.2f} s wall, {c:.2f} s CPU", flush=True)
    load_after = os.getloadavg()[0]

    ratio = statistics.median(cpu[True]) / statistics.median(cpu[False])
    per_image = (statistics.median(cpu[True]) - statistics.median(cpu[False])) / args.image_steps
    lines = [
        "# Overhead",
        "",
        f"`benchmarks/bench_overhead.py`: CharLM (4 layers, D = 256, 8 heads), batch {BATCH} x {MODEL['seq_len']}, "
        f"AdamW, {args.accelerator}"
        + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
        + f", CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}), "
        f"torch {torch.__version__}; {args.rounds} interleaved rounds, medians. Load average {load_before:.1f} "
        f"at the start, {load_after:.1f} at the end.",
        "",
        f"## CPU of image steps ({args.image_steps} measured steps, `HDITracker`, `image_queue_size=64`)",
        "",
        "| measured steps | process CPU, median (all threads, `close()` included) | wall, median | rounds (CPU) |",
        "|---|---:|---:|---|",
        f"| pictures at every one (all {args.image_steps} image steps written) | {statistics.median(cpu[True]):.2f} s "
        f"| {statistics.median(wall_img[True]):.2f} s | {', '.join(f'{x:.2f}' for x in cpu[True])} |",
        f"| no pictures | {statistics.median(cpu[False]):.2f} s | {statistics.median(wall_img[False]):.2f} s "
        f"| {', '.join(f'{x:.2f}' for x in cpu[False])} |",
        "",
        f"With / without pictures: **{ratio:.2f}x** process CPU (goal <= 1.5x); {1000 * per_image:.0f} ms of CPU per "
        "image step (drawing 9 PNGs, the principal angles and their histograms, writing them).",
    ]
    if args.skip_fit:
        lines += ["", "The whole `trainer.fit` was not timed in this run (`--skip-fit`)."]
    else:
        bare_w = statistics.median(w for w, _ in fits["none"])
        bare_c = statistics.median(c for _, c in fits["none"])
        lines += [
            "",
            f"## Whole `trainer.fit` ({args.steps} steps, TensorBoard logger; set-up and end of fit included)",
            "",
            "| monitor | wall, median | / no monitor | / no monitor, paired | process CPU, median | / no monitor "
            "| rounds (wall) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        names = {
            "none": "none",
            "defaults": "`HDIMonitor(every_n_steps=50)`, defaults (pictures at step 0 and at the end)",
            "no images": "the same, `log_images_every_n_steps=0`",
        }
        for kind in kinds:
            w = statistics.median(x for x, _ in fits[kind])
            c = statistics.median(x for _, x in fits[kind])
            # each round's fit against the same round's no-monitor fit (the machine's drift cancels)
            paired = statistics.median(x / b for (x, _), (b, _) in zip(fits[kind], fits["none"], strict=True))
            lines.append(
                f"| {names[kind]} | {w:.2f} s | {w / bare_w:.3f} | **{paired:.3f}** | {c:.2f} s | {c / bare_c:.3f} "
                f"| {', '.join(f'{x:.2f}' for x, _ in fits[kind])} |"
            )
        lines += [
            "",
            "Paired: the median over rounds of each round's wall time over that round's no-monitor fit. "
            "Goal for the defaults: <= 1.03x the whole fit without the monitor.",
        ]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)


if __name__ == "__main__":
    main()
