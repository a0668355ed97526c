"""``hdi-monitor allocate``: recommend a head count / head width split of a fixed attention width.

    hdi-monitor allocate --budget D --train-size N [--sweep runs.csv] [--current-heads H] [--out plot.png [--force]]

Prints the recommended ``(H, d_k)``, the continuous optimum ``d_k*`` and the predicted loss of every
feasible split (divisors of ``D`` in ``[--min-head-dim, --max-head-dim]``). With ``--sweep`` the
allocation law is first fitted to the sweep (columns ``H, d_k, N, loss`` and optionally
``correlation``) and the fit's residuals are printed; without it the law's illustrative defaults
are used. ``--out`` writes a plot; it never overwrites by surprise (see `_plot_path`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hdi_monitor.cli._common import CLIError, no_link

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
        "--budget", type=_positive_int, required=True, metavar="D", help="total attention width D = H * d_k to split"
    )
    parser.add_argument(
        "--train-size",
        type=_positive_float,
        required=True,
        metavar="N",
        help="training-set size N (same units as the sweep; 1e6 notation accepted)",
    )
    parser.add_argument(
        "--sweep", metavar="CSV", help="fit the law to this sweep first: columns H, d_k, N, loss [, correlation]"
    )
    parser.add_argument(
        "--current-heads", type=_positive_int, metavar="H", help="the head count in use now; marked in the table"
    )
    parser.add_argument(
        "--min-head-dim",
        type=_positive_int,
        default=8,
        metavar="D_MIN",
        help="smallest head width to consider (default 8)",
    )
    parser.add_argument(
        "--max-head-dim",
        type=_positive_int,
        default=256,
        metavar="D_MAX",
        help="largest head width to consider (default 256)",
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
    law = AllocationLaw()
    fit = None
    if args.fix and not args.sweep:
        raise CLIError("--fix only applies when fitting a --sweep")
    if args.sweep:
        try:
            runs = load_sweep_csv(args.sweep)
            fit = fit_allocation_law(runs, fixed=dict(args.fix) if args.fix else None)
        except (ImportError, ValueError) as err:  # ImportError: scipy, the advisor extra, is missing
            raise CLIError(str(err)) from None
        law = fit.law
    try:
        rec = recommend_allocation(
            args.budget,
            args.train_size,
            law,
            current_heads=args.current_heads,
            min_head_dim=args.min_head_dim,
            max_head_dim=args.max_head_dim,
            correlation=args.correlation,
        )
    except (ImportError, ValueError) as err:
        raise CLIError(str(err)) from None

    source = f"fitted to {args.sweep}" if fit is not None else "illustrative defaults (fit a sweep with --sweep)"
    print(f"Allocation law ({source}):")
    print(f"  {law.formula()}")
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
    return 0


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
