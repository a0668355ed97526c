"""What the weight-only signals cost on a measured step (issue 33).

Model: the overhead benchmark's causal 4-layer, 256-wide, 8-head encoder
(``hdi_monitor.contrib.demo.CharLM``), CPU, one torch thread. Two ratios, each from interleaved
rounds of the same work with and without the signal (medians):

* the logit bound: ``compute_report`` (all projections' HDI from the weights, what a measured
  step computes) with ``logit_bounds=True`` against ``logit_bounds=False``;
* the update entropy: a weights-only measured step of ``HDITracker`` (``tracker.measure()``) with
  ``update_entropy=True`` against without, after a first measurement (so the previous weights are
  held) and an optimizer step between every two measurements.

Run: ``python benchmarks/bench_weight_signals.py [--rounds 7] [--out benchmarks/results/weight_signals.md]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from hdi_monitor import HDITracker
from hdi_monitor.contrib.demo import CharLM
from hdi_monitor.models.discovery import find_attention_layers
from hdi_monitor.report.compute import compute_report


def _model() -> CharLM:
    torch.manual_seed(0)
    return CharLM(d_model=256, num_heads=8, num_layers=4)


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def nudge() -> None:  # an optimizer step: the weights change between two measured steps
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()

    trackers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for on in (False, True):
            t = HDITracker(model, every_n_steps=1, activations=False, log_images_every_n_steps=0, update_entropy=on)
            t.measure()
            trackers[on] = t

    def measured(on: bool) -> None:
        nudge()
        trackers[on].measure()

    layers = find_attention_layers(model)
    bound: dict[bool, list[float]] = {False: [], True: []}
    update: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            bound[on].append(_time(lambda on=on: compute_report(layers, logit_bounds=on), args.repeats))
            update[on].append(_time(lambda on=on: measured(on), args.repeats))
    med = {k: {on: statistics.median(v[on]) for on in (False, True)} for k, v in (("bound", bound), ("update", update))}
    lines = [
        "# Weight-only signals: cost on a measured step",
        "",
        f"`benchmarks/bench_weight_signals.py`: CharLM (4 layers, D = 256, 8 heads), cpu "
        f"({platform.machine()}, 1 thread), torch {torch.__version__}; {args.rounds} interleaved rounds of "
        f"{args.repeats} calls, medians.",
        "",
        "| signal | without | with | ratio |",
        "|---|---:|---:|---:|",
        f"| logit bound (`compute_report`, all projections) | {1e3 * med['bound'][False]:.1f} ms | "
        f"{1e3 * med['bound'][True]:.1f} ms | {med['bound'][True] / med['bound'][False]:.2f}x |",
        f"| update entropy (weights-only measured step of `HDITracker`) | {1e3 * med['update'][False]:.1f} ms | "
        f"{1e3 * med['update'][True]:.1f} ms | {med['update'][True] / med['update'][False]:.2f}x |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    for t in trackers.values():
        t.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
