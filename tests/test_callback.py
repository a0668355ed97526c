"""HDIMonitor end to end: a real Trainer, event files read back with EventAccumulator."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import loader, read_events, scalar_series, tiny_lm, trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from hdi_monitor import HDIMonitor, SaturationDetector, head_diversity
from hdi_monitor.contrib.demo import CharLM

PROJECTIONS = ("query", "key", "value", "output")
LAYERS = ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn")


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    """One lr=0 run: 10 steps, measure every 3 steps, images every 6."""
    tmp = tmp_path_factory.mktemp("tb")
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=3, log_images_every_n_steps=6, strict=True, detector=None)
    t = trainer(tmp, monitor, max_steps=10)
    t.fit(model, loader())
    return model, monitor, t, read_events(t.logger.log_dir)


def test_scalars_equal_head_diversity_of_the_model(tb_run):
    model, monitor, _, accs = tb_run
    reference = head_diversity(model, projections=PROJECTIONS)
    assert [layer.name for layer in reference.layers] == list(LAYERS)
    for layer in reference.layers:
        for projection in PROJECTIONS:
            series = scalar_series(accs, f"hdi/{projection}/{layer.name}")
            assert sorted(series) == [0, 3, 6, 9]
            for value in series.values():  # lr=0: every measured step sees the same weights
                assert value == pytest.approx(layer.hdi[projection], rel=1e-6, abs=1e-7)
    for projection in PROJECTIONS:
        mean = scalar_series(accs, f"hdi/{projection}/mean")
        assert mean[9] == pytest.approx(reference.mean_hdi(projection), rel=1e-6)
        chance = scalar_series(accs, f"hdi_chance/{projection}")
        assert chance[0] == pytest.approx(1 - 8 / (32 + 8 + 1), rel=1e-6)  # d=8, D=32, spectral


def test_nothing_logged_between_measured_steps(tb_run):
    _, _, _, accs = tb_run
    steps = set()
    for acc in accs:
        for tag in acc.Tags()["scalars"]:
            if tag.split("/")[0] in {"hdi", "hdi_chance", "hdi_max", "effective_heads", "head_correlation"}:
                steps |= {ev.step for ev in acc.Scalars(tag)}
    assert steps == {0, 3, 6, 9}


def test_images_and_histograms_at_image_steps(tb_run):
    _, _, _, accs = tb_run
    images = {t for acc in accs for t in acc.Tags()["images"]}
    expected = {f"diversity_map/{p}" for p in PROJECTIONS} | {f"overlap/{p}" for p in PROJECTIONS} | {"correlation"}
    assert images == expected  # one image per projection and kind, not one per layer
    for acc in accs:
        for tag in acc.Tags()["images"]:
            events = acc.Images(tag)
            assert [e.step for e in events] == [0, 6, 9]  # image steps, and the last measured step (9)
            assert events[0].width >= 400 and events[0].height >= 200  # a figure with labels and a colour bar
    hists = {t: acc.Histograms(t) for acc in accs for t in acc.Tags()["histograms"]}
    assert set(hists) == {f"principal_angles_deg/{p}/{n}" for p in PROJECTIONS for n in LAYERS}  # per layer
    for p in PROJECTIONS:
        for name in LAYERS:
            events = hists[f"principal_angles_deg/{p}/{name}"]
            assert [e.step for e in events] == [0, 6]
            # C(4, 2) pairs x 8 angles each
            assert events[0].histogram_value.num == 6 * 8
            assert events[0].histogram_value.min >= 0 and events[0].histogram_value.max <= 90.0 + 1e-4


def test_custom_scalars_layout_written_once(tb_run):
    _, _, _, accs = tb_run
    from tensorboard.plugins.custom_scalar import layout_pb2

    found = []
    for acc in accs:
        if "custom_scalars__config__" in acc.Tags()["tensors"]:
            for ev in acc.Tensors("custom_scalars__config__"):
                layout = layout_pb2.Layout()
                layout.ParseFromString(ev.tensor_proto.string_val[0])
                found.append(layout)
    assert len(found) == 1
    charts = {chart.title: chart for cat in found[0].category for chart in cat.chart}
    margin = charts["HDI (key): mean over 2 layers, min-max band, chance level"].margin.series
    assert [(s.value, s.lower, s.upper) for s in margin] == [
        ("hdi/key/mean", "hdi/key/min", "hdi/key/max"),
        ("hdi_chance/key", "hdi_chance/key", "hdi_chance/key"),
    ]
    scalars = {t for acc in accs for t in acc.Tags()["scalars"]}
    assert {tag for s in margin for tag in (s.value, s.lower, s.upper)} <= scalars
    chart = charts["HDI (key) per layer"]
    closed = {cat.title: cat.closed for cat in found[0].category}
    assert closed["HDI"] is False and closed["HDI per layer"] is True
    import re

    patterns = list(chart.multiline.tag)
    for tag in [f"hdi/key/{n}" for n in LAYERS] + ["hdi_chance/key"]:
        assert any(re.match(p, tag) for p in patterns), tag
    assert not any(re.match(p, "hdi/query/" + LAYERS[0]) for p in patterns)
    assert any(re.match(p, "train_loss") for p in charts["training loss"].multiline.tag)
    health = charts["invalid heads (key)"]
    assert any(re.match(p, f"invalid_heads/key/{LAYERS[1]}") for p in health.multiline.tag)


def test_invalid_head_counts_logged_on_every_measured_step(tb_run):
    """Item 5 (issue 12): invalid_heads/<projection>/<layer> is a scalar on every measured step (0 here)."""
    accs = tb_run[3]
    for p in PROJECTIONS:
        for layer in LAYERS:
            series = scalar_series(accs, f"invalid_heads/{p}/{layer}")
            assert series == {0: 0.0, 3: 0.0, 6: 0.0, 9: 0.0}


def test_activation_scalars_equal_the_offline_covariance_of_each_batch(tb_run):
    """Effective heads and mean correlation at step s are those of batch s (lr=0: fixed weights; 64
    tokens per step, under max_tokens, so no subsample)."""
    model, monitor, _, accs = tb_run
    batches = list(loader())
    for name in LAYERS:
        eff = scalar_series(accs, f"effective_heads/{name}")
        corr = scalar_series(accs, f"head_correlation/{name}")
        assert sorted(eff) == sorted(corr) == [0, 3, 6, 9]
        for step in eff:
            report = head_diversity(model, projections=("key",), inputs=(batches[step][0],))
            reference = next(layer for layer in report.layers if layer.name == name)
            assert eff[step] == pytest.approx(reference.effective_heads, rel=1e-5)
            assert corr[step] == pytest.approx(reference.mean_correlation, rel=1e-5, abs=1e-6)
    assert [h["step"] for h in monitor.history] == [0, 3, 6, 9]


def test_hooks_removed_after_training(tb_run):
    model, *_ = tb_run
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_csv_logger_gets_scalars(tmp_path):
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, strict=True, detector=None)
    t = trainer(tmp_path, monitor, max_steps=5, logger=CSVLogger(str(tmp_path), name="csv"))
    t.fit(model, loader())
    rows = list(csv.DictReader((Path(t.logger.log_dir) / "metrics.csv").read_text().splitlines()))
    ref = head_diversity(model, projections=("key",))
    col = f"hdi/key/{LAYERS[0]}"
    logged = {int(r["step"]): float(r[col]) for r in rows if r.get(col)}
    assert sorted(logged) == [0, 2, 4]
    assert logged[4] == pytest.approx(ref.layers[0].hdi["key"], rel=1e-6)


def test_resume_continues_history_without_duplicates(tmp_path):
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    model = tiny_lm(lr=1e-3)
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, strict=True, detector=None)
    t = trainer(tmp_path, [monitor, ckpt_cb], max_steps=4, enable_checkpointing=True)
    t.fit(model, loader())
    assert [h["step"] for h in monitor.history] == [0, 2]

    monitor2 = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, strict=True, detector=None)
    t2 = trainer(tmp_path, [monitor2], max_steps=9, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    t2.fit(tiny_lm(lr=1e-3), loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert [h["step"] for h in monitor2.history] == [0, 2, 4, 6, 8]
    # first run's points come back from the checkpoint unchanged
    assert monitor2.history[:2] == monitor.history
    accs = read_events(tmp_path / "tb")
    series = scalar_series(accs, f"hdi/key/{LAYERS[0]}")  # asserts no step appears twice across files
    assert sorted(series) == [0, 2, 4, 6, 8]


def test_fit_twice_on_one_trainer_continues_history_and_detector(tmp_path):
    """Item 4 (issue 12): a second trainer.fit on the same Trainer continues the history, the events
    and the detector on Lightning's own step axis; a new Trainer starts afresh."""
    model = tiny_lm(lr=0.0)  # flat HDI: saturation needs patience + 1 = 4 measurements in one series
    monitor = HDIMonitor(
        every_n_steps=2,
        projections=("key",),
        activations=False,
        detector=SaturationDetector(patience=3, warmup_steps=0),
        strict=True,
    )
    t = pl.Trainer(
        max_epochs=1,
        logger=TensorBoardLogger(str(tmp_path), name="tb"),
        callbacks=[monitor],
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    t.fit(model, loader(n=16))  # 4 steps: measured 0, 2
    assert [h["step"] for h in monitor.history] == [0, 2] and monitor.tracker.events == []
    t.fit_loop.max_epochs = 2
    with pytest.warns(UserWarning):  # the DiversityWarning of step 6 (and Lightning's own notes)
        t.fit(model, loader(n=16))  # steps 4..7: measured 4, 6
    assert t.global_step == 8
    assert [h["step"] for h in monitor.history] == [0, 2, 4, 6]
    saturated = {(e.layer, e.step) for e in monitor.tracker.events if e.kind == "saturation"}
    assert (LAYERS[0], 6) in saturated  # the detector saw all four measurements
    series = scalar_series(read_events(t.logger.log_dir), f"hdi/key/{LAYERS[0]}")
    assert sorted(series) == [0, 2, 4, 6]

    t2 = pl.Trainer(
        max_steps=3,
        logger=False,
        callbacks=[monitor],
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t2.fit(model, loader(n=16))
    assert [h["step"] for h in monitor.history] == [0, 2]
    assert monitor.tracker.events == []


def test_gradient_accumulation_measures_optimizer_steps(tmp_path):
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), strict=True, detector=None, max_tokens=None)
    t = trainer(tmp_path, monitor, max_steps=5, accumulate_grad_batches=3)
    t.fit(model, loader(n=80))
    assert [h["step"] for h in monitor.history] == [0, 2, 4]
    # head outputs come from all 3 micro-batches of the measured step: 3 x 4 sequences x 16 tokens
    assert monitor.tracker.last_token_counts[0] == 3 * 4 * 16
    # lr=0: the covariance of optimizer step 4 is that of its micro-batches 12, 13, 14, pooled
    batches = list(loader(n=80))
    reference = head_diversity(model, projections=("key",), inputs=[b[0] for b in batches[12:15]])
    got = monitor.last_measurement.report.layers
    assert [layer.name for layer in got] == [layer.name for layer in reference.layers]
    for ours, ref in zip(got, reference.layers, strict=True):
        assert ours.num_tokens == ref.num_tokens == 3 * 4 * 16
        assert ours.effective_heads == pytest.approx(ref.effective_heads, rel=1e-5)


