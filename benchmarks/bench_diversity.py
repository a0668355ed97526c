"""Speed of the head-diversity math (hdi_monitor.functional.diversity) against its natural baselines.

All ratios come from one run on the same weights (random Gaussian heads, float32, seed 0):

* weighted (spectral) HDI of a GPT-2-small layer (D=768, 12 heads of 64) against one 768 x 768
  float32 matmul, the cost of the Gram matrix it is built on (goal: at most 1.5x);
* the same HDI against a loop of ``scipy.linalg.subspace_angles`` over the 66 head pairs, which
  then averages cos^2 (goal: at least 100x faster);
* the uniform HDI (eigh whitening of each head's Gram block, QR only for ill-conditioned heads)
  against the spectral one on the same layer (goal: at most 2x), with the previous method (QR of
  every head, then the Gram) beside it, and the largest difference of its overlaps from scipy's
  mean cos^2 in float64 (goal: at most 1e-6);
* the exact principal-angle matrices (``pairwise_principal_angles``, float64) against the same
  scipy loop (goal: at least 20x faster);
* absolute times for a whole 12-layer GPT-2-small shape in one batched call, (12, 12, 768, 64), and
  for one 4096-wide, 32-head layer (32, 4096, 128).

Single calls are timed round-robin (so that load from other processes hits all candidates alike)
after a warm-up; ratios use each candidate's best call (the least disturbed one), medians are shown
too. The scipy loop is timed on float32 and float64 copies of the weights, with BLAS on
``--threads`` threads and on one (an oversubscribed OpenBLAS can be 100x slower on a loaded
machine), and the ratios are taken against the fastest of the four. A GPU section runs the torch
cases on CUDA, synchronised around every call, when a GPU exists.

    python benchmarks/bench_diversity.py --repeats 5 --out benchmarks/results/diversity.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy
import scipy.linalg
import torch

from hdi_monitor.functional.diversity import (
    _cross_sq_norms,
    head_diversity_index,
    orthonormal_basis,
    pairwise_principal_angles,
    subspace_overlap,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, device: torch.device, budget: float
) -> dict[str, list[float]]:
    """Seconds of single calls of each function, taken round-robin after a warm-up.

    Each round times every function in turn, each for as many single calls as fit in ``budget``
    seconds (at least one), so that load from other processes hits all candidates alike; the best
    single call is the least disturbed one.
    """
    calls: dict[str, int] = {}
    for name, fn in fns.items():  # warm-up, and how many calls fit in one round's budget
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        calls[name] = max(1, int(budget / max(time.perf_counter() - t0, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(calls[name]):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                samples[name].append(time.perf_counter() - t0)
    return samples


def scipy_pairwise_hdi(heads: np.ndarray) -> float:
    """The loop a user would write without this library: scipy's angles for each of the H (H - 1) / 2
    pairs, then 1 - mean cos^2 (the uniform HDI)."""
    h = heads.shape[0]
    angles = [scipy.linalg.subspace_angles(heads[i], heads[j]) for i in range(h) for j in range(i + 1, h)]
    return 1.0 - float(np.mean([np.mean(np.cos(a) ** 2) for a in angles]))


def qr_uniform_hdi(heads: torch.Tensor) -> torch.Tensor:
    """The previous uniform HDI: a QR basis of every head, then the Gram of the stacked bases."""
    scale = heads.abs().amax(dim=(-2, -1), keepdim=True)
    u, r = orthonormal_basis(heads / scale)
    overlap = _cross_sq_norms(u) / torch.minimum(r[..., :, None], r[..., None, :]).clamp_min(1).to(u.dtype)
    return head_diversity_index(overlap.clamp(0.0, 1.0))


def uniform_error_vs_scipy(heads: torch.Tensor) -> float:
    """Largest |rho_ij - mean cos^2 of scipy's angles| over the pairs (scipy on float64 copies)."""
    got = subspace_overlap(heads, "uniform").double().cpu().numpy()
    arr = heads.double().cpu().numpy()
    h = arr.shape[0]
    err = 0.0
    for i in range(h):
        for j in range(i + 1, h):
            ref = float(np.mean(np.cos(scipy.linalg.subspace_angles(arr[i], arr[j])) ** 2))
            err = max(err, abs(got[i, j] - ref))
    return err


