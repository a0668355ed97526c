"""``hdi-monitor allocate``: recommend a head count / head width split of a fixed attention width.

    hdi-monitor allocate --budget D --train-size N [--sweep runs.csv] [--current-heads H] [--out plot.png [--force]]
    hdi-monitor allocate --runs DIR [DIR ...] --metric TAG [--tokens N] [--budget D] [--train-size N] [--out ...]

Prints the recommended ``(H, d_k)``, the continuous optimum ``d_k*`` and the predicted loss of every
feasible split (divisors of ``D`` in ``[--min-head-dim, --max-head-dim]``). With ``--sweep`` the
allocation law is first fitted to the sweep (columns ``H, d_k, N, loss`` and optionally
``correlation``) and the fit's residuals are printed; without it the law's illustrative defaults
are used. ``--out`` writes a plot; it never overwrites by surprise (see `_plot_path`).

With ``--runs`` the sweep is read from the TensorBoard records of runs trained with the monitor
(`hdi_monitor.contrib.allocation.runs`): the split from the monitor's table of layer shapes, the
held-out loss from the scalar ``--metric`` (its last value), ``N`` from ``--tokens`` or the runs'
hyperparameter ``--tokens-key``, and the measured head correlation (``head_correlation/mean``)
in the ensemble factor unless ``--no-correlation``. ``--budget`` then defaults to the sweep's width
``H * d_k`` (the largest, if it has several), ``--train-size`` to its largest ``N`` and the head-width
range to the sweep's. Runs that do not form a sweep (one split, one head width, a missing metric)
are refused with a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from hdi_monitor.cli._common import CLIError, finite_json, no_link

HELP = "recommend how to split an attention width D into H heads of width d_k (allocation law)"


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 1")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return v


def _assignment(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. sigma2=0.01)")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        type=_positive_int,
        metavar="D",
        help="total attention width D = H * d_k to split (required without --runs; default there: the sweep's)",
    )
    parser.add_argument(
        "--train-size",
        type=_positive_float,
        metavar="N",
        help="training-set size N (same units as the sweep; 1e6 notation accepted; required without --runs;"
        " default there: the sweep's largest N)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--sweep", metavar="CSV", help="fit the law to this sweep first: columns H, d_k, N, loss [, correlation]"
    )
    source.add_argument(
        "--runs",
        nargs="+",
        metavar="DIR",
        help="fit the law to runs logged with the monitor: TensorBoard run folders (or folders of them)",
    )
    parser.add_argument(
        "--metric", metavar="TAG", help="with --runs: the scalar tag of the held-out loss (its last value is used)"
    )
    parser.add_argument(
        "--tokens",
        type=_positive_float,
        metavar="N",
        help="with --runs: the training-set size N of every run (default: each run's --tokens-key hyperparameter)",
    )
    parser.add_argument(
        "--tokens-key",
        default="train_tokens",
        metavar="NAME",
        help="with --runs: the hyperparameter that holds a run's N (default train_tokens)",
    )
    parser.add_argument(
        "--no-correlation",
        action="store_true",
        help="with --runs: fit rho instead of using the runs' measured head correlation",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the recommendation, the fit and the runs as JSON to this file"
    )
    parser.add_argument(
        "--current-heads", type=_positive_int, metavar="H", help="the head count in use now; marked in the table"
    )
    parser.add_argument(
        "--min-head-dim",
        type=_positive_int,
        metavar="D_MIN",
        help="smallest head width to consider (default 8; with --runs the sweep's smallest)",
    )
    parser.add_argument(
        "--max-head-dim",
        type=_positive_int,
        metavar="D_MAX",
        help="largest head width to consider (default 256; with --runs the sweep's largest)",
    )
    parser.add_argument(
        "--correlation",
        type=float,
        metavar="RHO",
        help="measured mean head correlation in [0, 1], used instead of the law's rho",
    )
    parser.add_argument(
        "--fix",
        type=_assignment,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="hold a law parameter fixed while fitting (repeatable), e.g. --fix sigma2=0.01",
    )
    parser.add_argument(
        "--out", metavar="PATH", help="write a plot here (.png/.svg/.pdf; a directory gets allocation.png)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing --out plot (a symbolic link --out is still refused)"
    )


def _plot_path(value: str, force: bool) -> Path:
    """The file ``--out`` names, checked (and its folder created) before any work is done.

    A folder (or a new name without a suffix, created) gets ``allocation.png``. Refused
    (CLIError): a symbolic link named by ``--out`` (links are never followed), a missing parent
    folder, a format other than .png/.svg/.pdf, and a file that exists unless ``force`` (it is
    then replaced when the plot is written; a link standing at ``allocation.png`` inside the folder
    is removed then, see `no_link`, never written through).
    """
    out = Path(value)
    if out.is_symlink():
        raise CLIError(f"--out {value!r} is a symbolic link; give a real file or folder (links are not followed)")
    if out.is_dir() or (not out.suffix and not out.exists()):
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CLIError(f"--out {value!r}: cannot create the folder ({err.strerror or err})") from err
        out = out / "allocation.png"
    elif not out.parent.exists():
        raise CLIError(f"--out: directory {str(out.parent)!r} does not exist")
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CLIError(f"--out: unsupported plot format {out.suffix!r}; use .png, .svg or .pdf")
    if out.is_dir():
        raise CLIError(f"--out: {str(out)!r} is a folder; give a file name or the folder that holds it")
    if (out.exists() or out.is_symlink()) and not force:
        raise CLIError(f"--out: {str(out)!r} exists; pass --force to replace it, or give a new file name")
    return out


def run(args: argparse.Namespace) -> int:
    from hdi_monitor.contrib.allocation import (
        AllocationLaw,
        fit_allocation_law,
        load_sweep_csv,
        plot_allocation,
        recommend_allocation,
    )

    plot = _plot_path(args.out, args.force) if args.out else None  # before any work: not after a fit
    json_path = _json_path(args.json, args.force) if args.json else None
    law = AllocationLaw()
    fit = None
    if args.fix and not (args.sweep or args.runs):
        raise CLIError("--fix only applies when fitting a --sweep or --runs")
    if not args.runs:
        unused = [f"--{n.replace('_', '-')}" for n in ("metric", "tokens", "no_correlation") if getattr(args, n)]
        if unused:
            raise CLIError(f"{', '.join(unused)} only apply with --runs")
        missing = [opt for opt, v in (("--budget", args.budget), ("--train-size", args.train_size)) if v is None]
        if missing:
            raise CLIError(f"{' and '.join(missing)} required (or fit runs logged with the monitor: --runs DIR ...)")
    logged = None
    budget, n_target = args.budget, args.train_size
    min_d, max_d = args.min_head_dim or 8, args.max_head_dim or 256
    source = "illustrative defaults (fit a sweep with --sweep or --runs)"
    try:
        if args.runs:
            if not args.metric:
                raise CLIError("--runs needs --metric TAG: the scalar tag of the held-out loss (e.g. val_loss)")
            from hdi_monitor.contrib.allocation.runs import read_logged_sweep

            logged = read_logged_sweep(args.runs, args.metric, tokens=args.tokens, tokens_key=args.tokens_key)
            runs = [r.to_allocation_run(use_correlation=not args.no_correlation) for r in logged]
            budget = budget or max(r.total_dim for r in logged)
            n_target = n_target or max(r.n_train for r in logged)
            min_d = args.min_head_dim or min(r.head_dim for r in logged)
            max_d = args.max_head_dim or max(r.head_dim for r in logged)
            source = f"fitted to {len(logged)} runs logged with the monitor (--metric {args.metric})"
        elif args.sweep:
            runs = load_sweep_csv(args.sweep)
            source = f"fitted to {args.sweep}"
        if args.runs or args.sweep:
            fit = fit_allocation_law(runs, fixed=dict(args.fix) if args.fix else None)
            law = fit.law
        rec = recommend_allocation(
            budget,
            n_target,
            law,
            current_heads=args.current_heads,
            min_head_dim=min_d,
            max_head_dim=max_d,
            correlation=args.correlation,
        )
    except (ImportError, ValueError) as err:  # ImportError: scipy/tensorboard, the advisor extra, is missing
        raise CLIError(str(err)) from None

    print(f"Allocation law ({source}):")
    print(f"  {law.formula()}")
    if logged is not None:
        widths = sorted({r.total_dim for r in logged})
        print(f"  runs: {len(logged)}, widths D={widths}, N={sorted({r.n_train for r in logged})}")
        if len(widths) > 1 and args.budget is None:
            print(f"  (several widths: recommending for the largest, D={budget}; choose one with --budget)")
    if fit is not None:
        print("  " + fit.summary().replace("\n", "\n  "))
        print("Residuals (ln predicted - ln measured):")
        print(_indent(fit.residual_table(limit=20)))
        if len(fit.runs) > 20:
            print(f"  (the 20 largest of {len(fit.runs)} runs)")
    print()
    print(rec.summary())
    print()
    print(rec.format_table())

    if plot is not None:
        plot_allocation(rec, no_link(plot), fit=fit)  # a link is replaced, never written through
        print(f"\nwrote {plot}")
    if json_path is not None:
        no_link(json_path).write_text(json.dumps(finite_json(_as_json(rec, fit, logged)), indent=1) + "\n")
        print(f"wrote {json_path}")
    return 0


def _json_path(value: str, force: bool) -> Path:
    """The ``--json`` file, checked before any work (same rules as ``--out`` for a file)."""
    out = Path(value)
    if out.is_symlink():
        raise CLIError(f"--json {value!r} is a symbolic link; give a real file (links are not followed)")
    if out.is_dir():
        raise CLIError(f"--json {value!r} is a folder; give a file name")
    if not out.parent.exists():
        raise CLIError(f"--json: directory {str(out.parent)!r} does not exist")
    if out.exists() and not force:
        raise CLIError(f"--json: {str(out)!r} exists; pass --force to replace it, or give a new file name")
    return out


def _as_json(rec: Any, fit: Any, logged: Any) -> dict[str, Any]:
    """The recommendation, the fit (law, per-run residuals) and the runs read, as plain data."""
    out: dict[str, Any] = {
        "recommendation": {
            "total_dim": rec.total_dim,
            "n_train": rec.n_train,
            "num_heads": rec.num_heads,
            "head_dim": rec.head_dim,
            "predicted_loss": rec.predicted_loss,
            "continuous_head_dim": rec.continuous_head_dim,
            "table": [
                {"num_heads": o.num_heads, "head_dim": o.head_dim, "predicted_loss": o.predicted_loss}
                for o in rec.table
            ],
        },
        "law": rec.law.as_dict(),
    }
    if fit is not None:
        out["fit"] = {
            "rms_log_residual": fit.rms_log_residual,
            "converged": fit.converged,
            "rho_source": fit.rho_source,
            "at_bound": list(fit.at_bound),
            "residuals": [
                {
                    "num_heads": r.num_heads,
                    "head_dim": r.head_dim,
                    "n_train": r.n_train,
                    "loss": r.loss,
                    "predicted": float(p),
                    "log_residual": float(e),
                }
                for r, p, e in zip(fit.runs, fit.predicted, fit.residuals, strict=True)
            ],
        }
    if logged is not None:
        out["runs"] = [dataclasses.asdict(r) for r in logged]
    return out


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
