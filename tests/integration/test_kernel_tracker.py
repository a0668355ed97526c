"""Kernel statistics wired into the tracker (issue 25, ``MonitorConfig(kernel_stats=True)``).

References, all independent of `hdi_monitor.functional.kernel`:

* the model's own attention probabilities (transformers' eager path, ``output_attentions=True``)
  of a twin model with the same weights: the entropy of those probabilities, per head and per
  layer, must equal what the tracker records and logs (RoPE and GQA included for Llama);
* the uniform level from the padding mask alone: under a causal mask query ``t`` of row ``b``
  may attend to ``cumsum(attention_mask[b])[t]`` keys, so the level is the mean of their logs;
* the unmonitored run itself: training with the tracker (kernel statistics on, dropout on, the
  query subsample drawn) is bit-identical to training without it;
* hand-computed event steps for the kernel detector on constructed series.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from hdi_monitor import HDITracker
from hdi_monitor.evidence import backed
from hdi_monitor.exceptions import DiversityWarning, MonitoringWarning
from hdi_monitor.monitor._publish import feed_report
from hdi_monitor.monitor.detector import SaturationDetector
from hdi_monitor.monitor.kernel_detector import KernelDetector
from hdi_monitor.report import DiversityReport, LayerDiversity

transformers = pytest.importorskip("transformers")

TOL = 1e-5
KERNEL_TAGS = ("attention_entropy", "attention_entropy_uniform", "max_attention_logit")


def _gpt2(impl: str, dropout: float = 0.0):
    cfg = transformers.GPT2Config(
        vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_implementation=impl,
        attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _llama(impl: str, dropout: float = 0.0):
    cfg = transformers.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=dropout, attn_implementation=impl,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


BUILDERS = {"gpt2": _gpt2, "llama": _llama}


def _batch(seed: int = 0, b: int = 3, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, :3] = 0  # left padding
    am[2, 6:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": am}


def _prob_entropy(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per head mean entropy of attention probabilities (B, H, T, S) over the kept queries."""
    p = probs.double()
    ent = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)
    w = keep[:, None, :].double()
    return (ent * w).sum((0, 2)) / w.sum((0, 2))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logged_entropy_equals_the_models_own_eager_attention(family):
    batch = _batch(seed=1)
    keep = batch["attention_mask"].bool()
    torch.manual_seed(0)
    eager = BUILDERS[family]("eager").eval()
    with torch.no_grad():
        probs = eager(**batch, output_attentions=True).attentions
    torch.manual_seed(0)
    model = BUILDERS[family]("sdpa")  # the tracker reads the sdpa kernel's own q/k
    tracker = HDITracker(model, kernel_stats=True, max_tokens=None, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitoringWarning)  # every layer reached: no note
        m = tracker.measure(batch)
    assert m is not None
    # uniform level from the padding mask alone: causal, so query t sees cumsum(mask)[t] keys
    allowed = batch["attention_mask"].cumsum(1).double()
    uniform = float(torch.log(allowed[keep]).mean())
    entropies = []
    for layer, p in zip(m.report.layers, probs, strict=True):
        ref = _prob_entropy(p, keep)
        assert layer.attention_entropy is not None
        torch.testing.assert_close(layer.attention_entropy, ref, atol=TOL, rtol=0)
        assert layer.attention_entropy_uniform is not None
        torch.testing.assert_close(layer.attention_entropy_uniform, torch.full((4,), uniform, dtype=torch.float64))
        assert layer.kernel_queries is not None and layer.kernel_queries.tolist() == [int(keep.sum())] * 4
        assert m.scalars[f"attention_entropy/{layer.name}"] == pytest.approx(float(ref.mean()), abs=TOL)
        assert m.scalars[f"max_attention_logit/{layer.name}"] == pytest.approx(float(layer.max_attention_logit.max()))
        entropies.append(float(ref.mean()))
    assert m.scalars["attention_entropy/mean"] == pytest.approx(sum(entropies) / 2, abs=TOL)
    assert m.scalars["attention_entropy_uniform/mean"] == pytest.approx(uniform)
    top = max(float(la.max_attention_logit.max()) for la in m.report.layers)
    assert m.scalars["max_attention_logit/max"] == top
    # the history keeps them, as typed series
    names, values, _ = tracker.history.layer_matrix("attention_entropy")
    assert names == [la.name for la in m.report.layers]
    torch.testing.assert_close(values[:, -1].double(), torch.tensor(entropies, dtype=torch.float64), atol=TOL, rtol=0)


