"""How the early warnings speak (issues 31 and 33): the evidence they follow, ``on_event`` and
``warn_on``, one line per measured step, the warm-up and end-of-run lines, the quiet demo."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_lm

from hdi_monitor import DiversityEvent, DiversityWarning, HDIMonitor, HDITracker, MonitorConfig, SaturationDetector

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results" / "warnings_study.json"


def _make_evidence():
    spec = importlib.util.spec_from_file_location("make_evidence", ROOT / "benchmarks" / "make_evidence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_evidence = _make_evidence()


def _signal(precision, interval, baselines, default_on, outcome="loss spike within 100 steps"):
    best = max(baselines, key=baselines.__getitem__)
    return {
        "outcome": outcome,
        "precision": precision,
        "interval": interval,
        "recall": 0.5,
        "baselines": baselines,
        "best_baseline": best,
        "best_baseline_precision": baselines[best],
        "default_on": default_on,
        "events": 40,
        "runs_flagged": 9,
    }


#: A small results file in the new schema: logit_blowup beats every baseline (interval 0.61-0.83
#: above 0.30), saturation/hdi does not (0.55-0.67 against 0.62), redundancy has no interval.
NEW_SCHEMA = {
    "command": "python benchmarks/warnings_study.py",
    "out_of_sample": {
        "logit_blowup": _signal(0.72, [0.61, 0.83], {"random": 0.21, "loss_zscore_3": 0.30, "lr_prior": 0.28}, True),
        "saturation/hdi": _signal(0.61, [0.55, 0.67], {"random": 0.58, "time_matched": 0.62}, False, "plateau"),
        "redundancy": _signal(0.40, None, {"random_heads": 0.45}, False, "ablation costs more than random heads"),
    },
    "defaults_on": ["logit_blowup"],
    "chosen_on_all_runs": {"logit_blowup": {"logit_threshold": 500.0}},
}


def _write(tmp_path: Path, results: dict, name: str = "study.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(results))
    return path


def _load(path: Path):
    """A generated evidence file, read as `hdi_monitor.evidence` reads the package's own."""
    from hdi_monitor.evidence import load_evidence

    return load_evidence(path)


@pytest.fixture
def with_evidence(tmp_path, monkeypatch):
    """``hdi_monitor.evidence`` with its names read from a file generated for a results file (restored
    after)."""
    import hdi_monitor.evidence as evidence

    def use(results: dict):
        out = tmp_path / "_evidence.json"
        assert make_evidence.main(["--results", str(_write(tmp_path, results)), "--out", str(out)]) == 0
        data = _load(out)
        monkeypatch.setattr(evidence, "SOURCE", data.source)
        monkeypatch.setattr(evidence, "HAS_EVIDENCE", data.has_evidence)
        monkeypatch.setattr(evidence, "EVIDENCE", data.evidence)
        monkeypatch.setattr(evidence, "DEFAULTS_ON", data.defaults_on)
        return evidence

    return use


# ---------------------------------------------------------------------------- the evidence file


