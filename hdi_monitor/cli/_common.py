"""What the subcommands of the ``hdi-monitor`` console script share: `CLIError` and the model
arguments."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

__all__ = ["CLIError", "add_model_arguments", "finite_json", "no_link", "prepare_out_dir"]


class CLIError(Exception):
    """Bad user input: printed as one line on stderr, exit status 2, no traceback."""


def add_model_arguments(parser: argparse.ArgumentParser, *, path_metavar: str = "PATH") -> None:
    """The arguments that name a model and its attention layers: ``path``, ``--module``, ``--config``,
    ``--layers`` and ``--tokenizer`` (read by `hdi_monitor.cli.report.load_model` and ``find_layers``)."""
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
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder for a .txt --inputs (default: the model folder, or the --config folder)",
    )


def prepare_out_dir(value: str, force: bool, option: str = "--out") -> Path:
    """Check and create an output folder before any work is done.

    Refused (CLIError): a symbolic link (links are never followed), something that is not a
    folder, and a folder that is not empty unless ``force`` (files of the same names are then
    replaced; a link standing where a file goes is removed first, see `no_link`).
    """
    path = Path(value)
    if path.is_symlink():
        raise CLIError(f"{option} {value!r} is a symbolic link; give a real folder (links are not followed)")
    if path.exists() and not path.is_dir():
        raise CLIError(f"{option} {value!r} exists and is not a folder")
    if path.is_dir() and not force:
        entries = sum(1 for _ in path.iterdir())
        if entries:
            raise CLIError(
                f"{option} {value!r} is not empty ({entries} entries); pass --force to write into it (files of "
                "the same names are replaced), or give a new folder"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"{option} {value!r}: cannot create the folder {_os_error(err, value)}") from err
    return path


def no_link(path: str | Path) -> Path:
    """``path``, with a symbolic link standing there removed first, so that the write that follows
    creates a regular file in the output folder and never writes through the link."""
    p = Path(path)
    if p.is_symlink():
        p.unlink()
    return p


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by None: valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _os_error(err: OSError, default: str) -> str:
    """``'path': reason`` of an OSError, in words (``'runs/x/index.html': No space left on device``)."""
    where = err.filename if err.filename is not None else default
    reason = err.strerror or str(err) or type(err).__name__
    if isinstance(err, (NotADirectoryError, FileExistsError)) and not isinstance(err, IsADirectoryError):
        reason += " (a file stands where a folder is expected)"
    elif isinstance(err, IsADirectoryError):
        reason += " (a folder stands where a file is expected)"
    return f"{str(where)!r}: {reason}"
