"""What each early-warning signal is worth, measured out of sample: the product follows the evidence.

A warning kind warns by default only if, on runs that did not choose its threshold, it beats every
baseline the warnings study brings (random and time-matched timing, a configuration prior, loss and
gradient spike detectors with their published defaults, persistence, learning-curve extrapolation):
the lower end of its bootstrap interval above the best baseline's precision. Every other signal is
detected, logged and drawn, and does not warn (``warn_on`` turns it on).

The figures come from ``benchmarks/results/warnings_study.json`` (its ``out_of_sample`` section),
through the generated package data file ``hdi_monitor/_evidence.json``, written by
``benchmarks/make_evidence.py`` (``--check`` fails when it is stale) and read here with
`importlib.resources` (`load_evidence` reads it, or another such file). A results file without that
section gives no evidence at all: `EVIDENCE` is empty and `DEFAULTS_ON` is empty, so nothing warns
by default.

```python
from hdi_monitor.evidence import DEFAULTS_ON, EVIDENCE, signal_of

for signal in DEFAULTS_ON:
    print(signal, EVIDENCE[signal].clause())
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hdi_monitor.events import DiversityEvent

__all__ = [
    "DEFAULTS_ON",
    "DOCS",
    "EVIDENCE",
    "HAS_EVIDENCE",
    "KINDS_WITH_METRIC",
    "SIGNALS",
    "SOURCE",
    "Evidence",
    "EvidenceFile",
    "backed",
    "evidence_clause",
    "load_evidence",
    "signal_of",
]

#: The early-warning signals the study scores and ``warn_on`` names. ``saturation`` and ``collapse``
#: come per metric (the HDI series, the effective heads); the others are one signal each.
SIGNALS: tuple[str, ...] = (
    "saturation/hdi",
    "saturation/effective_heads",
    "collapse/hdi",
    "collapse/effective_heads",
    "redundancy",
    "entropy_collapse",
    "logit_blowup",
    "logit_bound",
    "update_entropy",
)
#: Event kinds whose signal is ``"<kind>/<metric>"``.
KINDS_WITH_METRIC: tuple[str, ...] = ("saturation", "collapse")
#: Where a warning points for its evidence.
DOCS = "docs/early-warnings.md"
#: The package data file `load_evidence` reads by default (written by ``benchmarks/make_evidence.py``).
_DATA_FILE = "_evidence.json"


@dataclass(frozen=True)
class Evidence:
    """The out-of-sample record of one signal (from the study's results file).

    Attributes:
        signal: the signal's name (one of `SIGNALS`).
        outcome: what an event of the signal is scored against (e.g. a loss spike in the next
            window), in the study's words.
        precision: the fraction of its events followed by the outcome, on held-out runs.
        interval: the bootstrap interval of ``precision`` over runs, ``(low, high)``; None when the
            study could not compute one.
        recall: the fraction of outcomes it flagged, on held-out runs (None when not measured).
        best_baseline: the name of the baseline with the highest precision on the same folds.
        best_baseline_precision: that baseline's precision.
        default_on: True when it beats every baseline (the lower end of ``interval`` above
            ``best_baseline_precision``): it warns by default.
        baselines: each baseline's precision, by name (None for a baseline that never fired on
            the scored runs, so has no precision).
        events: how many events were scored (None when not given).
        runs_flagged: in how many runs it fired (None when not given).
    """

    signal: str
    outcome: str
    precision: float
    interval: tuple[float, float] | None
    recall: float | None
    best_baseline: str
    best_baseline_precision: float
    default_on: bool
    baselines: Mapping[str, float | None]
    events: int | None = None
    runs_flagged: int | None = None

    def clause(self, *, interval: bool = True, baseline_name: bool = True) -> str:
        """The evidence in a few words, for a warning: ``"held-out precision 0.42 [0.30-0.55] vs
        0.25 (loss_zscore)"``; ``interval`` and ``baseline_name`` shorten it."""
        text = f"held-out precision {self.precision:.2f}"
        if interval and self.interval is not None:
            text += f" [{self.interval[0]:.2f}-{self.interval[1]:.2f}]"
        text += f" vs {self.best_baseline_precision:.2f}"
        if baseline_name:
            text += f" ({self.best_baseline})"
        return text


