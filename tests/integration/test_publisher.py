"""The publisher and its picture worker: every wait bounded, no lock shared with the training
thread, the pictures queued at a checkpoint written before it (issue 30, items 6 and 8)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hdi_monitor import HDITracker
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.monitor.render import ImageJob, render_job
from hdi_monitor.monitor.sinks import MemorySink

D, HEADS = 16, 4


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


def _step(tracker: HDITracker, model: nn.Module) -> float:
    """One training step with the monitor; the seconds it took."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(tracker.current_step))
    start = time.perf_counter()
    with tracker.capture(x):
        loss = model(x).pow(2).mean()
    loss.backward()
    tracker.step()
    return time.perf_counter() - start


def _monitoring(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]


def _within(seconds: float, fn: Callable[[], Any]) -> float:
    """Run ``fn`` on a daemon thread and fail if it has not returned after ``seconds`` (it hangs: the
    test fails instead of hanging with it); re-raise its exception; the seconds it took."""
    done: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            done["error"] = err
        done["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds:g} s")
    if "error" in done:
        raise done["error"]
    return float(done["seconds"])


@pytest.mark.parametrize("stuck_in", ["renderer", "image sink"])
def test_a_renderer_that_never_returns_costs_its_pictures_not_the_run(stuck_in):
    """close() returns within the publisher's bound and names the steps whose pictures are lost; the
    steps themselves never waited. The same for an image sink whose write never returns (a stuck
    W&B or MLflow upload)."""
    release = threading.Event()

    def stuck(job: ImageJob) -> dict[str, bytes]:
        release.wait()  # never set before the end of the test
        return {}

    class StuckImages(MemorySink):
        def log_images(self, images, step):  # noqa: ANN001
            if step < 3:  # the pictures of steps 0-2 never get written
                release.wait()
            super().log_images(images, step)

    model = encoder()
    sink = StuckImages() if stuck_in == "image sink" else MemorySink()
    renderer = stuck if stuck_in == "renderer" else render_job
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=1, sinks=[sink], renderer=renderer)
    tracker.publisher.wait_timeout = 0.5
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            held = [_step(tracker, model) for _ in range(3)]
            closing = _within(30.0, tracker.close)  # waited forever before
        assert max(held[1:]) < 5.0  # (the first step also finds the layers)
        assert closing < 3.0  # 0.5 s to wait for the queue, 0.5 s to join: not forever
        lost = [m for m in _monitoring(caught) if "were not written" in m]
        assert len(lost) == 1 and "step(s) [0" in lost[0] and "did not return within 0.5 s" in lost[0]
        assert len(tracker.history) == 3 and sink.images == []
        # the run goes on: a later image step gets a new worker and is drawn (by a renderer that returns)
        tracker.renderer, tracker.publisher.wait_timeout = render_job, 60.0
        _step(tracker, model)
        _within(60.0, tracker.close)
        assert [s for s, _, _ in sink.images] and {s for s, _, _ in sink.images} == {3}
    finally:
        release.set()


