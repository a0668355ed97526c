"""Loading what ``hdi-monitor report`` and ``prune`` measure: the model (a Hugging Face folder, a
Lightning checkpoint with ``--module``, a plain ``state_dict`` with ``--config``, a pickled module
with ``--allow-pickle``), the training step its weights are from (`TrainingStep`, as the source
records it, never guessed) and the ``--inputs`` (a text file tokenized in batches, or a ``.pt``
file). Files are read with ``torch.load(weights_only=True)`` unless ``--allow-pickle``; every
failure is a one-line `CLIError`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdi_monitor.cli._common import CLIError

__all__ = ["TrainingStep", "load_inputs", "load_model", "one_line"]

_TEXT_BATCH = 16  # lines per batch for --inputs text files


def one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, KeyError) and len(err.args) == 1:
        text = f"missing key {err.args[0]!r}"
    return text.splitlines()[0].strip()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[Any]:
    """Import transformers with its loading bars and info/warning logs off; CLIError if missing."""
    try:
        import transformers
    except ImportError as err:
        raise CLIError(
            f"this PATH needs the transformers package ({one_line(err)}): pip install -e '.[hf]' in a checkout "
            "of hdi-monitor (pip install 'hdi-monitor[hf]' once it is on a package index)"
        ) from err
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield transformers
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@dataclass(frozen=True)
class TrainingStep:
    """The training step that a loaded model's weights are from, as its source records it.

    Attributes:
        step: the step, or None when the source records none (a ``from_pretrained`` folder without
            ``trainer_state.json``, a state_dict, a pickled module). Never guessed: a folder named
            ``checkpoint-500`` without ``trainer_state.json`` has no known step.
        source: where the step was read (``"global_step of the Lightning checkpoint"``), or why
            there is none.
    """

    step: int | None
    source: str

    def describe(self) -> str:
        """``"training step 200 (global_step of the Lightning checkpoint)"``, or ``"training step
        unknown: <why>"``."""
        if self.step is None:
            return f"training step unknown: {self.source}"
        return f"training step {self.step} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        """``{"step": int or None, "source": str}``."""
        return {"step": self.step, "source": self.source}


def _recorded_step(value: Any) -> int | None:
    """A step as a checkpoint stores it (an int, or a 0-d integer tensor); None for anything else."""
    import torch

    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _lightning_step(path: Path, allow_pickle: bool) -> TrainingStep:
    """``global_step`` of a Lightning checkpoint that `_load_lightning` has already read. The file is
    opened again memory-mapped (``torch.load(mmap=True)``), so no tensor is read a second time."""
    import torch

    try:
        try:
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped: read it whole
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=not allow_pickle)
    except Exception as err:  # noqa: BLE001 - the model is loaded; say why its step is not known
        return TrainingStep(None, f"the checkpoint could not be read again for its global_step ({one_line(err)})")
    raw = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
    step = _recorded_step(raw)
    if step is None:
        why = "has no global_step" if raw is None else f"has a global_step that is not a step count ({raw!r})"
        return TrainingStep(None, f"the Lightning checkpoint {why}")
    return TrainingStep(step, "global_step of the Lightning checkpoint")


def _folder_step(folder: Path) -> TrainingStep:
    """The step of a Hugging Face model folder: ``global_step`` of the ``trainer_state.json`` that the
    Trainer writes into every ``checkpoint-N`` folder; unknown without one (the folder's name is
    not read: it is not a record)."""
    state_file = folder / "trainer_state.json"
    if not state_file.is_file():
        return TrainingStep(None, "a Hugging Face model folder without trainer_state.json records no step")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return TrainingStep(None, f"its trainer_state.json cannot be read ({one_line(err)})")
    raw = state.get("global_step") if isinstance(state, dict) else None
    step = _recorded_step(raw)
    if step is None:
        return TrainingStep(None, "its trainer_state.json has no global_step")
    return TrainingStep(step, "global_step in trainer_state.json")


def _check_complete(path: Path, what: str) -> None:
    """CLIError for an empty file or a torch.save zip archive whose end is missing (a copy or a save
    that was cut off), so that such files are named for what they are."""
    import zipfile

    if not path.is_file():
        return
    size = path.stat().st_size
    if size == 0:
        raise CLIError(
            f"{what} {str(path)!r} is empty (0 bytes): the file was not written completely, or is not the one you meant"
        )
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        raise CLIError(
            f"{what} {str(path)!r} is truncated: it starts as a torch.save archive but its end is missing "
            f"({size} bytes); the save or the copy was cut off"
        )


def _truncated_pickle(err: BaseException) -> bool:
    return isinstance(err, EOFError) or "truncated" in str(err) or "Ran out of input" in str(err)


def _unpickling_error(err: BaseException, path: Path, what: str, allow_pickle: bool) -> CLIError | None:
    """The CLIError for a failed ``torch.load`` of ``what`` at ``path`` whose cause is known: Python
    objects refused by ``weights_only`` (unless ``allow_pickle``), or a file cut off; None otherwise
    (the caller says what it was doing)."""
    if not allow_pickle and "Weights only load failed" in str(err):
        return CLIError(
            f"{what} {str(path)!r} holds Python objects beyond tensors; if you trust the file, rerun with --allow-pickle"
        )
    if _truncated_pickle(err):
        return CLIError(f"{what} {str(path)!r} is truncated: its data ends early; the save or the copy was cut off")
    return None


def _looks_like_torch_file(path: Path) -> bool:
    """A ``torch.save`` zip archive, or a legacy pickle (protocol 2+ starts with byte 0x80)."""
    import zipfile

    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def _torch_load(path: Path, allow_pickle: bool, what: str) -> Any:
    import torch

    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise CLIError(f"{what} {str(path)!r} is a .safetensors file: pip install safetensors") from err
        try:
            return load_file(str(path), device="cpu")
        except Exception as err:  # noqa: BLE001 - any failure means: not a safetensors file
            raise CLIError(f"{what} {str(path)!r} is not a readable safetensors file ({one_line(err)})") from err
    _check_complete(path, what)
    if not _looks_like_torch_file(path):
        raise CLIError(f"{what} {str(path)!r} is not a PyTorch model file (neither a torch.save archive nor a pickle)")
    try:
        return torch.load(str(path), map_location="cpu", weights_only=not allow_pickle)
    except Exception as err:  # noqa: BLE001
        raise _unpickling_error(err, path, what, allow_pickle) or CLIError(
            f"{what} {str(path)!r} is not a PyTorch model file ({type(err).__name__}: {one_line(err)})"
        ) from err


def _import_class(spec: str) -> type:
    module_name, _, class_name = spec.rpartition(".")
    if not module_name or not class_name:
        raise CLIError(f"--module must be 'package.module.Class', got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        # last, so that modules next to the user's scripts import, but a stray file there (a jinja2.py)
        # never shadows an installed package that the command imports later
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CLIError(f"--module {spec}: cannot import {module_name!r} ({one_line(err)})") from err
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing
        raise CLIError(
            f"--module {spec}: importing {module_name!r} failed ({type(err).__name__}: {one_line(err)})"
        ) from err
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise CLIError(f"--module {spec}: {module_name!r} has no class {class_name!r}")
    return cls


def _load_lightning(path: Path, spec: str, allow_pickle: bool) -> Any:
    cls = _import_class(spec)
    try:
        import lightning.pytorch as pl
    except ImportError as err:  # pragma: no cover - lightning is a dependency
        raise CLIError(f"--module needs lightning ({one_line(err)})") from err
    if not issubclass(cls, pl.LightningModule):
        raise CLIError(f"--module {spec}: {cls.__name__} is not a LightningModule subclass")
    if path.is_dir():
        raise CLIError(f"{str(path)!r} is a folder; --module expects a Lightning checkpoint file")
    _check_complete(path, "checkpoint")
    try:
        return cls.load_from_checkpoint(str(path), map_location="cpu", weights_only=not allow_pickle)
    except Exception as err:  # noqa: BLE001
        raise _unpickling_error(err, path, "checkpoint", allow_pickle) or CLIError(
            f"cannot rebuild {spec} from {str(path)!r} ({type(err).__name__}: {one_line(err)})"
        ) from err


def _is_lightning_checkpoint(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "state_dict" in obj and any("lightning_version" in str(k) for k in obj)


def _as_state_dict(obj: Any) -> dict[str, Any] | None:
    """A ``{name: tensor}`` mapping from a loaded object, looking inside the usual wrappers."""
    import torch

    if not isinstance(obj, Mapping):
        return None
    if obj and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        return dict(obj)
    for key in ("state_dict", "model_state_dict", "model"):
        inner = obj.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return dict(inner)
    return None


def _config_path(config: str) -> Path:
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CLIError(f"--config {config!r}: no such config file (give a config.json or a folder holding one)")
    return path


def _strip_prefix(state: dict[str, Any], wanted: set[str], base_prefix: str | None) -> tuple[dict[str, Any], str]:
    """Pick the key prefix (``""``, ``"model."``, the model's ``base_model_prefix``, ...) whose
    stripped keys best cover ``wanted``; keys outside the prefix (task heads) are dropped."""
    candidates = {""}
    if base_prefix:
        candidates.add(base_prefix + ".")
    for key in state:
        parts = key.split(".")
        for n in (1, 2):
            if len(parts) > n:
                candidates.add(".".join(parts[:n]) + ".")
    best, best_prefix, best_hits = state, "", -1
    for prefix in sorted(candidates, key=len):
        stripped = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        hits = len(wanted & stripped.keys())
        if hits > best_hits:
            best, best_prefix, best_hits = stripped, prefix, hits
    return best, best_prefix


def _model_classes(transformers: Any, cfg: Any) -> list[tuple[str, Any]]:
    """Classes to try for a config: its ``architectures`` (the model the weights came from), then
    ``AutoModel`` (the base model)."""
    out: list[tuple[str, Any]] = []
    for name in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type):
            out.append((str(name), cls))
    out.append(("AutoModel", None))
    return out


def _build(transformers: Any, cls: Any, cfg: Any) -> Any:
    return transformers.AutoModel.from_config(cfg) if cls is None else cls(cfg)


def _load_state_dict_model(path: Path, state: dict[str, Any], config: str) -> Any:
    """Build the model ``config`` describes and load ``state`` into it, strictly up to one prefix."""
    import torch

    with _quiet_transformers() as transformers:
        cfg_path = _config_path(config)
        try:
            cfg = transformers.AutoConfig.from_pretrained(str(cfg_path.parent), local_files_only=True)
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"--config {config!r} is not a Hugging Face config ({one_line(err)})") from err
        best: tuple[int, str, str, list[str], list[str]] | None = None
        for name, cls in _model_classes(transformers, cfg):
            try:
                with torch.device("meta"):  # key names only: no memory, no initialisation
                    skeleton = _build(transformers, cls, cfg)
            except Exception as err:  # noqa: BLE001
                if cls is None:
                    raise CLIError(f"cannot build a model from --config {config!r} ({one_line(err)})") from err
                continue
            wanted = set(skeleton.state_dict().keys())
            stripped, prefix = _strip_prefix(state, wanted, getattr(skeleton, "base_model_prefix", None))
            missing = sorted(wanted - stripped.keys())
            unexpected = sorted(stripped.keys() - wanted)
            if not missing and not unexpected:
                model = _build(transformers, cls, cfg)
                try:
                    model.load_state_dict(stripped, strict=True)
                except Exception as err:  # noqa: BLE001 - shape mismatches
                    raise CLIError(f"{str(path)!r} does not fit {name} built from --config ({one_line(err)})") from err
                return model
            score = len(missing) + len(unexpected)
            if best is None or score < best[0]:
                best = (score, type(skeleton).__name__, prefix, missing, unexpected)
    assert best is not None
    _, cls_name, prefix, missing, unexpected = best
    where = f" (after removing the prefix {prefix!r})" if prefix else ""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s), e.g. {missing[:3]}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}")
    raise CLIError(
        f"{str(path)!r} does not fit {cls_name} built from --config{where}: "
        + "; ".join(parts)
        + '; for a task model (e.g. BertForMaskedLM) name its class in the config\'s "architectures"'
    )


#: Files that hold a tokenizer's vocabulary; a folder with none of them has no real tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "source.spm",
    "vocab.model",
)


def _text_tokenizer(args: argparse.Namespace, default: str | None) -> Any:
    """The tokenizer for a ``.txt`` ``--inputs`` (None when the inputs are not text): from
    ``--tokenizer``, else from ``default`` (the model or ``--config`` folder). Refused (CLIError)
    unless a real tokenizer is found: a folder without tokenizer files makes transformers 5 build a
    placeholder of a few special tokens that turns every word into ``[UNK]``."""
    if not (args.inputs and str(args.inputs).endswith(".txt")):
        return None
    named = getattr(args, "tokenizer", None)
    where = named or default
    option = f"--tokenizer {named!r}" if named else (f"{default!r}" if default else "")
    if where is None:
        return None  # load_inputs says that text needs a tokenizer
    folder = Path(where)
    if named and not folder.exists():
        raise CLIError(f"--tokenizer {named!r}: no such folder")
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CLIError(
            f"--inputs is text but {option} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
            "transformers would build a placeholder tokenizer that reads every word as [UNK]. Name the tokenizer "
            "folder with --tokenizer DIR, or give a .pt file of token ids"
        )
    with _quiet_transformers() as transformers:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"--inputs is text but {option} has no usable tokenizer ({one_line(err)})") from err
    specials = len(set(getattr(tokenizer, "all_special_tokens", []) or []))
    if len(tokenizer) <= specials + 1:
        raise CLIError(
            f"--inputs is text but the tokenizer of {option} has {len(tokenizer)} tokens, its special tokens only: "
            "every word would be [UNK]. Name a real tokenizer with --tokenizer DIR, or give a .pt file of token ids"
        )
    return tokenizer


def load_model(args: argparse.Namespace) -> tuple[Any, Any, TrainingStep]:
    """Load PATH as described by the options. Returns ``(model, tokenizer or None, training step)``."""
    from torch import nn

    path = Path(args.path)
    if not path.exists():
        raise CLIError(f"no such file or folder: {args.path!r}")
    if args.module:
        if args.config:
            raise CLIError(
                "--module and --config exclude each other (--module: Lightning checkpoint; --config: plain state_dict)"
            )
        model = _load_lightning(path, args.module, args.allow_pickle)
        return model, _text_tokenizer(args, None), _lightning_step(path, args.allow_pickle)
    if path.is_dir():
        if args.config:
            raise CLIError("--config is for a plain state_dict file; a Hugging Face folder brings its own config.json")
        if not (path / "config.json").is_file():
            raise CLIError(f"{args.path!r} is a folder without config.json, so not a Hugging Face model folder")
        with _quiet_transformers() as transformers:
            try:
                model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True)
            except Exception as err:  # noqa: BLE001
                raise CLIError(f"cannot load a Hugging Face model from {args.path!r} ({one_line(err)})") from err
        return model, _text_tokenizer(args, str(path)), _folder_step(path)
    obj = _torch_load(path, args.allow_pickle, "PATH")
    if isinstance(obj, nn.Module):
        return obj, None, TrainingStep(None, "a pickled module records no step")
    if _is_lightning_checkpoint(obj):
        raise CLIError(f"{args.path!r} is a Lightning checkpoint: pass --module package.Class (your LightningModule)")
    state = _as_state_dict(obj)
    if state is None:
        raise CLIError(
            f"{args.path!r} is not a model: expected a state_dict (name -> tensor), a Lightning checkpoint or a model folder"
        )
    if not args.config:
        raise CLIError(
            f"{args.path!r} is a plain state_dict: pass --config with the Hugging Face config.json that built it"
        )
    model = _load_state_dict_model(path, state, args.config)
    step = TrainingStep(None, "a state_dict records no step")
    return model, _text_tokenizer(args, str(_config_path(args.config).parent)), step


def load_inputs(path_str: str, model: Any, tokenizer: Any, allow_pickle: bool) -> Any:
    """``--inputs``: a .txt file tokenized in batches of 16 lines, or a .pt file of tensors."""
    path = Path(path_str)
    if not path.is_file():
        raise CLIError(f"--inputs: no such file: {path_str!r}")
    if path.suffix == ".txt":
        if tokenizer is None:
            raise CLIError(
                "--inputs is a text file, which needs a Hugging Face model folder with a tokenizer; give a .pt file of token ids instead"
            )
        lines = [
            line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()
        ]
        if not lines:
            raise CLIError(f"--inputs {path_str!r} has no non-empty line")
        if tokenizer.pad_token is None and getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no pad token
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 512
        limit = min(int(limit), int(getattr(tokenizer, "model_max_length", limit) or limit))
        accepted = set(inspect.signature(model.forward).parameters)
        batches = []
        for start in range(0, len(lines), _TEXT_BATCH):
            enc = tokenizer(
                lines[start : start + _TEXT_BATCH], padding=True, truncation=True, max_length=limit, return_tensors="pt"
            )
            batches.append({k: v for k, v in enc.items() if k in accepted})
        return batches
    if path.suffix in (".pt", ".pth", ".bin"):
        import torch

        obj = _torch_load(path, allow_pickle, "--inputs")
        if isinstance(obj, (torch.Tensor, Mapping, list, tuple)):
            return obj
        raise CLIError(
            f"--inputs {path_str!r} holds a {type(obj).__name__}; expected a tensor, a dict of tensors or a list of batches"
        )
    raise CLIError(f"--inputs must be a .txt or .pt file, got {path_str!r}")
