"""Cost of the head-output covariance per measured step, against the old Gram approach and a forward pass.

For one attention layer and ``T`` tokens (sequences of 1,024 tokens, ``T / 1024`` of them), all in one
run and on one device:

* **new**: `hdi_monitor.functional.covariance.HeadCovarianceAccumulator` (``H^2 + H D`` numbers of state:
  the contributions ``W_O,h o_h`` formed in bounded chunks), ``update`` over the ``T`` head outputs
  plus ``compute``;
* **old**: a small reference copy of the first version (kept here, not in the library): a float64
  ``(H d)^2`` Gram of the head outputs, chunked and merged with Chan's formula, and
  ``C = reduce((W_O^T W_O) * S)`` at the end;
* **forward**: one forward pass of the layer under ``no_grad`` (``qkv`` and output projections, causal
  ``scaled_dot_product_attention``), the work the measurement sits next to.

Reported per case: state bytes (new and old), peak transient bytes of the measurement above its
inputs (CPU: from the profiler's allocation records; CUDA: ``max_memory_allocated``), best time of
``--repeats`` calls, and the ratios new/old and new/forward. Layers: GPT-2 small (D = 768, 12 heads
of 64) and a 4096-wide, 32-head layer (heads of 128). The projected state for whole models (7B: 32
layers, H d = 4096; 70B: 80 layers, 64 heads, H d = 8192) is printed too.

    python benchmarks/bench_activations.py --out benchmarks/results/activations.md
    python benchmarks/bench_activations.py --device cuda --out $OUT/activations.md

On the CPU the wide layer runs at 1k and 4k tokens only unless ``--wide-tokens`` says otherwise
(every cost here is linear in ``T``; 16k tokens of it take minutes on two cores).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch.profiler import ProfilerActivity, profile

from hdi_monitor.functional.covariance import DEFAULT_CHUNK_BYTES
from hdi_monitor.measure.covariance import HeadCovarianceAccumulator

LAYERS = {"gpt2-small": (768, 12, 64), "4096-wide": (4096, 32, 128)}
SEQ = 1024


# ------------------------------------------------------------------------------ the old approach
def old_gram_covariance(o: torch.Tensor, w_out: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The first version's method: float64 (H d)^2 centred Gram of o, chunked with Chan merges, then
    C_ij = sum over the (i, j) block of (W_O^T W_O) * S. ``w_out`` is the (D, H d) projection weight."""
    width = o.shape[-1]
    chunk = max(1, DEFAULT_CHUNK_BYTES // (8 * width))
    n = torch.zeros((), dtype=torch.float64, device=o.device)
    total = torch.zeros(width, dtype=torch.float64, device=o.device)
    m2 = torch.zeros(width, width, dtype=torch.float64, device=o.device)
    for start in range(0, o.shape[0], chunk):
        x = o[start : start + chunk].double()
        nb = x.shape[0]
        sb = x.sum(dim=0)
        xc = x - sb / nb
        delta = sb / nb - total / n.clamp_min(1.0)
        m2 += xc.T @ xc + (n * nb / (n + nb)) * torch.outer(delta, delta)
        total += sb
        n += nb
    s = m2 / n
    w = w_out.double()
    gram = (w.T @ w) * s
    c = reduce(gram, "(i a) (j b) -> i j", "sum", i=num_heads, j=num_heads)
    return 0.5 * (c + c.T)


def old_state_bytes(num_heads: int, head_dim: int) -> int:
    width = num_heads * head_dim
    return 8 * (width * width + width + 1)


def new_state_bytes(num_heads: int, model_dim: int) -> int:
    return 8 * HeadCovarianceAccumulator.state_numel(num_heads, model_dim)


# ------------------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak of net allocations during ``fn`` (above what was allocated before)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    cur = peak = 0
    for _, nbytes in records:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def make_layer(model_dim: int, num_heads: int, head_dim: int, device: torch.device, gen: torch.Generator):
    width = num_heads * head_dim
    qkv = torch.randn(3 * width, model_dim, generator=gen).div_(math.sqrt(model_dim)).to(device)
    w_out = torch.randn(model_dim, width, generator=gen).div_(math.sqrt(width)).to(device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(x @ qkv.T, "b t (three h d) -> three b h t d", three=3, h=num_heads)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return rearrange(o, "b h t d -> b t (h d)") @ w_out.T

    return forward, w_out


def run_case(name: str, tokens: int, device: torch.device, repeats: int, profile_memory: bool) -> dict:
    model_dim, num_heads, head_dim = LAYERS[name]
    gen = torch.Generator().manual_seed(0)
    forward, w_out = make_layer(model_dim, num_heads, head_dim, device, gen)
    batch = max(1, tokens // SEQ)
    x = torch.randn(batch, SEQ, model_dim, generator=gen).to(device)
    # head outputs with a mean (as real ones have) and correlated heads
    o = (torch.randn(batch * SEQ, num_heads * head_dim, generator=gen) + 3.0).to(device)

    def new() -> torch.Tensor:
        acc = HeadCovarianceAccumulator(num_heads, head_dim, w_out=w_out)
        acc.update(o)
        return acc.compute().covariance

    def old() -> torch.Tensor:
        return old_gram_covariance(o, w_out, num_heads).cpu()

    with torch.no_grad():
        c_new, c_old = new(), old()
        agree = float((c_new - c_old).abs().max() / c_old.abs().max())
        t_new = best_time(new, repeats, device)
        t_old = best_time(old, repeats, device)
        t_fwd = best_time(lambda: forward(x), repeats, device)
        p_new = peak_bytes(new, device) if profile_memory else -1
        p_old = peak_bytes(old, device) if profile_memory else -1
    return {
        "layer": name,
        "tokens": batch * SEQ,
        "state_new": new_state_bytes(num_heads, model_dim),
        "state_old": old_state_bytes(num_heads, head_dim),
        "peak_new": p_new,
        "peak_old": p_old,
        "t_new": t_new,
        "t_old": t_old,
        "t_fwd": t_fwd,
        "agree": agree,
    }


def _bytes(n: int) -> str:
    if n < 0:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


HEADER = [
    "| layer | tokens | state new | state old | peak new | peak old | time new | time old | forward | new/old | new/forward | max rel. diff |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def row(c: dict) -> str:
    return (
        f"| {c['layer']} | {c['tokens']:,} | {_bytes(c['state_new'])} | {_bytes(c['state_old'])} | "
        f"{_bytes(c['peak_new'])} | {_bytes(c['peak_old'])} | {_time(c['t_new'])} | {_time(c['t_old'])} | "
        f"{_time(c['t_fwd'])} | {c['t_new'] / c['t_old']:.2f} | {c['t_new'] / c['t_fwd']:.2f} | {c['agree']:.1e} |"
    )


def projections() -> list[str]:
    lines = [
        "| model shape | layers | H | D | state new (all layers) | state old (all layers) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, layers, heads, dim, head_dim in (("7B", 32, 32, 4096, 128), ("70B", 80, 64, 8192, 128)):
        lines.append(
            f"| {label} | {layers} | {heads} | {dim} | {_bytes(layers * new_state_bytes(heads, dim))} | "
            f"{_bytes(layers * old_state_bytes(heads, head_dim))} |"
        )
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="GPT-2-small layer token counts")
    p.add_argument(
        "--wide-tokens",
        type=int,
        nargs="*",
        default=None,
        help="4096-wide layer token counts (default: 1024 4096 on CPU, as --tokens on CUDA)",
    )
    p.add_argument("--repeats", type=int, default=2, help="timed calls per case after a warm-up (default 2)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    wide = (
        args.wide_tokens if args.wide_tokens is not None else (args.tokens if device.type == "cuda" else [1024, 4096])
    )
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
        precision = "chunk products in IEEE float32 (TF32 off inside the measurement), moments in float64"
    else:
        where = f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads"
        precision = "chunk products in float64 (the CPU default), moments in float64"
    lines = [
        "## Head-output covariance: cost per measured step (one layer)",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}; {where}. Float32 head outputs and W_O; "
        f"new: {precision}; old: float64 Gram. Best of {args.repeats} calls after a warm-up; forward: one "
        f"no_grad forward pass of the layer over the same tokens (sequences of {SEQ}). "
        "Peak: transient bytes above the inputs during one measurement. max rel. diff: largest |C_new - C_old| "
        "over the largest |C_old|.",
        "",
        *HEADER,
    ]
    print("\n".join(lines), flush=True)
    results = []
    for name, counts in (("gpt2-small", args.tokens), ("4096-wide", wide)):
        for tokens in counts:
            case = run_case(name, tokens, device, args.repeats, not args.no_memory)
            results.append(case)
            lines.append(row(case))
            print(lines[-1], flush=True)
    tail = [
        "",
        "Projected state for whole models (all layers' accumulators live during a measured step):",
        "",
        *projections(),
    ]
    print("\n".join(tail))
    lines += tail
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