def test_make_evidence_generates_the_new_schema_and_checks_staleness(tmp_path, capsys):
    results = _write(tmp_path, NEW_SCHEMA)
    out = tmp_path / "data.json"
    assert make_evidence.main(["--results", str(results), "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["source"] == "study.json" and "do not edit" in raw["generated_by"]
    assert list(raw) == sorted(raw)  # sort_keys: a rerun diffs cleanly
    assert raw["out_of_sample"]["logit_blowup"]["interval"] == [0.61, 0.83]
    assert raw["out_of_sample"]["logit_blowup"]["baselines"]["loss_zscore_3"] == 0.30
    data = _load(out)
    assert data.has_evidence is True
    assert data.defaults_on == ("logit_blowup",)
    assert sorted(data.evidence) == ["logit_blowup", "redundancy", "saturation/hdi"]
    assert data.evidence["logit_blowup"].interval == (0.61, 0.83)
    assert data.evidence["logit_blowup"].baselines["loss_zscore_3"] == 0.30
    assert data.chosen_on_all_runs == {"logit_blowup": {"logit_threshold": 500.0}}
    assert make_evidence.main(["--results", str(results), "--out", str(out), "--check"]) == 0
    # the results change: the module is stale until regenerated
    changed = json.loads(json.dumps(NEW_SCHEMA))
    changed["out_of_sample"]["logit_blowup"]["precision"] = 0.70
    assert (
        make_evidence.main(["--results", str(_write(tmp_path, changed, "b.json")), "--out", str(out), "--check"]) == 1
    )
    assert "stale" in capsys.readouterr().err
    assert make_evidence.main(["--results", str(results), "--out", str(tmp_path / "none.json"), "--check"]) == 1


def test_make_evidence_without_out_of_sample_gives_no_evidence(tmp_path, capsys):
    """The study's first schema (no held-out scoring): no evidence, nothing warns by default, said."""
    old = {"command": "python benchmarks/warnings_study.py", "chosen": {"saturation": None}}
    out = tmp_path / "data.json"
    assert make_evidence.main(["--results", str(_write(tmp_path, old)), "--out", str(out)]) == 0
    assert "no evidence, nothing warns by default" in capsys.readouterr().out
    data = _load(out)
    assert data.has_evidence is False and data.evidence == {} and data.defaults_on == ()
    assert "no held-out evidence" in data.note


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["out_of_sample"]["saturation/hdi"].update(default_on=True), "does not beat every baseline"),
        (lambda r: r["out_of_sample"]["redundancy"].update(default_on=True), "does not beat every baseline"),
        (lambda r: r.update(defaults_on=["logit_blowup", "redundancy"]), "is not the signals marked default_on"),
        (lambda r: r.pop("defaults_on"), "no defaults_on"),
        (lambda r: r["out_of_sample"]["logit_blowup"].pop("interval"), "lacks interval"),
        (lambda r: r["out_of_sample"]["logit_blowup"].update(best_baseline_precision=0.1), "is below baseline"),
        (lambda r: r["out_of_sample"]["logit_blowup"].update(precision=float("nan")), "finite number"),
        (lambda r: r["out_of_sample"]["logit_blowup"].update(interval=[0.9, 0.6]), "low above high"),
    ],
)
def test_make_evidence_refuses_an_inconsistent_file(tmp_path, capsys, edit, message):
    results = json.loads(json.dumps(NEW_SCHEMA))
    edit(results)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(results, allow_nan=True))
    out = tmp_path / "data.json"
    assert make_evidence.main(["--results", str(path), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_make_evidence_signals_are_the_monitors():
    from hdi_monitor.evidence import SIGNALS

    assert make_evidence.SIGNALS == SIGNALS


def test_committed_evidence_matches_the_results_file_and_defaults_beat_their_baselines():
    """The generated file is what ``benchmarks/results/warnings_study.json`` gives (make_evidence
    --check), and every default-on signal is one the results file marks as beating its baselines,
    with the lower end of its interval above the best baseline (read from the file here)."""
    from hdi_monitor.evidence import DEFAULTS_ON, EVIDENCE

    assert make_evidence.main(["--check"]) == 0
    results = json.loads(RESULTS.read_text())
    section = results.get("out_of_sample") or {}
    for signal in DEFAULTS_ON:
        record = section[signal]
        assert record["default_on"] is True, signal
        assert record["interval"][0] > record["best_baseline_precision"], signal
        assert record["best_baseline_precision"] >= max(v for v in record["baselines"].values() if v is not None)
    assert set(DEFAULTS_ON) == set(results.get("defaults_on") or [])
    assert set(EVIDENCE) == set(section)
    for signal, record in EVIDENCE.items():
        assert record.precision == section[signal]["precision"]
        assert record.best_baseline_precision == section[signal]["best_baseline_precision"]


def test_the_evidence_ships_as_package_data():
    """``hdi_monitor/_evidence.json`` is found through `importlib.resources` where the package is
    imported from, is the file ``make_evidence --check`` keeps up to date, is what
    `hdi_monitor.evidence` holds, and is listed in pyproject.toml's package data (a wheel ships it)."""
    from importlib.resources import files

    import hdi_monitor.evidence as evidence

    resource = files("hdi_monitor") / "_evidence.json"
    assert resource.is_file()
    text = resource.read_text(encoding="utf-8")
    assert text == make_evidence.OUT.read_text(encoding="utf-8")
    data = evidence.load_evidence(json.loads(text))
    assert data == evidence.load_evidence()
    held = (evidence.SOURCE, evidence.HAS_EVIDENCE, evidence.DEFAULTS_ON, evidence.EVIDENCE)
    assert held == (data.source, data.has_evidence, data.defaults_on, data.evidence)
    with pytest.raises(ValueError, match="lacks has_evidence, note"):
        evidence.load_evidence({k: v for k, v in json.loads(text).items() if k not in ("has_evidence", "note")})
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "_evidence.json" in setuptools["package-data"]["hdi_monitor"]


def test_evidence_records_and_defaults_come_from_the_file(with_evidence):
    evidence = with_evidence(NEW_SCHEMA)
    assert evidence.DEFAULTS_ON == ("logit_blowup",) and evidence.HAS_EVIDENCE
    rec = evidence.EVIDENCE["logit_blowup"]
    assert (rec.precision, rec.interval, rec.best_baseline, rec.best_baseline_precision) == (
        0.72,
        (0.61, 0.83),
        "loss_zscore_3",
        0.30,
    )
    assert rec.default_on and not evidence.EVIDENCE["saturation/hdi"].default_on
    assert evidence.EVIDENCE["redundancy"].interval is None
    clause = evidence.evidence_clause("logit_blowup")
    assert clause == "held-out precision 0.72 [0.61-0.83] vs 0.30 (loss_zscore_3); docs/early-warnings.md"
    assert evidence.evidence_clause("update_entropy") == "no held-out evidence; docs/early-warnings.md"
    # the default warn_on follows the file
    assert MonitorConfig().warned_signals == frozenset({"logit_blowup"})


# ---------------------------------------------------------------------------- settings


def test_warn_on_names_are_checked_and_expanded():
    assert MonitorConfig(warn_on=("saturation",)).warned_signals == {"saturation/hdi", "saturation/effective_heads"}
    assert MonitorConfig(warn_on="collapse/hdi").warn_on == ("collapse/hdi",)
    assert MonitorConfig(warn_on=["redundancy", "logit_blowup"]).warn_on == ("redundancy", "logit_blowup")
    assert MonitorConfig(warn_on=()).warned_signals == frozenset()
    with pytest.raises(ValueError, match=r"unknown signal\(s\) 'saturaton'.*saturation/hdi.*update_entropy"):
        MonitorConfig(warn_on=("saturaton",))
    with pytest.raises(ValueError, match="'redundancy/hdi'"):
        HDIMonitor(warn_on=["redundancy/hdi"])
    with pytest.raises(TypeError, match="warn_on"):
        MonitorConfig(warn_on=3)
    with pytest.raises(ValueError, match="on_event must be 'warn', 'log', 'stop' or a callable"):
        MonitorConfig(on_event="quiet")
    assert MonitorConfig(warn_on=["redundancy"]).to_dict()["warn_on"] == ["redundancy"]
    assert "on_saturation" not in MonitorConfig().to_dict()


def test_on_saturation_is_a_deprecated_alias_of_on_event():
    with pytest.warns(FutureWarning, match="on_saturation is deprecated.*on_event='stop'") as caught:
        monitor = HDIMonitor(on_saturation="stop")
    assert caught[0].filename == __file__  # points at the line above
    assert monitor.config.on_event == "stop" and monitor.config.on_saturation is None
    with pytest.warns(FutureWarning, match="on_event"):
        assert MonitorConfig(on_saturation="warn").on_event == "warn"
    with pytest.raises(ValueError, match="give on_event, not on_saturation"):
        MonitorConfig(on_event="log", on_saturation="stop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HDIMonitor.from_config(MonitorConfig(on_event="log")).config.on_event == "log"  # no warning


def test_on_saturation_alias_in_the_trainer_callback():
    pytest.importorskip("transformers")
    from hdi_monitor import HDITrainerCallback

    with pytest.warns(FutureWarning, match="on_event"):
        callback = HDITrainerCallback(on_saturation="log")
    assert callback.config.on_event == "log"
    assert callback.events == [] and HDIMonitor().events == []  # monitor.events exists before a run


# ---------------------------------------------------------------------------- one line per step


def _event(kind, layer, step=100, metric="hdi", projection="key", pairs=()):
    return DiversityEvent(kind, layer, projection, metric, step, 0.5, 0.6, 0.9, pairs, f"{kind} of {layer}")


def test_event_line_counts_per_kind_and_states_the_evidence_once(with_evidence):
    from hdi_monitor.monitor._warnings import MAX_LINE, event_line

    with_evidence(NEW_SCHEMA)
    events = [
        _event("logit_blowup", "l0", projection="kernel", metric="max_attention_logit"),
        _event("logit_blowup", "l1", projection="kernel", metric="max_attention_logit"),
        _event("saturation", "l0"),
        _event("saturation", "mean"),
    ]
    explained: set[str] = set()
    first = event_line(100, events, logged=3, explained=explained)
    # the first new signal gets its evidence (the file's numbers), the other one its count in short
    assert first.startswith("step 100: logit blowup in 2 layers (held-out precision 0.72")
    assert "vs 0.30" in first and "saturation (2); docs/early-warnings.md;" in first
    assert first.endswith("; see the Text tab (diversity_events/*) or monitor.events")
    assert len(first) <= MAX_LINE and "\n" not in first
    assert explained == {"logit_blowup"}
    # the next line tells saturation's evidence
    second = event_line(110, events, explained=explained)
    assert second.startswith("step 110: saturation (2; held-out precision 0.61 vs 0.62")  # shortened to fit
    assert "logit blowup (2); docs/early-warnings.md;" in second and len(second) <= MAX_LINE
    assert explained == {"logit_blowup", "saturation/hdi"}
    third = event_line(120, events[:2], logged=3, explained=explained)
    assert third == (
        "step 120: logit blowup in 2 layers; 3 more events logged; see the Text tab (diversity_events/*) or "
        "monitor.events"
    )


def test_event_line_stays_short_with_every_kind_at_once():
    from hdi_monitor.monitor._warnings import MAX_LINE, event_line

    pairs = tuple((i, i + 1, 0.95) for i in range(6))
    events = [
        *[_event("saturation", f"encoder.layers.{i}.attention.self", metric=m) for i in range(12) for m in ("hdi",)],
        *[_event("collapse", f"encoder.layers.{i}.attention.self", metric="effective_heads") for i in range(12)],
        *[_event("redundancy", f"encoder.layers.{i}.attention.self", pairs=pairs) for i in range(12)],
        _event("entropy_collapse", "l0", projection="kernel", metric="attention_entropy"),
        _event("logit_blowup", "l0", projection="kernel", metric="max_attention_logit"),
    ]
    line = event_line(123456, events, logged=40, explained=set())
    assert len(line) <= MAX_LINE and "\n" not in line
    assert line.startswith("step 123456: ") and "monitor.events" in line


def _plain_run(
    steps: int, every: int, tracker: HDITracker | None = None, **settings
) -> tuple[HDITracker, list[str], list[warnings.WarningMessage]]:
    """The demo model (weights fixed: lr 0) watched by a tracker in a plain loop (``tracker``: go on
    with that one, a second run); the monitor's log lines and warnings."""
    model = tiny_lm(lr=0.0) if tracker is None else tracker.model
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("hdi_monitor")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if tracker is None:
        tracker = HDITracker(
            model, every_n_steps=every, projections=("key",), activations=False, strict=True, **settings
        )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                with tracker.capture(), torch.no_grad():
                    pass  # weights only (activations off): the forward pass is not needed
                tracker.step()
            tracker.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return tracker, lines, [w for w in caught if issubclass(w.category, DiversityWarning)]


def _tied(tracker_model):
    attn = tracker_model.encoder.layers[0].self_attn
    d, dim = attn.head_dim, attn.embed_dim
    with torch.no_grad():
        w = attn.in_proj_weight
        w[dim + 3 * d : dim + 4 * d] = w[dim + 1 * d : dim + 2 * d]


def test_default_is_quiet_events_are_still_recorded():
    """With no evidence-backed signal (the current results file), events are detected and recorded
    but nothing warns; ``warn_on`` turns one kind on alone; ``on_event="log"`` prints nothing."""
    from hdi_monitor.evidence import DEFAULTS_ON

    detector = SaturationDetector(patience=2, warmup_steps=0)
    tracker, lines, caught = _plain_run(8, 1, detector=detector, warn_on=() if DEFAULTS_ON else None)
    assert any(e.kind == "saturation" for e in tracker.events)  # lr 0: flat, saturates
    assert caught == []
    assert lines[-1].startswith(f"hdi-monitor: {len(tracker.events)} early-warning events in 8 measurements (0 warned")

    tracker, lines, caught = _plain_run(
        8, 1, detector=SaturationDetector(patience=2, warmup_steps=0), warn_on=("saturation/hdi",)
    )
    steps = sorted({e.step for e in tracker.events if e.kind == "saturation"})
    assert [str(w.message).split(":")[0] for w in caught] == [f"step {s}" for s in steps]
    assert "saturation in 2 layers and the model mean" in str(caught[0].message)
    assert "warn on saturation/hdi" in lines[0]
    warned = sum(e.kind == "saturation" for e in tracker.events)
    assert f"({warned} warned: {warned} saturation" in lines[-1] and lines[-1].endswith("monitor.events")

    tracker, lines, caught = _plain_run(
        8, 1, detector=SaturationDetector(patience=2, warmup_steps=0), warn_on=("saturation",), on_event="log"
    )
    assert tracker.events and caught == [] and lines == []


def test_stop_follows_warn_on():
    tracker, _, caught = _plain_run(
        6, 1, detector=SaturationDetector(patience=2, warmup_steps=0), on_event="stop", warn_on=("collapse",)
    )
    assert not tracker.stop_requested and caught == []  # saturation is not warned: no stop
    tracker, _, caught = _plain_run(
        6, 1, detector=SaturationDetector(patience=2, warmup_steps=0), on_event="stop", warn_on=("saturation",)
    )
    assert tracker.stop_requested and len(caught) == 1


def test_messages_advise_no_action_without_evidence(with_evidence):
    """Pruning advice only where the redundancy ablation beat random heads."""
    det = SaturationDetector(warmup_steps=0, patience=2)
    pairwise = torch.eye(4)
    pairwise[0, 1] = pairwise[1, 0] = 0.97
    (event,) = det.update(0, "l0", "key", 0.5, pairwise=pairwise)
    assert "prun" not in event.message and "fewer heads" not in event.message
    assert "an observation, not a validated warning" in event.message and "docs/early-warnings.md" in event.message
    backed = json.loads(json.dumps(NEW_SCHEMA))
    backed["out_of_sample"]["redundancy"] = _signal(0.8, [0.7, 0.9], {"random_heads": 0.45}, True)
    backed["defaults_on"] = ["logit_blowup", "redundancy"]
    with_evidence(backed)
    (event,) = SaturationDetector(warmup_steps=0).update(0, "l0", "key", 0.5, pairwise=pairwise)
    assert "consider pruning one of them (held-out precision 0.80 [0.70-0.90] vs 0.45" in event.message
    events = [e for step in (1, 2, 3) for e in det.update(step, "l0", "key", 0.5)]
    assert [e.kind for e in events] == ["saturation"]
    assert "H" not in events[0].message.split("):")[-1] and "prun" not in events[0].message  # saturation not backed


# ---------------------------------------------------------------------------- warm-up


def test_warmup_follows_the_cadence_and_is_said():
    """A 130-step run measured every 10 steps: the detectors warm up for 10 measurements (until step
    90), say so at the first measured step, and the end line says the run had no event and when
    saturation is first judged (after the warm-up and a full window of patience + 1 measurements);
    a run ending inside its warm-up is told so."""
    tracker, lines, _ = _plain_run(130, 10)
    assert tracker.detector.warmup_measurements == 10 and tracker.detector.warmup_steps is None
    assert len(tracker.history) == 13
    assert lines[0].startswith("hdi-monitor: early-warning detectors warm up until step 90 (10 measurements, every 10")
    assert lines[-1].startswith("hdi-monitor: 0 early-warning events in 13 measurements")
    first = 10 + tracker.detector.patience + 1
    assert first > 13 and lines[-1].endswith(f"saturation is first judged at measurement {first}")
    assert len(lines) == 2 and all(len(line) <= 200 for line in lines)

    tracker, lines, _ = _plain_run(50, 10)
    assert len(tracker.history) == 5
    assert lines[-1].startswith("hdi-monitor: the run ended inside the early-warning warm-up (step 40, 5 measurement")
    # a second run of the same tracker goes on with its detectors: its 5 measurements are the warm-up's
    # last (steps 50 to 90); a third run starts warm
    tracker, lines, _ = _plain_run(50, 10, tracker=tracker)
    assert lines[0].startswith("hdi-monitor: early-warning detectors warm up until step 90 (")
    assert lines[-1].startswith("hdi-monitor: the run ended inside the early-warning warm-up (step 90,")
    tracker, lines, _ = _plain_run(20, 10, tracker=tracker)
    assert lines[0].startswith(
        "hdi-monitor: early-warning detectors warm up no longer (10 measurements before step 100)"
    )


# ---------------------------------------------------------------------------- above the progress bar

_BAR = r"""
import sys, warnings
from tqdm import tqdm
from hdi_monitor import DiversityWarning
from hdi_monitor.monitor._warnings import say, warn
bar = tqdm(total=10, file=sys.stderr, ascii=True, mininterval=0)
bar.update(5)
warn("hdi-monitor step 5: saturation in 1 layer; see the Text tab", DiversityWarning)
say("hdi-monitor: a log line")
bar.update(1)
warnings.simplefilter("ignore", DiversityWarning)
warn("IGNORED", DiversityWarning)
warnings.simplefilter("error", DiversityWarning)
try:
    warn("RAISED", DiversityWarning)
except DiversityWarning as err:
    print("raised:", err)
bar.close()
"""


@pytest.mark.slow  # a subprocess importing torch
def test_warnings_are_written_above_an_active_progress_bar(tmp_path):
    """With a tqdm bar showing, a warning and a log line start on a line of their own (tqdm.write),
    not glued to the bar; the warnings filters still apply (ignore, error)."""
    script = tmp_path / "bar.py"
    script.write_text(_BAR)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    warning = f"{script}:8: DiversityWarning: hdi-monitor step 5: saturation in 1 layer; see the Text tab"
    for text in (warning, "hdi-monitor: a log line"):
        at = err.index(text)
        assert err[at - 1] in "\r\n", repr(err[max(0, at - 40) : at + 10])  # at the start of a line
        assert err[at + len(text)] == "\n"
    assert "IGNORED" not in err and "raised: RAISED" in proc.stdout


# ---------------------------------------------------------------------------- the demo


@pytest.mark.slow  # the demo's 1,200 steps, about a minute on 2 cores
def test_the_demo_is_quiet(tmp_path):
    """Issue 31: ``hdi-monitor demo --steps 1200 --every 25 --d-model 32 --heads 4 --layers 2`` wrote
    10 warning lines, one over 300 characters. The monitor's lines (its warnings and its log lines),
    counted in the captured output of the command: at most 5, none over 200 characters. Run here
    with the same 48 measurements in a third of the steps (``--steps 480 --every 10``): 38 of them
    past the detectors' warm-up, where events can fire (114 s of CI for 1,200 steps)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "hdi_monitor.cli", "demo", "--steps", "480", "--every", "10", "--d-model", "32"]
    cmd += ["--heads", "4", "--layers", "2", "--out", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [part for line in (proc.stdout + proc.stderr).splitlines() for part in line.split("\r")]
    ours = [
        line.strip()
        for line in lines
        if "DiversityWarning" in line or "MonitoringWarning" in line or line.strip().startswith("hdi-monitor:")
    ]
    assert ours, "the demo says at least when its detectors warm up"
    assert len(ours) <= 5, ours
    assert all(len(line) <= 200 for line in ours), [len(line) for line in ours]
