"""Subcommands of the ``hdi-monitor`` console script.

Each subcommand is a module here exposing ``HELP: str``, ``add_arguments(parser)`` and
``run(args) -> int``. A subcommand reports bad user input by raising `CLIError`; the entry
point turns it into a one-line message on stderr and exit status 2.
"""

from __future__ import annotations


class CLIError(Exception):
    """Bad user input: printed as one line on stderr, exit status 2, no traceback."""


# name -> module, imported lazily so that `hdi-monitor --help` stays fast.
SUBCOMMANDS: dict[str, str] = {
    "demo": "hdi_monitor.cli.demo",
    "report": "hdi_monitor.cli.report",
    "allocate": "hdi_monitor.cli.allocate",
    "prune": "hdi_monitor.cli.prune",
}
