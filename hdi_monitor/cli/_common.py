"""What the subcommands of the ``hdi-monitor`` console script share: `CLIError` and the model
arguments."""

from __future__ import annotations

import argparse

__all__ = ["CLIError", "add_model_arguments"]


class CLIError(Exception):
    """Bad user input: printed as one line on stderr, exit status 2, no traceback."""


def add_model_arguments(parser: argparse.ArgumentParser, *, path_metavar: str = "PATH") -> None:
    """The arguments that name a model and its attention layers: ``path``, ``--module``, ``--config``
    and ``--layers`` (read by `hdi_monitor.cli.report.load_model` and ``find_layers``)."""
    parser.add_argument(
        "path", metavar=path_metavar, help="Hugging Face model folder, Lightning checkpoint, or state_dict file"
    )
    parser.add_argument(
        "--module", metavar="PACKAGE.CLASS", help="LightningModule class to rebuild a Lightning checkpoint"
    )
    parser.add_argument(
        "--config", metavar="CONFIG", help="Hugging Face config.json (or its folder) for a plain state_dict"
    )
    parser.add_argument(
        "--layers", metavar="REGEX", help="only attention layers whose qualified name matches this regex (re.search)"
    )
