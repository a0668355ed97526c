"""``hdi-monitor report PATH``: head diversity of a trained model, offline.

PATH is one of

* a Hugging Face model folder (``config.json`` + weights), loaded with
  ``transformers.AutoModel.from_pretrained(PATH, local_files_only=True)``;
* a Lightning checkpoint (``.ckpt``), rebuilt with ``--module package.Class`` through
  ``Class.load_from_checkpoint(PATH, map_location="cpu")``;
* a plain ``state_dict`` (``.pt``/``.pth``/``.bin``/``.safetensors``) with ``--config`` (a Hugging
  Face ``config.json`` or a folder holding one): the model class named in the config's
  ``architectures`` (else ``AutoModel.from_config``) and a strict ``load_state_dict`` that accepts
  one common key prefix (``model.``, ``bert.``, ...);
* with ``--allow-pickle`` only, a whole pickled ``nn.Module`` saved by ``torch.save(model)``.

Files are read with ``torch.load(weights_only=True)``; ``--allow-pickle`` lifts that for files you
trust (unpickling can run code). The output is a table (default) under a line that names the
model and its training step, the JSON of `to_dict` with a ``training_step`` field (``--json``,
nothing else on stdout), and with ``--out DIR`` heatmaps, an HDI-by-layer plot and a
self-contained ``index.html`` that states the step too. The step is the one the source records
(`hdi_monitor.cli._load.TrainingStep`: a Lightning checkpoint's ``global_step``, the
``global_step`` of a Hugging Face Trainer folder's ``trainer_state.json``); a source that records
none (a ``from_pretrained`` folder, a state_dict) is said to have an unknown step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdi_monitor.cli._common import CLIError, _os_error, add_model_arguments, prepare_out_dir
from hdi_monitor.cli._load import load_inputs, load_model
from hdi_monitor.cli._load import one_line as _one_line

HELP = "report the head diversity of a trained model (Hugging Face folder, Lightning checkpoint or state_dict)"

_PROJECTIONS = ("query", "key", "value", "output")
_PROGRESS_LAYERS = 12  # show a progress bar by default above this many attention layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--projections",
        action="append",
        metavar="P[,P...]",
        help="projections to measure, comma-separated (or repeated): query, key, value, output, or 'all' (default: all)",
    )
    parser.add_argument(
        "--weighting", choices=("spectral", "uniform"), default="spectral", help="subspace overlap (default: spectral)"
    )
    parser.add_argument(
        "--inputs",
        metavar="FILE",
        help="a .txt file (one example per line) or a .pt tensor/dict file, for head-output statistics",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="cap on tokens per layer for --inputs"
    )
    parser.add_argument(
        "--call",
        metavar="NAME",
        help="the submodule to run --inputs through (e.g. net), for a model without a forward() of its own; "
        "default: the model, or the one submodule that holds every attention layer and has a forward()",
    )
    parser.add_argument("--device", default="cpu", help="device to measure on (default: cpu)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (the DiversityReport.to_dict schema, and training_step: "
        "{step: N or null, source: where it was read})",
    )
    parser.add_argument("--out", metavar="DIR", help="write heatmap PNGs, an HDI-by-layer plot and index.html here")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --out folder (files of the same names are replaced)",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow full unpickling of PATH/--inputs (runs code: trusted files only)",
    )
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show a progress bar (stderr)"
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")


# ----------------------------------------------------------------------------------------- helpers


def _projections(values: list[str] | None) -> tuple[str, ...]:
    values = values or ["all"]
    items = [v.strip().lower() for value in values for v in value.split(",") if v.strip()]
    if items == ["all"]:
        return _PROJECTIONS
    bad = [v for v in items if v not in _PROJECTIONS]
    if bad or not items:
        raise CLIError(f"--projections: unknown {bad or values}; choose from {', '.join(_PROJECTIONS)} or 'all'")
    return tuple(dict.fromkeys(items))


def find_layers(model: Any, args: argparse.Namespace) -> list[Any]:
    """The attention layers of ``model`` selected by ``--layers`` (CLIError when there is none)."""
    import torch

    from hdi_monitor.models import find_attention_layers

    try:
        with torch.no_grad():
            return find_attention_layers(model, layers=args.layers)
    except (ValueError, TypeError) as err:
        raise CLIError(f"{args.path!r}: {_one_line(err)}") from err


def _has_forward(module: Any) -> bool:
    """True when ``module`` has a ``forward`` of its own (not the base classes' unimplemented one)."""
    from torch import nn

    forward = type(module).forward
    bases = [nn.Module.forward]
    try:
        from lightning.pytorch import LightningModule

        bases.append(LightningModule.forward)
    except ImportError:  # pragma: no cover - lightning is a dependency
        pass
    return all(forward is not base for base in bases)


def call_target(model: Any, layers: list[Any], name: str | None) -> Any:
    """The module ``--inputs`` are passed to: ``--call NAME``, the model when it has a ``forward``,
    else the outermost submodule that holds every attention layer and has a ``forward`` of its own
    (the network a LightningModule runs in its ``training_step``); CLIError when none is found."""
    if name is not None:
        try:
            target = model.get_submodule(name)
        except AttributeError as err:
            raise CLIError(f"--call {name!r}: {type(model).__name__} has no submodule of that name") from err
        if not _has_forward(target):
            raise CLIError(f"--call {name!r}: {type(target).__name__} has no forward() to run the inputs through")
        return target
    if _has_forward(model):
        return model
    names = [la.name for la in layers]
    candidates = [
        (path, module)
        for path, module in model.named_modules()
        if path and _has_forward(module) and all(n == path or n.startswith(path + ".") for n in names)
    ]
    if candidates:
        return min(candidates, key=lambda c: c[0].count("."))[1]
    children = ", ".join(n for n, _ in model.named_children()) or "none"
    raise CLIError(
        f"{type(model).__name__} has no forward() to run --inputs through and no submodule with one holds every "
        f"attention layer; pass --call NAME, the submodule its training_step calls (its children: {children})"
    )


def measure(
    model: Any,
    projections: tuple[str, ...],
    weighting: str,
    inputs: Any = None,
    max_tokens: int | None = None,
    layer_filter: str | None = None,
    progress: Callable[[int], Any] | None = None,
    call: Any = None,
) -> Any:
    """The report of `head_diversity` (the same call, ``layer_filter`` is its ``layers``), with
    ``progress`` called as it goes: one per layer and projection, then one per batch of
    ``inputs``."""
    from hdi_monitor.measure.oneshot import head_diversity

    try:
        return head_diversity(
            model,
            projections=projections,  # type: ignore[arg-type]
            weighting=weighting,  # type: ignore[arg-type]
            layers=layer_filter,
            inputs=inputs,
            max_tokens=max_tokens,
            progress=progress,
            call=None if call is model else call,
        )
    except Exception as err:  # noqa: BLE001 - the user's inputs or model: one line, never an internal error
        if inputs is None:
            raise
        if isinstance(err, (ValueError, TypeError)):
            raise CLIError(f"--inputs: {_one_line(err)}") from err
        runner = type(call if call is not None else model).__name__
        raise CLIError(f"--inputs: running {runner} on them failed ({type(err).__name__}: {_one_line(err)})") from err


def run(args: argparse.Namespace) -> int:
    projections = _projections(args.projections)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    if args.out:  # fail before the model is loaded and measured, not after
        prepare_out_dir(args.out, args.force)
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise CLIError(f"--device {args.device!r}: {_one_line(err)}") from err
    model, tokenizer, step = load_model(args)
    model.eval()
    layers = find_layers(model, args)
    inputs = target = None
    if args.inputs:
        target = call_target(model, layers, args.call)
        inputs = load_inputs(args.inputs, target, tokenizer, args.allow_pickle)
    elif args.call is not None:
        raise CLIError("--call names the submodule --inputs run through: give --inputs too")
    if device.type != "cpu":
        try:
            model.to(device)
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"--device {args.device!r}: {_one_line(err)}") from err
        from lightning.fabric.utilities.apply_func import move_data_to_device

        inputs = move_data_to_device(inputs, device)
    show = args.progress if args.progress is not None else len(layers) > _PROGRESS_LAYERS
    if inputs is not None:
        from hdi_monitor.models.hooks import iter_batches

        inputs = list(iter_batches(inputs))  # a list of batches: counted for the bar, measured the same
    total = len(layers) * len(projections) + (len(inputs) if inputs is not None else 0)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, file=sys.stderr, desc="hdi-monitor report", unit="layer", leave=False, disable=not show)
    try:
        bar.set_postfix_str(f"{len(layers)} layers, {', '.join(projections)}", refresh=False)
        report = measure(
            model, projections, args.weighting, inputs, args.max_tokens, args.layers, progress=bar.update, call=target
        )
        files = None
        resolved = Path(args.path).resolve()
        name = f"{resolved.parent.name}/{resolved.name}" if resolved.is_dir() else resolved.name
        if args.out:
            from hdi_monitor.cli.html import figure_count, write_report

            bar.total += figure_count(report)
            bar.set_postfix_str("figures", refresh=True)
            title = f"Head diversity: {name}"
            try:
                files = write_report(
                    report, args.out, title=title, source=str(args.path), step=step, progress=bar.update
                )
            except OSError as err:
                raise CLIError(f"--out {args.out!r}: cannot write {_os_error(err, args.out)}") from err
    finally:
        bar.close()
    try:
        if args.json:
            json.dump({**report.to_dict(), "training_step": step.to_dict()}, sys.stdout, allow_nan=False)
            sys.stdout.write("\n")
        else:
            print(f"{name}: {step.describe()}")
            print(report.format_table())
        if files is not None:
            print(f"wrote {len(files.all())} files; open {files.html}", file=sys.stderr if args.json else sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as err:
        name = _stdout_name()
        _discard_stdout()
        raise CLIError(f"cannot write the report to {name}: {err.strerror or err}") from err
    return 0


def _stdout_name() -> str:
    """What standard output is connected to (``'/dev/full'``, a file path), for error messages."""
    try:
        target = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
    except (OSError, ValueError, AttributeError):
        return "standard output"
    return f"standard output ({target})" if target.startswith("/") else "standard output"


def _discard_stdout() -> None:
    """Point standard output at /dev/null so that the interpreter's final flush of what could not be
    written does not fail a second time (the BrokenPipeError recipe of the Python docs)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
