"""Cost of the dashboards: time and bytes per image step (the PNGs alone, and everything the event
file grows by), event-file bytes per measurement.

Runs the demo's model (`hdi_monitor.contrib.demo.CharLM`, D=128, 8 heads) at 4 and 24 layers
through `HDITracker.measure` with a `SummaryWriter`, 20 measured steps with images every 5th
(the demo's ratio is every 8th), and writes benchmarks/results/dashboard.md. CPU, a few minutes.

    PYTHONPATH=. python benchmarks/bench_dashboard.py
"""

from __future__ import annotations

import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from torch.utils.tensorboard import SummaryWriter

from hdi_monitor.contrib.demo import CharLM
from hdi_monitor.monitor.render import render_job
from hdi_monitor.monitor.tracker import HDITracker

STEPS, IMAGES_EVERY = 20, 5
OUT = Path(__file__).parent / "results" / "dashboard.md"


def _event_bytes(log_dir: str) -> int:
    return sum(f.stat().st_size for f in Path(log_dir).rglob("events.out.tfevents.*"))


def measure(num_layers: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = CharLM(d_model=128, num_heads=8, num_layers=num_layers)
    batch = torch.randint(0, 128, (16, 64))
    with tempfile.TemporaryDirectory() as log_dir:
        writer = SummaryWriter(log_dir)
        tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=IMAGES_EVERY, writer=writer)
        plain_t, plain_b, image_t, image_b = [], [], [], []
        draw_t: list[float] = []
        png_b: list[int] = []
        sizes: set[tuple[int, int]] = set()
        for step in range(STEPS):
            before = _event_bytes(log_dir)
            start = time.perf_counter()
            tracker.measure(batch, step=step)
            elapsed = time.perf_counter() - start
            tracker.flush()  # the pictures are drawn and written by the background worker
            grown = _event_bytes(log_dir) - before
            if step == 0:
                continue  # the layout and the levels text are written once, at the first step
            if step % IMAGES_EVERY:
                plain_t.append(elapsed)
                plain_b.append(grown)
            else:
                image_t.append(elapsed)
                image_b.append(grown)
                m = tracker.last_measurement
                assert m is not None
                job = tracker.dashboard.image_job(
                    m.report, tracker.history, step=step, projections=tracker.config.projections, activations=True
                )
                start = time.perf_counter()
                images = render_job(job)  # what the worker does off the training step
                draw_t.append(time.perf_counter() - start)
                png_b.append(sum(len(png) for png in images.values()))
                sizes |= {_png_size(png) for png in images.values()}
        writer.close()
        layers = len(tracker.layers)
    return {
        "layers": layers,
        "plain_s": statistics.median(plain_t),
        "plain_bytes": statistics.median(plain_b),
        "image_s": statistics.median(image_t) - statistics.median(plain_t),
        "draw_s": statistics.median(draw_t),
        "image_bytes": statistics.median(image_b) - statistics.median(plain_b),
        "png_bytes": statistics.median(png_b),
        "sizes": ", ".join(f"{w} x {h}" for w, h in sorted(sizes)),
    }


def _png_size(png: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(png)) as picture:
        return picture.size


def main() -> int:
    torch.set_num_threads(2)
    rows = [measure(n) for n in (4, 24)]
    lines = [
        "# Dashboard cost",
        "",
        f"`benchmarks/bench_dashboard.py`: the demo's CharLM (D = 128, 8 heads of width 16) measured with "
        f"`HDITracker.measure` on a 16 x 64 token batch, {STEPS} measured steps, images every {IMAGES_EVERY}th, "
        f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}. Medians; the first step "
        "(layout, levels text) is left out.",
        "",
        "| layers | event-file bytes per measurement (no images) | measurement time | extra time per image step "
        "(on the training step) | drawing the 9 PNGs (on the background worker) | the 9 PNGs | "
        "extra bytes per image step (PNGs and histograms) | picture sizes (px) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['plain_bytes'] / 1024:.1f} KiB | {r['plain_s'] * 1000:.0f} ms "
            f"| {r['image_s'] * 1000:.0f} ms | {r['draw_s'] * 1000:.0f} ms | {r['png_bytes'] / 1024:.0f} KiB "
            f"| {r['image_bytes'] / 1024:.0f} KiB | {r['sizes']} |"
        )
    lines += [
        "",
        "An image step writes 2 x projections + 1 PNG images (here 9) whatever the depth: per projection a "
        "diversity map and a tiled overlap image (at most 16 layers), and one tiled correlation image, plus "
        "the principal-angle histograms (per layer up to 8 layers, else 8 groups). Steps that are not image "
        "steps draw nothing; image steps only queue copies of a few small tensors, the PNGs are encoded from "
        "them on the background worker (no figure). Times depend on the machine (and on what else runs on "
        "it); bytes do not.",
        "",
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
