"""The ``hdi-monitor`` console script: a thin dispatcher over the subcommand modules.

Each subcommand is a module of this package exposing ``HELP: str``, ``add_arguments(parser)`` and
``run(args) -> int``; it reports bad user input by raising `CLIError`, which `main` turns into a
one-line message on stderr and exit status 2. The subcommand modules are imported plainly: each
one imports its heavy dependencies (Lightning, transformers, scipy, matplotlib) inside ``run``, so
importing all four costs about 20 ms on top of ``import hdi_monitor``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from hdi_monitor import __version__
from hdi_monitor.cli import allocate, demo, prune, report
from hdi_monitor.cli._common import CLIError

__all__ = ["SUBCOMMANDS", "CLIError", "build_parser", "main"]

#: Subcommand name -> its module, in the order ``hdi-monitor --help`` lists them.
SUBCOMMANDS: dict[str, ModuleType] = {"demo": demo, "report": report, "allocate": allocate, "prune": prune}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hdi-monitor`` with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="hdi-monitor",
        description="Attention-head diversity (HDI) for transformers: reports, demo training, allocation advice.",
    )
    parser.add_argument("--version", action="version", version=f"hdi-monitor {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns the process exit status (0 ok, 2 bad input or an unwritable/unreadable
    path, 1 internal error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except CLIError as err:
        if args.debug:
            raise
        print(f"hdi-monitor {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as err:  # the environment, not a bug: a full disk, a read-only or missing path
        if args.debug:
            raise
        where = f"{str(err.filename)!r}: " if err.filename is not None else ""
        print(f"hdi-monitor {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        print(
            f"hdi-monitor {args.command}: internal error: {type(err).__name__}: {err} (rerun with --debug)",
            file=sys.stderr,
        )
        return 1