def test_a_slow_image_sink_never_holds_the_training_step():
    """The worker's image writes share no lock with the training thread's scalar writes: an image
    upload that has not returned does not make the next steps wait (the first of them waited for it
    when they shared the sink's lock; here that wait would last until the upload's 60 s bound)."""

    uploading, release = threading.Event(), threading.Event()

    class SlowImages(MemorySink):
        def log_images(self, images, step):  # noqa: ANN001
            uploading.set()
            release.wait(timeout=60.0)  # the upload ends when the test has taken its steps
            super().log_images(images, step)

    model = encoder()
    sink = SlowImages()
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=4, sinks=[sink], strict=True)
    _step(tracker, model)  # step 0: an image step, its upload blocks the worker until release
    assert uploading.wait(timeout=60.0)  # the worker is inside log_images now (the picture is drawn)
    held = [_step(tracker, model) for _ in range(3)]  # steps 1-3 write scalars to the same sink
    release.set()
    assert max(held) < 5.0, held
    tracker.close()
    assert {s for s, _, _ in sink.images} >= {0} and sorted({s for s, _, _ in sink.scalars}) == [0, 1, 2, 3]


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "raises"])
def test_lightning_fit_with_a_stuck_renderer_returns(monkeypatch, tmp_path, fails):
    """``trainer.fit`` ends although the renderer never returns (it waited forever in on_train_end),
    also when the run fails: the training step's exception reaches the caller (on_exception closes
    the tracker within its bound, it waited forever there too)."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    import hdi_monitor.monitor._publish as publish
    from hdi_monitor import HDIMonitor
    from hdi_monitor.contrib.demo import CharDataModule, CharLM

    release = threading.Event()

    def stuck(job: ImageJob) -> dict[str, bytes]:
        release.wait()
        return {}

    class Failing(CharLM):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN202
            if fails and self.global_step == 3:  # after the image steps 0 and 2 were queued
                raise RuntimeError("the user's training step failed")
            return super().training_step(batch, batch_idx)

    monkeypatch.setattr(publish, "render_job", stuck)  # the default renderer the callback's tracker gets
    monkeypatch.setattr(publish, "WAIT_SECONDS", 0.5)
    model = Failing(d_model=32, num_heads=4, num_layers=1)
    trainer = L.Trainer(
        max_steps=4,
        callbacks=[HDIMonitor(every_n_steps=1, log_images_every_n_steps=2)],
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_model_summary=False,
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if fails:
                with pytest.raises(RuntimeError, match="the user's training step failed"):
                    _within(120.0, lambda: trainer.fit(model, datamodule=CharDataModule()))
            else:
                _within(120.0, lambda: trainer.fit(model, datamodule=CharDataModule()))
        assert any("were not written" in m for m in _monitoring(caught))
    finally:
        release.set()


def test_the_pictures_queued_at_a_checkpoint_are_written_before_it():
    """A checkpoint taken while image steps wait in the queue (a slow renderer) waits for them, so a
    run killed right after it has their pictures (steps 0 and 2 were never drawn when the checkpoint
    recorded nothing pending and the killed process took the queue with it)."""
    gate = threading.Event()

    def slow(job: ImageJob) -> dict[str, bytes]:
        gate.wait(timeout=30.0)  # slow: the jobs are still queued when the checkpoint is taken
        return render_job(job)

    model = encoder()
    sink = MemorySink()
    tracker = HDITracker(
        model, every_n_steps=1, log_images_every_n_steps=2, sinks=[sink], renderer=slow, image_queue_size=4
    )
    for _ in range(3):  # image steps 0 and 2 queued
        _step(tracker, model)
    assert tracker.publisher.pending_pictures == [0, 2]  # still queued
    threading.Timer(1.0, gate.set).start()  # the renderer gets going while the checkpoint waits
    state = tracker.state_dict()  # what a checkpoint saves; the process is killed right after
    assert {s for s, _, _ in sink.images} == {0, 2}
    assert state["last_step"] == 2


def test_a_non_finite_head_output_is_named_and_left_out():
    """Issue 30 item 4: a NaN in one head's output gave effective_heads NaN with no invalid head and no
    note. The head is now invalid (non-finite), named once, and H_eff is over the other heads
    (equal to the brute force on the finite heads)."""

    class Nan(nn.Module):
        def forward(self, o):  # noqa: ANN001
            o = o.clone()
            o[..., 2 * (D // HEADS)] = float("nan")  # one channel of head 2
            return o

    torch.manual_seed(0)
    attn = nn.MultiheadAttention(D, HEADS, batch_first=True, bias=False)
    from hdi_monitor.models import AttentionSpec

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
            self.corrupt = Nan()
            self.o = nn.Linear(D, D, bias=False)

        def forward(self, x):  # noqa: ANN001
            b, t, _ = x.shape
            q, k, v = (m(x).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D)
            return self.o(self.corrupt(o))

    del attn
    net = Net()
    spec = AttentionSpec(modules=r"^$", query="q", key="k", value="v", output="o", num_heads=HEADS)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    tracker = HDITracker(net, every_n_steps=1, spec=spec, max_tokens=None, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = tracker.measure(x)
    layer = m.report.layers[0]
    assert layer.invalid_heads["activations"] == [2] and layer.nonfinite_heads == (2,)
    notes = [n for n in _monitoring(caught) if "non-finite outputs" in n]
    assert len(notes) == 1 and "head(s) [2] gave non-finite outputs" in notes[0]
    # brute force over the three finite heads: contributions c_h = W_O,h o_h, covariance over tokens
    with torch.no_grad():
        b, t, _ = x.shape
        q, k, v = (mod(x).view(b, t, HEADS, -1).transpose(1, 2) for mod in (net.q, net.k, net.v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * t, HEADS, -1)
        w = net.o.weight.double().view(D, HEADS, -1)
        live = [0, 1, 3]
        c = torch.stack([o[:, h].double() @ w[:, h].T for h in live])  # (3, N, D)
        c = c - c.mean(dim=1, keepdim=True)
        cov = torch.einsum("inD,jnD->ij", c, c) / c.shape[1]
        expected = len(live) / float(cov.sum() / cov.diagonal().sum())
        std = cov.diagonal().sqrt()
        corr = cov / (std[:, None] * std[None, :])
        mean_corr = float(corr[~torch.eye(len(live), dtype=torch.bool)].mean())  # the 6 off-diagonal pairs
    assert layer.effective_heads == pytest.approx(expected, rel=1e-9)
    assert layer.mean_correlation == pytest.approx(mean_corr, rel=1e-9)  # over the same live heads
    # the health chart shows it: the total and the layer's own invalid-head scalar
    assert m.scalars["invalid_heads/activations"] == 1.0 and m.scalars["invalid_heads/activations/<root>"] == 1.0
    assert m.scalars["effective_heads/<root>"] == pytest.approx(expected, rel=1e-9)
    assert m.scalars["head_correlation/<root>"] == pytest.approx(mean_corr, rel=1e-9)


def test_the_picture_worker_computes_on_one_thread_and_leaves_trainings_thread_count_alone():
    """The worker's torch work (the principal angles, the renderer) runs with one intra-op thread,
    set on the worker's own thread: two OpenMP teams on the same cores spun against each other
    (3 image steps of a 4-layer 256-wide encoder cost 12.8 s of CPU with the default 2 threads on 2
    cores, 2.7 s now). The training thread keeps the count it had."""
    import torch

    from hdi_monitor.monitor.render import render_job

    seen: list[int] = []

    def counting(job: ImageJob) -> dict[str, bytes]:
        seen.append(torch.get_num_threads())
        return render_job(job)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = encoder()
        sink = MemorySink()
        tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=1, sinks=[sink], renderer=counting)
        for _ in range(2):
            _step(tracker, model)
        tracker.close()
        assert seen == [1, 1] and torch.get_num_threads() == 2
        assert sorted({step for step, _, _ in sink.images}) == [0, 1]
    finally:
        torch.set_num_threads(before)
