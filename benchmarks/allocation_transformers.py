"""The allocation law on real transformers: a sweep of head splits, a held-out prediction, early choice.

Small causal byte-level language models (`hdi_monitor.contrib.demo.CharLM`: ``nn.TransformerEncoder``
blocks, learned positions, tied read-out) are trained on real text (the docstrings of standard-library
modules, as in the warnings study, or ``--corpus FILE``) at every split ``H x d_k`` of each width
``D`` (``d_k`` from ``--min-head-dim`` up to ``D``), at several training-set sizes ``N`` (distinct
training bytes; every run takes the same number of steps, so small-``N`` runs repeat epochs and are
data-limited) and several seeds. Depth, optimiser, steps and schedule are the same for every split.
Every run is logged with the monitor (`HDITracker`: HDI, effective heads, head correlation, kernel
statistics) to TensorBoard under ``--logdir`` (each run with its ``train_tokens`` hyperparameter, so
``hdi-monitor allocate --runs <logdir>/D64 --metric val_loss`` reads them back), and its held-out
loss is measured on a fixed held-out set along the way and at the end.

Then:

* the measured best split per ``(D, N)`` (mean over seeds), with the splits the seeds cannot tell
  apart from it (paired t-test over seeds, 95%);
* the law (`hdi_monitor.contrib.allocation`) fitted to the runs at the smaller ``N`` predicts the best
  split at the largest ``N``: with the head correlation measured by the monitor (from ``H_eff``) in
  its ensemble factor and with a fitted ``rho``; the prediction's error, ``d_k*`` against ``N``,
  ``H*`` against ``D``, and where the conventions ``d_k = 64`` and ``H = D / 8`` land;
* early choice: at 10% and 25% of training the splits of each ``(D, N, seed)`` are ranked by (a) the
  law fitted to the losses and head correlations measured so far, (b) the current held-out loss,
  (c) a power-law extrapolation of each run's held-out curve; Spearman correlation with the final
  ranking and regret (final loss of the chosen split minus the best), mean and 95% t-interval
  over seeds.

Outputs (``--out``, default ``benchmarks/results``): ``allocation_transformers.json``, ``.md`` and
``.png``; ``--docs docs/allocation.md`` rewrites the page's generated block. ``--quick`` (one seed,
one width, two sizes, few steps) checks the pipeline in under three minutes; its numbers are not
results. Runs go to ``--jobs`` worker processes of one thread each.

    python benchmarks/allocation_transformers.py --jobs 2 --docs docs/allocation.md
    python benchmarks/allocation_transformers.py --quick --out /tmp/alloc
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from hdi_monitor.contrib.allocation import AllocationLaw, AllocationRun, fit_allocation_law, recommend_allocation
from hdi_monitor.contrib.demo import CharLM
from hdi_monitor.monitor.tracker import HDITracker

SEQ_LEN = 64
BATCH = 16
VOCAB = 128
LAYERS = 2
LR = 3e-3
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05  # linear warmup, then cosine decay to 10% of LR
CURVE_BATCHES = 4  # held-out windows of the learning curve: CURVE_BATCHES * BATCH (4,096 bytes)
FINAL_BATCHES = 32  # held-out windows of the final loss: FINAL_BATCHES * BATCH (32,768 bytes)
MEASURE_FRACTION = 0.05  # the monitor measures every 5% of training (10% and 25% are measured steps)
FRACTIONS = (0.10, 0.25)  # early-choice points
BEGIN, END = "<!-- allocation-transformers:begin -->", "<!-- allocation-transformers:end -->"
RESULT_KEYS = (
    "command",
    "corpus",
    "seeds",
    "widths",
    "sizes",
    "runs",
    "best",
    "law_prediction",
    "early_choice",
)

# The default corpus is the warnings study's (the same stdlib docstrings, one loader; the script's own
# folder is on sys.path when it runs).
from warnings_study import MODULES, file_documents, stdlib_documents  # noqa: E402, F401


def log(msg: str) -> None:
    print(f"[allocation-transformers] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- data
def split_tokens(docs: list[str], seed: int = 0) -> tuple[Tensor, Tensor]:
    """Train and held-out byte streams: documents shuffled by a private generator, 10% held out."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(docs), generator=g).tolist()
    cut = max(1, len(docs) // 10)
    held, train = [docs[i] for i in order[:cut]], [docs[i] for i in order[cut:]]

    def encode(parts: list[str]) -> Tensor:
        return torch.tensor(list("\n\n".join(parts).encode("ascii")), dtype=torch.long)

    return encode(train), encode(held)


def windows(stream: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` random windows of ``SEQ_LEN + 1`` bytes."""
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (count,), generator=generator)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])


# ------------------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class Spec:
    """One run of the sweep."""

    D: int
    H: int
    N: int
    seed: int
    steps: int
    logdir: str

    @property
    def d_k(self) -> int:
        return self.D // self.H

    @property
    def name(self) -> str:
        return f"D{self.D}/N{self.N}/H{self.H}_dk{self.d_k}_seed{self.seed}"


@dataclass
class Run:
    """What one run recorded: the held-out curve, the monitor's series at its measured steps, the end."""

    D: int
    H: int
    d_k: int
    N: int
    seed: int
    final_loss: float = math.nan
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)
    measured_steps: list[int] = field(default_factory=list)
    key_hdi: list[float | None] = field(default_factory=list)
    effective_heads: list[float | None] = field(default_factory=list)
    head_correlation: list[float | None] = field(default_factory=list)
    attention_entropy: list[float | None] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def eval_steps(steps: int) -> list[int]:
    """Held-out curve points: every 1% of training up to 10%, every 2.5% up to 25%, then every 5%."""
    fine = {round(steps * k / 100) for k in range(1, 11)}
    mid = {round(steps * k / 40) for k in range(4, 11)}
    coarse = {round(steps * k / 20) for k in range(5, 21)}
    return sorted(s for s in fine | mid | coarse if s > 0)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, held: Tensor) -> float:
    """Mean loss over the fixed held-out batches (eval mode, restored after)."""
    was = model.training
    model.eval()
    try:
        losses = []
        for i in range(0, len(held), BATCH):
            b = held[i : i + BATCH]
            logits = model(b[:, :-1])
            losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), b[:, 1:].reshape(-1)))
        return float(torch.stack(losses).mean())
    finally:
        model.train(was)


def _get(scalars: dict[str, float], tag: str) -> float | None:
    v = scalars.get(tag)
    return None if v is None or not math.isfinite(v) else float(v)


def train_run(spec: Spec, streams: tuple[Tensor, Tensor]) -> Run:
    """Train one model with the monitor; returns what was recorded (also written to TensorBoard)."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    torch.set_num_threads(1)
    train_all, held_stream = streams
    train = train_all[: spec.N]  # the first N bytes: nested subsets across N, the same for every split
    torch.manual_seed(spec.seed)  # the sweep's own runs: seeding the global generator is the point here
    data_gen = torch.Generator().manual_seed(1000 + spec.seed)
    final_held = windows(held_stream, FINAL_BATCHES * BATCH, torch.Generator().manual_seed(7))
    held = final_held[: CURVE_BATCHES * BATCH]  # the curve's windows: the first of the final set
    model = CharLM(d_model=spec.D, num_heads=spec.H, num_layers=LAYERS, seq_len=SEQ_LEN, vocab_size=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    warm = max(1, round(WARMUP_FRACTION * spec.steps))

    def lr_at(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, spec.steps - warm)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    every = max(1, round(MEASURE_FRACTION * spec.steps))
    run_dir = Path(spec.logdir) / spec.name
    writer = SummaryWriter(str(run_dir))
    for summary in hparams(
        {"train_tokens": spec.N, "d_model": spec.D, "num_heads": spec.H, "head_dim": spec.d_k, "seed": spec.seed},
        {},
    ):
        assert writer.file_writer is not None
        writer.file_writer.add_summary(summary)  # what add_hparams does, without its sub-folder
    tracker = HDITracker(
        model,
        writer=writer,
        every_n_steps=every,
        log_images_every_n_steps=0,
        max_tokens=512,
        kernel_stats=True,
        detector=None,
        activation_detector=None,
        kernel_detector=None,
        seed=spec.seed,
    )
    run = Run(spec.D, spec.H, spec.d_k, spec.N, spec.seed)
    evals = set(eval_steps(spec.steps))
    start, cpu = time.perf_counter(), time.process_time()
    try:
        for step in range(spec.steps):
            batch = windows(train, BATCH, data_gen)
            with tracker.capture(batch[:, :-1]):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            m = tracker.step()  # before optimizer.step(): the weights of this forward
            if m is not None:
                s = m.scalars
                run.measured_steps.append(step)
                run.key_hdi.append(_get(s, "hdi/key/mean"))
                run.effective_heads.append(_get(s, "effective_heads/mean"))
                run.head_correlation.append(_get(s, "head_correlation/mean"))
                run.attention_entropy.append(_get(s, "attention_entropy/mean"))
            opt.step()
            schedule.step()
            if step + 1 in evals:
                value = held_out_loss(model, held)
                run.curve_steps.append(step + 1)
                run.curve_loss.append(value)
                writer.add_scalar("val_loss", value, step + 1)
        run.final_loss = held_out_loss(model, final_held)
        writer.add_scalar("final_val_loss", run.final_loss, spec.steps)
    finally:
        tracker.close()
        writer.close()
    run.seconds = time.perf_counter() - start
    run.cpu_seconds = time.process_time() - cpu
    return run


_STREAMS: tuple[Tensor, Tensor] | None = None


def _init_worker(streams: tuple[Tensor, Tensor]) -> None:
    global _STREAMS
    torch.set_num_threads(1)
    _STREAMS = streams


def _work(spec: Spec) -> Run:
    assert _STREAMS is not None
    run = train_run(spec, _STREAMS)
    log(f"{spec.name}: final held-out loss {run.final_loss:.4f} ({run.seconds:.0f} s)")
    return run


def cost(spec: Spec) -> float:
    """Relative cost of a run (for scheduling the longest first): grows with D and with H."""
    return spec.D * (1.0 + 0.1 * spec.H)


def train_all(specs: list[Spec], streams: tuple[Tensor, Tensor], jobs: int) -> list[Run]:
    ordered = sorted(specs, key=cost, reverse=True)
    if jobs <= 1:
        _init_worker(streams)
        return [_work(s) for s in ordered]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs, initializer=_init_worker, initargs=(streams,)) as pool:
        return list(pool.imap_unordered(_work, ordered))


# ------------------------------------------------------------------------------------ analysis
def rho_from_heff(H: int, heff: float | None) -> float | None:
    """The mean correlation of the law's ensemble factor from the measured effective heads:
    ``1 / H_eff = rho + (1 - rho) / H`` gives ``rho = (H / H_eff - 1) / (H - 1)``."""
    if H == 1 or heff is None or not math.isfinite(heff) or heff <= 0:
        return None
    rho = (H / heff - 1.0) / (H - 1.0)
    return float(min(1.0, max(rho, -1.0 / (H - 1) + 1e-6)))


def at_step(run: Run, step: int) -> tuple[float, float | None]:
    """The held-out loss at ``step`` (the evaluation at or before it) and the monitor's H_eff there."""
    i = max(k for k, s in enumerate(run.curve_steps) if s <= step)
    j = max((k for k, s in enumerate(run.measured_steps) if s <= step), default=None)
    return run.curve_loss[i], None if j is None else run.effective_heads[j]


def t_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, 95% t-interval and range over seeds (None where fewer than two finite values)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"mean": None, "low": None, "high": None, "min": None, "max": None, "n": 0}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": mean, "low": None, "high": None, "min": min(xs), "max": max(xs), "n": len(xs)}
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": mean, "low": mean - half, "high": mean + half, "min": min(xs), "max": max(xs), "n": len(xs)}


def cells(runs: Sequence[Run]) -> dict[tuple[int, int], dict[int, dict[int, Run]]]:
    """``{(D, N): {d_k: {seed: run}}}``."""
    out: dict[tuple[int, int], dict[int, dict[int, Run]]] = {}
    for r in runs:
        out.setdefault((r.D, r.N), {}).setdefault(r.d_k, {})[r.seed] = r
    return out


def best_per_cell(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The measured best split per (D, N) by mean final loss over seeds, and the splits the seeds
    cannot tell apart from it (paired t-test over seeds, two-sided 95%; with one seed, none)."""
    from scipy import stats

    out = []
    for (D, N), by_dk in sorted(cells(runs).items()):
        means = {d: statistics.fmean(r.final_loss for r in s.values()) for d, s in by_dk.items()}
        best = min(means, key=lambda d: means[d])
        tied = []
        for d, s in by_dk.items():
            if d == best:
                continue
            seeds = sorted(set(s) & set(by_dk[best]))
            diffs = [s[k].final_loss - by_dk[best][k].final_loss for k in seeds]
            if len(diffs) >= 2 and statistics.stdev(diffs) > 0:
                p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
                if p >= 0.05:
                    tied.append(d)
        spread = {
            d: (statistics.stdev([r.final_loss for r in s.values()]) if len(s) > 1 else None) for d, s in by_dk.items()
        }
        out.append(
            {
                "D": D,
                "N": N,
                "best_H": D // best,
                "best_d_k": best,
                "best_loss": means[best],
                # None with one seed: nothing to test
                "within_noise_d_k": sorted(tied) if min(len(x) for x in by_dk.values()) >= 2 else None,
                "mean_loss": {str(d): means[d] for d in sorted(means)},
                "seed_sd": {str(d): spread[d] for d in sorted(spread)},
            }
        )
    return out


def within_noise(cell: dict[str, Any], d_k: int) -> bool | None:
    """Whether split ``d_k`` is the best of its cell or tied with it (None: one seed, untestable)."""
    if d_k == cell["best_d_k"]:
        return True
    return None if cell["within_noise_d_k"] is None else d_k in cell["within_noise_d_k"]


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _law_runs(runs: Sequence[Run], *, correlation: bool, step: int | None = None) -> list[AllocationRun]:
    out = []
    for r in runs:
        if step is None:
            loss, heff = r.final_loss, r.effective_heads[-1] if r.effective_heads else None
        else:
            loss, heff = at_step(r, step)
        rho = rho_from_heff(r.H, heff) if correlation else None
        out.append(AllocationRun(r.H, r.d_k, r.N, loss, rho))
    return out


def law_prediction(runs: Sequence[Run], best: list[dict[str, Any]], min_head_dim: int) -> dict[str, Any]:
    """Fit the law on the smaller N, predict the largest; d_k* against N; H* against D; conventions."""
    sizes = sorted({r.N for r in runs})
    widths = sorted({r.D for r in runs})
    n_max = sizes[-1]
    train = [run for run in runs if run.N in sizes[:-1]]  # the smaller sizes
    by_cell = {(b["D"], b["N"]): b for b in best}
    out: dict[str, Any] = {"fitted_on_N": sizes[:-1], "predicted_N": n_max, "variants": {}}
    for variant, corr in (("measured_correlation", True), ("fitted_rho", False)):
        try:
            fit = fit_allocation_law(_law_runs(train, correlation=corr))
        except ValueError as err:
            out["variants"][variant] = {"error": str(err)}
            continue
        per_width = []
        held_errors = []
        for D in widths:
            cell = by_cell[(D, n_max)]
            rec = recommend_allocation(D, n_max, fit.law, min_head_dim=min_head_dim, max_head_dim=D)
            measured = {int(d): v for d, v in cell["mean_loss"].items()}
            predicted = {d: float(fit.law.predict(D // d, d, n_max)) for d in measured}
            held_errors += [math.log(predicted[d] / measured[d]) for d in measured]
            pick = rec.head_dim if rec.head_dim in measured else min(measured, key=lambda d: predicted[d])
            per_width.append(
                {
                    "D": D,
                    "predicted_d_k": pick,
                    "predicted_H": D // pick,
                    "continuous_d_k": rec.continuous_head_dim,
                    "measured_d_k": cell["best_d_k"],
                    "within_noise": within_noise(cell, pick),
                    "regret": measured[pick] - cell["best_loss"],
                    "predicted_loss": {str(d): predicted[d] for d in sorted(predicted)},
                }
            )
        out["variants"][variant] = {
            "law": fit.law.as_dict(),
            "rho_source": fit.rho_source,
            "at_bound": list(fit.at_bound),
            "train_rms_log_residual": fit.rms_log_residual,
            "held_out_rms_log_error": float(np.sqrt(np.mean(np.square(held_errors)))),
            "per_width": per_width,
        }
    # the law on every size (with the measured correlation): d_k* against N
    trend: dict[str, Any] = {}
    try:
        full = fit_allocation_law(_law_runs(runs, correlation=True))
        trend["law_all_N"] = full.law.as_dict()
        trend["law_all_N_rms_log_residual"] = full.rms_log_residual
        trend["law_d_k_star"] = {
            str(D): {
                str(N): recommend_allocation(
                    D, N, full.law, min_head_dim=min_head_dim, max_head_dim=D
                ).continuous_head_dim
                for N in sizes
            }
            for D in widths
        }
    except ValueError as err:
        trend["law_all_N"] = {"error": str(err)}
    trend["measured_d_k_star"] = {str(D): {str(N): by_cell[(D, N)]["best_d_k"] for N in sizes} for D in widths}
    if len(sizes) >= 2:
        trend["measured_d_k_slope_per_ln_N"] = {
            str(D): float(np.polyfit(np.log(sizes), [by_cell[(D, N)]["best_d_k"] for N in sizes], 1)[0]) for D in widths
        }
    trend["measured_H_star"] = {str(N): {str(D): by_cell[(D, N)]["best_H"] for D in widths} for N in sizes}
    conv = []
    for D in widths:
        for N in sizes:
            cell = by_cell[(D, N)]
            means = {int(d): v for d, v in cell["mean_loss"].items()}
            order = sorted(means, key=lambda d: means[d])
            for label, d in (("d_k=64", 64), ("H=D/8", D // 8)):
                if d in means:
                    conv.append(
                        {
                            "D": D,
                            "N": N,
                            "convention": label,
                            "d_k": d,
                            "rank": order.index(d) + 1,
                            "of": len(order),
                            "gap": means[d] - cell["best_loss"],
                            "within_noise": within_noise(cell, d),
                        }
                    )
    trend["conventions"] = conv
    out["trends"] = trend
    return out


def power_law_extrapolate(steps: Sequence[int], losses: Sequence[float], target: int) -> tuple[float, bool]:
    """Fit ``L(t) = c + b t^-a`` to a held-out curve and evaluate it at ``target``; returns the value
    and whether the fit succeeded (else the last loss)."""
    from scipy.optimize import curve_fit

    t = np.asarray(steps, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if len(t) < 4:
        return float(y[-1]), False

    def f(x: np.ndarray, c: float, b: float, a: float) -> np.ndarray:
        return c + b * x**-a

    try:
        p, _ = curve_fit(
            f, t, y, p0=(float(y.min()) * 0.9, float(y[0] - y.min()) * t[0] ** 0.5 + 1e-3, 0.5),
            bounds=([0.0, 0.0, 1e-3], [float(y.max()) * 2, np.inf, 5.0]), maxfev=5000,
        )  # fmt: skip
        value = float(f(np.array([float(target)]), *p)[0])
        return (value, True) if math.isfinite(value) else (float(y[-1]), False)
    except (RuntimeError, ValueError):
        return float(y[-1]), False


def early_choice(runs: Sequence[Run], steps: int) -> dict[str, Any]:
    """Rank the splits of each (D, N, seed) at 10% and 25% of training by (a) the law, (b) the
    current held-out loss, (c) a power-law extrapolation; Spearman with the final ranking, regret."""
    from scipy.stats import spearmanr

    seeds = sorted({r.seed for r in runs})
    out: dict[str, Any] = {}
    for frac in FRACTIONS:
        step = round(frac * steps)
        scores: dict[str, dict[str, list[float]]] = {
            m: {"spearman": [], "regret": []} for m in ("law", "loss", "power_law")
        }
        per_seed: dict[str, dict[str, list[float]]] = {m: {"spearman": [], "regret": []} for m in scores}
        fallbacks = 0
        law_errors: list[str] = []
        for seed in seeds:
            mine = [r for r in runs if r.seed == seed]
            try:
                law: AllocationLaw | None = fit_allocation_law(_law_runs(mine, correlation=True, step=step)).law
            except ValueError as err:
                law = None
                law_errors.append(f"seed {seed}: {err}")
            seed_scores: dict[str, dict[str, list[float]]] = {m: {"spearman": [], "regret": []} for m in scores}
            for (_D, _N), by_dk in sorted(cells(mine).items()):
                group = [s[seed] for s in by_dk.values() if seed in s]
                if len(group) < 2:
                    continue
                final = np.array([r.final_loss for r in group])
                preds: dict[str, np.ndarray] = {"loss": np.array([at_step(r, step)[0] for r in group])}
                if law is not None:
                    preds["law"] = np.array([law.predict(r.H, r.d_k, r.N) for r in group])
                ext = []
                for r in group:
                    k = [i for i, s in enumerate(r.curve_steps) if s <= step]
                    value, ok = power_law_extrapolate(
                        [r.curve_steps[i] for i in k], [r.curve_loss[i] for i in k], steps
                    )
                    fallbacks += not ok
                    ext.append(value)
                preds["power_law"] = np.array(ext)
                for method, pred in preds.items():
                    rho = spearmanr(pred, final).statistic if np.ptp(pred) > 0 else math.nan
                    regret = float(final[int(np.argmin(pred))] - final.min())
                    seed_scores[method]["spearman"].append(float(rho))
                    seed_scores[method]["regret"].append(regret)
            for method, sc in seed_scores.items():
                for key in ("spearman", "regret"):
                    xs = [v for v in sc[key] if math.isfinite(v)]
                    per_seed[method][key].append(statistics.fmean(xs) if xs else math.nan)
                    scores[method][key] += sc[key]
        out[f"{int(round(100 * frac))}%"] = {
            "step": step,
            **{
                method: {
                    "spearman": t_interval(per_seed[method]["spearman"]),
                    "regret": t_interval(per_seed[method]["regret"]),
                    "cells": len(scores[method]["regret"]),
                }
                for method in scores
            },
            "power_law_fallbacks": fallbacks,
            "law_errors": law_errors,
        }
    return out


def summarize(runs: Sequence[Run], args: argparse.Namespace, corpus: dict[str, Any], command: str) -> dict[str, Any]:
    best = best_per_cell(runs)
    results = {
        "command": command,
        "corpus": corpus,
        "seeds": sorted({r.seed for r in runs}),
        "widths": sorted({r.D for r in runs}),
        "sizes": sorted({r.N for r in runs}),
        "runs": [
            {
                "D": r.D,
                "H": r.H,
                "d_k": r.d_k,
                "N": r.N,
                "seed": r.seed,
                "final_loss": r.final_loss,
                "key_hdi": r.key_hdi[-1] if r.key_hdi else None,
                "effective_heads": r.effective_heads[-1] if r.effective_heads else None,
                "head_correlation": r.head_correlation[-1] if r.head_correlation else None,
                "attention_entropy": r.attention_entropy[-1] if r.attention_entropy else None,
                "seconds": r.seconds,
                "cpu_seconds": r.cpu_seconds,
                "curve": {"step": r.curve_steps, "loss": r.curve_loss},
                "monitor": {
                    "step": r.measured_steps,
                    "key_hdi": r.key_hdi,
                    "effective_heads": r.effective_heads,
                    "head_correlation": r.head_correlation,
                },
            }
            for r in sorted(runs, key=lambda r: (r.D, r.N, r.d_k, r.seed))
        ],
        "best": best,
        "law_prediction": law_prediction(runs, best, args.min_head_dim),
        "early_choice": early_choice(runs, args.steps),
    }
    assert tuple(results) == RESULT_KEYS
    return results


# ------------------------------------------------------------------------------------ writing
def fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _interval(iv: dict[str, Any], digits: int = 3) -> str:
    if iv["mean"] is None:
        return "-"
    if iv["low"] is None:
        return fmt(iv["mean"], digits)
    return f"{fmt(iv['mean'], digits)} [{fmt(iv['low'], digits)}, {fmt(iv['high'], digits)}]"


def verdicts(res: dict[str, Any]) -> list[str]:
    """What the numbers say, in sentences generated from them (no hand-written claims)."""
    out = []
    lp = res["law_prediction"]
    variants = {k: v for k, v in lp["variants"].items() if "error" not in v}
    for name, v in variants.items():
        for w in v["per_width"]:
            noise = {True: "within seed noise of it", False: "outside seed noise", None: "one seed: no noise test"}
            same = w["predicted_d_k"] == w["measured_d_k"]
            out.append(
                f"Law ({name.replace('_', ' ')}), D = {w['D']}: fitted on the smaller N, it picks d_k = "
                f"{w['predicted_d_k']} at N = {lp['predicted_N']:,}; the measured best is d_k = {w['measured_d_k']}"
                + (" (the same split)." if same else f" ({noise[w['within_noise']]}; regret {fmt(w['regret'])} nats).")
            )
    if len(variants) == 2:
        m, f = (variants[k]["held_out_rms_log_error"] for k in ("measured_correlation", "fitted_rho"))
        verb = "lowers" if m < f else "does not lower"
        out.append(
            f"The measured head correlation (from H_eff) in the ensemble factor {verb} the held-out error"
            f" of the law's losses (RMS log error {m:.4f} with it, {f:.4f} with a fitted rho)."
        )
    tr = lp["trends"]
    for D, by_n in tr["measured_d_k_star"].items():
        seq = [by_n[str(n)] for n in res["sizes"]]
        steady = all(b >= a for a, b in zip(seq, seq[1:], strict=False))
        shape = (
            "grows with N"
            if steady and seq[-1] > seq[0]
            else "does not change with N"
            if len(set(seq)) == 1
            else "does not grow steadily with N"
        )
        out.append(f"Measured best d_k at D = {D} over N = {res['sizes']}: {seq}, which {shape}.")
    if len(res["widths"]) > 1:
        n = str(res["sizes"][-1])
        hs = ", ".join(f"D = {D}: H = {tr['measured_H_star'][n][str(D)]}" for D in res["widths"])
        out.append(f"Best head count at the largest N: {hs}.")
    names = {"law": "(a) the law", "loss": "(b) the current loss", "power_law": "(c) the power-law extrapolation"}
    for at, ec in res["early_choice"].items():
        rho = {k: ec[k]["spearman"]["mean"] for k in names if ec[k]["spearman"]["mean"] is not None}
        reg = {k: ec[k]["regret"]["mean"] for k in names if ec[k]["regret"]["mean"] is not None}
        if not rho or not reg:
            continue
        top = [names[k] for k in names if rho.get(k) == max(rho.values())]
        low = [names[k] for k in names if reg.get(k) == min(reg.values())]
        out.append(
            f"At {at} of training the closest early ranking is {' and '.join(top)} (mean Spearman"
            f" {max(rho.values()):.2f}); the lowest regret: {' and '.join(low)} ({min(reg.values()):.3f} nats)."
            + (" With one seed there are no intervals." if len(res["seeds"]) < 2 else "")
        )
    return out


def markdown(res: dict[str, Any], *, quick: bool, wall: float, plot_name: str) -> str:
    lines = []
    if quick:
        lines += [
            '!!! warning "Quick run, not the result"',
            "    This block comes from `--quick` (one seed, one width, two sizes, a few steps): it shows",
            "    the shape of the output only. The full sweep replaces it.",
            "",
        ]
    runs = res["runs"]
    lines += [
        f"Corpus: {res['corpus']['name']} ({res['corpus']['train_bytes']:,} training bytes,"
        f" {res['corpus']['held_out_bytes']:,} held out). Widths D = {res['widths']}, sizes N = {res['sizes']}"
        f" (distinct training bytes), seeds {res['seeds']}: {len(runs)} runs, {wall / 60:.1f} min wall.",
        f"Command: `{res['command']}`.",
        "",
        "**Held-out loss (nats/byte) per split, mean over seeds.** Bold: the best split; *italic*: splits",
        "the seeds cannot tell apart from it (paired t-test, 95%).",
        "",
    ]
    for D in res["widths"]:
        cellsD = [b for b in res["best"] if b["D"] == D]
        dks = sorted({int(d) for b in cellsD for d in b["mean_loss"]})
        lines += [f"| D = {D}: N | " + " | ".join(f"H={D // d} x {d}" for d in dks) + " |"]
        lines += ["|---:|" + "---:|" * len(dks)]
        for b in cellsD:
            row = []
            for d in dks:
                v = b["mean_loss"].get(str(d))
                text = fmt(v)
                if d == b["best_d_k"]:
                    text = f"**{text}**"
                elif d in (b["within_noise_d_k"] or []):
                    text = f"*{text}*"
                row.append(text)
            lines.append(f"| {b['N']:,} | " + " | ".join(row) + " |")
        lines.append("")
    lp = res["law_prediction"]
    lines += [
        f"**The law, fitted on N = {lp['fitted_on_N']}, predicting N = {lp['predicted_N']:,}.**",
        "",
        "| variant | D | predicted d_k | measured best d_k | within noise | regret (nats) | held-out RMS log error | train RMS log residual |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, v in lp["variants"].items():
        if "error" in v:
            lines.append(f"| {name.replace('_', ' ')} | - | fit failed: {v['error']} | | | | | |")
            continue
        for w in v["per_width"]:
            lines.append(
                f"| {name.replace('_', ' ')} | {w['D']} | {w['predicted_d_k']} | {w['measured_d_k']} |"
                f" {yes_no(w['within_noise'])} | {fmt(w['regret'])} | {fmt(v['held_out_rms_log_error'], 4)} |"
                f" {fmt(v['train_rms_log_residual'], 4)} |"
            )
    tr = lp["trends"]
    lines += ["", "**d_k\\* against N** (measured best; the law fitted on every N, continuous optimum):", ""]
    lines += ["| D | " + " | ".join(f"N={n:,}" for n in res["sizes"]) + " | slope per ln N (measured) |"]
    lines += ["|---:|" + "---:|" * (len(res["sizes"]) + 1)]
    for D in res["widths"]:
        meas = tr["measured_d_k_star"][str(D)]
        law = tr.get("law_d_k_star", {}).get(str(D), {})
        slope = tr.get("measured_d_k_slope_per_ln_N", {}).get(str(D))
        lines.append(
            f"| {D} | "
            + " | ".join(f"{meas[str(n)]} (law {fmt(law.get(str(n)), 1)})" for n in res["sizes"])
            + f" | {fmt(slope, 2)} |"
        )
    conv = tr["conventions"]
    if conv:
        lines += ["", "**Conventions** (rank among the splits of the width; gap to the best, nats):", ""]
        lines += ["| convention | D | N | d_k | rank | gap | within noise |", "|---|---:|---:|---:|---:|---:|---|"]
        for c in conv:
            lines.append(
                f"| {c['convention']} | {c['D']} | {c['N']:,} | {c['d_k']} | {c['rank']} of {c['of']} |"
                f" {fmt(c['gap'])} | {yes_no(c['within_noise'])} |"
            )
    lines += [
        "",
        "**Choosing early** (per (D, N, seed), then the mean over cells per seed; mean and 95% t-interval over seeds):",
        "",
        "| at | method | Spearman with final ranking | regret (nats) |",
        "|---|---|---:|---:|",
    ]
    names = {
        "law": "(a) law, fitted so far",
        "loss": "(b) current held-out loss",
        "power_law": "(c) power-law extrapolation",
    }
    for at, ec in res["early_choice"].items():
        for method, label in names.items():
            lines.append(
                f"| {at} | {label} | {_interval(ec[method]['spearman'])} | {_interval(ec[method]['regret'])} |"
            )
    lines += ["", "**What it says** (sentences generated from the numbers above):", ""]
    lines += [f"- {v}" for v in verdicts(res)]
    lines += ["", f"![allocation on transformers]({plot_name})", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    widths = res["widths"]
    fig = Figure(figsize=(5.0 * (len(widths) + 1), 4.0), layout="constrained")
    axes = fig.subplots(1, len(widths) + 1)
    lp = res["law_prediction"]
    variant = lp["variants"].get("measured_correlation", {})
    for ax, D in zip(axes, widths, strict=False):
        for b in (b for b in res["best"] if b["D"] == D):
            dks = sorted(int(d) for d in b["mean_loss"])
            ys = [b["mean_loss"][str(d)] for d in dks]
            sds = [b["seed_sd"][str(d)] or 0.0 for d in dks]
            ax.errorbar(dks, ys, yerr=sds, marker="o", capsize=2, label=f"N={b['N']:,}")
        for w in variant.get("per_width", []):
            if w["D"] == D:
                dks = sorted(int(d) for d in w["predicted_loss"])
                ax.plot(
                    dks,
                    [w["predicted_loss"][str(d)] for d in dks],
                    "k--",
                    label=f"law, N={lp['predicted_N']:,} (held out)",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("head width d_k")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title(f"D = {D}")
        ax.legend(fontsize=7)
    ax = axes[-1]
    tr = lp["trends"]
    for D in widths:
        meas = tr["measured_d_k_star"][str(D)]
        ax.plot(res["sizes"], [meas[str(n)] for n in res["sizes"]], "o-", label=f"measured best, D={D}")
        law = tr.get("law_d_k_star", {}).get(str(D))
        if law:
            ax.plot(res["sizes"], [law[str(n)] for n in res["sizes"]], "--", label=f"law d_k*, D={D}")
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("N (training bytes)")
    ax.set_ylabel("best head width d_k")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def replace_block(page: Path, text: str) -> None:
    body = page.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} block")
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128], help="attention widths D")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[25_000, 63_000, 158_000, 400_000], help="training bytes N"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of every run")
    parser.add_argument("--min-head-dim", type=int, default=4, help="smallest head width d_k")
    parser.add_argument("--corpus", type=Path, default=None, help="a text file (default: stdlib docstrings)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--logdir", type=Path, default=Path("runs/allocation_transformers"))
    parser.add_argument("--docs", type=Path, default=None, help="rewrite this page's generated block")
    parser.add_argument("--quick", action="store_true", help="one seed, one width, two sizes, few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.sizes, args.seeds, args.steps = [args.widths[0]], [25_000, 100_000], [0], 60
    if any(D % args.min_head_dim for D in args.widths):
        parser.error("every width must be a multiple of --min-head-dim")
    docs = file_documents(args.corpus) if args.corpus else stdlib_documents()
    streams = split_tokens(docs)
    corpus = {
        "name": str(args.corpus) if args.corpus else "stdlib docstrings (the warnings study's corpus)",
        "train_bytes": int(len(streams[0])),
        "held_out_bytes": int(len(streams[1])),
    }
    if max(args.sizes) > len(streams[0]):
        parser.error(f"--sizes up to {max(args.sizes)} but the corpus has {len(streams[0])} training bytes")
    specs = [
        Spec(D, D // d, N, seed, args.steps, str(args.logdir))
        for D in args.widths
        for d in (2**k for k in range(0, 16))
        if args.min_head_dim <= d <= D and D % d == 0
        for N in args.sizes
        for seed in args.seeds
    ]
    command = "python benchmarks/allocation_transformers.py " + " ".join(
        ["--quick"] if args.quick else
        [f"--widths {' '.join(map(str, args.widths))}", f"--sizes {' '.join(map(str, args.sizes))}",
         f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}", f"--min-head-dim {args.min_head_dim}",
         f"--jobs {args.jobs}"] + ([f"--corpus {args.corpus}"] if args.corpus else [])
    )  # fmt: skip
    log(f"{len(specs)} runs of {args.steps} steps on {args.jobs} worker(s); corpus {corpus}")
    start = time.perf_counter()
    runs = train_all(specs, streams, args.jobs)
    wall = time.perf_counter() - start
    results = summarize(runs, args, corpus, command)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "allocation_transformers_quick" if args.quick else "allocation_transformers"
    from hdi_monitor.cli._common import finite_json

    (args.out / f"{stem}.json").write_text(json.dumps(finite_json(results), indent=1) + "\n")
    plot(results, args.out / f"{stem}.png")
    (args.out / f"{stem}.md").write_text(markdown(results, quick=args.quick, wall=wall, plot_name=f"{stem}.png"))
    if args.docs is not None:  # the page shows the plot from docs/img
        image = args.docs.parent / "img" / f"{stem}.png"
        image.parent.mkdir(exist_ok=True)
        shutil.copyfile(args.out / f"{stem}.png", image)
        replace_block(args.docs, markdown(results, quick=args.quick, wall=wall, plot_name=f"img/{stem}.png"))
    log(f"done in {wall / 60:.1f} min: {args.out / (stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
