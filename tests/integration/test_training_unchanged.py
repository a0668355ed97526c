"""Monitoring never changes the training it watches (issue 12, item 1).

Each test trains the same model twice from the same seed, once without and once with the monitor,
with dropout on and more tokens per measured step than ``max_tokens`` (so the token subsample is
drawn), and asserts bit-identical weights, losses and global random state. The reference is the
unmonitored run itself: any draw from the global generator, any module flag or backend flag left
changed, shifts a dropout mask and breaks the equality.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import cuda
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hdi_monitor import HDIMonitor, HDITracker

VOCAB, WIDTH, SEQ, BATCH = 48, 32, 24, 8  # 192 tokens per batch per layer
MAX_TOKENS = 40  # well below the tokens of one measured step


class DropoutEncoder(nn.Module):
    """Two encoder layers with dropout 0.1 (attention weights and residual paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.encoder(self.embed(tokens))))


class DropoutLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = DropoutEncoder()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(n: int = 96) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=BATCH)


def global_state() -> dict:
    """Everything of the process that training can see and the monitor must leave alone."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": [s.tolist() for s in torch.cuda.get_rng_state_all()] if cuda else None,
        "grad_enabled": torch.is_grad_enabled(),
        "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn": (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
    }


def run_record(model: torch.nn.Module, losses: list, **extra: object) -> dict:
    """What `assert_same_run` compares of a finished run: the weights, the losses, the process's
    global state and every module's training flag (plus ``extra``, e.g. the monitor)."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "globals": global_state(),
        "training_flags": [m.training for m in model.modules()],
        **extra,
    }


def assert_same_run(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key
    assert len(a["losses"]) == len(b["losses"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True))
    assert torch.equal(a["globals"].pop("torch_rng"), b["globals"].pop("torch_rng"))
    assert a["globals"] == b["globals"]
    assert a["training_flags"] == b["training_flags"]


def lightning_run(tmp_path: Path, monitored: bool, accumulate: int = 1, **settings: Any) -> dict:
    pl.seed_everything(0, verbose=False)
    model = DropoutLM()
    monitor = HDIMonitor(every_n_steps=2, max_tokens=MAX_TOKENS, log_images_every_n_steps=4, strict=True, **settings)
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="tb"),
        callbacks=[monitor] if monitored else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=1,
    )
    trainer.fit(model, data())
    return run_record(model, model.losses, monitor=monitor)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_training_is_bit_identical_with_the_monitor(tmp_path, accumulate):
    """Item 1: Lightning Trainer, dropout on, subsampled tokens, also under gradient accumulation."""
    without = lightning_run(tmp_path / "without", monitored=False, accumulate=accumulate)
    with_ = lightning_run(tmp_path / "with", monitored=True, accumulate=accumulate)
    monitor = with_["monitor"]
    assert [h["step"] for h in monitor.history] == [0.0, 2.0, 4.0]
    # the subsample really ran: each layer kept MAX_TOKENS per measured step, whatever the number of
    # micro-batches (max_tokens caps a layer per measured step, issue 23)
    assert monitor.tracker.last_token_counts == [MAX_TOKENS] * 2
    assert "effective_heads/mean" in monitor.history[-1]
    assert_same_run(without, with_)


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def train_step(
    loss_of: Callable[[], torch.Tensor], x: torch.Tensor, tracker: HDITracker | None, optimizer: torch.optim.Optimizer
) -> torch.Tensor:
    """One optimizer step on ``loss_of()``, its forward captured by ``tracker`` when given (measured
    steps only); returns the loss."""
    with tracker.capture(x) if tracker is not None else contextlib.nullcontext():
        loss = loss_of()
    loss.backward()
    if tracker is not None:
        tracker.step()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach().clone()


