"""HDIMonitor end to end: a real Trainer, event files read back with EventAccumulator."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import loader, read_events, scalar_series, tiny_lm, trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from hdi_monitor import DiversityWarning, HDIMonitor, MonitoringWarning, SaturationDetector, head_diversity
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
            # as wide as TensorBoard's Images card (shown there pixel for pixel), with labels and a colour bar
            assert events[0].width == 350 and events[0].height >= 256
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
    margin = charts["HDI (key): mean over layers, min-max band, chance level"].margin.series
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
    assert not any(re.match(p, "val_loss") for p in charts["training loss"].multiline.tag)
    totals = charts["invalid heads per projection (0 when healthy)"].multiline.tag
    per_layer = charts["invalid heads per layer (layers that had any)"].multiline.tag
    assert any(re.match(p, "invalid_heads/key") for p in totals)
    assert any(re.match(p, f"invalid_heads/key/{LAYERS[1]}") for p in per_layer)
    assert not any(re.match(p, f"invalid_heads/key/{LAYERS[1]}") for p in totals)


def test_invalid_head_counts_logged_on_every_measured_step(tb_run):
    """Item 5 (issue 12): invalid_heads/<projection> (over all layers) is a scalar on every measured
    step (0 here); a healthy model writes no per-layer invalid_heads tags (issue 24: no all-zero
    charts per layer in the Scalars tab)."""
    accs = tb_run[3]
    tags = {t for acc in accs for t in acc.Tags()["scalars"]}
    for p in PROJECTIONS:
        assert scalar_series(accs, f"invalid_heads/{p}") == {0: 0.0, 3: 0.0, 6: 0.0, 9: 0.0}
        assert not [t for t in tags if t.startswith(f"invalid_heads/{p}/")]


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


def test_a_scalar_only_logger_is_called_on_the_training_thread_only(tmp_path):
    """A ``CSVLogger`` rewrites its file on ``save()``; the picture worker used to ``flush()`` every
    sink after an image step, so the CSV file was saved from two threads at once and came out
    corrupt now and then ("dict contains fields not in fieldnames: None"). A sink that takes no
    pictures is never called by the worker: every ``log_metrics`` and ``save`` of the logger runs on
    the training thread, with images drawn at every measured step."""
    import threading

    calls: list[tuple[str, str]] = []

    class Recording(CSVLogger):
        def log_metrics(self, metrics, step=None):  # noqa: ANN001, ANN201
            calls.append(("log_metrics", threading.current_thread().name))
            return super().log_metrics(metrics, step)

        def save(self):  # noqa: ANN201
            calls.append(("save", threading.current_thread().name))
            return super().save()

    monitor = HDIMonitor(every_n_steps=1, projections=("key",), activations=False, strict=True, detector=None)
    t = trainer(tmp_path, monitor, max_steps=4, logger=Recording(str(tmp_path), name="csv"))
    fit_thread = threading.current_thread().name
    t.fit(tiny_lm(), loader())
    assert monitor.tracker is not None and len(monitor.history) == 4
    assert {name for name, _ in calls} == {"log_metrics", "save"}
    assert {thread for _, thread in calls} == {fit_thread}
    rows = list(csv.DictReader((Path(t.logger.log_dir) / "metrics.csv").read_text().splitlines()))
    assert sorted(int(r["step"]) for r in rows if r.get(f"hdi/key/{LAYERS[0]}")) == [0, 1, 2, 3]


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


def test_resume_with_changed_settings_keeps_history_and_says_what_changed(tmp_path):
    """Issue 23 item 9 under Lightning: the callback's state key does not carry every_n_steps or
    projections, so a run resumed with other settings gets its history back, minus the series of a
    projection no longer measured, and one MonitoringWarning names each change."""
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    monitor = HDIMonitor(every_n_steps=2, projections=("key", "query"), activations=False, strict=True, detector=None)
    t = trainer(tmp_path, [monitor, ckpt_cb], max_steps=4, enable_checkpointing=True)
    t.fit(tiny_lm(lr=1e-3), loader())
    monitor2 = HDIMonitor(every_n_steps=3, projections=("key",), activations=False, strict=True, detector=None)
    t2 = trainer(tmp_path, [monitor2], max_steps=7)
    with pytest.warns(MonitoringWarning, match="resumed with changed settings") as record:
        t2.fit(tiny_lm(lr=1e-3), loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    text = next(str(w.message) for w in record if "resumed with changed settings" in str(w.message))
    assert "every_n_steps 2 -> 3" in text
    assert "projections ('key', 'query') -> ('key',): query no longer measured" in text
    assert [h["step"] for h in monitor2.history] == [0, 2, 6]
    key = f"hdi/key/{LAYERS[0]}"
    assert [h[key] for h in monitor2.history[:2]] == [h[key] for h in monitor.history]
    assert not any(tag.startswith("hdi/query") for h in monitor2.history for tag in h)


def test_fit_twice_on_one_trainer_continues_history_and_detector(tmp_path):
    """Item 4 (issue 12): a second trainer.fit on the same Trainer continues the history, the events
    and the detector on Lightning's own step axis; a new Trainer starts afresh."""
    model = tiny_lm(lr=0.0)  # flat HDI: saturation needs patience + 1 = 4 measurements in one series
    monitor = HDIMonitor(
        every_n_steps=2,
        projections=("key",),
        activations=False,
        detector=SaturationDetector(patience=3, warmup_steps=0),
        warn_on=("saturation",),
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
    with pytest.warns(DiversityWarning, match="saturation"):  # the DiversityWarning of step 6
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


def _breakable_spec(broken: dict[str, bool]):
    """A user spec for the demo's attention whose key weights raise once ``broken["now"]`` is set
    (the public seam: a callable spec reference), so a measurement fails inside the monitor."""
    from hdi_monitor import AttentionSpec

    def qkv(m):
        if broken["now"]:
            raise RuntimeError("boom")
        return m.in_proj_weight

    return AttentionSpec(modules=r"self_attn$", qkv=qkv, qkv_layout="contiguous", output="out_proj", num_heads=4)


class _BreakAfterStart(pl.Callback):
    def __init__(self, broken: dict[str, bool]) -> None:
        self.broken = broken

    def on_train_start(self, trainer, pl_module):
        self.broken["now"] = True  # setup saw healthy weights; every measurement now fails


def test_internal_error_becomes_warning_and_training_goes_on(tmp_path):
    from hdi_monitor import MonitoringWarning

    broken = {"now": False}
    model = tiny_lm()
    monitor = HDIMonitor(every_n_steps=1, detector=None, spec=_breakable_spec(broken))
    with pytest.warns(MonitoringWarning, match="boom"):
        t = trainer(tmp_path, [monitor, _BreakAfterStart(broken)], max_steps=3)
        t.fit(model, loader())
    assert t.global_step == 3
    assert monitor.history == []

    broken["now"] = False
    strict = HDIMonitor(every_n_steps=1, strict=True, detector=None, spec=_breakable_spec(broken))
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [strict, _BreakAfterStart(broken)], max_steps=3).fit(tiny_lm(), loader())


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
        ({"on_event": "explode"}, "on_event"),
        ({"warn_on": ["saturaton"]}, "warn_on names unknown"),
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
            logits = old_model(batch[0])  # the model's own forward pass and the loss CharLM logs
            expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
            assert loss[step] == pytest.approx(float(expected), rel=1e-6)
        assert hdi[step] == pytest.approx(head_diversity(old_model).layers[0].hdi["key"], rel=1e-6)
    # and the weights did move between measurements
    assert by_step[2][f"hdi/key/{LAYERS[0]}"] != pytest.approx(by_step[4][f"hdi/key/{LAYERS[0]}"], rel=1e-7)


