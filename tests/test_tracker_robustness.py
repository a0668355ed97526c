"""HDITracker guarantees: no work on unmeasured steps, a failed step stays skipped, autocast never
reaches the measurement, and a late state restore (FSDP-style strategies) is not lost."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hdi_monitor.tracker as tracker_mod
from hdi_monitor import HDIMonitor, HDITracker, head_diversity


def encoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_unmeasured_steps_run_no_collective_and_no_measurement(monkeypatch):
    calls = []
    real = tracker_mod._all_ranks_agree
    monkeypatch.setattr(tracker_mod, "_all_ranks_agree", lambda flag: calls.append(flag) or real(flag))
    model = encoder()
    tracker = HDITracker(model, every_n_steps=100, log_images_every_n_steps=0, strict=True)
    x = torch.randn(2, 5, 16)
    for _ in range(10):
        with tracker.capture(x):
            model(x)
        tracker.step()
    assert [h["step"] for h in tracker.history] == [0]
    assert len(calls) == 2  # step 0 only: "all hold it" and "all succeeded"


def test_a_failed_hook_skips_the_step_and_is_not_restarted(monkeypatch):
    import hdi_monitor.capture as capture

    model = encoder()
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0)
    real = capture._on_output
    state = {"fail": True}

    def flaky(*args, **kwargs):
        if state["fail"]:
            raise RuntimeError("hook broke")
        real(*args, **kwargs)

    monkeypatch.setattr(capture, "_on_output", flaky)
    x = torch.randn(2, 5, 16)
    with pytest.warns(tracker_mod.MonitoringWarning, match="hook broke"):
        with tracker.capture(x):  # micro-batch 1 of step 0: the hook fails, the forward goes on
            out = model(x)
    assert torch.isfinite(out).all()
    state["fail"] = False
    with tracker.capture(x) as measured:  # micro-batch 2 of the same step: not restarted
        model(x)
    assert measured is False
    assert tracker.step() is None  # step 0 is skipped, not replaced by a partial measurement
    with tracker.capture(x):
        model(x)
    assert tracker.step().step == 1
    assert [h["step"] for h in tracker.history] == [1]


def test_measurements_ignore_autocast():
    model = encoder()
    x = torch.randn(3, 6, 16)
    reference = head_diversity(model, projections=("query", "key", "value", "output"), inputs=x)
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with tracker.capture(x):
            model(x)
    m = tracker.step()
    for ref, got in zip(reference.layers, m.report.layers):
        for p in ("query", "key", "value", "output"):
            assert got.hdi[p] == pytest.approx(ref.hdi[p], rel=1e-6)
        # the head outputs were recomputed in float32 (bf16 would move H_eff in the 3rd digit);
        # the forward itself ran in bf16, hence the looser tolerance than the weights'
        assert got.effective_heads == pytest.approx(ref.effective_heads, rel=2e-2)


def test_mha_recompute_is_float32_under_autocast():
    model = encoder()
    layer = tracker_mod.find_attention_layers(model)[0]
    seen = []
    handle = layer.attach_output_hook(lambda o, keep: seen.append(o.dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4, 16))
    finally:
        handle.remove()
    assert seen and all(d == torch.float32 for d in seen)


def test_late_state_restore_is_applied(tmp_path):
    """Strategies with restore_checkpoint_after_setup (FSDP, ModelParallel, DeepSpeed) call
    load_state_dict after on_fit_start, when the tracker exists."""
    import lightning.pytorch as pl

    from test_callback import loader, tiny_lm

    first = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, early_warning=False)
    pl.Trainer(max_steps=5, callbacks=[first], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(tiny_lm(), loader())
    state = first.state_dict()
    assert [h["step"] for h in state["history"]] == [0, 2, 4]

    second = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, early_warning=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=1, callbacks=[second], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(tiny_lm(), loader())
    assert second.tracker is not None
    second.load_state_dict(state)  # after on_fit_start: goes straight into the tracker
    assert [h["step"] for h in second.history] == [0, 2, 4]
    assert second.tracker.should_measure(4) is False and second.tracker.should_measure(6) is True