def _blas_threads(n: int) -> contextlib.AbstractContextManager:
    """Context limiting numpy/scipy's BLAS threads to ``n`` (a no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - optional
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def time_scipy(heads: torch.Tensor, threads: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per scipy loop in four settings: float32 (the weights as they are) and float64 input,
    BLAS on ``threads`` threads and on one. The first setting is the weights as they are, with BLAS on
    ``threads`` threads (scipy's default when that is all cores)."""
    samples: dict[str, list[float]] = {}
    for dtype in (np.float32, np.float64):
        arr = heads.cpu().numpy().astype(dtype)
        for n in sorted({threads, 1}, reverse=True):
            with _blas_threads(n):
                t0 = time.perf_counter()
                scipy_pairwise_hdi(arr)  # warm-up
                first = time.perf_counter() - t0
                # An oversubscribed OpenBLAS (other processes on the cores) can run 100x slower:
                # then the warm-up call is the only sample.
                times = [first] if first > 5.0 else []
                for _ in range(0 if times else rounds):
                    t0 = time.perf_counter()
                    scipy_pairwise_hdi(arr)
                    times.append(time.perf_counter() - t0)
            samples[f"scipy loop, {np.dtype(dtype).name}, BLAS threads {n}"] = times
    return samples


def _fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _goal(value: float, goal: float, at_most: bool) -> str:
    return "yes" if (value <= goal if at_most else value >= goal) else "NO"