def test_early_stopping_watches_the_published_hdi(tmp_path):
    """Issue 24: stock ``EarlyStopping(monitor="hdi/key/mean", mode="max")`` stops a run whose HDI
    stops improving (lr = 0: the weights, hence the HDI, never move), on the value the monitor logged,
    which is the model's own HDI (`head_diversity` of its weights)."""
    from lightning.pytorch.callbacks import EarlyStopping

    model = tiny_lm(lr=0.0)
    monitor = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, detector=None)
    stop = EarlyStopping(monitor="hdi/key/mean", mode="max", patience=2, check_on_train_epoch_end=True)
    t = trainer(tmp_path, [monitor, stop], max_steps=1000, max_epochs=50)
    t.fit(model, loader(n=16))  # 4 steps an epoch
    # epoch 0 sets the best; epochs 1 and 2 do not improve on it: stopped at the end of epoch 2
    assert stop.stopped_epoch == 2 and t.current_epoch == 3 and t.global_step == 12
    expected = head_diversity(model).mean_hdi("key")
    assert float(stop.best_score) == pytest.approx(expected, rel=1e-6)
    logged = scalar_series(read_events(t.logger.log_dir), "hdi/key/mean")
    assert sorted(logged) == list(range(0, 12, 2))
    assert float(t.callback_metrics["hdi/key/mean"]) == pytest.approx(logged[10], rel=1e-6)