def _evidence(signal: str, record: Mapping[str, Any]) -> Evidence:
    interval = record.get("interval")
    return Evidence(
        signal=signal,
        outcome=str(record["outcome"]),
        precision=float(record["precision"]),
        interval=None if interval is None else (float(interval[0]), float(interval[1])),
        recall=None if record.get("recall") is None else float(record["recall"]),
        best_baseline=str(record["best_baseline"]),
        best_baseline_precision=float(record["best_baseline_precision"]),
        default_on=bool(record["default_on"]),
        baselines=MappingProxyType(
            {str(k): None if v is None else float(v) for k, v in record.get("baselines", {}).items()}
        ),
        events=None if record.get("events") is None else int(record["events"]),
        runs_flagged=None if record.get("runs_flagged") is None else int(record["runs_flagged"]),
    )


@dataclass(frozen=True)
class EvidenceFile:
    """The generated evidence file, read (`load_evidence`): what this module's names hold.

    Attributes:
        source: the results file the figures were generated from.
        has_evidence: False when that file holds no held-out evidence (then ``evidence`` and
            ``defaults_on`` are empty).
        note: what the file holds, in one line.
        evidence: each signal's out-of-sample record, by signal name.
        defaults_on: the signals that beat every baseline out of sample.
        chosen_on_all_runs: the detector settings the study chose on all its runs, per signal.
    """

    source: str
    has_evidence: bool
    note: str
    evidence: Mapping[str, Evidence]
    defaults_on: tuple[str, ...]
    chosen_on_all_runs: Mapping[str, Mapping[str, Any]]


def load_evidence(source: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> EvidenceFile:
    """Read an evidence file written by ``benchmarks/make_evidence.py``: by default the package's own
    (``hdi_monitor/_evidence.json``, through `importlib.resources`), else the file at ``source`` or
    its parsed content.

    Raises:
        ValueError: the file lacks one of the generator's keys.
    """
    if source is None:
        data = json.loads((files("hdi_monitor") / _DATA_FILE).read_text(encoding="utf-8"))
    elif isinstance(source, Mapping):
        data = source
    else:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
    keys = ("source", "has_evidence", "note", "out_of_sample", "defaults_on", "chosen_on_all_runs")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"the evidence file lacks {', '.join(missing)}; rerun python benchmarks/make_evidence.py")
    return EvidenceFile(
        source=str(data["source"]),
        has_evidence=bool(data["has_evidence"]),
        note=str(data["note"]),
        evidence=MappingProxyType({str(s): _evidence(str(s), r) for s, r in data["out_of_sample"].items()}),
        defaults_on=tuple(str(s) for s in data["defaults_on"]),
        chosen_on_all_runs=MappingProxyType(
            {str(s): MappingProxyType(dict(v)) for s, v in data["chosen_on_all_runs"].items()}
        ),
    )


_FILE = load_evidence()
#: The results file the figures were generated from.
SOURCE: str = _FILE.source
#: False when that file holds no held-out evidence (then `EVIDENCE` and `DEFAULTS_ON` are empty).
HAS_EVIDENCE: bool = _FILE.has_evidence
#: Each signal's out-of-sample record, by signal name; empty when the results file holds none.
EVIDENCE: Mapping[str, Evidence] = _FILE.evidence
#: The signals that warn by default (``warn_on=None``): those that beat every baseline out of sample.
DEFAULTS_ON: tuple[str, ...] = _FILE.defaults_on


def signal_of(event: DiversityEvent) -> str:
    """The signal an event belongs to: ``"<kind>/<metric>"`` for saturation and collapse
    (``"saturation/hdi"``, ``"collapse/effective_heads"``), else its kind."""
    return f"{event.kind}/{event.metric}" if event.kind in KINDS_WITH_METRIC else event.kind


def evidence_clause(signal: str, *, interval: bool = True, baseline_name: bool = True) -> str:
    """What the study measured for ``signal``, with the docs link, for a warning's text:
    ``"held-out precision 0.42 [0.30-0.55] vs 0.25 (loss_zscore); docs/early-warnings.md"``, or
    ``"no held-out evidence; docs/early-warnings.md"`` when the results file has none for it."""
    record = EVIDENCE.get(signal)
    if record is None:
        return f"no held-out evidence; {DOCS}"
    return f"{record.clause(interval=interval, baseline_name=baseline_name)}; {DOCS}"


def backed(signal: str) -> bool:
    """True when the study backs acting on ``signal`` (it beats every baseline out of sample)."""
    record = EVIDENCE.get(signal)
    return record is not None and record.default_on
