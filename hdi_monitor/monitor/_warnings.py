"""The tracker's warnings: attributed to the user's code, rank-zero aware, written above the
progress bar, one line per measured step for all events together.

Events speak according to ``on_event`` and ``warn_on`` (`hdi_monitor.config.MonitorConfig`): only the
signals in ``warn_on`` (by default the evidence-backed ones, `hdi_monitor.evidence.DEFAULTS_ON`)
warn, in one `DiversityWarning` line of at most `MAX_LINE` characters per measured step that names
the counts per kind, says once per run and signal what the study measured for it, and points at the
Text tab and ``monitor.events``; every event is recorded whatever speaks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from hdi_monitor import evidence
from hdi_monitor.events import DiversityEvent
from hdi_monitor.evidence import DOCS, signal_of
from hdi_monitor.exceptions import DiversityWarning, MonitoringWarning

__all__ = ["MAX_LINE", "dispatch_events", "event_line", "run_summary", "say", "warn"]

#: The longest event warning or summary line the monitor writes (the message; printed as
#: ``hdi-monitor:0: DiversityWarning: <message>`` from the command line, 200 characters at most).
MAX_LINE = 165
#: Where every event line points for the full messages.
SEE = "see the Text tab (diversity_events/*) or monitor.events"


def _active_bar() -> Any:
    """The ``tqdm`` class when a tqdm progress bar (Lightning's, the Trainer's) is showing, else None;
    tqdm is never imported here."""
    std = sys.modules.get("tqdm.std")
    cls = getattr(std, "tqdm", None)
    instances = getattr(cls, "_instances", None)
    if not instances:
        return None
    with contextlib.suppress(Exception):
        if any(not getattr(bar, "disable", True) for bar in list(instances)):
            return cls
    return None


@contextlib.contextmanager
def _above_the_bar() -> Iterator[None]:
    """While a tqdm bar shows and warnings are displayed the default way (nothing records them:
    ``pytest.warns``, ``catch_warnings(record=True)`` or a custom ``showwarning`` keep theirs), show
    warnings with ``tqdm.write`` on stderr, one line above the bar, as Lightning's own messages
    are. The filters still apply (``ignore``, ``error``, ``once``): only the display changes."""
    bar = _active_bar()
    default = (
        warnings.showwarning is getattr(warnings, "_showwarning_orig", None)
        and getattr(getattr(warnings, "_showwarnmsg_impl", None), "__module__", None) == "warnings"
    )
    if bar is None or not default:
        yield
        return

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line="")
        bar.write(text.rstrip("\n"), file=file if file is not None else sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = getattr(warnings, "_showwarning_orig", warnings.showwarning)


class _BarAwareHandler(logging.StreamHandler):
    """A handler writing to the current ``sys.stderr`` (so that a Rich progress bar's redirect, or a
    test's capture, sees it), above an active tqdm progress bar (``tqdm.write``)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        bar = _active_bar()
        if bar is None:
            super().emit(record)
            return
        try:
            bar.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging never raises into training
            self.handleError(record)


#: The monitor's one-line messages (warm-up, end-of-run summary): Python logging, as Lightning's own
#: messages; a handler printing the message alone (above the progress bar) is added when the
#: application has configured none.
LOGGER = logging.getLogger("hdi_monitor")
if not logging.getLogger().hasHandlers() and not LOGGER.handlers:
    _handler = _BarAwareHandler()
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
            with _above_the_bar():
                warnings.warn_explicit(message, category, filename=NO_USER_CODE, lineno=0, module="hdi_monitor")
            return
        del frame
        with _above_the_bar():
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


_KIND_WORDS = {
    "saturation/hdi": "saturation",
    "saturation/effective_heads": "saturation of effective heads",
    "collapse/hdi": "collapse",
    "collapse/effective_heads": "collapse of effective heads",
    "entropy_collapse": "entropy collapse",
    "logit_blowup": "logit blowup",
    "logit_bound": "logit bound",
    "update_entropy": "update entropy",
}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _counts(signal: str, events: Sequence[DiversityEvent]) -> str:
    """``"saturation in 2 layers and the model mean"``, ``"3 redundant head pairs in 2 layers"``."""
    if signal == "redundancy":
        pairs = sum(len(e.pairs) for e in events)
        return f"{_plural(pairs, 'redundant head pair')} in {_plural(len({e.layer for e in events}), 'layer')}"
    layers = {e.layer for e in events}
    named = layers - {"mean"}
    where = _plural(len(named), "layer") if named else ""
    if "mean" in layers:
        where = f"{where} and the model mean" if where else "the model mean"
    return f"{_KIND_WORDS.get(signal, signal.replace('_', ' '))} in {where}"


def _clauses(signal: str) -> list[str]:
    """What the study measured for ``signal``, longest first (the line keeps the longest that fits)."""
    record = evidence.EVIDENCE.get(signal)
    if record is None:
        return ["no held-out evidence", "unvalidated"]
    return [
        f"held-out precision {record.clause(interval=True, baseline_name=True)[len('held-out precision ') :]}",
        f"held-out precision {record.precision:.2f} vs {record.best_baseline_precision:.2f} ({record.best_baseline})",
        f"held-out precision {record.precision:.2f} vs {record.best_baseline_precision:.2f}",
    ]


def event_line(
    step: int, warned: Sequence[DiversityEvent], *, logged: int = 0, explained: set[str] | None = None
) -> str:
    """The one line of a measured step's warned events (at most `MAX_LINE` characters): the counts
    per kind, for the signals not yet ``explained`` in this run what the study measured for them,
    with the docs link (as many as fit, first ones first; those are added to ``explained``, the
    others are told at their next line), how many events of the step were logged without warning,
    and where the full messages are. E.g. ``"step 650: logit blowup in 2 layers (held-out precision
    0.42 vs 0.25 (loss_zscore)); docs/early-warnings.md; see the Text tab (diversity_events/*) or
    monitor.events"`` (the warning's category, ``DiversityWarning``, says whose line it is)."""
    explained = set() if explained is None else explained
    groups: dict[str, list[DiversityEvent]] = {}
    for event in warned:
        groups.setdefault(signal_of(event), []).append(event)
    order = [s for s in groups if s not in explained] + [s for s in groups if s in explained]
    head = f"step {step}: "
    extra = f"; {_plural(logged, 'more event')} logged" if logged else ""

    def compose(clauses: dict[str, str], *, short: int, more: str = "") -> str:
        """``short``: 0 the counts in words; 1 the kinds without evidence as ``kind (n)``; 2 all."""
        parts = []
        for signal in order:
            if signal in clauses and short == 2:
                parts.append(f"{_KIND_WORDS.get(signal, signal)} ({len(groups[signal])}; {clauses[signal]})")
            elif signal in clauses:
                parts.append(f"{_counts(signal, groups[signal])} ({clauses[signal]})")
            elif short:  # the others in a few words: the line is about the newly explained ones
                parts.append(f"{_KIND_WORDS.get(signal, signal)} ({len(groups[signal])})")
            else:
                parts.append(_counts(signal, groups[signal]))
        link = f"; {DOCS}" if clauses else ""
        return f"{head}{', '.join(parts)}{link}{more}; {SEE}"

    new = [s for s in order if s not in explained]
    chosen: dict[str, str] = {}
    short = 0
    for short in (0, 1, 2):
        chosen = {}
        for signal in new:
            for clause in _clauses(signal):
                if len(compose({**chosen, signal: clause}, short=short)) <= MAX_LINE:
                    chosen[signal] = clause
                    break
        if chosen or not new:
            break
    line = compose(chosen, short=short, more=extra)
    if len(line) > MAX_LINE:
        line = compose(chosen, short=short)
    if len(line) > MAX_LINE:  # many kinds at once: counts only
        chosen = {}
        line = compose(chosen, short=1)
    if len(line) > MAX_LINE:
        line = f"{head}{_plural(len(warned), 'event')} warned; {SEE}"
    explained.update(chosen)
    return line


def run_summary(events: Sequence[DiversityEvent], warned_signals: frozenset[str], measurements: int) -> str:
    """The end-of-run line: ``"hdi-monitor: 12 early-warning events in 40 measurements (2 warned:
    2 logit blowup; logged: 8 collapse, 2 redundancy) - see the Text tab (diversity_events/*) or
    monitor.events"`` (at most 200 characters: the per-kind counts go first when it is longer)."""
    warned: dict[str, int] = {}
    logged: dict[str, int] = {}
    for event in events:
        signal = signal_of(event)
        into = warned if signal in warned_signals else logged
        word = _KIND_WORDS.get(signal, signal.replace("_", " "))
        into[word] = into.get(word, 0) + 1
    n_warned = sum(warned.values())
    head = f"hdi-monitor: {_plural(len(events), 'early-warning event')} in {_plural(measurements, 'measurement')}"
    detail = []
    if warned:
        detail.append(f"{n_warned} warned: " + ", ".join(f"{n} {k}" for k, n in warned.items()))
    else:
        detail.append("0 warned")
    if logged:
        detail.append("logged: " + ", ".join(f"{n} {k}" for k, n in logged.items()))
    line = f"{head} ({'; '.join(detail)}) - {SEE}"
    if len(line) > 200:
        line = f"{head} ({n_warned} warned) - {SEE}"
    return line


def dispatch_events(
    step: int,
    events: Sequence[DiversityEvent],
    on_event: str | Callable[[DiversityEvent], Any],
    warned_signals: frozenset[str] = frozenset(),
    *,
    explained: set[str] | None = None,
) -> bool:
    """Hand one measured step's events on: a callable ``on_event`` gets each one; ``"log"`` says
    nothing; ``"warn"`` and ``"stop"``: one `DiversityWarning` line (`event_line`) when some event
    is of a signal in ``warned_signals``. Returns True when the run should stop (``"stop"`` and a
    warned event)."""
    if not events:
        return False
    if callable(on_event):
        for event in events:
            on_event(event)
        return False
    if on_event == "log":
        return False
    warned = [e for e in events if signal_of(e) in warned_signals]
    if not warned:
        return False
    line = event_line(step, warned, logged=len(events) - len(warned), explained=explained)
    warn(line, DiversityWarning, rank_zero_only=True)
    return on_event == "stop"
