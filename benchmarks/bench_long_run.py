"""A long run through the real pipeline: does the monitor's cost grow with the run?

A 24-layer encoder (``nn.TransformerEncoder``, D = 64, 8 heads of width 8, synthetic weights
that drift a little every step) is measured at every step for 10,000 steps by `HDITracker`
(4 projections, head outputs, the default early-warning detectors, images every 10th measured
step, drawn on the background worker into a sink that counts bytes). Reported, as ratios within
this one run:

* bytes per image step at the start and at the end (goal: last / first <= 1.2);
* history memory and checkpoint size after 1k and 10k measurements (goal: flat, under 8 MiB);
* time the training step is held by the monitor (``begin`` + ``finish``) at an image step against
  a measured step without images (goal: <= 1.5x; medians);
* how many image steps found the drawing queue full (their pictures dropped, counted).

``--inductor`` adds one inductor measurement (a 2-layer model compiled with the default
backend): graphs and graph breaks, and the time of unmeasured and measured steps, with and without
the monitor.

On the CPU the full run takes about an hour on 2 shared cores (``--quick``: 1,200 measured steps,
sizes at 600 and 1,200; ``--steps N``: N measured steps, sizes at N/2 and N). ``--device cuda`` puts
the model, its inputs and the drift on the GPU (the times are synchronised; the pictures are still
drawn on the CPU worker); `benchmarks/gpu_check.sh` runs it that way. Writes
benchmarks/results/long_run.md (``--quick``: long_run_quick.md; ``--out FILE``: there).

    PYTHONPATH=. python benchmarks/bench_long_run.py [--quick | --steps N] [--inductor] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from hdi_monitor.config import MonitorConfig
from hdi_monitor.monitor.tracker import HDITracker

OUT = Path(__file__).parent / "results"
LAYERS, D, HEADS, IMAGES_EVERY = 24, 64, 8, 10


class ByteSink:
    """Counts what the monitor writes: PNG bytes per step, histogram values, scalars."""

    def __init__(self) -> None:
        self.image_bytes: dict[int, int] = {}
        self.image_count: dict[int, int] = {}
        self.scalars = 0
        self._lock = threading.Lock()

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.scalars += len(scalars)

    def log_images(self, images: dict[str, Any], step: int) -> None:
        with self._lock:
            self.image_bytes[step] = self.image_bytes.get(step, 0) + sum(len(v) for v in images.values())
            self.image_count[step] = self.image_count.get(step, 0) + len(images)

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def log_layout(self, layout: Any) -> None:
        pass

    def flush(self) -> None:
        pass


def _checkpoint_bytes(tracker: HDITracker) -> int:
    buffer = io.BytesIO()
    torch.save(tracker.state_dict(), buffer)
    return buffer.tell()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def long_run(steps: int, marks: tuple[int, int], device: torch.device, budget: int | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    for block in model.layers:
        block.self_attn._reset_parameters()
    model.to(device)
    sink = ByteSink()
    tracker = HDITracker(
        model,
        every_n_steps=1,
        log_images_every_n_steps=IMAGES_EVERY,
        sinks=[sink],
        detector="default",
        activation_detector="default",
        history_budget=MonitorConfig().history_budget if budget is None else budget,
    )
    g = torch.Generator(device=device).manual_seed(1)
    held_plain: list[float] = []
    held_image: list[float] = []
    sizes: dict[int, tuple[int, int]] = {}
    start_all = time.perf_counter()
    for step in range(steps):
        x = torch.randn(2, 16, D, generator=g, device=device)
        _sync(device)
        t0 = time.perf_counter()
        tracker.begin(step, x)
        _sync(device)
        t1 = time.perf_counter()
        with torch.no_grad():
            model(x)
        tracker.stop_capture()
        _sync(device)
        t2 = time.perf_counter()
        tracker.finish()
        _sync(device)
        t3 = time.perf_counter()
        (held_image if step % IMAGES_EVERY == 0 else held_plain).append((t1 - t0) + (t3 - t2))
        with torch.no_grad():  # synthetic training: the weights drift
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=device), alpha=1e-3)
        if step + 1 in marks:
            sizes[step + 1] = (tracker.history.nbytes, _checkpoint_bytes(tracker))
    tracker.close()
    wall = time.perf_counter() - start_all
    written = sorted(sink.image_bytes)
    first, last = written[0], written[-1]
    return {
        "steps": steps,
        "wall_s": wall,
        "first_step": first,
        "last_step": last,
        "first_bytes": sink.image_bytes[first],
        "last_bytes": sink.image_bytes[last],
        "images_per_step": sink.image_count[first],
        "image_steps": len(range(0, steps, IMAGES_EVERY)),
        "written_steps": len(written),
        "dropped": tracker.publisher.dropped,
        "sizes": sizes,
        "held_plain": statistics.median(held_plain),
        "held_image": statistics.median(held_image),
        "history_rows": len(tracker.history),
        "budget": tracker.config.history_budget,
    }


# ------------------------------------------------------------------------------------ inductor


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x)


def _inductor_run(monitor: bool, device: torch.device, steps: int = 60, every: int = 10) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = _Tiny().to(device)
    model = cast(nn.Module, torch.compile(net))
    tracker = HDITracker(model, every_n_steps=every, log_images_every_n_steps=0) if monitor else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator(device=device).manual_seed(1)
    plain: list[float] = []
    measured: list[float] = []
    for step in range(steps):
        x = torch.randn(8, 32, 32, generator=g, device=device)
        _sync(device)
        t0 = time.perf_counter()
        if tracker is not None:
            with tracker.capture(x):
                loss = model(x).pow(2).mean()
        else:
            loss = model(x).pow(2).mean()
        loss.backward()
        if tracker is not None:
            tracker.step()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        elapsed = time.perf_counter() - t0
        if step >= 2:  # after compilation
            (measured if step % every == 0 else plain).append(elapsed)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    weights = [p.detach().clone() for p in net.parameters()]
    torch._dynamo.reset()
    return {
        "graphs": graphs,
        "breaks": breaks,
        "plain_ms": statistics.median(plain) * 1000,
        "measured_ms": statistics.median(measured) * 1000,
        "weights": weights,
    }


def inductor(device: torch.device) -> dict[str, Any]:
    without, with_ = _inductor_run(False, device), _inductor_run(True, device)
    same = all(torch.equal(a, b) for a, b in zip(without["weights"], with_["weights"], strict=True))
    return {"without": without, "with": with_, "bit_identical": same}


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (pictures on the CPU, {torch.get_num_threads()} threads)"
    return f"CPU ({torch.get_num_threads()} threads)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,200 measured steps (sizes at 600 and 1,200)")
    parser.add_argument("--inductor", action="store_true", help="also measure one inductor-compiled run")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (sizes at half and all of them)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--budget", type=int, default=None, help="history budget in rows (default: the library's)")
    parser.add_argument("--out", type=Path, default=None, help="the results file (default: benchmarks/results/)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.steps is not None and args.steps < 2 * IMAGES_EVERY:
        parser.error(f"--steps must be at least {2 * IMAGES_EVERY}")
    torch.set_num_threads(2)
    if args.steps is not None:
        steps, marks = args.steps, (args.steps // 2, args.steps)
    else:
        steps, marks = (1200, (600, 1200)) if args.quick else (10_000, (1000, 10_000))
    r = long_run(steps, marks, device, args.budget)
    ratio_bytes = r["last_bytes"] / r["first_bytes"]
    ratio_held = r["held_image"] / r["held_plain"]
    (m1, (mem1, ck1)), (m2, (mem2, ck2)) = sorted(r["sizes"].items())
    mib = 1024 * 1024
    # flat is only claimed once the history budget is full at both marks
    full = f"n/a: the budget ({r['budget']} rows) is not full at {m1:,}" if m1 < r["budget"] else ""
    lines = [
        "# Long run",
        "",
        f"`benchmarks/bench_long_run.py {' '.join(sys.argv[1:])}`: a {LAYERS}-layer encoder (D = {D}, "
        f"{HEADS} heads of width {D // HEADS}, synthetic drifting weights) measured at every one of {steps:,} steps "
        f"by `HDITracker` (4 projections, head outputs of a 2 x 16-token batch, the default detectors, images every "
        f"{IMAGES_EVERY}th measured step drawn on the background worker), history budget {r['budget']} rows. "
        f"{_machine(device)}, torch {torch.__version__}; {r['wall_s'] / 60:.1f} min in all.",
        "",
        "| what | start | end | end / start | goal | met |",
        "|---|---:|---:|---:|---|---|",
        f"| PNG bytes of an image step ({r['images_per_step']} images; steps {r['first_step']} and {r['last_step']}) "
        f"| {r['first_bytes'] / 1024:.1f} KiB | {r['last_bytes'] / 1024:.1f} KiB | {ratio_bytes:.2f} | <= 1.2 "
        f"| {'yes' if ratio_bytes <= 1.2 else 'no'} |",
        f"| history memory after {m1:,} / {m2:,} measurements | {mem1 / mib:.2f} MiB | {mem2 / mib:.2f} MiB "
        f"| {mem2 / mem1:.2f} | flat, < 8 MiB | {full or ('yes' if mem2 <= 1.01 * mem1 and mem2 < 8 * mib else 'no')} |",
        f"| checkpoint (`state_dict`, torch.save) after {m1:,} / {m2:,} measurements | {ck1 / mib:.2f} MiB "
        f"| {ck2 / mib:.2f} MiB | {ck2 / ck1:.2f} | flat, < 8 MiB | "
        f"{full or ('yes' if ck2 <= 1.05 * ck1 and ck2 < 8 * mib else 'no')} |",
        "",
        "| what | measured | goal | met |",
        "|---|---:|---|---|",
        f"| training step held by the monitor (`begin` + `finish`, median): image step / measured step without "
        f"images | **{ratio_held:.2f}x** ({r['held_image'] * 1000:.1f} ms / {r['held_plain'] * 1000:.1f} ms) "
        f"| <= 1.5x | {'yes' if ratio_held <= 1.5 else 'no'} |",
        f"| image steps drawn / queued-out (queue full: pictures dropped, counted in a warning) | "
        f"{r['written_steps']} drawn of {r['image_steps']} image steps (+ the last measured step), "
        f"{r['dropped']} dropped | never blocks | yes |",
        "",
        "The history keeps its newest half whole and halves the resolution of its older half when full, so the "
        "diversity map has at most the budget's columns and the PNG stays the same size. The image step's extra "
        "held time is the principal angles (from the weights already read for the HDI) and copying the few "
        "small tensors the pictures need; the PNGs are encoded on the worker thread (straight from the tensors, "
        "no figure; it shares the interpreter, so on 2 cores it slows the training thread a little). Times depend on "
        "the machine; bytes and sizes do not.",
        "",
    ]
    if args.inductor:
        try:
            ind = inductor(device)
        except Exception as err:  # noqa: BLE001 - keep the long run's figures
            lines += ["## Inductor", "", f"Not measured: {type(err).__name__}: {err}", ""]
            ind = None
    if args.inductor and ind is not None:
        w, n = ind["with"], ind["without"]
        lines += [
            "## Inductor",
            "",
            "A 2-layer encoder (D = 32, 4 heads, dropout 0.1) compiled with the default backend (inductor), SGD, "
            "measured every 10th of 60 steps (no pictures); medians after compilation.",
            "",
            "| | graphs | graph breaks | unmeasured step | measured step |",
            "|---|---:|---:|---:|---:|",
            f"| without the monitor | {n['graphs']} | {n['breaks']} | {n['plain_ms']:.2f} ms | {n['measured_ms']:.2f} ms |",
            f"| with the monitor | {w['graphs']} | {w['breaks']} | {w['plain_ms']:.2f} ms | {w['measured_ms']:.2f} ms |",
            "",
            f"Weights bit-identical with and without the monitor: {'yes' if ind['bit_identical'] else 'NO'}. "
            "A measured step costs one extra eager forward of the original module (no grad) for the head outputs.",
            "",
        ]
    out = args.out or OUT / ("long_run_quick.md" if args.quick else "long_run.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