def _run(family: str, kernel: bool | None, steps: int = 5) -> dict:
    """Train with dropout on; ``kernel``: None = no monitor, else the tracker with kernel_stats."""
    torch.manual_seed(0)
    model = BUILDERS[family]("sdpa", dropout=0.2).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = None
    if kernel is not None:
        tracker = HDITracker(model, every_n_steps=2, kernel_stats=kernel, max_tokens=10, strict=True)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        batch = _batch(seed=int(torch.randint(0, 1000, (), generator=g)), b=4, t=12)
        if tracker is not None:
            with tracker.capture(batch):
                out = model(**batch, labels=batch["input_ids"])
        else:
            out = model(**batch, labels=batch["input_ids"])
        out.loss.backward()
        losses.append(out.loss.detach())
        if tracker is not None:
            tracker.step()
        opt.step()
        opt.zero_grad()
    if tracker is not None:
        tracker.close()
    return {
        "state": model.state_dict(),
        "losses": torch.stack(losses),
        "rng": torch.get_rng_state(),
        "tracker": tracker,
        "training": [mod.training for mod in model.modules()],
    }


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_bit_identical_with_kernel_stats(family):
    without = _run(family, None)
    with_ = _run(family, True)
    assert torch.equal(without["losses"], with_["losses"])
    assert torch.equal(without["rng"], with_["rng"])
    assert without["training"] == with_["training"]
    assert all(torch.equal(without["state"][n], with_["state"][n]) for n in without["state"])
    tracker = with_["tracker"]
    assert len(tracker.history) == 3  # steps 0, 2, 4
    last = tracker.last_measurement
    for layer in last.report.layers:  # the subsample ran: 10 queries per kernel call
        assert layer.kernel_queries.tolist() == [10] * 4
    assert "attention_entropy/mean" in last.scalars


def test_kernel_stats_off_adds_no_hook_and_no_tag():
    import transformers.modeling_utils as mu

    def hooks(model):
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    seen = {}
    for kernel in (False, True):
        torch.manual_seed(0)
        model = _llama("sdpa")
        tracker = HDITracker(model, kernel_stats=kernel, activations=False, strict=True)
        sdpa, registry = F.scaled_dot_product_attention, dict(mu.ALL_ATTENTION_FUNCTIONS._local_mapping)
        batch = _batch()
        inside = []  # the globals as the first attention layer's forward sees them (after the monitor's hooks)

        def look(*_, inside=inside, sdpa=sdpa, registry=registry):
            inside.append(
                (F.scaled_dot_product_attention is sdpa, mu.ALL_ATTENTION_FUNCTIONS._local_mapping == registry)
            )

        with tracker.capture(batch) as measured:
            assert measured
            attached = hooks(model)
            outside = (F.scaled_dot_product_attention is sdpa, mu.ALL_ATTENTION_FUNCTIONS._local_mapping == registry)
            handle = model.model.layers[0].self_attn.register_forward_pre_hook(look)
            model(**batch)
            handle.remove()
        seen[kernel] = (attached, *inside[0])
        assert outside == (True, True)  # wrapped only while a watched layer's forward runs
        m = tracker.step()
        assert F.scaled_dot_product_attention is sdpa and hooks(model) == 0
        tags = [t for t in m.scalars if t.split("/")[0] in KERNEL_TAGS]
        assert bool(tags) == kernel
        assert all(layer.attention_entropy is None for layer in m.report.layers) != kernel
    assert seen[False] == (0, True, True)  # nothing attached, nothing wrapped
    assert seen[True][0] > 0 and not seen[True][1] and not seen[True][2]  # the check can fail


def test_kernel_events_reach_the_tracker_and_the_warning():
    """A detector that fires on any logit: the event, its count tag and the DiversityWarning."""
    torch.manual_seed(0)
    model = _gpt2("sdpa")
    tracker = HDITracker(
        model,
        kernel_stats=True,
        detector=SaturationDetector(warmup_steps=0),
        kernel_detector=KernelDetector(warmup_steps=0, logit_threshold=-1e6),
        activations=False,
        warn_on=("logit_blowup",),
    )
    with pytest.warns(DiversityWarning, match="logit blowup in 2 layers"):
        m = tracker.measure(_batch())
    assert m is not None
    kinds = [(e.kind, e.layer) for e in m.events if e.projection == "kernel"]
    assert kinds == [("logit_blowup", la.name) for la in m.report.layers]
    assert m.scalars["diversity_events/logit_blowup"] == 2.0
    assert m.scalars["diversity_events/entropy_collapse"] == 0.0
    state = tracker.state_dict()
    assert state["kernel_detector"]["fired"]


