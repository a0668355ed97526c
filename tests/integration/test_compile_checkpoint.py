"""HDIMonitor / HDITracker on torch.compile'd models and under gradient checkpointing.

torch.compile: Dynamo does not guard on module hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so a forward pre-hook attached after a
module was compiled does not run inside the compiled forward, and hooks present when Dynamo first
traces stay in its graphs for the whole run. The tracker therefore never hooks a compiled unit: on
a measured step it runs a side forward of the unit's original module, eagerly, on the arguments of
the compiled call (`hdi_monitor.monitor.compiled`). Values must equal the uncompiled model's at
every measured step; with ``backend="aot_eager"`` the graph and graph-break counts
(``torch._dynamo.utils.counters``) and the trained weights must be those of the run without the
monitor. Most tests compile with ``backend="eager"`` (about a second instead of about thirty).

Gradient checkpointing: the forward pass of a checkpointed block runs again during backward.
The callback removes its hooks in ``on_before_backward``, so the recomputation is not counted.

References: ``head_diversity()`` of the same uncompiled, unchecked model (lr=0, so the weights never
change), with ``inputs=`` the measured step's batch for the activation statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from hdi_monitor import AttentionSpec, HDIMonitor, HDITracker, head_diversity
from hdi_monitor.contrib.demo import CharLM
from hdi_monitor.monitor.tracker import MonitoringWarning

PROJECTIONS = ("query", "key", "value", "output")
STEPS, EVERY, BATCH, SEQ = 5, 2, 4, 16
MEASURED = [0, 2, 4]


# ------------------------------------------------------------------------------------------- models


class Attention(nn.Module):
    """A plain causal self-attention (no nn.MultiheadAttention): found through an AttentionSpec."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (rearrange(lin(x), "b t (h d) -> b h t d", h=self.num_heads) for lin in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(rearrange(o, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, num_heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class SpecNet(nn.Module):
    """Token embedding, two blocks of custom attention, tied read-out."""

    def __init__(self, d_model: int = 32, num_heads: int = 4, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x @ self.embed.weight.T


SPEC = AttentionSpec(modules=r"(.*\.)?blocks\.\d+\.attn", query="wq", key="wk", value="wv", output="wo", num_heads=4)


class SpecLM(pl.LightningModule):
    """A LightningModule around :class:`SpecNet` (SGD, lr=0: the weights never change)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SpecNet()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, 128), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CheckpointedCharLM(CharLM):
    """CharLM whose encoder layers run under ``torch.utils.checkpoint`` (recomputed in backward)."""

    def __init__(self, *args, use_reentrant: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_reentrant = use_reentrant

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        mask = self.causal[:t, :t]
        for layer in self.encoder.layers:
            x = checkpoint(layer, x, mask, None, True, use_reentrant=self.use_reentrant)  # src_mask, padding, is_causal
        return self.norm(x) @ self.embed.weight.T


def char_lm(cls=CharLM, **kwargs) -> CharLM:
    torch.manual_seed(0)
    model = cls(d_model=32, num_heads=4, num_layers=2, seq_len=SEQ, lr=0.0, **kwargs)
    for layer in model.encoder.layers:  # nn.TransformerEncoder deep-copies one layer: make them differ
        layer.self_attn._reset_parameters()
    return model


def spec_lm() -> SpecLM:
    torch.manual_seed(0)
    return SpecLM()


def batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (STEPS * BATCH, SEQ + 1), generator=g)
    return [(tokens[i : i + BATCH, :-1], tokens[i : i + BATCH, 1:]) for i in range(0, STEPS * BATCH, BATCH)]


def fit(model: pl.LightningModule, monitor: HDIMonitor) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        callbacks=[monitor],
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(batches(), batch_size=None))


def references(model: nn.Module, spec: AttentionSpec | None):
    """Uncompiled head_diversity: the weights, and each measured step's batch."""
    weights = head_diversity(model, projections=PROJECTIONS, spec=spec)
    acts = {s: head_diversity(model, spec=spec, inputs=batches()[s][0]) for s in MEASURED}
    return weights, acts


def check_measured_or_fell_back(history: list[dict], caught: list, weights, acts, prefix: str = "") -> list[int]:
    """Weight HDIs equal the uncompiled model's at every measured step; effective heads either equal
    the uncompiled model's or are absent, and if any is absent a MonitoringWarning names
    torch.compile. Returns the steps with activation statistics."""
    assert [int(h["step"]) for h in history] == MEASURED
    measured = []
    for h in history:
        step = int(h["step"])
        for layer in weights.layers:
            for projection in PROJECTIONS:
                assert h[f"hdi/{projection}/{prefix}{layer.name}"] == pytest.approx(layer.hdi[projection], rel=1e-6)
        keys = [f"effective_heads/{prefix}{layer.name}" for layer in weights.layers]
        if all(k in h for k in keys):
            for key, layer in zip(keys, acts[step].layers, strict=True):
                assert h[key] == pytest.approx(layer.effective_heads, rel=1e-5), f"step {step}: {key}"
            measured.append(step)
        else:
            assert not any(k in h for k in keys), f"step {step}: activation statistics for only some layers"
    fallback = [w for w in caught if issubclass(w.category, MonitoringWarning) and "torch.compile" in str(w.message)]
    if measured != MEASURED:
        missing = sorted(set(MEASURED) - set(measured))
        assert fallback, f"activation statistics missing at steps {missing} without a warning"
    return measured


# ------------------------------------------------------------------------------------ torch.compile


def test_hooks_attached_after_compile_do_not_run():
    """The premise of the fallback (torch 2.13): a pre-hook attached after compilation is invisible
    to the compiled forward, while the same hook on the uncompiled module runs. If this starts
    failing, Dynamo guards on hooks and the fallback warning should no longer appear."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="eager")
    compiled(x)
    seen = []
    handle = model[2].register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        compiled(x)
        assert seen == []
        model(x)  # eager: the same hook runs
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], torch.relu(model[0](x)))
    finally:
        handle.remove()
        torch._dynamo.reset()


@pytest.mark.parametrize("how", ["wrap", "inplace"])
@pytest.mark.parametrize("family", ["torch_mha", "spec"])
def test_monitor_on_compiled_submodule(family, how):
    """LightningModule with a compiled submodule (``torch.compile(m)`` replaces it and names gain
    ``_orig_mod``; ``m.compile()`` compiles in place)."""
    torch._dynamo.reset()
    if family == "torch_mha":
        model, spec, inner = char_lm(), None, "encoder"
    else:
        model, spec, inner = spec_lm(), SPEC, "net"
    weights, acts = references(model, spec)
    if how == "wrap":
        setattr(model, inner, torch.compile(getattr(model, inner), backend="eager"))
        prefix = f"{inner}._orig_mod."
    else:
        getattr(model, inner).compile(backend="eager")
        prefix = ""
    monitor = HDIMonitor(every_n_steps=EVERY, spec=spec, log_images_every_n_steps=0, detector=None, max_tokens=None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(model, monitor)
    finally:
        torch._dynamo.reset()
    if how == "wrap":  # torch.compile(m) puts the module under `_orig_mod`: compare under those names
        weights, acts = _renamed(weights, inner), {k: _renamed(v, inner) for k, v in acts.items()}
    assert [layer.name for layer in monitor.tracker.layers] == [prefix + layer.name for layer in weights.layers]
    measured = check_measured_or_fell_back(monitor.history, caught, weights, acts, prefix=prefix)
    assert measured == MEASURED  # the side forward measures every step, whatever Dynamo guards on


def _renamed(report, inner: str):
    """The reference report with ``inner.`` taken off its layer names (the records are frozen)."""
    layers = [dataclasses.replace(la, name=la.name.removeprefix(inner + ".")) for la in report.layers]
    return dataclasses.replace(report, layers=layers)


@pytest.mark.parametrize("family", ["torch_mha", "spec"])
def test_tracker_on_whole_compiled_model(family):
    """Plain loop: ``HDITracker(torch.compile(model))`` with ``capture()`` around each forward."""
    torch._dynamo.reset()
    if family == "torch_mha":
        model, spec = char_lm(), None
    else:
        model, spec = spec_lm().net, SPEC
    weights, acts = references(model, spec)
    compiled = torch.compile(model, backend="eager")
    tracker = HDITracker(compiled, every_n_steps=EVERY, spec=spec, log_images_every_n_steps=0, max_tokens=None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, _ in batches():
                with tracker.capture(x):
                    compiled(x).sum().backward()
                tracker.step()
    finally:
        torch._dynamo.reset()
    measured = check_measured_or_fell_back(tracker.history, caught, weights, acts, prefix="_orig_mod.")
    assert measured == MEASURED


# ---------------------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_does_not_double_count(use_reentrant):
    """Checkpointed encoder layers run their forward twice per step (once more in backward); the
    monitor counts each token once and gives the covariance of the model without checkpointing."""
    model = char_lm(CheckpointedCharLM, use_reentrant=use_reentrant)
    plain = char_lm()
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):  # the same weights
        assert torch.equal(ours, theirs)
    acts = {s: head_diversity(plain, inputs=batches()[s][0]) for s in MEASURED}
    calls = []
    counter = model.encoder.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(1), with_kwargs=True
    )
    monitor = HDIMonitor(every_n_steps=EVERY, log_images_every_n_steps=0, detector=None, max_tokens=None, strict=True)
    fit(model, monitor)
    counter.remove()
    assert len(calls) == 2 * STEPS  # the checkpoint really recomputed every forward in backward
    assert monitor.tracker.last_token_counts == [BATCH * SEQ] * 2
    assert [int(h["step"]) for h in monitor.history] == MEASURED
    for h in monitor.history:
        for layer in acts[int(h["step"])].layers:
            assert h[f"effective_heads/{layer.name}"] == pytest.approx(layer.effective_heads, rel=1e-5)
            assert h[f"head_correlation/{layer.name}"] == pytest.approx(layer.mean_correlation, rel=1e-5, abs=1e-7)
    last = monitor.last_measurement.report.layers
    for got, ref in zip(last, acts[4].layers, strict=True):
        scale = float(ref.covariance.abs().max())
        torch.testing.assert_close(got.covariance, ref.covariance.double(), rtol=1e-5, atol=1e-6 * scale)


# ------------------------------------------------------------- compile-safe: graphs untouched (issue 21)


class DropBlock(Block):
    """A block with dropout: a monitor that drew from the global generator would change training."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__(d_model, num_heads)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm(x)))
        return x + self.mlp(x)


class DropNet(SpecNet):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropBlock(32, 4) for _ in range(2))


