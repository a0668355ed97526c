"""Time to compute every layer's HDI (all four projections) of LLM-sized attention on one device.

Shapes (random Gaussian weights, stored in ``--dtype``, bfloat16 by default as in LLM training;
the library upcasts to float32 for the math):

* ``7b``:  32 layers, D = 4096, 32 heads of 128 (Llama-2-7B attention);
* ``70b``: 80 layers, D = 8192, 64 query heads of 128, 8 key/value heads (Llama-2-70B attention).

Goal: under 1 s for the 70B shape on one GPU (H100/H200 class).

Only the attention projections are built (a ``q_proj``/``k_proj``/``v_proj``/``o_proj`` block per
layer, found through an `AttentionSpec`); the 70B shape holds 12.1 billion
parameters, 24 GB in bfloat16. Two ways to compute are timed, each one ``compute_report`` call
(what ``HDIMonitor`` runs at a measured step), synchronised, after one warm-up call:

* ``batched``: all layers of one shape stacked into one call per projection (the default path);
* ``per-layer``: one layer at a time (the path for sharded FSDP2 weights; peak memory one layer).

On CUDA the script also reports the peak memory above the weights and, with ``--tf32 both``, the
same timings with TF32 tensor-core matmuls allowed (``torch.backends.cuda.matmul.allow_tf32``,
which ``torch.set_float32_matmul_precision("high")`` also turns on) and the largest HDI difference
that causes. The spectral HDI of a layer needs the Gram matrix of its stacked heads, about
``2 D (H d)^2`` flops (1.1 TFLOP for a 70B query or output projection), so the 70B shape is about
176 TFLOP in all: seconds at FP32 rates, a fraction of a second on TF32 tensor cores.

    python benchmarks/bench_hdi_scale.py                          # GPU, both shapes
    python benchmarks/bench_hdi_scale.py --device cpu --small     # quick CPU smoke run (scaled shapes)
    python benchmarks/bench_hdi_scale.py --out benchmarks/results/hdi_scale.md

``--small`` keeps 4 layers of each shape at CPU size with heads of 32 and the same ratios
(7b: D = 256, 8 heads, ``H d = D``; 70b: D = 512, 16 query and 2 key/value heads). A case that
runs out of GPU memory is reported as such and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hdi_monitor import AttentionSpec
from hdi_monitor.models import PROJECTIONS, find_attention_layers
from hdi_monitor.report import DiversityReport, compute_report


@dataclass(frozen=True)
class Shape:
    """Attention shape of a model: layers, width, query heads, key/value heads, head width."""

    name: str
    layers: int
    model_dim: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def params(self) -> int:
        q_o = 2 * self.model_dim * self.heads * self.head_dim
        k_v = 2 * self.model_dim * self.kv_heads * self.head_dim
        return self.layers * (q_o + k_v)

    @property
    def gram_flops(self) -> float:
        """Flops of the spectral HDI's Gram matrices, all layers and projections: ``2 D (h d)^2`` each."""
        widths = (self.heads, self.kv_heads, self.kv_heads, self.heads)  # query, key, value, output
        per_layer = sum(2 * self.model_dim * (h * self.head_dim) ** 2 for h in widths)
        return float(self.layers * per_layer)


FULL = {
    "7b": Shape("7b", layers=32, model_dim=4096, heads=32, kv_heads=32, head_dim=128),
    "70b": Shape("70b", layers=80, model_dim=8192, heads=64, kv_heads=8, head_dim=128),
}
#: ``--small``: the same head width ratios at CPU size (d = 32), 4 layers, grouped-query kept for 70b.
SMALL = {
    "7b": Shape("7b-small", layers=4, model_dim=256, heads=8, kv_heads=8, head_dim=32),
    "70b": Shape("70b-small", layers=4, model_dim=512, heads=16, kv_heads=2, head_dim=32),
}


class Attention(nn.Module):
    """The four projections of one attention layer, in ``nn.Linear`` layout (no forward needed)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> None:
        super().__init__()
        q, kv, dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.model_dim

        def weight(rows: int, cols: int) -> nn.Parameter:
            w = torch.randn(rows, cols, device=device, dtype=torch.float32, generator=generator) / math.sqrt(cols)
            return nn.Parameter(w.to(dtype), requires_grad=False)

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Module() for _ in range(4))
        self.q_proj.weight = weight(q, dim)
        self.k_proj.weight = weight(kv, dim)
        self.v_proj.weight = weight(kv, dim)
        self.o_proj.weight = weight(dim, q)


def build(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, AttentionSpec]:
    """A module list of ``shape.layers`` random attention layers and the spec that finds them."""
    generator = torch.Generator(device=device).manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList(Attention(shape, device, dtype, generator) for _ in range(shape.layers))
    spec = AttentionSpec(
        modules=r"layers\.\d+",
        query="q_proj",
        key="k_proj",
        value="v_proj",
        output="o_proj",
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
    )
    return model, spec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def tf32(enabled: bool, device: torch.device) -> Iterator[None]:
    """Allow (or forbid) TF32 matmuls on CUDA for the duration; a no-op elsewhere."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def compute(layers: list, variant: str) -> list[DiversityReport]:
    """One all-layer HDI computation: one batched ``compute_report`` call, or one call per layer."""
    if variant == "batched":
        return [compute_report(layers, projections=PROJECTIONS)]
    return [compute_report([layer], projections=PROJECTIONS) for layer in layers]