def test_no_logger_warns_and_keeps_history(tmp_path):
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, strict=True, detector=None)
    with pytest.warns(UserWarning, match="no logger"):
        trainer(tmp_path, monitor, max_steps=3, logger=False).fit(model, loader())
    assert [h["step"] for h in monitor.history] == [0, 2]


def test_fast_dev_run(tmp_path):
    monitor = HDIMonitor(every_n_steps=1, strict=True, detector=None)
    t = pl.Trainer(fast_dev_run=2, callbacks=[monitor], accelerator="cpu", enable_progress_bar=False)
    t.fit(tiny_lm(), loader())
    assert [h["step"] for h in monitor.history] == [0, 1]


def test_two_monitors_coexist_with_state_keys(tmp_path):
    a = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, state_key="a", detector=None)
    b = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, state_key="b", detector=None)
    assert a.state_key != b.state_key
    trainer(tmp_path, [a, b], max_steps=3).fit(tiny_lm(), loader())
    assert [h["step"] for h in a.history] == [h["step"] for h in b.history] == [0, 2]


def test_internal_error_becomes_warning_and_training_goes_on(tmp_path, monkeypatch):
    import hdi_monitor.monitor.tracker as tracker_mod

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tracker_mod, "compute_report", broken)
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=1, detector=None)
    with pytest.warns(tracker_mod.MonitoringWarning, match="boom"):
        t = trainer(tmp_path, monitor, max_steps=3)
        t.fit(model, loader())
    assert t.global_step == 3
    assert monitor.history == []

    strict = HDIMonitor(every_n_steps=1, strict=True, detector=None)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, strict, max_steps=3).fit(tiny_lm(), loader())


