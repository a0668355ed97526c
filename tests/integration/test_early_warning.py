"""Early warnings end to end with a real Trainer: saturation stops training, tied heads are
reported as redundant, and a resumed run warns exactly as an uninterrupted one."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import loader, read_events, tiny_lm, trainer

from hdi_monitor import DiversityEvent, DiversityWarning, HDIMonitor, SaturationDetector

LAYER0 = "encoder.layers.0.self_attn"


def test_flat_hdi_fires_saturation_and_stop_ends_training_early(tmp_path):
    monitor = HDIMonitor(
        every_n_steps=2,
        projections=("key",),
        activations=False,
        detector=SaturationDetector(patience=3, warmup_steps=0),
        on_event="stop",
        warn_on=("saturation",),
        strict=True,
    )
    t = trainer(tmp_path, monitor, max_steps=40)
    with pytest.warns(DiversityWarning, match="step 6: saturation in 2 layers and the model mean"):
        t.fit(tiny_lm(lr=0.0), loader(n=400))
    # flat series: the window of patience + 1 = 4 measurements (steps 0, 2, 4, 6) is full at step 6
    assert t.global_step == 7
    kinds = {(e.kind, e.layer) for e in monitor.tracker.events}
    assert ("saturation", LAYER0) in kinds and ("saturation", "mean") in kinds
    accs = read_events(t.logger.log_dir)
    texts = {tag for acc in accs for tag in acc.Tags()["tensors"] if tag.startswith("diversity_events")}
    assert any("saturation" in tag for tag in texts)
    flags = [
        ev
        for acc in accs
        if "diversity_events/saturation" in acc.Tags()["scalars"]
        for ev in acc.Scalars("diversity_events/saturation")
    ]
    assert [f.step for f in flags] == [0, 2, 4, 6]  # a point at every measured step, 0 without events
    assert [f.value for f in flags[:3]] == [0.0, 0.0, 0.0] and flags[3].value >= 1


def test_warn_mode_does_not_stop(tmp_path):
    monitor = HDIMonitor(
        every_n_steps=2,
        projections=("key",),
        activations=False,
        detector=SaturationDetector(patience=2, warmup_steps=0),
        warn_on=("saturation",),
    )
    t = trainer(tmp_path, monitor, max_steps=12)
    with pytest.warns(DiversityWarning, match="saturation"):
        t.fit(tiny_lm(lr=0.0), loader())
    assert t.global_step == 12


def _tie_key_heads(model, layer: int, a: int, b: int) -> None:
    attn = model.encoder.layers[layer].self_attn
    d, dim = attn.head_dim, attn.embed_dim
    with torch.no_grad():
        w = attn.in_proj_weight
        w[dim + b * d : dim + (b + 1) * d] = w[dim + a * d : dim + (a + 1) * d]


def test_tied_key_heads_get_a_redundancy_warning(tmp_path):
    model = tiny_lm(lr=0.0)
    _tie_key_heads(model, layer=0, a=1, b=3)
    events: list[DiversityEvent] = []
    monitor = HDIMonitor(
        every_n_steps=2,
        projections=("key",),
        detector=SaturationDetector(warmup_steps=0),
        on_event=events.append,
        strict=True,
    )
    trainer(tmp_path, monitor, max_steps=3).fit(model, loader())
    redundant = [e for e in events if e.kind == "redundancy" and e.projection == "key"]
    assert len(redundant) == 1  # once, not at every measurement
    event = redundant[0]
    assert event.layer == LAYER0 and event.step == 0
    assert [(i, j) for i, j, _ in event.pairs] == [(1, 3)]
    assert event.pairs[0][2] == pytest.approx(1.0, abs=1e-6)
    assert LAYER0 in event.message and "1 and 3" in event.message


def _warnings_of(fit) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in caught if issubclass(w.category, DiversityWarning)]


def test_resumed_run_warns_exactly_like_an_uninterrupted_one(tmp_path):
    def monitor():
        return HDIMonitor(
            every_n_steps=2,
            projections=("key", "query"),
            activations=False,
            detector=SaturationDetector(patience=2, warmup_steps=4, redundancy_threshold=0.99),
            warn_on=("saturation", "redundancy"),
            strict=True,
        )

    def model():
        m = tiny_lm(lr=0.0)
        _tie_key_heads(m, layer=1, a=0, b=2)
        return m

    full = monitor()
    whole = _warnings_of(lambda: trainer(tmp_path / "a", full, max_steps=16).fit(model(), loader()))
    assert len(whole) >= 2  # redundancy, then saturation of both layers and the mean (one summary per step)

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=7)
    first = monitor()
    part1 = _warnings_of(
        lambda: trainer(tmp_path / "b", [first, ckpt], max_steps=7, enable_checkpointing=True).fit(model(), loader())
    )
    second = monitor()
    part2 = _warnings_of(
        lambda: trainer(tmp_path / "b", [second], max_steps=16).fit(
            model(), loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    )
    assert part1 and part2
    assert part1 + part2 == whole
    assert [e.to_dict() for e in second.tracker.events] == [e.to_dict() for e in full.tracker.events]


def test_at_most_one_warning_per_measured_step_pointing_at_user_code(tmp_path):
    """Item 9 (issue 12): the demo model (CharLM) with tied heads and a flat HDI fires many events at
    one step; the run emits one DiversityWarning per step with events, attributed to the line that
    called trainer.fit, and every full message stays in monitor.events and the Text tab."""
    from hdi_monitor import MonitoringWarning

    model = tiny_lm(lr=0.0)
    _tie_key_heads(model, layer=0, a=1, b=3)
    _tie_key_heads(model, layer=1, a=0, b=2)
    monitor = HDIMonitor(
        every_n_steps=2,
        detector=SaturationDetector(patience=2, warmup_steps=0, redundancy_threshold=0.99),
        warn_on=("saturation", "collapse", "redundancy"),
        strict=True,
    )
    t = trainer(tmp_path, monitor, max_steps=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader())  # every monitor warning must point at this line
    fit_line = __import__("inspect").currentframe().f_lineno - 1
    ours = [w for w in caught if issubclass(w.category, (DiversityWarning, MonitoringWarning))]
    events = monitor.tracker.events
    steps = sorted({e.step for e in events})
    per_step = {s: sum(e.step == s for e in events) for s in steps}
    assert max(per_step.values()) >= 5  # the test is not vacuous: many events share a step
    assert len(ours) == len(steps) <= len(monitor.history)
    for w, step in zip(ours, steps, strict=True):
        assert w.filename == __file__ and w.lineno == fit_line, (w.filename, w.lineno)
        assert str(w.message).startswith(f"step {step}: ")
        assert "see the Text tab (diversity_events/*) or monitor.events" in str(w.message)
        assert len(str(w.message)) <= 165 and "\n" not in str(w.message)
    assert "2 redundant head pairs in 2 layers" in str(ours[0].message)
    accs = read_events(t.logger.log_dir)
    texts = sum(
        len(acc.Tensors(tag)) for acc in accs for tag in acc.Tags()["tensors"] if tag.startswith("diversity_events")
    )
    assert texts == len(events)


_WARNS = """
import sys, warnings
warnings.simplefilter("always")
from lightning.pytorch.loggers import CSVLogger
from hdi_monitor.integrations.loggers import sinks_for_loggers
sinks_for_loggers([CSVLogger(sys.argv[1])])  # a MonitoringWarning raised inside hdi-monitor
"""


def _stderr_of(code_path: str, tmp_path) -> str:
    """Run ``_WARNS`` as if it were the file ``code_path`` (a console script or a user script)."""
    import os
    import subprocess
    import sys

    runner = f"import sys; sys.argv = ['x', {str(tmp_path)!r}]; exec(compile({_WARNS!r}, {code_path!r}, 'exec'))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.slow  # two subprocesses that import Lightning
def test_warnings_from_a_console_script_carry_no_launcher_noise(tmp_path):
    """Issue 24: the demo's warnings were prefixed with the console script's venv path and its
    ``sys.exit(main())`` line. From a console script (a file in the environment's scripts folder)
    a warning is one line at ``hdi-monitor:0``; from a user's script it points at the user's line."""
    import sysconfig

    launcher = str(Path(sysconfig.get_path("scripts")) / "hdi-monitor")
    err = _stderr_of(launcher, tmp_path)
    lines = [line for line in err.splitlines() if "takes scalars only" in line]
    assert len(lines) == 1 and lines[0].startswith("hdi-monitor:0: MonitoringWarning: hdi-monitor: CSVLogger")
    assert launcher not in err and "sinks_for_loggers([CSVLogger" not in err  # no path, no source line

    user = str(tmp_path / "train.py")
    err = _stderr_of(user, tmp_path)
    assert f"{user}:6: MonitoringWarning: hdi-monitor: CSVLogger takes scalars only" in err