def _dynamo_counts() -> tuple[int, dict[str, int]]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def _fresh_copy(net: nn.Module) -> nn.Module:
    """An uncompiled copy with the same weights, made without drawing from the global generator."""
    with torch.random.fork_rng(devices=[]):
        copy = DropNet()
    copy.load_state_dict(net.state_dict())
    return copy


def _train_step(
    model: nn.Module, tracker: HDITracker | None, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer
) -> None:
    """One SGD step of the next-token loss, measured through ``tracker`` when given."""
    with tracker.capture(x) if tracker is not None else contextlib.nullcontext():
        loss = F.cross_entropy(model(x).reshape(-1, 128), y.reshape(-1))
    loss.backward()
    if tracker is not None:
        tracker.step()
    optimizer.step()
    optimizer.zero_grad()


def _plain_run(monitor: bool, how: str, **settings: Any):
    """SGD (lr 0.1) on a dropout model compiled with aot_eager; measured every 2nd step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = DropNet()
    if how == "wrap":
        model: nn.Module = torch.compile(net, backend="aot_eager")
    else:
        net.compile(backend="aot_eager")
        model = net
    tracker = (
        HDITracker(
            model, every_n_steps=EVERY, spec=SPEC, log_images_every_n_steps=4, max_tokens=None, strict=True, **settings
        )
        if monitor
        else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = {}
    for step, (x, y) in enumerate(batches()):
        if tracker is not None and step % EVERY == 0:  # the reference: eager, eval mode, same weights
            refs[step] = head_diversity(_fresh_copy(net), spec=SPEC, inputs=x)
        _train_step(model, tracker, x, y, optimizer)
    if tracker is not None:
        tracker.close()
    counts = _dynamo_counts()
    torch._dynamo.reset()
    return [p.detach().clone() for p in net.parameters()], counts, tracker, refs


def test_compiled_plain_loop_with_the_update_entropy_keeps_its_graphs_and_trains_bit_identically():
    """Issue 33: with the update entropy on (weights read at every measured step, the previous
    step's kept), torch.compile(model) with aot_eager keeps its graphs and graph breaks and trains bit
    for bit as without the monitor; the update entropy is logged from the second measured step."""
    plain_weights, plain_counts, _, _ = _plain_run(False, "wrap")
    weights, counts, tracker, _ = _plain_run(True, "wrap", update_entropy=True)
    assert counts == plain_counts and plain_counts[0] >= 1
    for a, b in zip(weights, plain_weights, strict=True):
        assert torch.equal(a, b)
    assert any(k.startswith("update_entropy/") for k in tracker.history[-1]), sorted(tracker.history[-1])


@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_compiled_plain_loop_keeps_its_graphs_and_trains_bit_identically(how):
    """torch.compile(model) / model.compile() with aot_eager: the same graphs and graph breaks with
    and without the monitor (measured steps included), bit-identical weights (dropout on), and head
    outputs measured at every measured step, equal to head_diversity() of an eager copy."""
    plain_weights, plain_counts, _, _ = _plain_run(False, how)
    weights, counts, tracker, refs = _plain_run(True, how)
    assert counts == plain_counts
    assert plain_counts[0] >= 1  # something was compiled
    for a, b in zip(weights, plain_weights, strict=True):
        assert torch.equal(a, b)
    prefix = "_orig_mod." if how == "wrap" else ""
    assert tracker.history.steps == MEASURED
    for row in tracker.history:
        for layer in refs[int(row["step"])].layers:
            assert row[f"effective_heads/{prefix}{layer.name}"] == pytest.approx(layer.effective_heads, rel=1e-5)
            assert row[f"hdi/key/{prefix}{layer.name}"] == pytest.approx(layer.hdi["key"], rel=1e-6)


class CompiledLM(SpecLM):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.net = DropNet()
        if how == "wrap":
            self.net = torch.compile(self.net, backend="aot_eager")
        else:
            self.net.compile(backend="aot_eager")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_run(monitor: bool, how: str):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = CompiledLM(how)
    callbacks = (
        [
            HDIMonitor(
                every_n_steps=EVERY, spec=SPEC, log_images_every_n_steps=4, detector=None, max_tokens=None, strict=True
            )
        ]
        if monitor
        else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        callbacks=callbacks,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(batches(), batch_size=None))
    counts = _dynamo_counts()
    torch._dynamo.reset()
    return [p.detach().clone() for p in model.parameters()], counts, callbacks


@pytest.mark.parametrize("how", ["wrap", "inplace"])
def test_compiled_lightning_module_keeps_its_graphs_and_trains_bit_identically(how):
    """A LightningModule whose network is compiled (aot_eager): graphs, graph breaks and weights as
    without the monitor; head outputs measured at every measured step."""
    plain_weights, plain_counts, _ = _lightning_run(False, how)
    weights, counts, (monitor,) = _lightning_run(True, how)
    assert counts == plain_counts and plain_counts[0] >= 1
    for a, b in zip(weights, plain_weights, strict=True):
        assert torch.equal(a, b)
    assert monitor.history.steps == MEASURED
    names = [la.name for la in monitor.tracker.layers]
    for row in monitor.history:
        assert all(f"effective_heads/{n}" in row for n in names)


def _llama_layers_compiled_run(monitor: bool):
    """A tiny Llama whose decoder layers are compiled one by one (aot_eager), trained with its
    default ``use_cache=True``: every compiled layer call receives the model's key/value cache."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.train()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    tracker = (
        HDITracker(model, every_n_steps=2, log_images_every_n_steps=0, max_tokens=None, strict=True)
        if monitor
        else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 9), generator=g)
        with tracker.capture({"input_ids": ids}) if tracker is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if tracker is not None:
            tracker.step()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if tracker is not None:
        tracker.close()
    counts = _dynamo_counts()
    torch._dynamo.reset()
    return losses, [p.detach().clone() for p in model.parameters()], counts, tracker


