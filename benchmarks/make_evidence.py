"""Write ``hdi_monitor/_evidence.json`` from the warnings study's results file.

The early warnings follow the evidence (`hdi_monitor.evidence`): which signals warn by default and
what each warning says about its worth come from the ``out_of_sample`` section of
``benchmarks/results/warnings_study.json``, written by ``benchmarks/warnings_study.py``. This script
turns that section into a small generated package data file (read by `hdi_monitor.evidence` through
`importlib.resources`), checked on the way:

* every signal's record has ``outcome``, ``precision``, ``interval`` (two numbers or null),
  ``recall``, ``best_baseline``, ``best_baseline_precision`` and ``default_on``;
* ``best_baseline_precision`` is the highest of its ``baselines`` (when they are given);
* a signal marked ``default_on`` beats every baseline: the lower end of its interval is above
  ``best_baseline_precision``;
* ``defaults_on`` is exactly the signals marked ``default_on``, each one the monitor knows
  (`hdi_monitor.evidence.SIGNALS`).

A results file without ``out_of_sample`` (the study's first schema) holds no held-out evidence: the
generated file then has none, and nothing warns by default; the script says so.

Run: ``PYTHONPATH=. python benchmarks/make_evidence.py [--results FILE] [--out FILE] [--check]``.
``--check`` writes nothing and exits 1 when the generated file is not what the results file gives.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "warnings_study.json"
OUT = ROOT / "hdi_monitor" / "_evidence.json"
#: The signals the monitor knows (`hdi_monitor.evidence.SIGNALS`, repeated so that this script runs
#: without the package; ``tests/unit/monitor/test_warnings.py`` checks that they agree).
SIGNALS = (
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
_REQUIRED = ("outcome", "precision", "interval", "recall", "best_baseline", "best_baseline_precision", "default_on")
_KEPT = (*_REQUIRED, "baselines", "events", "runs_flagged")


class EvidenceError(ValueError):
    """The results file's ``out_of_sample`` section is inconsistent (named in the message)."""


