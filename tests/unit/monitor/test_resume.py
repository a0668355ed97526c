"""The tracker's state: a bad state is refused naming what is wrong (issue 30 item 12), a resumed
Lightning run publishes its last measurement at once (item 9), a weights-only measurement says
nothing about kernel statistics (item 13)."""

from __future__ import annotations

import base64
import warnings

import pytest
import torch
from torch import nn

from hdi_monitor import HDITracker
from hdi_monitor.exceptions import MonitoringWarning

D, HEADS = 16, 4


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        (None, TypeError, "hdi-monitor state must be a dict .* got NoneType"),
        ([1, 2], TypeError, "hdi-monitor state must be a dict .* got list"),
        ({"generator": base64.b64encode(b"abc").decode()}, ValueError, "'generator' holds 3 bytes, a CPU generator"),
        ({"generator": "not base64!"}, ValueError, "'generator' is not base64"),
        ({"events": [{"layer": "x"}]}, ValueError, "event 0 is not an event .*missing kind"),
        ({"events": "x"}, TypeError, "'events' must be a list"),
        ({"last_step": "3"}, TypeError, "'last_step' must be a int"),
        ({"history": 5}, TypeError, "'history' must be a dict or list"),
    ],
)
def test_a_bad_state_is_refused_naming_what_is_wrong(state, error, match):
    tracker = HDITracker(encoder(), every_n_steps=1)
    with pytest.raises(error, match=match):
        tracker.load_state_dict(state)


def test_a_state_round_trips_and_its_generator_continues():
    model = encoder()
    a = HDITracker(model, every_n_steps=1, max_tokens=3)
    x = torch.randn(2, 5, D)
    a.measure(x)
    state = a.state_dict()
    b = HDITracker(model, every_n_steps=1, max_tokens=3)
    b.load_state_dict(state)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert b.history.steps == a.history.steps and b.state_dict()["last_step"] == state["last_step"]


def test_a_weights_only_measurement_says_nothing_about_kernel_statistics():
    """Issue 30 item 13: ``tracker.measure()`` without inputs (weights only) with kernel statistics on
    said "kernel statistics not measured (the layer's forward did not run)" once per layer, so the
    layer's later real failure was never named. Now it says nothing, a real forward is measured, and
    a later step whose forward skips a layer names that layer (the note is said once per layer: on the
    previous code it had been spent on the weights-only measurement)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    tracker = HDITracker(model, every_n_steps=1, kernel_stats=True)

    def kernel_notes(caught) -> list[str]:  # noqa: ANN001
        return [m for m in _monitoring(caught) if "kernel statistics not measured" in m]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = tracker.measure()  # weights only (step 0)
    assert m is not None and [la.attention_entropy for la in m.report.layers] == [None, None]
    assert kernel_notes(caught) == []
    x = torch.randn(2, 5, D)
    assert tracker.step() is None  # the loop's step 0: measured already
    with tracker.capture(x):  # step 1: a real forward, measured
        model(x)
    m = tracker.step()
    assert m is not None and m.step == 1 and all(la.attention_entropy is not None for la in m.report.layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracker.capture(x) as measured:  # step 2: the forward skips layers.1
            model.layers[0](x)
        m = tracker.step()
    assert measured and m is not None and m.step == 2
    assert [la.attention_entropy is not None for la in m.report.layers] == [True, False]
    (note,) = kernel_notes(caught)
    assert "layers.1.self_attn: kernel statistics not measured (the layer's forward did not run" in note
    assert "layers.0.self_attn" not in note


def _monitoring(caught) -> list[str]:  # noqa: ANN001
    return [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]


@pytest.mark.filterwarnings("ignore:HDIMonitor. the Trainer has no logger")  # logger=False on purpose
@pytest.mark.parametrize("restore", ["before_setup", "after_setup"])
def test_a_resumed_lightning_run_publishes_its_last_measurement_at_once(tmp_path, restore):
    """Issue 30 item 9: after a resume, ``hdi/...`` was missing from ``callback_metrics`` until the
    next measured step, so ``EarlyStopping(monitor="hdi/key/mean")`` failed with "metric not
    available". The restored last measurement is published when the resumed fit starts, also where
    the strategy restores the checkpoint after its setup (FSDP, ModelParallel, DeepSpeed: the
    callback's state arrives after ``on_fit_start``)."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from hdi_monitor import HDIMonitor
    from hdi_monitor.contrib.demo import CharDataModule, CharLM

    class RestoresAfterSetup(SingleDeviceStrategy):  # the order of the sharding strategies, on one CPU
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

    def trainer(steps: int, extra: list[Callback]) -> L.Trainer:
        strategy = RestoresAfterSetup(torch.device("cpu")) if restore == "after_setup" else "auto"
        return L.Trainer(
            max_steps=steps,
            callbacks=[HDIMonitor(every_n_steps=4, log_images_every_n_steps=0), *extra],
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            enable_model_summary=False,
            accelerator="cpu",
            strategy=strategy,
        )

    torch.manual_seed(0)
    first = trainer(5, [])
    first.fit(CharLM(d_model=32, num_heads=4, num_layers=1), datamodule=CharDataModule())
    expected = float(first.callback_metrics["hdi/key/mean"])
    ckpt = tmp_path / "after5.ckpt"
    first.save_checkpoint(ckpt)

    seen: dict[str, float] = {}

    class Peek(Callback):  # what a stock callback sees at the first step of the resumed run (step 5: not measured)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if not seen:
                seen.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("hdi/")})

    resumed = trainer(6, [Peek()])
    resumed.fit(CharLM(d_model=32, num_heads=4, num_layers=1), datamodule=CharDataModule(), ckpt_path=ckpt)
    assert seen["hdi/key/mean"] == pytest.approx(expected, rel=1e-12)