@pytest.mark.slow
def test_layers_compiled_one_by_one_with_a_kv_cache_train_bit_identically():
    """The side forward of a compiled decoder layer never appends to the model's key/value cache
    (the compiled call would then read doubled keys): same losses, weights and graph counts with and
    without the monitor, and head outputs measured."""
    plain_losses, plain_weights, plain_counts, _ = _llama_layers_compiled_run(False)
    losses, weights, counts, tracker = _llama_layers_compiled_run(True)
    assert counts == plain_counts and plain_counts[0] >= 1
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert tracker.history.steps == [0, 2]
    assert all(row["effective_heads/mean"] > 0 for row in tracker.history)


class EvalFailsNet(SpecNet):
    """A SpecNet whose forward raises in eval mode only: the side forward of a measured step (eval
    mode, no grad) fails while the compiled training forward (train mode) runs."""

    def forward(self, tokens: Tensor) -> Tensor:
        if not self.training:
            raise RuntimeError("no eval forward here")
        return super().forward(tokens)


def _failing_side_forward_run(monitor: bool, strict: bool = False) -> tuple[list[Tensor], list[str], HDITracker | None]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(EvalFailsNet(), backend="eager")
    tracker = HDITracker(model, every_n_steps=EVERY, spec=SPEC, strict=strict) if monitor else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches():
            _train_step(model, tracker, x, y, optimizer)
    torch._dynamo.reset()
    messages = [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]
    return [p.detach().clone() for p in model.parameters()], messages, tracker


