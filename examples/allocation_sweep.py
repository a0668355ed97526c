"""A small real sweep for the allocation law: ensembles of learned Nadaraya-Watson heads.

The task is the theory's own setting. Inputs ``x`` in R^12 are Gaussian; the target depends on 8
of the coordinates with decaying weights, non-additively (so heads cannot split it between them):

    y = cos(2 * sqrt(sum_j x_j^2 / j)) + noise,  j = 1..8,  noise ~ N(0, 0.1^2)

The model is an ensemble of H Nadaraya-Watson heads with a Gaussian kernel, each in its own
learned d_k-dimensional projection ``W_h`` (its scale is the head's bandwidth), averaged with
equal weights: ``y_hat(q) = mean_h sum_i softmax_i(-|W_h^T (q - x_i)|^2 / 2) y_i`` over the N
training points. This is single-layer attention with queries = keys = W_h^T x and values = y.
The total width is fixed at D = H * d_k = 16 and the projections are trained with Adam on the
leave-one-out training loss. The test loss (MSE against noisy targets, noise floor 0.01) is
measured on 2000 fresh points, with the N training points as keys.

Splits (H, d_k) in {(16,1), (8,2), (4,4), (2,8), (1,16)} at N in {128, 256, 512, 1024, 2048},
``--seeds`` seeds each (default 3: 75 trainings of ``--steps`` 400 Adam steps; the seed draws the
data and the initial projection, shared by all splits). ``--quick`` runs N in {64, 128, 256}, one
seed, 30 steps. The script

1. writes ``sweep.csv`` (H, d_k, N, seed-averaged loss, measured mean head-error correlation, each
   seed's loss);
2. fits the allocation law on every N but the largest, with the noise floor fixed at its known
   value, then predicts the held-out largest-N losses and the best split there;
3. fits the law on all runs and reports d_k* against N (continuous and among the divisors);
4. writes ``allocation.png`` and ``allocation.md`` into ``--out`` and prints what it found.

The default ``--out`` is ``runs/allocation_sweep/``: the checkout is left alone. ``--write-docs``
writes into ``benchmarks/results/allocation_sweep/`` instead, whose ``allocation.md`` is the one
place the sweep's numbers are written down (docs/allocation.md includes it), so rerun the script
with it instead of editing numbers by hand. Time: the default sweep took 122 s of CPU time with
``--threads 1`` (measured on a shared 2-core machine, where it took 28 minutes of wall time at low
priority; on a quiet core wall time is about the CPU time). Needs scipy (from a checkout: ``pip install -e '.[advisor]'``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path

import numpy as np
import scipy.stats
import torch
from einops import rearrange

from hdi_monitor.contrib.allocation import (
    AllocationRun,
    fit_allocation_law,
    optimal_head_dim,
    recommend_allocation,
)

P, M, SIGMA = 12, 8, 0.1  # input dim, relevant coordinates, noise std
TOTAL_DIM = 16
N_TEST = 2000
DOCS_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "allocation_sweep"  # --write-docs


def target(x: torch.Tensor) -> torch.Tensor:
    w = torch.arange(1, M + 1, dtype=x.dtype) ** -1.0
    return torch.cos(2.0 * torch.sqrt((w * x[:, :M] ** 2).sum(-1)))


def make_data(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(n, P, generator=g)
    f = target(x)
    return x, f, f + SIGMA * torch.randn(n, generator=g)


def head_predictions(
    W: torch.Tensor, H: int, q: torch.Tensor, xk: torch.Tensor, yk: torch.Tensor, self_index: torch.Tensor | None = None
) -> torch.Tensor:
    """(H, n_queries) predictions of the H Nadaraya-Watson heads (Gaussian kernel in each projection)."""
    Wh = rearrange(W, "p (h d) -> h p d", h=H)
    pq = torch.einsum("np,hpd->hnd", q, Wh)
    pk = torch.einsum("np,hpd->hnd", xk, Wh)
    # -|a - b|^2 / 2 = a.b - |b|^2/2 - |a|^2/2; the last term is constant over keys and cancels
    logits = pq @ pk.transpose(1, 2) - 0.5 * (pk**2).sum(-1)[:, None, :]
    if self_index is not None:  # leave-one-out: a training query must not see its own value
        logits[:, torch.arange(len(self_index)), self_index] = -float("inf")
    return torch.softmax(logits, dim=-1) @ yk


def train_and_test(H: int, n_train: int, seed: int, steps: int, batch: int, lr: float = 0.05) -> tuple[float, float]:
    """Train one split; return (test MSE, mean off-diagonal correlation of the heads' test errors)."""
    g = torch.Generator().manual_seed(seed)
    x, _, y = make_data(n_train, g)
    xt, ft, yt = make_data(N_TEST, g)
    W = (0.5 * torch.randn(P, TOTAL_DIM, generator=g)).requires_grad_()
    opt = torch.optim.Adam([W], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        idx = torch.randint(0, n_train, (min(batch, n_train),), generator=g)
        pred = head_predictions(W, H, x[idx], x, y, self_index=idx).mean(0)
        loss = ((pred - y[idx]) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        ph = torch.cat([head_predictions(W, H, xt[i : i + 500], x, y) for i in range(0, N_TEST, 500)], dim=1)
        test = float(((ph.mean(0) - yt) ** 2).mean())
        corr = float("nan")
        if H > 1:
            C = torch.corrcoef((ph - ft).double())
            corr = float((C.sum() - C.diagonal().sum()) / (H * (H - 1)))
    return test, corr


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: runs/allocation_sweep)")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="regenerate the tracked results: --out defaults to benchmarks/results/allocation_sweep",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (N up to 256, 1 seed, 30 steps)")
    parser.add_argument(
        "--refit", action="store_true", help="skip training: fit and report from the sweep.csv already in --out"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(DOCS_OUT) if args.write_docs else "runs/allocation_sweep"
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    n_values = [64, 128, 256] if args.quick else [128, 256, 512, 1024, 2048]
    seeds = 1 if args.quick else args.seeds
    steps = 30 if args.quick else args.steps
    heads = [16, 8, 4, 2, 1]

    t0 = time.time()
    per_seed: dict[tuple[int, int], list[float]] = {}  # (N, H) -> test MSE of each seed
    corrs: dict[tuple[int, int], float | None] = {}  # (N, H) -> seed-mean head-error correlation
    if args.refit:  # the training results of an earlier run, from its sweep.csv
        with open(out / "sweep.csv", newline="") as fh:
            lines = fh.read().splitlines()
        provenance = lines[0].lstrip("# ") + "; fit and report rerun with --refit"
        for row in csv.DictReader(ln for ln in lines if not ln.startswith("#")):
            key = (int(row["N"]), int(row["H"]))
            per_seed[key] = [float(row[k]) for k in sorted(row) if k.startswith("loss_seed")]
            corrs[key] = float(row["correlation"]) if row["correlation"] else None
        n_values = sorted({n for n, _ in per_seed})
        seeds = len(next(iter(per_seed.values())))
    else:
        for n in n_values:
            for H in heads:
                res = [train_and_test(H, n, s, steps, args.batch) for s in range(seeds)]
                per_seed[(n, H)] = [r[0] for r in res]
                corrs[(n, H)] = float(np.mean([r[1] for r in res])) if H > 1 else None
                print(
                    f"N={n:5d}  H={H:2d} d_k={TOTAL_DIM // H:2d}  test MSE {np.mean(per_seed[(n, H)]):.4f}"
                    f" (seeds {', '.join(f'{r[0]:.4f}' for r in res)})"
                    f"  head-error corr {corrs[(n, H)] or float('nan'):.3f}",
                    flush=True,
                )
        provenance = (
            f"{len(n_values) * len(heads)} splits x {seeds} seed(s), {steps} Adam steps each;"
            f" training took {time.time() - t0:.0f} s"
        )
        with open(out / "sweep.csv", "w", newline="") as fh:
            fh.write(f"# {provenance}\n")
            w = csv.writer(fh)
            w.writerow(["H", "d_k", "N", "loss", "correlation", *(f"loss_seed{s}" for s in range(seeds))])
            for (n, H), losses in per_seed.items():
                corr = corrs[(n, H)]
                w.writerow(
                    [H, TOTAL_DIM // H, n, f"{np.mean(losses):.6g}", "" if corr is None else f"{corr:.4f}"]
                    + [f"{v:.6g}" for v in losses]
                )
    n_fit, n_held = n_values[:-1], n_values[-1]
    runs = [AllocationRun(H, TOTAL_DIM // H, n, float(np.mean(v)), corrs[(n, H)]) for (n, H), v in per_seed.items()]

    noise = SIGMA**2  # the Bayes error of the test MSE, known by construction: held fixed in the fits
    plain = [AllocationRun(r.num_heads, r.head_dim, r.n_train, r.loss) for r in runs]  # without correlations
    # (a) fit on the smaller N, predict the largest N (extrapolation, as a user would with a bigger dataset)
    fit = fit_allocation_law([r for r in plain if r.n_train in n_fit], fixed={"sigma2": noise})
    held = [r for r in runs if r.n_train == n_held]
    pred_held = np.array([fit.law.predict(r.num_heads, r.head_dim, r.n_train) for r in held])
    held_resid = np.log(pred_held) - np.log([r.loss for r in held])
    # (b) fit on all runs; (c) the same with the measured head correlations plugged in per run
    fit_all = fit_allocation_law(plain, fixed={"sigma2": noise})
    fit_corr = fit_allocation_law(runs, fixed={"sigma2": noise})

    def best_measured(n: float) -> AllocationRun:
        return min((r for r in runs if r.n_train == n), key=lambda r: r.loss)

    def near_best(n: float) -> list[int]:
        """d_k of the splits whose mean MSE is within one standard error (of the difference) of the best."""
        best = best_measured(n)
        if seeds < 2:
            return [best.head_dim]
        sem = {H: float(np.std(per_seed[(n, H)], ddof=1)) / math.sqrt(seeds) for H in heads}
        return sorted(
            TOTAL_DIM // H for H in heads if measured_loss(n, H) - best.loss <= math.hypot(sem[H], sem[best.num_heads])
        )

    def best_per_seed(n: float) -> list[int]:
        return [TOTAL_DIM // min(heads, key=lambda H: per_seed[(n, H)][s]) for s in range(seeds)]

    def measured_loss(n: float, H: int) -> float:
        return next(r.loss for r in runs if r.n_train == n and r.num_heads == H)

    rec_held = recommend_allocation(TOTAL_DIM, n_held, fit.law, min_head_dim=1, max_head_dim=TOTAL_DIM)
    regret = measured_loss(n_held, rec_held.num_heads) / best_measured(n_held).loss - 1
    cont_all = [optimal_head_dim(TOTAL_DIM, n, fit_all.law) for n in n_values]
    best_d = [best_measured(n).head_dim for n in n_values]

    lines: list[str] = []
    say = lines.append
    say(f"# Allocation sweep: learned Nadaraya-Watson head ensembles, D = {TOTAL_DIM}\n")
    say(f"{provenance}.\n")
    say("## Measured test MSE (mean over seeds; noise floor 0.01)\n")
    say(
        "| N | "
        + " | ".join(f"H={H}, d_k={TOTAL_DIM // H}" for H in heads)
        + " | best d_k | within seed noise of the best | best d_k per seed |"
    )
    say("|---:|" + "---:|" * (len(heads) + 2) + "---|")
    for n in n_values:
        best_h = best_measured(n).num_heads
        cells = [f"**{measured_loss(n, H):.4f}**" if best_h == H else f"{measured_loss(n, H):.4f}" for H in heads]
        say(
            f"| {n} | " + " | ".join(cells) + f" | {TOTAL_DIM // best_h} | {', '.join(map(str, near_best(n)))}"
            f" | {', '.join(map(str, best_per_seed(n)))} |"
        )
    say(
        "\nBest: the lowest mean MSE over the seeds (the ranking uses the full values, four decimals are shown)."
        " 'Within seed noise' lists every d_k whose mean is within one standard error (of the difference) of the"
        " best; where it lists several, this sweep cannot tell them apart."
    )
    say("\nMean correlation of the heads' test errors (H > 1):\n")
    say("| N | " + " | ".join(f"d_k={TOTAL_DIM // H}" for H in heads[:-1]) + " |")
    say("|---:|" + "---:|" * (len(heads) - 1))
    for n in n_values:
        row = {r.num_heads: r for r in runs if r.n_train == n}
        say(f"| {n} | " + " | ".join(f"{row[H].correlation:.3f}" for H in heads[:-1]) + " |")
    say(f"\n## Fit on N in {n_fit}, prediction of held-out N = {n_held}\n")
    say("```\n" + fit.summary() + "\n```\n")
    say("| H | d_k | measured | predicted | log residual |\n|---:|---:|---:|---:|---:|")
    for r, p, e in zip(held, pred_held, held_resid):
        say(f"| {r.num_heads} | {r.head_dim} | {r.loss:.4f} | {p:.4f} | {e:+.3f} |")
    say(
        f"\nHeld-out RMS log residual {math.sqrt(float(np.mean(held_resid**2))):.3f}"
        f" (in-sample {fit.rms_log_residual:.3f}). Predicted best split at N = {n_held}:"
        f" H={rec_held.num_heads}, d_k={rec_held.head_dim}; measured best: H={best_measured(n_held).num_heads},"
        f" d_k={best_measured(n_held).head_dim}; the predicted split's measured loss is {100 * regret:+.1f}%"
        " from the measured best.\n"
    )
    say("## d_k* against N\n")
    say("Law fitted to all runs (constant rho):\n")
    say("```\n" + fit_all.summary() + "\n```\n")
    say("Same, with each run's measured head correlation in the ensemble factor:\n")
    say("```\n" + fit_corr.summary() + "\n```\n")
    say("| N | d_k* (fit on all) | best divisor (fit on all) | d_k* (fit on small N) | measured best d_k |")
    say("|---:|---:|---:|---:|---:|")
    for n, c_all, b in zip(n_values, cont_all, best_d):
        d_all = recommend_allocation(TOTAL_DIM, n, fit_all.law, min_head_dim=1, max_head_dim=TOTAL_DIM).head_dim
        say(f"| {n} | {c_all:.2f} | {d_all} | {optimal_head_dim(TOTAL_DIM, n, fit.law):.2f} | {b} |")
    # what it shows, computed from the numbers above
    two_beta = 2 * fit_all.law.beta
    rank = float(scipy.stats.spearmanr(n_values, best_d).statistic)
    say("\n## What it shows\n")
    say(
        f"- Measured best d_k over N = {n_values[0]}..{n_values[-1]}: {best_d}"
        f" (rank correlation with N {rank:+.2f})."
        + (
            " Several splits are within seed noise of the best at "
            + "; ".join(f"N = {n} (d_k = {', '.join(map(str, near_best(n)))})" for n in tied)
            + ": there the sweep does not pick a winner."
            if (tied := [n for n in n_values if len(near_best(n)) > 1])
            else " Every winner is clear of seed noise."
        )
    )
    say(
        f"- The fitted law's continuous d_k* goes {cont_all[0]:.2f} -> {cont_all[-1]:.2f} over the same range"
        f" ({'rising' if cont_all[-1] > cont_all[0] else 'not rising'} with N)."
    )
    regime = "pre-asymptotic (d_k* < 2 beta)" if max(cont_all) < two_beta else "asymptotic (d_k* > 2 beta)"
    say(
        f"- Fitted 2 beta = {two_beta:.1f}, so this sweep is in the law's {regime} regime: there d_k* grows faster"
        " than linearly in log N; the log N / log log N regime needs d_k well above 2 beta."
        if regime.startswith("pre")
        else f"- Fitted 2 beta = {two_beta:.1f}: this sweep is in the law's {regime} regime (d_k* ~ log N / log log N)."
    )
    if fit_all.law.rho > 0.99:
        say(
            "- The fit drives rho to 1: this sweep gives no evidence for the ensemble factor (many narrow heads"
            " are strongly correlated, see the correlation table); the d_k dependence is carried by the"
            " approximation and estimation terms alone."
        )
    elif fit_all.law.rho < 0.01:
        say(
            "- The fit drives rho to 0: the ensemble factor 1/H takes its strongest form here, although the"
            " measured head-error correlations (table above) are far from 0."
        )
    say(
        f"- Extrapolation to N = {n_held}: RMS log residual {math.sqrt(float(np.mean(held_resid**2))):.3f};"
        f" mean log residual {float(np.mean(held_resid)):+.3f}"
        f" ({'over' if np.mean(held_resid) > 0 else 'under'}-predicts the loss on average)."
    )
    report = "\n".join(lines)
    (out / "allocation.md").write_text(report + "\n")
    print()
    print(report)

    _plot(out / "allocation.png", runs, fit, fit_all, n_values, heads)
    print(
        f"\nwrote {out / 'sweep.csv'}, {out / 'allocation.md'}, {out / 'allocation.png'}"
        f" ({time.time() - t0:.0f} s in all)"
    )


def _plot(path: Path, runs, fit, fit_all, n_values, heads) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    ax = axes[0]
    dgrid = np.geomspace(1, TOTAL_DIM, 100)
    for color, n in zip(("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"), n_values):
        rs = sorted((r for r in runs if r.n_train == n), key=lambda r: r.head_dim)
        ax.plot([r.head_dim for r in rs], [r.loss for r in rs], "o", color=color, label=f"measured N={n}")
        held_out = n > max(r.n_train for r in fit.runs)
        ax.plot(
            dgrid,
            fit.law.predict(TOTAL_DIM / dgrid, dgrid, n),
            "--" if held_out else "-",
            color=color,
            alpha=0.8,
            label="law (held out)" if held_out else None,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("head width d_k  (H = 16 / d_k)")
    ax.set_ylabel("test MSE")
    ax.set_title("measured (dots) vs law fitted on the smaller N (lines)")
    ax.legend(fontsize=7)
    ax = axes[1]
    ns = np.geomspace(64, 1e5, 60)
    ax.plot(ns, [optimal_head_dim(TOTAL_DIM, n, fit_all.law) for n in ns], "-", color="k", label="d_k* (fit on all)")
    ax.plot(
        ns, [optimal_head_dim(TOTAL_DIM, n, fit.law) for n in ns], "--", color="gray", label="d_k* (fit on small N)"
    )
    meas = [min((r for r in runs if r.n_train == n), key=lambda r: r.loss).head_dim for n in n_values]
    ax.plot(n_values, meas, "s", color="tab:red", ms=9, label="measured best d_k")
    ax.set_xscale("log")
    ax.set_xlabel("training-set size N")
    ax.set_ylabel("optimal head width d_k*")
    ax.set_title("does d_k* move with N?")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