def plain_run(
    monitored: bool,
    steps: int = 6,
    device: str = "cpu",
    parametrization: str | None = None,
    kernel_stats: bool = False,
    **settings: Any,
) -> dict:
    torch.manual_seed(0)
    model = DropoutEncoder().to(device)
    if parametrization is not None:  # on the packed in_proj_weight of every nn.MultiheadAttention
        for layer in model.encoder.layers:
            getattr(nn.utils.parametrizations, parametrization)(layer.self_attn, name="in_proj_weight")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = HDITracker(
        model,
        every_n_steps=2,
        max_tokens=MAX_TOKENS,
        log_images_every_n_steps=2,
        kernel_stats=kernel_stats,
        strict=True,
        **settings,
    )
    losses = []
    for x, y in data():
        if len(losses) == steps:
            break
        x, y = x.to(device), y.to(device)
        loss_of = partial(next_token_loss, model, x, y)
        losses.append(train_step(loss_of, x, tracker if monitored else None, optimizer))
    tracker.close()
    return run_record(model, losses, tracker=tracker)


def test_plain_loop_training_is_bit_identical_with_the_tracker():
    """Item 1: the plain PyTorch loop (capture + step), dropout on, subsampled tokens."""
    without = plain_run(monitored=False)
    with_ = plain_run(monitored=True)
    assert len(with_["tracker"].history) == 3
    assert with_["tracker"].last_token_counts == [MAX_TOKENS, MAX_TOKENS]
    assert_same_run(without, with_)


def _weight_signals_logged(row: dict) -> None:
    assert any(k.startswith("update_entropy/") for k in row), sorted(row)
    assert any(k.startswith("logit_bound/") for k in row), sorted(row)


def test_weight_only_signals_leave_plain_and_lightning_training_bit_identical(tmp_path):
    """Issue 33: with the update entropy on (opt-in; the logit bound is read on every measured step),
    the plain loop and the Lightning Trainer train bit for bit as without the monitor, and both
    signals are logged."""
    plain = plain_run(monitored=True, update_entropy=True)
    _weight_signals_logged(plain["tracker"].history[-1])
    assert_same_run(plain_run(monitored=False), plain)
    with_ = lightning_run(tmp_path / "with", monitored=True, update_entropy=True)
    _weight_signals_logged(with_["monitor"].history[-1])
    assert_same_run(lightning_run(tmp_path / "without", monitored=False), with_)


@pytest.mark.filterwarnings(
    "ignore:hdi-monitor step:hdi_monitor.MonitoringWarning"
)  # dead-head notes of a run that diverges
@pytest.mark.parametrize("kernel_stats", [False, True])
@pytest.mark.parametrize("parametrization", ["spectral_norm", "orthogonal", "weight_norm"])
def test_parametrized_mha_in_proj_trains_bit_identically(parametrization, kernel_stats):
    """Issue 23, item 1, on nn.MultiheadAttention: a parametrization on the packed
    ``in_proj_weight`` is read inside the training forward (the head-output hook and the kernel
    capture recompute q/k/v from it), and the MHA forward reads it once per fast-path check:
    spectral_norm's power iteration must advance exactly as often as without the monitor."""
    without = plain_run(monitored=False, parametrization=parametrization)
    with_ = plain_run(monitored=True, parametrization=parametrization, kernel_stats=kernel_stats)
    tracker = with_["tracker"]
    assert [int(row["step"]) for row in tracker.history] == [0, 2, 4]
    assert tracker.last_token_counts == [MAX_TOKENS, MAX_TOKENS]  # the head-output hooks ran
    assert ("attention_entropy/mean" in tracker.history[-1]) == kernel_stats
    assert_same_run(without, with_)