def _number(signal: str, key: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EvidenceError(f"out_of_sample[{signal!r}][{key!r}] must be a finite number, got {value!r}")
    return float(value)


def _record(signal: str, raw: Any) -> dict[str, Any]:
    """One signal's record, checked, with the kept keys only."""
    if not isinstance(raw, dict):
        raise EvidenceError(f"out_of_sample[{signal!r}] must be an object, got {type(raw).__name__}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise EvidenceError(f"out_of_sample[{signal!r}] lacks {', '.join(missing)}")
    precision = _number(signal, "precision", raw["precision"])
    _number(signal, "recall", raw["recall"], optional=True)
    best = _number(signal, "best_baseline_precision", raw["best_baseline_precision"])
    assert precision is not None and best is not None
    interval = raw["interval"]
    if interval is not None:
        if not isinstance(interval, list) or len(interval) != 2:
            raise EvidenceError(f"out_of_sample[{signal!r}]['interval'] must be [low, high] or null, got {interval!r}")
        low, high = (_number(signal, "interval", v) for v in interval)
        assert low is not None and high is not None
        if low > high:
            raise EvidenceError(f"out_of_sample[{signal!r}]['interval'] is [{low}, {high}]: low above high")
    if not isinstance(raw["default_on"], bool):
        raise EvidenceError(f"out_of_sample[{signal!r}]['default_on'] must be true or false")
    baselines = raw.get("baselines") or {}
    if not isinstance(baselines, dict):
        raise EvidenceError(f"out_of_sample[{signal!r}]['baselines'] must be an object")
    measured = {str(k): float(v) for k, v in baselines.items() if v is not None and math.isfinite(float(v))}
    if measured:
        top = max(measured.values())
        if best < top - 1e-9:
            name = max(measured, key=measured.__getitem__)
            raise EvidenceError(
                f"out_of_sample[{signal!r}]: best_baseline_precision {best} is below baseline {name!r} ({top})"
            )
    if raw["default_on"] and (interval is None or float(interval[0]) <= best):
        raise EvidenceError(
            f"out_of_sample[{signal!r}] is marked default_on, but the lower end of its interval {interval} is not "
            f"above the best baseline's precision {best} ({raw['best_baseline']}): it does not beat every baseline"
        )
    return {k: raw[k] for k in _KEPT if k in raw}


def evidence_data(results: dict[str, Any]) -> dict[str, Any]:
    """The part of the results file the monitor reads, checked (see the module docstring).

    Raises:
        EvidenceError: an inconsistent ``out_of_sample`` / ``defaults_on`` section.
    """
    section = results.get("out_of_sample")
    if section is None:
        return {"has_evidence": False, "out_of_sample": {}, "defaults_on": [], "chosen_on_all_runs": {}}
    if not isinstance(section, dict):
        raise EvidenceError(f"out_of_sample must be an object, got {type(section).__name__}")
    records = {str(signal): _record(str(signal), raw) for signal, raw in sorted(section.items())}
    marked = sorted(s for s, r in records.items() if r["default_on"])
    listed = results.get("defaults_on")
    if listed is None or not isinstance(listed, list):
        raise EvidenceError("the results file has out_of_sample but no defaults_on list")
    if sorted(listed) != marked:
        raise EvidenceError(f"defaults_on {sorted(listed)} is not the signals marked default_on {marked}")
    unknown = [s for s in marked if s not in SIGNALS]
    if unknown:
        raise EvidenceError(f"defaults_on names {unknown}, which the monitor does not know (it knows {SIGNALS})")
    chosen = results.get("chosen_on_all_runs") or {}
    if not isinstance(chosen, dict):
        raise EvidenceError("chosen_on_all_runs must be an object")
    return {"has_evidence": True, "out_of_sample": records, "defaults_on": marked, "chosen_on_all_runs": chosen}


def render(data: dict[str, Any], source: str) -> str:
    """The text of ``hdi_monitor/_evidence.json`` for ``data`` (from `evidence_data`): the keys that
    `hdi_monitor.evidence.load_evidence` reads, pretty-printed with sorted keys."""
    if data["has_evidence"]:
        note = (
            f"held-out evidence for {len(data['out_of_sample'])} signal(s); on by default: "
            f"{', '.join(data['defaults_on']) or 'none (no signal beats every baseline)'}"
        )
    else:
        note = "no held-out evidence (the results file has no out_of_sample section): nothing warns by default"
    payload = {
        "generated_by": f"benchmarks/make_evidence.py from {source}: do not edit (rerun the script)",
        "source": source,
        "has_evidence": data["has_evidence"],
        "note": note,
        **{k: data[k] for k in ("out_of_sample", "defaults_on", "chosen_on_all_runs")},
    }
    try:
        return json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as err:  # a NaN or infinity in a part that evidence_data does not check
        raise EvidenceError(f"the evidence is not plain JSON: {err}") from None


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the study's results file")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON file to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is stale")
    args = parser.parse_args(argv)
    try:
        data = evidence_data(json.loads(args.results.read_text()))
        text = render(data, _relative(args.results))
    except EvidenceError as err:
        print(f"make_evidence: {args.results}: {err}", file=sys.stderr)
        return 2
    if not data["has_evidence"]:
        print(f"make_evidence: {args.results} has no out_of_sample section: no evidence, nothing warns by default")
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"make_evidence: {args.out} is stale; rerun python benchmarks/make_evidence.py", file=sys.stderr)
            return 1
        print(f"make_evidence: {args.out} is up to date")
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"make_evidence: wrote {args.out} ({'; '.join(render_summary(data))})")
    return 0


def render_summary(data: dict[str, Any]) -> list[str]:
    """One line per fact of the generated file, for the script's output."""
    if not data["has_evidence"]:
        return ["no evidence"]
    return [f"{len(data['out_of_sample'])} signal(s)", f"default on: {data['defaults_on'] or 'none'}"]


if __name__ == "__main__":
    sys.exit(main())