def test_a_failing_side_forward_skips_the_measurement_and_never_the_training():
    """The side forward of a compiled model raises on every measured step: each measured step gives
    one MonitoringWarning naming the error and is skipped; the training runs, bit-identical to the
    run without the monitor. With strict=True the error reaches the caller."""
    plain, _, _ = _failing_side_forward_run(False)
    weights, messages, tracker = _failing_side_forward_run(True)
    for a, b in zip(weights, plain, strict=True):
        assert torch.equal(a, b)
    failures = [m for m in messages if "error while capturing head outputs" in m]
    assert len(failures) == len(MEASURED)
    assert all("no eval forward here" in m for m in failures)
    assert tracker is not None and len(tracker.history) == 0
    with pytest.raises(RuntimeError, match="no eval forward here"):
        _failing_side_forward_run(True, strict=True)


class PaddedEncoderNet(nn.Module):
    """Embedding, an nn.TransformerEncoder called with a padding mask, a read-out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(16, 50)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.head(self.enc(self.emb(x), src_key_padding_mask=pad))


def test_a_compiled_encoder_with_padding_is_measured_in_the_side_forward():
    """The side forward runs in eval mode, where nn.TransformerEncoder hands its layers a nested
    tensor (the batch without its padding): the hooks read it padded again. Each layer counts the
    real tokens (the mask's sum) and its effective heads equal those of the uncompiled encoder on
    the same batch; the global fast-path flag is left as it was."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = PaddedEncoderNet()
    eager = PaddedEncoderNet()
    eager.load_state_dict(net.state_dict())
    net.enc = torch.compile(net.enc, backend="eager")
    x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[:, 6:] = True
    tracker = HDITracker(net, every_n_steps=1, max_tokens=None, strict=True)
    with tracker.capture((x, pad)):
        net(x, pad)
    tracker.step()
    torch._dynamo.reset()
    assert torch.backends.mha.get_fastpath_enabled()
    assert tracker.last_token_counts == [int((~pad).sum())] * 2
    ref = head_diversity(eager, inputs=(x, pad), max_tokens=None)
    row = tracker.history[-1]
    for layer in ref.layers:
        assert row[f"effective_heads/enc._orig_mod.{layer.name.removeprefix('enc.')}"] == pytest.approx(
            layer.effective_heads, rel=1e-5
        )


class _EvalFailsUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            raise RuntimeError("no eval forward here")
        return self.attn(x, x, x, need_weights=False)[0]


class _CountingUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.eval_calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.eval_calls += not self.training
        return self.attn(x, x, x, need_weights=False)[0]


def test_no_side_forward_runs_once_the_measurement_is_dropped():
    """Two compiled units; the first one's side forward fails, which drops the step's measurement:
    the second unit then runs no side forward (one eager forward saved per unit and step)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(
        torch.compile(_EvalFailsUnit(), backend="eager"), torch.compile(_CountingUnit(), backend="eager")
    )
    tracker = HDITracker(net, every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(2, 5, 16)
            with tracker.capture(x):
                net(x).sum().backward()
            tracker.step()
    torch._dynamo.reset()
    assert net[1]._orig_mod.eval_calls == 0
    assert len(tracker.history) == 0
    assert sum("no eval forward here" in str(w.message) for w in caught) == 2  # one per measured step