class FrozenBeside(nn.Module):
    """A frozen nn.MultiheadAttention in eval mode feeding a trained one with spectral_norm on its
    packed in_proj_weight."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.trained = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        nn.utils.parametrizations.spectral_norm(self.trained, name="in_proj_weight")
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(x, x, x, need_weights=False)[0]
        return self.head(self.trained(h, h, h, need_weights=False)[0]).square().mean()


def frozen_beside_run(monitored: bool) -> dict:
    torch.manual_seed(0)
    model = FrozenBeside()
    model.frozen.eval().requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tracker = HDITracker(model, every_n_steps=1, log_images_every_n_steps=0, strict=True)
    losses = []
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(2, 6, WIDTH, generator=g)
        losses.append(train_step(partial(model, x), x, tracker if monitored else None, optimizer))
    return run_record(model, losses, tracker=tracker)


def test_a_frozen_eval_mode_mha_beside_a_trained_spectral_norm_mha_trains_bit_identically():
    """The monitor never touches the global MHA fast-path flag: switching it off for a hooked
    eval-mode module made the trained module's forward skip its fast-path reads of
    in_proj_weight, each a spectral_norm power step (training changed)."""
    without = frozen_beside_run(False)
    with_ = frozen_beside_run(True)
    assert len(with_["tracker"].history) == 3
    assert "effective_heads/trained" in with_["tracker"].history[-1]
    assert_same_run(without, with_)


@cuda
def test_plain_loop_on_cuda_leaves_the_cuda_generator_alone():
    """Item 1 on an accelerator: dropout masks come from the CUDA generator, which the subsample
    (drawn on the tracker's CPU generator) must not touch."""
    without = plain_run(monitored=False, device="cuda")
    with_ = plain_run(monitored=True, device="cuda")
    assert with_["tracker"].last_token_counts == [MAX_TOKENS, MAX_TOKENS]
    assert with_["globals"]["cuda_rng"] is not None
    assert_same_run(without, with_)


def test_resumed_tracker_subsamples_the_same_tokens():
    """Item 1: the generator state travels in state_dict, so a resumed run picks the same tokens
    (same effective heads) as an uninterrupted one, whatever the global generator holds."""
    torch.manual_seed(0)
    model = DropoutEncoder().eval()  # no dropout: the subsample is the only randomness
    batches = [x for x, _ in data()][:6]

    def run(tracker: HDITracker, steps) -> None:
        for i in steps:
            with torch.no_grad(), tracker.capture(batches[i]):
                model(batches[i])
            tracker.step()

    def tracker() -> HDITracker:
        return HDITracker(model, every_n_steps=1, max_tokens=MAX_TOKENS, log_images_every_n_steps=0, strict=True)

    whole = tracker()
    run(whole, range(6))
    first = tracker()
    run(first, range(3))
    saved = copy.deepcopy(first.state_dict())
    torch.manual_seed(12345)  # a resumed process holds some other global state
    second = tracker()
    second.load_state_dict(saved)
    run(second, range(3, 6))
    assert second.history == whole.history
    # and the subsample does depend on the generator (the check above is not vacuous)
    other = HDITracker(model, every_n_steps=1, max_tokens=MAX_TOKENS, log_images_every_n_steps=0, seed=1)
    run(other, range(1))
    assert other.history[0]["effective_heads/mean"] != whole.history[0]["effective_heads/mean"]


# ---------------------------------------------------------------------------------- Hugging Face

transformers = pytest.importorskip("transformers")


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(5, 50, (16,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids.clone()}


def hf_run(tmp_path: Path, monitored: bool, **settings: Any) -> dict:
    from hdi_monitor.integrations import HDITrainerCallback

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = transformers.BertForMaskedLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        gradient_accumulation_steps=2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    monitor = HDITrainerCallback(
        every_n_steps=2, max_tokens=MAX_TOKENS, log_dir=str(tmp_path / "tb"), strict=True, **settings
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=TokenDataset(), callbacks=[monitor] if monitored else []
    )
    trainer.train()
    return run_record(
        model, [torch.tensor(h["loss"]) for h in trainer.state.log_history if "loss" in h], monitor=monitor
    )


def test_hf_trainer_training_is_bit_identical_with_the_callback(tmp_path):
    """Item 1: the Hugging Face Trainer callback, dropout on, 2 micro-batches of 64 tokens per
    update (> max_tokens each)."""
    without = hf_run(tmp_path / "without", monitored=False)
    with_ = hf_run(tmp_path / "with", monitored=True)
    assert [h["step"] for h in with_["monitor"].history] == [0.0, 2.0, 4.0]
    assert with_["monitor"].tracker.last_token_counts == [MAX_TOKENS] * 2  # per layer per measured step
    assert_same_run(without, with_)


def test_weight_only_signals_leave_hf_training_bit_identical(tmp_path):
    """Issue 33: the Hugging Face Trainer callback with the update entropy on trains bit for bit as
    without it, and logs both weight-only signals."""
    with_ = hf_run(tmp_path / "with", monitored=True, update_entropy=True)
    _weight_signals_logged(with_["monitor"].history[-1])
    assert_same_run(hf_run(tmp_path / "without", monitored=False), with_)