# --------------------------------------------------------------------------------------------------
# the kernel detector on constructed series (exact values)
# --------------------------------------------------------------------------------------------------


def test_entropy_collapse_fires_exactly_below_the_fraction_of_the_best():
    det = KernelDetector(warmup_steps=20, entropy_fraction=0.5)
    series = [(0, 0.1), (10, 0.05), (20, 2.0), (30, 2.5), (40, 1.3), (50, 1.26), (60, 1.2), (70, 0.5)]
    fired = []
    for step, value in series:
        events = det.update(step, "h.0", entropy=value, uniform=math.log(16))
        fired += [(step, e.kind, e.value, e.best, e.chance) for e in events]
    # 0.1 and 0.05 are before warmup; best 2.5; 1.3 and 1.26 are above 1.25; 1.2 is the first below;
    # it fires once
    assert fired == [(60, "entropy_collapse", 1.2, 2.5, math.log(16))]
    ev = det.events[0]
    assert ev.metric == "attention_entropy" and ev.projection == "kernel"
    assert "fell to 1.200 nats at step 60, below 0.5 of its best 2.500" in ev.message
    assert ("QK-norm" in ev.message) == backed("entropy_collapse")  # advice only where the study backs it


def test_logit_blowup_threshold_and_growth_and_state_round_trip():
    det = KernelDetector(warmup_steps=0, logit_threshold=50.0, logit_growth=4.0, patience=2, min_logit=10.0)
    out = {}
    for layer, values in {"a": [30.0, 40.0, 50.0, 51.0], "b": [3.0, 5.0, 11.9, 12.0], "c": [2.0, 3.0, 8.0]}.items():
        for step, v in enumerate(values):
            for e in det.update(step, layer, max_logit=v):
                out[layer] = (step, e.kind, e.value)
    # a: 50 is not above 50 (nor 4 x 30), 51 is; b: 11.9 < 4 * 3 = 12, then 12 >= 4 * 5? no: the window is
    # (5, 11.9, 12) -> 12 < 20; c: 8 >= 4 * 2 but below min_logit 10
    assert out == {"a": (3, "logit_blowup", 51.0)}
    det2 = KernelDetector(warmup_steps=0, logit_threshold=50.0, logit_growth=4.0, patience=2, min_logit=10.0)
    for step, v in enumerate([3.0, 5.0, 12.0]):
        det2.update(step, "b", max_logit=v)
    assert [(e.step, e.kind) for e in det2.events] == [(2, "logit_blowup")]  # 12 >= 4 * 3, patience 2 back
    restored = KernelDetector(warmup_steps=0, logit_threshold=50.0)
    restored.load_state_dict(det.state_dict())
    assert restored.update(10, "a", max_logit=99.0) == []  # fired once per layer, also after resume
    assert restored.update(10, "d", max_logit=99.0)[0].kind == "logit_blowup"


def test_feed_report_feeds_layer_means_to_the_kernel_detector():
    def layer(name, entropy):
        return LayerDiversity(
            name=name, family="x", num_heads=2, num_kv_heads=2, head_dim=4, model_dim=8,
            attention_entropy=torch.tensor(entropy, dtype=torch.float64),
            attention_entropy_uniform=torch.tensor([2.0, 2.0], dtype=torch.float64),
            max_attention_logit=torch.tensor([1.0, 3.0], dtype=torch.float64),
        )  # fmt: skip

    det = KernelDetector(warmup_steps=0, entropy_fraction=0.2)
    events = []
    for step, ent in enumerate([[1.0, 2.0], [1.6, 1.4], [0.2, float("nan")], [0.1, 0.5]]):
        report = DiversityReport(layers=[layer("mean", ent)], projections=(), weighting="spectral")
        events += feed_report(None, None, step, report, projections=(), kernel_detector=det)
    # layer means (NaN heads left out): 1.5, 1.5, 0.2 -> 0.2 < 0.2 * 1.5 fires at step 2, as "mean_layer"
    assert [(e.step, e.layer, e.value, e.best) for e in events] == [(2, "mean_layer", 0.2, 1.5)]