def test_hooks_removed_on_exception(tmp_path):
    class Exploding(CharLM):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise ValueError("user code failed")
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    model = Exploding(d_model=32, num_heads=4, num_layers=2, seq_len=16, lr=0.0)
    monitor = HDIMonitor(every_n_steps=2, strict=True, detector=None)
    with pytest.raises(ValueError, match="user code failed"):
        trainer(tmp_path, monitor, max_steps=5).fit(model, loader())
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"projections": ("keys",)}, "unknown projection"),
        ({"projections": "key"}, "projections"),
        ({"weighting": "svd"}, "weighting"),
        ({"log_images_every_n_steps": -1}, "log_images_every_n_steps"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"on_saturation": "explode"}, "on_saturation"),
    ],
)
def test_bad_arguments_fail_in_init(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HDIMonitor(**kwargs)


def test_no_attention_layer_raises_in_setup_before_the_first_step(tmp_path):
    """Item 6 (issue 12): a model the monitor cannot watch fails in setup, naming its modules and
    how to pass a spec; it never trains unmonitored."""

    class MLP(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 128)
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return self.net(batch[0].float()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    model = MLP()
    with pytest.raises(
        ValueError, match=r"no attention layer found in MLP(.|\n)*Modules of this model: net(.|\n)*spec="
    ):
        trainer(tmp_path, HDIMonitor(every_n_steps=1), max_steps=2).fit(model, loader())
    assert model.steps == 0


def test_layers_filter_matching_nothing_raises_with_the_real_names(tmp_path):
    """Item 6 (issue 12): a `layers` filter that matches no layer raises in setup and lists the layers."""
    model = tiny_lm()
    with pytest.raises(ValueError, match=r"matches none(.|\n)*encoder\.layers\.0\.self_attn"):
        trainer(tmp_path, HDIMonitor(every_n_steps=1, layers=r"decoder"), max_steps=2).fit(model, loader())
    assert model.global_step == 0


def test_points_use_the_weights_of_their_forward_pass(tmp_path):
    """lr > 0: each point's HDI and effective heads match the model as it was for that batch."""
    import copy

    snapshots: dict[int, tuple[CharLM, torch.Tensor]] = {}

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots[trainer.global_step] = (copy.deepcopy(pl_module), [t.clone() for t in batch])

    model = tiny_lm(lr=0.05)
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), strict=True, detector=None, max_tokens=None)
    t = trainer(tmp_path, [Snapshot(), monitor], max_steps=5)
    t.fit(model, loader())
    by_step = {int(h["step"]): h for h in monitor.history}
    assert sorted(by_step) == [0, 2, 4]
    for step in (2, 4):
        old_model, batch = snapshots[step]
        reference = head_diversity(old_model, inputs=(batch[0],))
        for layer in reference.layers:
            assert by_step[step][f"hdi/key/{layer.name}"] == pytest.approx(layer.hdi["key"], rel=1e-6)
            assert by_step[step][f"effective_heads/{layer.name}"] == pytest.approx(layer.effective_heads, rel=1e-5)
    # TensorBoard step axis: the HDI point at step s and the training loss at step s come from the
    # same batch and the same weights (an off-by-one on either axis fails here; the weights move).
    accs = read_events(t.logger.log_dir)
    loss = scalar_series(accs, "train_loss")
    hdi = scalar_series(accs, f"hdi/key/{LAYERS[0]}")
    assert sorted(hdi) == [0, 2, 4] and sorted(loss) == [0, 1, 2, 3, 4]
    for step in (0, 2, 4):
        old_model, batch = snapshots[step]
        with torch.no_grad():
            assert loss[step] == pytest.approx(float(old_model._loss(tuple(batch))), rel=1e-6)
        assert hdi[step] == pytest.approx(head_diversity(old_model).layers[0].hdi["key"], rel=1e-6)
    # and the weights did move between measurements
    assert by_step[2][f"hdi/key/{LAYERS[0]}"] != pytest.approx(by_step[4][f"hdi/key/{LAYERS[0]}"], rel=1e-7)
