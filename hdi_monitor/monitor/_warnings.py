"""The tracker's warnings: attributed to the user's code, rank-zero aware, one summary per step."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hdi_monitor.events import DiversityEvent
from hdi_monitor.exceptions import DiversityWarning, MonitoringWarning

__all__ = ["dispatch_events", "say", "summarize_events", "warn"]

#: The monitor's one-line messages (warm-up, end-of-run summary): Python logging, as Lightning's own
#: messages; a handler printing the message alone is added when the application has configured none.
LOGGER = logging.getLogger("hdi_monitor")
if not logging.getLogger().hasHandlers() and not LOGGER.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def say(line: str) -> None:
    """One informational line on rank zero (the ``hdi_monitor`` logger, level INFO)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    LOGGER.info(line)


_INTERNAL_PACKAGES = (
    "hdi_monitor",
    "torch",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "transformers",
    "accelerate",
)
_internal_prefixes: tuple[str, ...] | None = None


def _internal() -> tuple[str, ...]:
    global _internal_prefixes
    if _internal_prefixes is None:
        prefixes = [contextlib.__file__]
        for name in _INTERNAL_PACKAGES:
            with contextlib.suppress(Exception):
                spec = importlib.util.find_spec(name)
                for location in (spec.submodule_search_locations or []) if spec else []:
                    prefixes.append(os.path.join(location, ""))
        _internal_prefixes = tuple(prefixes)
    return _internal_prefixes


_launcher_dirs: set[str] | None = None

#: Where a warning with no user code to point at is attributed (``hdi-monitor:0: ...``).
NO_USER_CODE = "hdi-monitor"


def _is_launcher(frame: FrameType) -> bool:
    """True for frames that start Python rather than run the user's code: ``python -m``'s runpy
    (``<frozen runpy>``), and a console script in the environment's ``bin``/``Scripts`` folder
    (``sys.exit(main())`` of ``hdi-monitor demo``)."""
    global _launcher_dirs
    filename = frame.f_code.co_filename
    if filename.startswith("<frozen") or os.path.basename(filename) == "runpy.py":
        return True
    if _launcher_dirs is None:
        dirs = {sysconfig.get_path("scripts")}
        for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
            dirs.update({os.path.join(prefix, "bin"), os.path.join(prefix, "Scripts")})
        _launcher_dirs = {os.path.realpath(d) for d in dirs if d}
    return os.path.realpath(os.path.dirname(filename)) in _launcher_dirs


def warn(message: str, category: type[Warning], *, rank_zero_only: bool = False) -> None:
    """``warnings.warn`` attributed to the first frame outside hdi-monitor, torch, Lightning and
    transformers (the user's ``trainer.fit`` or loop line). When that frame is a launcher (the
    ``hdi-monitor`` console script, ``python -m``), there is no user code to point at: the warning
    is attributed to `NO_USER_CODE` (printed as ``hdi-monitor:0: DiversityWarning: ...``, one line,
    instead of a venv path and ``sys.exit(main())``). With ``rank_zero_only`` (for what every rank
    sees alike: events, layer changes) only rank 0 warns under torch.distributed; a failure of one
    rank is warned on that rank."""
    import torch.distributed as dist

    if rank_zero_only and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    internal = _internal()
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    with _category_shown():
        if frame is None or _is_launcher(frame):
            del frame
            warnings.warn_explicit(message, category, filename=NO_USER_CODE, lineno=0, module="hdi_monitor")
            return
        del frame
        warnings.warn(message, category, stacklevel=level)


def _with_category(format_warning: Any) -> Any:
    """``format_warning`` (the installed ``warnings.formatwarning``), except that hdi-monitor's own
    warnings are printed in Python's standard form, ``file:line: Category: message``. Lightning
    replaces ``warnings.formatwarning`` with one that leaves out the category for every file whose
    path contains "lightning" (meant for its own package), which a user's ``lightning_cli.py`` or a
    project folder named after Lightning also matches."""

    def formatwarning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        if not issubclass(category, (DiversityWarning, MonitoringWarning)):
            return str(format_warning(message, category, filename, lineno, line))
        text = f"{filename}:{lineno}: {category.__name__}: {message}\n"
        if line is None:
            import linecache

            line = linecache.getline(filename, lineno)
        return text + (f"  {line.strip()}\n" if line and line.strip() else "")

    formatwarning.keeps_category = True  # type: ignore[attr-defined]
    return formatwarning


@contextlib.contextmanager
def _category_shown() -> Any:
    """While one of our warnings is issued, the installed formatter keeps its category name."""
    installed = warnings.formatwarning
    if getattr(installed, "keeps_category", False):
        yield
        return
    warnings.formatwarning = _with_category(installed)
    try:
        yield
    finally:
        if getattr(warnings.formatwarning, "keeps_category", False):
            warnings.formatwarning = installed


def summarize_events(step: int, events: Sequence[DiversityEvent]) -> str:
    """One line for the events of one measured step, e.g. ``"hdi-monitor step 650: collapse in 3
    layers, 2 redundant head pairs; ..."``; the full messages are in the Text tab and ``events``."""
    parts = []
    for kind in ("saturation", "collapse", "entropy_collapse", "logit_blowup"):
        layers = {e.layer for e in events if e.kind == kind}
        if layers:
            named = layers - {"mean"}
            where = f"{len(named)} layer{'s' if len(named) != 1 else ''}" if named else ""
            if "mean" in layers:
                where = f"{where} and the model mean" if where else "the model mean"
            parts.append(f"{kind.replace('_', ' ')} in {where}")
    redundant = [e for e in events if e.kind == "redundancy"]
    if redundant:
        pairs = sum(len(e.pairs) for e in redundant)
        count = len({e.layer for e in redundant})
        parts.append(
            f"{pairs} redundant head pair{'s' if pairs != 1 else ''} in {count} layer{'s' if count != 1 else ''}"
        )
    return (
        f"hdi-monitor step {step}: {', '.join(parts)}; see the Text tab (diversity_events/*) or monitor.events "
        "for the full messages"
    )


def dispatch_events(step: int, events: Sequence[DiversityEvent], on_saturation: Any) -> bool:
    """Hand one measured step's events on: a callable ``on_saturation`` gets each one; otherwise at
    most one `DiversityWarning` (the one message, or a summary). Returns True when the run should
    stop (``on_saturation="stop"`` and a saturation or collapse event)."""
    if not events:
        return False
    if callable(on_saturation):
        for event in events:
            on_saturation(event)
        return False
    stop = on_saturation == "stop" and any(e.kind in ("saturation", "collapse") for e in events)
    message = events[0].message if len(events) == 1 else summarize_events(step, events)
    warn(message, DiversityWarning, rank_zero_only=True)
    return stop
