"""``hdi-monitor demo``: train a small character-level transformer with HDIMonitor (the README's main job)."""

from __future__ import annotations

import argparse
import sys

from hdi_monitor.cli._common import CLIError

HELP = "train a small character-level transformer with HDIMonitor and write TensorBoard dashboards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs", help="TensorBoard log root (default: runs)")
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps (default: 1200)")
    parser.add_argument("--every", type=int, default=25, help="measure every N steps (default: 25)")
    parser.add_argument("--images-every", type=int, default=200, help="heatmaps every N steps (default: 200)")
    parser.add_argument("--d-model", type=int, default=128, help="model width (default: 128)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads per layer (default: 8)")
    parser.add_argument("--layers", type=int, default=4, help="encoder layers (default: 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


#: `run_demo`'s parameter -> the command-line option that gives it.
_RUN_DEMO = {
    "max_steps": "steps",
    "every_n_steps": "every",
    "log_images_every_n_steps": "images_every",
    "d_model": "d_model",
    "num_heads": "heads",
    "num_layers": "layers",
    "seed": "seed",
}


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "every", "d_model", "heads", "layers"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise CLIError(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    from hdi_monitor.contrib.demo import run_demo

    given = {parameter: getattr(args, option) for parameter, option in _RUN_DEMO.items()}
    log_dir = run_demo(args.out, **given, progress=not args.no_progress)
    print(f"TensorBoard logs written to {log_dir}")
    print(
        f"Open the dashboards with:  tensorboard --logdir {args.out}   (Custom Scalars tab: one chart per projection)"
    )
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    if ckpt.is_file():
        print(f"Report on the trained weights:  hdi-monitor report {ckpt} --module hdi_monitor.contrib.demo.CharLM")
    else:  # never silently promise a file that is not there
        print(f"warning: no checkpoint at {ckpt}", file=sys.stderr)
    return 0