def hdis(reports: list[DiversityReport]) -> torch.Tensor:
    """(layers, projections) HDI values of a computation's reports."""
    return torch.tensor([[lay.hdi[p] for p in PROJECTIONS] for r in reports for lay in r.layers], dtype=torch.float64)


def time_case(layers: list, variant: str, device: torch.device, repeats: int) -> dict:
    """Best and median seconds of ``repeats`` synchronised calls after a warm-up, peak memory, HDIs."""
    _sync(device)
    reports = compute(layers, variant)  # warm-up (kernels, allocator)
    _sync(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        reports = compute(layers, variant)  # ends with the host copy of the results
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return {"best": min(times), "median": statistics.median(times), "peak_bytes": peak, "hdi": hdis(reports)}


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark every requested shape, variant and TF32 mode; returns one dict per case."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    table = SMALL if args.small else FULL
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tf32] if device.type == "cuda" else [False]
    results = []
    for key in args.shapes:
        shape = table[key]
        model, spec = build(shape, device, dtype, seed=args.seed)
        layers = find_attention_layers(model, spec=spec)
        reference = None
        for allow in modes:
            for variant in args.variants:
                try:
                    with tf32(allow, device):
                        case = time_case(layers, variant, device, args.repeats)
                except torch.OutOfMemoryError as err:
                    print(f"| {shape.name} | {variant} | TF32={allow} | out of memory: {str(err).splitlines()[0]} |")
                    torch.cuda.empty_cache()
                    continue
                if reference is None:
                    reference = case["hdi"]
                case.update(
                    shape=shape,
                    variant=variant,
                    tf32=allow,
                    max_hdi_diff=float((case["hdi"] - reference).abs().max()),
                    mean_hdi={p: float(case["hdi"][:, i].mean()) for i, p in enumerate(PROJECTIONS)},
                )
                results.append(case)
                print(_row(case, device), flush=True)
        del model, layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _row(case: dict, device: torch.device) -> str:
    shape: Shape = case["shape"]
    peak = "-" if case["peak_bytes"] is None else f"{case['peak_bytes'] / 2**30:.1f} GiB"
    rate = shape.gram_flops / case["best"] / 1e12
    goal = ""
    if shape.name == "70b":
        goal = "yes" if case["best"] < 1.0 else "NO"
    tf = ("TF32" if case["tf32"] else "FP32") if device.type == "cuda" else "-"
    return (
        f"| {shape.name} | {shape.layers} x D={shape.model_dim}, "
        f"{shape.heads}/{shape.kv_heads} heads of {shape.head_dim} "
        f"| {case['variant']} | {tf} | {_fmt_s(case['best'])} | {_fmt_s(case['median'])} | {rate:.3g} | {peak} "
        f"| {case['max_hdi_diff']:.1e} | {goal} |"
    )


HEADER = [
    "| shape | layers, width, heads | variant | matmul | best | median | TFLOP/s "
    "| peak memory above weights | max HDI diff | < 1 s |",
    "|---|---|---|---|---:|---:|---:|---:|---:|---|",
]


def describe(device: torch.device, args: argparse.Namespace) -> list[str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return [
        f"device: {device} ({name}), torch {torch.__version__}, Python {platform.python_version()}",
        f"weights: {args.dtype}, random Gaussian (seed {args.seed}); projections: {', '.join(PROJECTIONS)}; "
        f"spectral weighting; {args.repeats} timed calls after one warm-up",
        "max HDI diff: largest |HDI| difference from the first case of the same shape (batched, FP32).",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_device, help="cuda (the default when present) or cpu")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (4 layers, D/16) for a smoke run")
    p.add_argument("--shapes", nargs="+", choices=sorted(FULL), default=["7b", "70b"])
    p.add_argument("--variants", nargs="+", choices=["batched", "per-layer"], default=["batched", "per-layer"])
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="weight storage dtype"
    )
    p.add_argument("--tf32", choices=["off", "on", "both"], default="both", help="TF32 matmuls on CUDA (default: both)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available; use --device cpu --small")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    lines = describe(device, args)
    print("\n".join(lines), "", *HEADER, sep="\n", flush=True)
    results = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join([*lines, "", *HEADER, *(_row(c, device) for c in results)]) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