def run(device: torch.device, args: argparse.Namespace) -> list[str]:
    """Benchmark on one device; returns the markdown table's lines."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.randn(12, 768, 64, generator=gen).to(device)  # GPT-2 small: D=768, 12 heads of 64
    model = torch.randn(12, 12, 768, 64, generator=gen).to(device)  # 12 such layers
    mat_a = torch.randn(768, 768, generator=gen).to(device)
    mat_b = torch.randn(768, 768, generator=gen).to(device)

    def spectral_hdi(w: torch.Tensor) -> torch.Tensor:
        return head_diversity_index(subspace_overlap(w, "spectral"))

    def uniform_hdi(w: torch.Tensor) -> torch.Tensor:
        return head_diversity_index(subspace_overlap(w, "uniform"))

    cases = {
        "matmul": lambda: mat_a @ mat_b,
        "spectral": lambda: spectral_hdi(layer),
        "uniform": lambda: uniform_hdi(layer),
        "uniform_qr": lambda: qr_uniform_hdi(layer),
        "pairwise": lambda: pairwise_principal_angles(layer),
        "model_spectral": lambda: spectral_hdi(model),
        "model_uniform": lambda: uniform_hdi(model),
    }
    samples = time_interleaved(cases, args.repeats, device, args.budget)
    scipy_names: list[str] = []
    if device.type == "cpu":
        scipy_samples = time_scipy(layer, args.threads, args.scipy_repeats)
        scipy_names = list(scipy_samples)
        samples.update(scipy_samples)
    if not args.no_large:
        wide = torch.randn(32, 4096, 128, generator=gen).to(device)  # one 4096-wide, 32-head layer
        large = {
            "wide_spectral": lambda: spectral_hdi(wide),
            "wide_uniform": lambda: uniform_hdi(wide),
            "wide_pairwise": lambda: pairwise_principal_angles(wide),
        }
        samples.update(time_interleaved(large, min(args.repeats, 2), device, 0.0))
    best = {k: min(v) for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}

    def row(case: str, name: str, ratio: str = "", goal: str = "", met: str = "") -> str:
        return f"| {case} | {_fmt(best[name])} | {_fmt(med[name])} | {len(samples[name])} | {ratio} | {goal} | {met} |"

    lines = ["| case | best | median | calls | ratio (best) | goal | met |", "|---|---:|---:|---:|---:|---|---|"]
    lines.append(row("one 768x768 float32 matmul (baseline)", "matmul"))
    r = best["spectral"] / best["matmul"]
    case = "spectral HDI, GPT-2-small layer (12, 768, 64) fp32"
    lines.append(row(case, "spectral", f"{r:.2f}x matmul", "<= 1.5x", _goal(r, 1.5, True)))
    lines.append(row("uniform HDI, same layer", "uniform", f"{best['uniform'] / best['matmul']:.1f}x matmul"))
    r = best["uniform"] / best["spectral"]
    lines.append(
        row("uniform HDI vs spectral HDI, same layer", "uniform", f"{r:.2f}x spectral", "<= 2x", _goal(r, 2.0, True))
    )
    r = best["uniform_qr"] / best["spectral"]
    lines.append(row("previous uniform HDI (QR of every head), same layer", "uniform_qr", f"{r:.2f}x spectral"))
    err = uniform_error_vs_scipy(layer)
    lines.append(
        f"| uniform overlaps vs scipy float64 mean cos^2, max abs difference over 66 pairs | {err:.1e} | | | | "
        f"<= 1e-6 | {_goal(err, 1e-6, True)} |"
    )
    lines.append(row("pairwise_principal_angles, same layer (float64)", "pairwise"))
    if scipy_names:
        as_is, fastest = scipy_names[0], min(scipy_names, key=best.__getitem__)
        for name in scipy_names:
            note = ", ".join(n for n, hit in (("as is", name == as_is), ("fastest", name == fastest)) if hit)
            lines.append(row(f"{name}, 66 pairs", name, note))
        for label, name, goal in (("spectral HDI", "spectral", 100.0), ("pairwise_principal_angles", "pairwise", 20.0)):
            for which, ref in (("as is", as_is), ("fastest", fastest)):
                r = best[ref] / best[name]
                verdict = _goal(r, goal, False)
                lines.append(row(f"{label} vs scipy {which}", name, f"{r:.1f}x faster", f">= {goal:.0f}x", verdict))
    lines.append(row("whole GPT-2-small model (12, 12, 768, 64), spectral, one call", "model_spectral"))
    lines.append(row("whole GPT-2-small model, uniform, one call", "model_uniform"))
    if not args.no_large:
        lines.append(row("4096-wide layer (32, 4096, 128), spectral", "wide_spectral"))
        lines.append(row("4096-wide layer, uniform", "wide_uniform"))
        lines.append(row("4096-wide layer, pairwise_principal_angles (496 pairs)", "wide_pairwise"))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of interleaved timing (default 5)")
    parser.add_argument("--budget", type=float, default=0.1, help="seconds per case per round (default 0.1)")
    parser.add_argument("--scipy-repeats", type=int, default=3, help="timed runs per scipy setting (default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and BLAS threads (default: all)")
    parser.add_argument("--no-large", action="store_true", help="skip the 4096-wide layer")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    if min(args.repeats, args.scipy_repeats, args.threads) < 1 or args.budget < 0:
        parser.error("--repeats, --scipy-repeats and --threads must be positive and --budget not negative")
    torch.set_num_threads(args.threads)

    lines = [
        "## hdi_monitor.functional.diversity benchmark",
        "",
        f"torch {torch.__version__}, scipy {scipy.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}; {platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}. Random Gaussian heads (seed 0). Single calls timed "
        f"round-robin over {args.repeats} rounds after a warm-up; ratios from each case's best call. "
        "The scipy loop (subspace_angles on the 66 head pairs of the same weights) runs in four "
        "settings: float32 or float64 input, BLAS on --threads threads or one; 'as is' is the float32 weights "
        "with BLAS on --threads threads (scipy's default when --threads is all cores).",
        "",
        "### CPU",
        "",
    ]
    with torch.no_grad():
        lines += run(torch.device("cpu"), args)
        if torch.cuda.is_available():
            lines += ["", f"### GPU ({torch.cuda.get_device_name()})", ""]
            lines += run(torch.device("cuda"), args)
        else:
            lines += ["", "### GPU", "", "No CUDA device here: GPU section skipped."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