def test_two_data_parallel_ranks_sum_to_the_single_process_measurement(tmp_path, gloo2):
    """Each of 2 gloo ranks measures half the batch; after the tracker's sum both hold the
    one-process measurement of the whole batch (entropy and uniform level to 1e-5, the same
    maximum logit and query counts)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "kernel_tracker_ddp.py"
    gloo2.run(script, "scenario", str(tmp_path), timeout_s=300)
    spec = importlib.util.spec_from_file_location("kernel_tracker_ddp", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    batch = mod.full_batch()
    keep = batch["attention_mask"].bool()
    torch.manual_seed(0)
    eager = _llama("eager").eval()
    with torch.no_grad():
        probs = eager(**batch, output_attentions=True).attentions
    allowed = batch["attention_mask"].cumsum(1).double()
    uniform = float(torch.log(allowed[keep]).mean())
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for (ent, uni, top, count), p in zip(got["layers"], probs, strict=True):
            torch.testing.assert_close(ent, _prob_entropy(p, keep), atol=TOL, rtol=0)
            torch.testing.assert_close(uni, torch.full((4,), uniform, dtype=torch.float64))
            assert count.tolist() == [int(keep.sum())] * 4
            assert torch.isfinite(top).all()
    one = HDITracker(mod.build(), kernel_stats=True, max_tokens=None, strict=True).measure(batch)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for (_, _, top, _), layer in zip(got["layers"], one.report.layers, strict=True):
            torch.testing.assert_close(top, layer.max_attention_logit, atol=TOL, rtol=0)
        assert got["scalars"]["attention_entropy/mean"] == pytest.approx(one.scalars["attention_entropy/mean"])


def _compiled_run(monitor: bool, steps: int = 3) -> dict:
    """torch.compile(Llama, aot_eager), dropout on; the tracker measures steps 0 and 2."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = _llama("sdpa", dropout=0.2).train()
    with torch.random.fork_rng(devices=[]):
        twin = _llama("eager")
    twin.load_state_dict(net.state_dict())  # the step-0 reference (eager attention, same weights)
    model = torch.compile(net, backend="aot_eager")
    tracker = HDITracker(model, every_n_steps=2, kernel_stats=True, max_tokens=None, strict=True) if monitor else None
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batch = _batch(seed=5, b=3, t=8)
    first = None
    for _ in range(steps):
        if tracker is not None:
            with tracker.capture(batch):
                out = model(**batch, labels=batch["input_ids"])
            out.loss.backward()
            m = tracker.step()
            first = first or m
        else:
            out = model(**batch, labels=batch["input_ids"])
            out.loss.backward()
        opt.step()
        opt.zero_grad()
    graphs = (int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values()))
    torch._dynamo.reset()
    return {"weights": [p.detach().clone() for p in net.parameters()], "graphs": graphs, "first": first, "twin": twin}


def test_compiled_model_kernel_stats_from_the_side_forward():
    """Under torch.compile the kernel capture runs only in the eager side forward: the same graphs and
    graph breaks, bit-identical weights (dropout on), and step 0's entropy equals the eager attention of
    the same weights."""
    plain = _compiled_run(False)
    watched = _compiled_run(True)
    assert watched["graphs"] == plain["graphs"] and plain["graphs"][0] >= 1
    assert all(torch.equal(a, b) for a, b in zip(watched["weights"], plain["weights"], strict=True))
    batch = _batch(seed=5, b=3, t=8)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        probs = watched["twin"].eval()(**batch, output_attentions=True).attentions
    m = watched["first"]
    assert m is not None and m.step == 0
    for layer, p in zip(m.report.layers, probs, strict=True):
        assert layer.attention_entropy is not None, layer.name
        torch.testing.assert_close(layer.attention_entropy, _prob_entropy(p, keep), atol=TOL, rtol=0)


@pytest.mark.filterwarnings("ignore:.*token mask:hdi_monitor.MonitoringWarning")  # the 4-D mask note, expected
def test_partly_compiled_model_names_the_layers_outside_the_compiled_part():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _llama("sdpa").eval()
    model.model.layers[0].compile(backend="aot_eager")
    tracker = HDITracker(model, kernel_stats=True, max_tokens=None, strict=True)
    # use_cache=False: the side forward of a compiled decoder layer would otherwise append to the
    # KV cache passed in its kwargs (a compiled.py issue, reported; not the kernel capture's)
    batch = {**_batch(), "use_cache": False}
    with pytest.warns(MonitoringWarning, match=r"model\.layers\.1\.self_attn: kernel statistics not measured \(part"):
        with tracker.capture(batch), torch.no_grad():
            model(**batch)
        m = tracker.step()
    torch._dynamo.reset()
    first, second = m.report.layers
    assert first.attention_entropy is not None and second.attention_entropy is None
    assert f"attention_entropy/{first.name}" in m.scalars and f"attention_entropy/{second.name}" not in m.scalars


