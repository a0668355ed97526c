"""HDITracker guarantees: no work on unmeasured steps, a failed step stays skipped, autocast never
reaches the measurement, and a late state restore (FSDP-style strategies) is not lost."""

from __future__ import annotations

import warnings

import pytest
import torch
from einops import rearrange
from torch import nn

import hdi_monitor.monitor.tracker as tracker_mod
from hdi_monitor import HDIMonitor, HDITracker, head_diversity
from hdi_monitor.measure import ranks
from hdi_monitor.models import AttentionSpec, find_attention_layers


def encoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_unmeasured_steps_run_no_collective_and_no_measurement():
    model = encoder()
    tracker = HDITracker(model, every_n_steps=100, log_images_every_n_steps=0, strict=True)
    calls = []
    tracker.agree = lambda flag: calls.append(flag) or ranks.all_agree(flag)  # the public collective seam
    x = torch.randn(2, 5, 16)
    for _ in range(10):
        with tracker.capture(x):
            model(x)
        tracker.step()
    assert [h["step"] for h in tracker.history] == [0]
    assert calls == [True, True]  # step 0 only: "all hold it" and "all succeeded"


class SelfAttention(nn.Module):
    """Plain multi-head self-attention, watched through an AttentionSpec (its mask from ``batch["mask"]``)."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(w(x), "b t (h d) -> b h t d", h=self.heads) for w in (self.wq, self.wk, self.wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.wo(rearrange(o, "b h t d -> b t (h d)"))


def test_a_failed_hook_skips_the_step_and_is_not_restarted():
    torch.manual_seed(0)
    model = nn.Sequential(SelfAttention())
    spec = AttentionSpec(modules="0", query="wq", key="wk", value="wv", output="wo", num_heads=4, mask_key="mask")
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, spec=spec)
    x = torch.randn(2, 5, 16)
    # a token mask of the right shape that the hook cannot read (no data: a meta tensor); the model
    # itself never sees it, so the forward runs and only the monitor's head-output hook fails
    broken = {"mask": torch.ones(2, 5, dtype=torch.bool, device="meta")}
    with pytest.warns(tracker_mod.MonitoringWarning, match="error while capturing head outputs.*meta"):
        with tracker.capture(broken):  # micro-batch 1 of step 0: the hook fails, the forward goes on
            out = model(x)
    assert torch.isfinite(out).all()
    good = {"mask": torch.ones(2, 5, dtype=torch.bool)}
    with tracker.capture(good) as measured:  # micro-batch 2 of the same step: not restarted
        model(x)
    assert measured is False
    assert tracker.step() is None  # step 0 is skipped, not replaced by a partial measurement
    with tracker.capture(good):
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
    for ref, got in zip(reference.layers, m.report.layers, strict=True):
        for p in ("query", "key", "value", "output"):
            assert got.hdi[p] == pytest.approx(ref.hdi[p], rel=1e-6)
    # The head outputs are recomputed in float32. Layer 0 reads the float32 input itself, so its
    # H_eff is exact (head outputs in bf16 would move it by 8e-4); layer 1 reads layer 0's output,
    # which the forward computed in bf16 (observed 2.8e-4 off).
    layer0, layer1 = zip(reference.layers, m.report.layers, strict=True)
    assert layer0[1].effective_heads == pytest.approx(layer0[0].effective_heads, rel=1e-6)
    assert layer1[1].effective_heads == pytest.approx(layer1[0].effective_heads, rel=2e-3)


def test_mha_recompute_is_float32_under_autocast():
    model = encoder()
    layer = find_attention_layers(model)[0]
    seen = []
    handle = layer.attach_output_hook(lambda o, keep: seen.append(o.dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4, 16))
    finally:
        handle.remove()
    assert seen and all(d == torch.float32 for d in seen)


@pytest.mark.filterwarnings("ignore:HDIMonitor. the Trainer has no logger")  # logger=False on purpose
def test_late_state_restore_is_applied(tmp_path):
    """Strategies with restore_checkpoint_after_setup (FSDP, ModelParallel, DeepSpeed) call
    load_state_dict after on_fit_start, when the tracker exists."""
    import lightning.pytorch as pl
    from conftest import loader, tiny_lm

    first = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, detector=None)
    pl.Trainer(
        max_steps=5,
        callbacks=[first],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(tiny_lm(), loader())
    state = first.state_dict()
    assert state["history"]["steps"] == [0, 2, 4]  # the columnar state (History.state_dict)

    second = HDIMonitor(every_n_steps=2, projections=("key",), activations=False, detector=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            max_steps=1,
            callbacks=[second],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        ).fit(tiny_lm(), loader())
    assert second.tracker is not None
    second.load_state_dict(state)  # after on_fit_start: goes straight into the tracker
    assert [h["step"] for h in second.history] == [0, 2, 4]
    assert second.tracker.should_measure(4) is False and second.tracker.should_measure(6) is True


# ------------------------------------------------------------------ issue 12: never misleads


def _monitoring_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tracker_mod.MonitoringWarning)]


def _hdi_scalars(report, projections=("query", "key", "value", "output")) -> dict[str, float]:
    return {
        f"hdi/{p}/{layer.name}": layer.hdi[p]
        for layer in report.layers
        for p in projections
        if layer.hdi.get(p) is not None
    }


def test_replaced_mha_is_picked_up_with_one_warning_and_measured_correctly():
    """Item 2: a replaced nn.MultiheadAttention (new head count) gives one MonitoringWarning naming the
    layer and what changed; from then on the new module is measured (= head_diversity of the changed
    model, weights and head outputs). Steps where nothing changed do not search the model again."""
    model = encoder()
    x = torch.randn(3, 7, 16)
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True)
    found = tracker.setup()  # a search returns a new list of new AttentionLayer objects
    for _ in range(3):
        with tracker.capture(x):
            model(x)
        tracker.step()
    # found once; unchanged steps only compare module identity and shapes (a search would replace them)
    assert tracker.layers is found and all(a is b for a, b in zip(tracker.layers, found, strict=True))
    torch.manual_seed(5)
    model.layers[0].self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracker.capture(x):
                model(x)
            tracker.step()
        notes = _monitoring_warnings(caught)
        if _ == 0:
            assert len(notes) == 1, notes
            assert "layers.0.self_attn: module replaced, 4 heads of width 4 -> 2 heads of width 8" in notes[0]
            assert tracker.layers is not found  # one more search, at the step of the change ...
            rediscovered = tracker.layers
        else:
            assert notes == []  # nothing changed since: no warning, no rediscovery message
            assert tracker.layers is rediscovered  # ... and none after it
    ref = head_diversity(model, projections=("query", "key", "value", "output"), inputs=x)
    last = tracker.history[-1]
    for tag, value in _hdi_scalars(ref).items():
        assert last[tag] == pytest.approx(value, abs=1e-6), tag
    assert ref.layers[0].num_heads == 2
    assert last["effective_heads/layers.0.self_attn"] == pytest.approx(ref.layers[0].effective_heads, rel=1e-6)
    assert tracker.layers[0].module is model.layers[0].self_attn
    assert [h["step"] for h in tracker.history] == [0, 1, 2, 3, 4]


def test_pruned_bert_heads_are_picked_up_and_measured_correctly():
    """Item 2: heads pruned with transformers' prune_linear_layer (same module, new parameter
    shapes) are noticed and the layer is measured with its remaining heads."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import prune_linear_layer

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    model = transformers.BertModel(config).eval()
    tracker = HDITracker(model, every_n_steps=1, activations=False, log_images_every_n_steps=0, strict=True)
    tracker.measure(step=0)
    att = model.encoder.layer[0].attention
    d = att.self.attention_head_size
    keep = torch.ones(4, d, dtype=torch.bool)
    keep[1] = False  # prune head 1, as the removed BertAttention.prune_heads did
    index = torch.arange(4 * d)[keep.flatten()]
    for name in ("query", "key", "value"):
        setattr(att.self, name, prune_linear_layer(getattr(att.self, name), index))
    att.output.dense = prune_linear_layer(att.output.dense, index, dim=1)
    att.self.num_attention_heads = 3
    att.self.all_head_size = 3 * d
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.measure(step=1)
    notes = _monitoring_warnings(caught)
    assert (
        len(notes) == 1 and "encoder.layer.0.attention: parameters changed, 4 heads of width 8 -> 3 heads" in notes[0]
    )
    ref = head_diversity(model, projections=("query", "key", "value", "output"))
    assert ref.layers[0].num_heads == 3
    last = tracker.history[-1]
    for tag, value in _hdi_scalars(ref).items():
        assert last[tag] == pytest.approx(value, abs=1e-6), tag
    # independent check of layer 0's key HDI over the 3 remaining heads (spectral overlap by hand)
    w = att.self.key.weight.detach().double().reshape(3, d, 32).transpose(1, 2)  # (h, D, d)
    gram = torch.einsum("iak,jal->ijkl", w, w)
    cross = gram.pow(2).sum((-1, -2))
    rho = cross / torch.outer(cross.diagonal().sqrt(), cross.diagonal().sqrt())
    hdi = 1 - (rho.sum() - rho.diagonal().sum()) / 6
    assert last["hdi/key/encoder.layer.0.attention"] == pytest.approx(float(hdi), abs=1e-6)