def test_callback_metrics_hold_the_logged_summaries_and_model_checkpoint_saves_on_them(tmp_path):
    """Issue 24: on measured steps the model-mean HDI per projection, the mean effective heads and the
    event counts are in ``trainer.callback_metrics`` under their logged names, and
    ``ModelCheckpoint(monitor="hdi/key/mean", mode="max")`` saves the best step on them."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    seen: dict[int, dict[str, float]] = {}

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen[trainer.global_step - 1] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    model = tiny_lm(lr=0.05)
    monitor = HDIMonitor(every_n_steps=2, log_images_every_n_steps=0)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="hdi/key/mean", mode="max", save_top_k=1, every_n_train_steps=1
    )
    t = trainer(tmp_path, [monitor, ckpt, Record()], max_steps=7, enable_checkpointing=True)
    t.fit(model, loader())
    accs = read_events(t.logger.log_dir)
    names = [f"hdi/{p}/mean" for p in PROJECTIONS] + ["effective_heads/mean"]
    names += ["diversity_events/saturation", "diversity_events/collapse", "diversity_events/redundancy"]
    for step in (0, 2, 4, 6):  # measured steps: the logged value, under the logged name
        for name in names:
            assert seen[step][name] == pytest.approx(scalar_series(accs, name)[step], rel=1e-6), (step, name)
    for step in (1, 3, 5):  # in between: the last measured value
        assert seen[step]["hdi/key/mean"] == seen[step - 1]["hdi/key/mean"]
    key = scalar_series(accs, "hdi/key/mean")
    best_step = max(key, key=key.get)
    assert float(ckpt.best_model_score) == pytest.approx(key[best_step], rel=1e-6)
    # saved at the end of the best measured batch (global_step = step + 1, after its optimizer
    # update); a tie later does not replace it
    assert Path(ckpt.best_model_path).is_file() and f"step={best_step + 1}.ckpt" in ckpt.best_model_path
    assert len(set(key.values())) == len(key)  # the weights moved: a real choice among 4 values


def test_runs_of_different_depth_share_every_custom_scalars_chart(tmp_path):
    """Issue 24: a ``runs/`` folder with a 2-layer and a 4-layer run shows each Custom Scalars chart
    once. The layouts are merged by TensorBoard's own Custom Scalars plugin (it drops a chart only when
    another run has the identical chart); every chart's regexes still find each run's tags."""
    import json
    import re

    from tensorboard import context as tb_context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin

    runs = tmp_path / "runs"
    for name, depth in (("two", 2), ("four", 4)):
        torch.manual_seed(0)
        model = CharLM(d_model=32, num_heads=4, num_layers=depth, seq_len=16, lr=0.0)
        monitor = HDIMonitor(every_n_steps=2, log_images_every_n_steps=0, detector=None)
        trainer(tmp_path, monitor, max_steps=3, logger=TensorBoardLogger(str(runs), name=name)).fit(model, loader())
    mux = multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(runs))
    mux.Reload()
    context = base_plugin.TBContext(
        logdir=str(runs), multiplexer=mux, data_provider=data_provider.MultiplexerDataProvider(mux, str(runs))
    )
    merged = CustomScalarsPlugin(context).layout_impl(tb_context.RequestContext(), "")
    merged = json.loads(merged) if isinstance(merged, (str, bytes)) else merged
    titles = [chart["title"] for category in merged["category"] for chart in category["chart"]]
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
    # as many charts as one run has: nothing was added by the second run
    single = CustomScalarsPlugin(
        base_plugin.TBContext(
            logdir=str(runs / "four"),
            multiplexer=(m := multiplexer.EventMultiplexer().AddRunsFromDirectory(str(runs / "four"))),
            data_provider=data_provider.MultiplexerDataProvider(m.Reload(), str(runs / "four")),
        )
    ).layout_impl(tb_context.RequestContext(), "")
    single = json.loads(single) if isinstance(single, (str, bytes)) else single
    assert len(titles) == sum(len(category["chart"]) for category in single["category"])
    assert "HDI (key): mean over layers, min-max band, chance level" in titles
    assert not [t for t in titles if re.search(r"\d+ layers", t)]
    charts = {chart["title"]: chart for category in merged["category"] for chart in category["chart"]}
    per_layer = charts["HDI (key) per layer"]["multiline"]["tag"]
    for run, depth in (("two", 2), ("four", 4)):
        tags = {t for acc in read_events(runs / run) for t in acc.Tags()["scalars"]}
        layer_tags = {t for t in tags if t.startswith("hdi/key/") and t.split("/")[-1] not in ("mean", "min", "max")}
        assert len(layer_tags) == depth
        assert {t for t in tags if any(re.match(p, t) for p in per_layer) and t.startswith("hdi/")} == layer_tags
        for chart in charts.values():  # every margin series exists in both runs
            for series in chart.get("margin", {}).get("series", []):
                assert {series["value"], series["lower"], series["upper"]} <= tags, (run, chart["title"])