def test_layout_charts_every_kernel_tag_only_when_kernel_stats_is_on():
    import re

    torch.manual_seed(0)
    tracker = HDITracker(_gpt2("sdpa"), kernel_stats=True, activations=False, strict=True)
    m = tracker.measure(_batch())
    names = {"key": [la.name for la in m.report.layers]}
    kernel_tags = [t for t in m.scalars if t.split("/")[0] in KERNEL_TAGS]
    assert len(kernel_tags) == 2 * 2 + 3  # two per layer, three summaries
    on = tracker.dashboard.layout(names, activations=False, kernel=True)
    off = tracker.dashboard.layout(names, activations=False)
    (cat,) = [c for c in on["categories"] if c["title"].startswith("Attention kernel")]
    assert not [c for c in off["categories"] if c["title"].startswith("Attention kernel")]
    regexes = [r for chart in cat["charts"] for r in chart["multiline"]]
    for tag in kernel_tags:  # TensorBoard matches with re.match
        assert any(re.match(r, tag) for r in regexes), tag


def test_lightning_training_bit_identical_with_kernel_stats_on_torch_mha(tmp_path):
    """HDIMonitor(kernel_stats=True) on nn.TransformerEncoder (torch MHA, dropout on, 40 of 192
    queries per kernel call): the run is the unmonitored run bit for bit, and every layer has
    kernel statistics over exactly 40 queries per head."""
    import lightning.pytorch as pl

    from hdi_monitor import HDIMonitor
    from integration.test_training_unchanged import DropoutLM, assert_same_run, data, run_record

    def run(monitored: bool) -> dict:
        pl.seed_everything(0, verbose=False)
        model = DropoutLM()
        monitor = HDIMonitor(every_n_steps=2, max_tokens=40, kernel_stats=True, strict=True)
        trainer = pl.Trainer(
            max_steps=4, accelerator="cpu", logger=pl.loggers.TensorBoardLogger(str(tmp_path), name=str(monitored)),
            callbacks=[monitor] if monitored else [], enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=1,
        )  # fmt: skip
        trainer.fit(model, data())
        return run_record(model, model.losses, monitor=monitor)

    without, with_ = run(False), run(True)
    last = with_["monitor"].tracker.last_measurement
    assert last is not None and last.step == 2
    for layer in last.report.layers:
        assert layer.kernel_queries.tolist() == [40] * 4
        assert f"attention_entropy/{layer.name}" in last.scalars
    assert_same_run(without, with_)


def test_weights_only_step_has_no_kernel_values_and_no_note():
    torch.manual_seed(0)
    tracker = HDITracker(_gpt2("sdpa"), kernel_stats=True, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitoringWarning)
        m = tracker.step()  # no capture(): the weights alone
    assert m is not None and all(la.attention_entropy is None for la in m.report.layers)
    assert not [t for t in m.scalars if t.split("/")[0] in KERNEL_TAGS]
    with pytest.raises(TypeError, match="kernel_stats"):
        HDITracker(_gpt2("sdpa"), kernel_stats="yes")


def test_hf_trainer_bit_identical_with_kernel_stats(tmp_path):
    """HDITrainerCallback(kernel_stats=True) on BERT (sdpa, dropout on), 2 micro-batches per update:
    the run is the unmonitored run bit for bit; each kernel call gives 40 queries, so 80 per head."""
    from hdi_monitor.integrations import HDITrainerCallback
    from integration.test_training_unchanged import TokenDataset, assert_same_run, run_record

    def run(monitored: bool) -> dict:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(monitored)), max_steps=4, per_device_train_batch_size=4,
            learning_rate=1e-2, gradient_accumulation_steps=2, report_to=[], use_cpu=True, logging_steps=1,
            save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )  # fmt: skip
        monitor = HDITrainerCallback(
            every_n_steps=2, max_tokens=40, kernel_stats=True, log_dir=str(tmp_path / "tb"), strict=True
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=TokenDataset(), callbacks=[monitor] if monitored else []
        )
        trainer.train()
        return run_record(
            model, [torch.tensor(h["loss"]) for h in trainer.state.log_history if "loss" in h], monitor=monitor
        )

    without, with_ = run(False), run(True)
    last = with_["monitor"].tracker.last_measurement
    assert last is not None and last.step == 4
    for layer in last.report.layers:
        assert layer.kernel_queries.tolist() == [80] * 4
        assert f"max_attention_logit/{layer.name}" in last.scalars
    assert_same_run(without, with_)