class _BrokenSink:
    """A sink whose every scalar write fails (a full disk)."""

    def __init__(self) -> None:
        self.calls = 0

    def log_scalars(self, scalars, step):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def log_images(self, images, step): ...
    def log_histograms(self, values, step): ...
    def log_text(self, tag, text, step): ...
    def log_layout(self, layout): ...
    def flush(self): ...


def _flat_run(sinks, steps=6):
    """lr = 0 (weights never change): saturation fires once the window is full."""
    from hdi_monitor.exceptions import DiversityWarning
    from hdi_monitor.monitor.detector import SaturationDetector

    model = encoder()
    tracker = HDITracker(
        model,
        every_n_steps=1,
        projections=("key",),
        activations=False,
        log_images_every_n_steps=0,
        sinks=sinks,
        detector=SaturationDetector(patience=2, warmup_steps=0),
        warn_on=("saturation",),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            tracker.step()
    diversity = [str(w.message) for w in caught if issubclass(w.category, DiversityWarning)]
    return tracker, diversity, _monitoring_warnings(caught)


def test_a_failing_sink_costs_only_its_own_write():
    """Item 3: a sink that raises on every step costs one warning and its own writes; history,
    events, the detector's warnings and the other sinks are those of a run without it."""
    from hdi_monitor.monitor.sinks import MemorySink

    good_ref = MemorySink()
    ref, ref_warnings, ref_notes = _flat_run([good_ref])
    broken, good = _BrokenSink(), MemorySink()
    run, run_warnings, notes = _flat_run([broken, good])
    assert broken.calls == 6  # tried at every step (a transient failure would recover)
    assert len(notes) == 1 and "_BrokenSink failed at step 0 (OSError" in notes[0] and ref_notes == []
    assert run.history == ref.history and len(run.history) == 6
    assert [e.to_dict() for e in run.events] == [e.to_dict() for e in ref.events] and run.events
    assert run_warnings == ref_warnings and run_warnings
    assert good.scalars == good_ref.scalars and good.texts == good_ref.texts and good.texts


def _nan_key_head(model: nn.Module, layer: int, head: int) -> None:
    attn = model.layers[layer].self_attn
    d, dim = attn.head_dim, attn.embed_dim
    with torch.no_grad():
        attn.in_proj_weight[dim + head * d : dim + (head + 1) * d] = float("nan")


def test_nan_heads_are_loud_and_the_hdi_is_over_valid_heads():
    """Item 5: one MonitoringWarning when a layer first has a non-finite head (layer, projection,
    heads); an invalid_heads total per projection on every measured step, and a per-layer count for
    a layer from its first invalid head on; HDI over the valid heads only."""
    model = encoder()
    tracker = HDITracker(model, every_n_steps=1, activations=False, log_images_every_n_steps=0, strict=True)
    tracker.measure(step=0)
    assert tracker.history[-1]["invalid_heads/key"] == 0.0
    assert "invalid_heads/key/layers.0.self_attn" not in tracker.history[-1]  # healthy: no per-layer chart
    _nan_key_head(model, layer=0, head=1)
    caught_per_step = []
    for step in (1, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracker.measure(step=step)
        caught_per_step.append(_monitoring_warnings(caught))
    assert len(caught_per_step[0]) == 1 and caught_per_step[1] == []
    note = caught_per_step[0][0]
    assert "layers.0.self_attn (key): head(s) [1] are dead (all zero) or non-finite" in note
    assert "3 valid head(s) of 4" in note
    for h in tracker.history[1:]:
        assert h["invalid_heads/key/layers.0.self_attn"] == 1.0
        assert h["invalid_heads/key"] == 1.0
        assert h["invalid_heads/query"] == 0.0
        assert "invalid_heads/key/layers.1.self_attn" not in h
    # reference: the key HDI of the 3 finite heads, spectral overlap computed by hand
    attn = model.layers[0].self_attn
    w = attn.in_proj_weight.detach().double()[16:32].reshape(4, 4, 16).transpose(1, 2)[[0, 2, 3]]
    cross = torch.einsum("iak,jal->ijkl", w, w).pow(2).sum((-1, -2))
    rho = cross / torch.outer(cross.diagonal().sqrt(), cross.diagonal().sqrt())
    expected = 1 - (rho.sum() - rho.diagonal().sum()) / 6
    assert tracker.history[-1]["hdi/key/layers.0.self_attn"] == pytest.approx(float(expected), abs=1e-6)


def test_all_heads_nan_still_logs_what_is_wrong():
    """Item 5: with every head of every layer NaN a measurement logs the invalid-head counts, not only `step`."""
    model = encoder()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    tracker = HDITracker(model, every_n_steps=1, activations=False, log_images_every_n_steps=0, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.measure(step=0)
    last = tracker.history[-1]
    assert set(last) - {"step"}
    for p in ("query", "key", "value", "output"):
        for layer in ("layers.0.self_attn", "layers.1.self_attn"):
            assert last[f"invalid_heads/{p}/{layer}"] == 4.0
            assert f"hdi/{p}/{layer}" not in last
    notes = _monitoring_warnings(caught)
    assert len(notes) == 1 and notes[0].count("are dead (all zero) or non-finite") == 8


class GatedAttention(nn.Module):
    """Self-attention whose head outputs are scaled by a fixed per-head gate (0 = a dead head whose
    weights are all nonzero: dead in the head outputs only)."""

    def __init__(self, gate: list[float], d_model: int = 16, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d_model, d_model) for _ in range(4))
        self.register_buffer("gate", torch.tensor(gate))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """The gated per-head outputs ``(B, H, T, d)``."""
        q, k, v = (
            rearrange(p(x), "b t (h d) -> b h t d", h=self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return torch.nn.functional.scaled_dot_product_attention(q, k, v) * self.gate[None, :, None, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(rearrange(self.heads(x), "b h t d -> b t (h d)"))


class GatedNet(nn.Module):
    def __init__(self, gate: list[float]) -> None:
        super().__init__()
        self.attn = GatedAttention(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _effective_heads_over_live(attn: GatedAttention, x: torch.Tensor, live: list[int]) -> float:
    """Brute force in float64: each live head's contribution ``o_h W_O,h^T`` over all tokens, its
    covariance C, then ``H_live / (sum_ij C_ij / sum_i C_ii)``."""
    with torch.no_grad():
        o = attn.heads(x).double()  # (B, H, T, d)
        w = attn.out_proj.weight.double()  # (D, H d)
        d = attn.head_dim
        contrib = torch.stack([o[:, h].reshape(-1, d) @ w[:, h * d : (h + 1) * d].T for h in live])  # (L, N, D)
        centred = contrib - contrib.mean(dim=1, keepdim=True)
        cov = torch.einsum("ind,jnd->ij", centred, centred)
    return float(len(live) / (cov.sum() / cov.diagonal().sum()))


def test_a_head_dead_in_its_outputs_only_is_counted_reported_and_left_out_of_effective_heads():
    """Issue 23, item 2: a head gated to zero (its weights are not zero, so the weight checks see a
    live head) contributes nothing: it is counted under invalid_heads/activations on every measured
    step, named once in the step's note, and H_eff is over the 3 live heads (brute force). A healthy
    model logs 0 there and no per-layer chart."""
    torch.manual_seed(0)
    model = GatedNet([1.0, 1.0, 1.0, 0.0])
    x = torch.randn(4, 30, 16)
    tracker = HDITracker(model, every_n_steps=1, max_tokens=None, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with tracker.capture(x):
                model(x)
            tracker.step()
    notes = [str(w.message) for w in caught if "contributed nothing" in str(w.message)]
    assert len(notes) == 1
    assert (
        "attn (head outputs): head(s) [3] contributed nothing to the layer output (zero variance over 120 tokens); "
        "effective heads are over the 3 live head(s) of 4 (scalar invalid_heads/activations/attn)"
    ) in notes[0]
    expected = _effective_heads_over_live(model.attn, x, [0, 1, 2])
    assert 2.0 < expected < 3.0
    for row in tracker.history:
        assert row["invalid_heads/activations/attn"] == 1.0
        assert row["invalid_heads/activations"] == 1.0
        assert row["invalid_heads/value"] == 0.0  # the weights are alive
        assert row["effective_heads/attn"] == pytest.approx(expected, rel=1e-5)
    report = head_diversity(model, inputs=x)
    assert report.layers[0].invalid_heads["activations"] == [3]
    assert report.layers[0].effective_heads == pytest.approx(expected, rel=1e-5)
    table = report.format_table()  # the table marks the H_eff taken over fewer heads, and says why
    assert f"{report.layers[0].effective_heads:.2f}*" in table
    assert "* (H_eff) heads that contributed nothing to the layer output, left out" in table

    healthy = GatedNet([1.0, 1.0, 1.0, 1.0])
    tracker = HDITracker(healthy, every_n_steps=1, max_tokens=None, strict=True)
    with tracker.capture(x):
        healthy(x)
    tracker.step()
    row = tracker.history[-1]
    assert row["invalid_heads/activations"] == 0.0
    assert "invalid_heads/activations/attn" not in row
    assert row["effective_heads/attn"] == pytest.approx(
        _effective_heads_over_live(healthy.attn, x, [0, 1, 2, 3]), rel=1e-5
    )


class SharedLayerNet(nn.Module):
    """One attention layer applied three times per forward (ALBERT-style), each time to a batch of
    identical tokens (one fixed point per application): within one application every token's head
    outputs are the same, so the head-output covariance is zero unless tokens of several
    applications are measured."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = GatedAttention([1.0, 1.0, 1.0, 1.0])
        self.register_buffer("points", torch.randn(3, 16, generator=torch.Generator().manual_seed(3)))

    def application(self, k: int, like: torch.Tensor) -> torch.Tensor:
        return self.points[k].expand_as(like).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.attn(self.application(k, x)) for k in range(3))


def test_max_tokens_is_shared_between_the_calls_of_a_layer():
    """Issue 23, item 9: a layer called 3 times per forward with max_tokens = one call's tokens. The
    first measured step does not know the calls yet: the first call fills the budget (all its tokens
    are the same point: every head is dead, no H_eff). From the next measured step on each call
    keeps a third of the budget, and H_eff equals the brute-force value over the three points,
    equally weighted (exact: the tokens of one call are identical, so which ones are drawn does not
    matter)."""
    torch.manual_seed(0)
    model = SharedLayerNet()
    x = torch.zeros(2, 12, 16)  # 24 tokens per call; only the shape is used
    tracker = HDITracker(model, every_n_steps=1, max_tokens=24, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step 0's dead-head note
        for _ in range(2):
            with tracker.capture(x):
                model(x)
            tracker.step()
    first, second = tracker.history
    assert first["invalid_heads/activations"] == 4.0 and "effective_heads/attn" not in first
    assert tracker.last_token_counts == [24]
    with torch.no_grad():
        w = model.attn.out_proj.weight.double()
        d = model.attn.head_dim
        o = torch.stack([model.attn.heads(model.application(k, x[:1, :1]))[0, :, 0].double() for k in range(3)])
        contrib = torch.stack([o[:, h] @ w[:, h * d : (h + 1) * d].T for h in range(4)])  # (H, 3 points, D)
        centred = contrib - contrib.mean(dim=1, keepdim=True)
        cov = torch.einsum("ind,jnd->ij", centred, centred)
    expected = float(4 / (cov.sum() / cov.diagonal().sum()))
    assert second["invalid_heads/activations"] == 0.0
    assert second["effective_heads/attn"] == pytest.approx(expected, rel=1e-5)


def test_a_resumed_tracker_shares_max_tokens_as_the_uninterrupted_run():
    """The calls counted at the last measured step are part of the tracker's state: a tracker
    resumed from a checkpoint (torch.save, weights_only load) logs at its first measured step what
    the uninterrupted run logs there (it used to let the first call fill the budget again: every head
    reported dead)."""
    import io

    torch.manual_seed(0)
    model = SharedLayerNet()
    x = torch.zeros(2, 12, 16)

    def run(tracker: HDITracker, steps: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                with tracker.capture(x):
                    model(x)
                tracker.step()

    uninterrupted = HDITracker(model, every_n_steps=1, max_tokens=24, strict=True)
    run(uninterrupted, 3)
    first = HDITracker(model, every_n_steps=1, max_tokens=24, strict=True)
    run(first, 2)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = HDITracker(model, every_n_steps=1, max_tokens=24, strict=True)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    run(resumed, 1)
    assert resumed.history.steps == uninterrupted.history.steps == [0, 1, 2]
    assert resumed.history[-1] == uninterrupted.history[-1]
    assert resumed.history[-1]["invalid_heads/activations"] == 0.0
