"""What every subcommand of the ``hdi-monitor`` console script shares: `CLIError`."""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """Bad user input: printed as one line on stderr, exit status 2, no traceback."""
