"""Integrations beyond Lightning, end to end: a hand-written PyTorch loop with HDITracker, and the
Hugging Face Trainer with HDITrainerCallback. Event files are read back with EventAccumulator and
compared with head_diversity of the weights each point claims to show."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_events, scalar_series
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from hdi_monitor import DiversityWarning, HDITracker, SaturationDetector, head_diversity

PROJECTIONS = ("query", "key", "value", "output")
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------- plain loop


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (3, 10), generator=g) for _ in range(n)]


def plain_loop(tmp_path: Path, lr: float, steps: int = 5, every: int = 2):
    """A hand-written loop; returns (model, tracker, per-step weight snapshots, per-step batches)."""
    torch.manual_seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    writer = SummaryWriter(str(tmp_path))
    tracker = HDITracker(model, every_n_steps=every, log_images_every_n_steps=0, writer=writer, strict=True)
    snapshots, seen = [], []
    for x in batches(steps):
        snapshots.append(copy.deepcopy(model))  # the weights that produce this step's forward pass
        seen.append(x)
        with tracker.capture(x):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), x.reshape(-1))
        loss.backward()
        writer.add_scalar("loss", loss.item(), tracker.current_step)
        tracker.step()
        optimizer.step()
        optimizer.zero_grad()
    tracker.close()
    writer.close()
    return model, tracker, snapshots, seen


def test_plain_loop_scalars_equal_head_diversity_at_lr0(tmp_path):
    model, tracker, _, seen = plain_loop(tmp_path, lr=0.0)
    accs = read_events(tmp_path)
    reference = head_diversity(model, projections=PROJECTIONS)
    names = [layer.name for layer in reference.layers]
    assert names == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    for layer in reference.layers:
        for p in PROJECTIONS:
            series = scalar_series(accs, f"hdi/{p}/{layer.name}")
            assert sorted(series) == [0, 2, 4]
            for value in series.values():
                assert value == pytest.approx(layer.hdi[p], rel=1e-6, abs=1e-7)
    # head outputs of the measured step's forward pass: same as running that batch through head_diversity
    with_inputs = head_diversity(model, inputs=seen[4])
    for layer in with_inputs.layers:
        eff = scalar_series(accs, f"effective_heads/{layer.name}")
        assert sorted(eff) == [0, 2, 4]
        assert eff[4] == pytest.approx(layer.effective_heads, rel=1e-5)
    assert set(scalar_series(accs, "loss")) == {0, 1, 2, 3, 4}  # the loop's loss on the same axis
    assert [h["step"] for h in tracker.history] == [0, 2, 4]


def test_plain_loop_points_show_the_weights_of_their_step(tmp_path):
    _, tracker, snapshots, _ = plain_loop(tmp_path, lr=0.5, steps=5, every=2)
    accs = read_events(tmp_path)
    name = "encoder.layers.1.self_attn"
    series = scalar_series(accs, f"hdi/key/{name}")
    values = [head_diversity(s).layers[1].hdi["key"] for s in snapshots]
    assert len(set(values)) == 5  # the weights do move
    for step in (0, 2, 4):
        assert series[step] == pytest.approx(values[step], rel=1e-6)


def test_plain_loop_effective_heads_use_the_weights_of_their_step(tmp_path):
    _, _, snapshots, seen = plain_loop(tmp_path, lr=0.5, steps=3, every=2)
    accs = read_events(tmp_path)
    ref = head_diversity(snapshots[2], inputs=seen[2])  # step 2's batch through step 2's weights
    for layer in ref.layers:
        assert scalar_series(accs, f"effective_heads/{layer.name}")[2] == pytest.approx(layer.effective_heads, rel=1e-5)


# ----------------------------------------------------------------------------- Hugging Face Trainer

try:
    import accelerate  # noqa: F401 - transformers.Trainer needs it
    import transformers
except ImportError:
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="needs transformers and accelerate")


class MaskedDataset(torch.utils.data.Dataset):
    """Sequences of 10 tokens, the last 2 of them padding (8 real tokens each)."""

    def __init__(self, n: int = 32, vocab: int = 50) -> None:
        self.n, self.vocab = n, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(5, self.vocab, (10,), generator=g)
        mask = torch.ones(10, dtype=torch.long)
        ids[8:], mask[8:] = 0, 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def training_args(tmp_path: Path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=0.0,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Reference(transformers.TrainerCallback if transformers is not None else object):
    """Independent record of what each point should show: the weights at the start of update k
    (logged at global_step k) and the batches the model's forward saw during that update."""

    def __init__(self, model: nn.Module, build) -> None:
        self.build = build
        self.states = {0: self._state(model)}
        self.batches: dict[int, list[dict]] = {}
        self.step = None
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    @staticmethod
    def _state(model: nn.Module) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def model_at(self, step: int) -> nn.Module:
        model = self.build()
        model.load_state_dict(self.states[step])
        return model.eval()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.step = state.global_step + 1
        self.states[self.step] = self._state(model)
        self.batches[self.step] = []

    def _record(self, module, args, kwargs):
        if module.training and self.step is not None:
            self.batches[self.step].append({k: v.detach().clone() for k, v in kwargs.items() if k != "labels"})


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """4 updates of 2 micro-batches each, gradient checkpointing on, lr > 0, measured every 2 updates;
    the Trainer's TensorBoardCallback and HDITrainerCallback share one writer."""
    from transformers.integrations import TensorBoardCallback

    from hdi_monitor.integrations import HDITrainerCallback

    tmp = tmp_path_factory.mktemp("hf")
    model = tiny_bert()
    reference = Reference(model, tiny_bert)
    writer = SummaryWriter(str(tmp / "tb"))
    monitor = HDITrainerCallback(every_n_steps=2, log_images_every_n_steps=2, writer=writer, strict=True, detector=None)
    fields = transformers.TrainingArguments.__dataclass_fields__
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = training_args(tmp, learning_rate=5e-2, gradient_accumulation_steps=2, **{checkpointing: True})
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=MaskedDataset(),
        callbacks=[reference, TensorBoardCallback(writer), monitor],
    )
    trainer.train()
    writer.close()
    return model, monitor, reference, read_events(tmp / "tb")


LAYERS = ("bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention")


@needs_hf
def test_hf_scalars_show_the_weights_of_each_update(hf_run):
    _, monitor, reference, accs = hf_run
    assert [h["step"] for h in monitor.history] == [0, 2, 4]
    expected = {step: head_diversity(reference.model_at(step), projections=PROJECTIONS) for step in (0, 2, 4)}
    assert expected[0].layers[0].hdi["key"] != expected[4].layers[0].hdi["key"]  # training moved the weights
    for i, name in enumerate(LAYERS):
        for p in PROJECTIONS:
            series = scalar_series(accs, f"hdi/{p}/{name}")
            assert sorted(series) == [0, 2, 4]
            for step, value in series.items():
                assert value == pytest.approx(expected[step].layers[i].hdi[p], rel=1e-6, abs=1e-7)


@needs_hf
def test_hf_step_axis_matches_the_trainer_loss(hf_run):
    """The Trainer logs update k's loss at global_step k; it is computed on the weights that the HDI
    point at step k reads (`model_at(k)`, checked in the test above), so the two axes line up."""
    _, _, reference, accs = hf_run
    loss = scalar_series(accs, "train/loss")
    assert sorted(loss) == [1, 2, 3, 4]
    assert sorted(scalar_series(accs, f"hdi/key/{LAYERS[0]}")) == [0, 2, 4]
    expected = {}
    for step in (1, 2, 3, 4):
        model = reference.model_at(step)
        assert len(reference.batches[step]) == 2  # the update's two micro-batches
        with torch.no_grad():
            losses = [model(**b, labels=b["input_ids"]).loss for b in reference.batches[step]]
        expected[step] = float(torch.stack(losses).mean())
    # How the Trainer scales an accumulated loss depends on its version (transformers 5.24 logs the
    # sum of the micro-batch means here, 2x); one factor must map every update's own loss onto the
    # point logged at its step. The losses differ by up to 13% between updates, so a shifted axis
    # fails; the Trainer rounds logged values to 4 decimals (under 1e-5 relative here).
    factor = loss[1] / expected[1]
    assert factor == pytest.approx(1.0, rel=1e-4) or factor == pytest.approx(2.0, rel=1e-4)
    for step in (2, 3, 4):
        assert loss[step] == pytest.approx(factor * expected[step], rel=2e-5)


@needs_hf
def test_hf_head_outputs_of_every_micro_batch_once(hf_run):
    _, monitor, reference, accs = hf_run
    # 2 micro-batches x 4 sequences x 8 real tokens; gradient checkpointing recomputes each layer's
    # forward during backward, which must not be counted again
    assert monitor.tracker.last_token_counts == [64, 64]
    assert all(len(reference.batches[step]) == 2 for step in (1, 2, 3, 4))
    for name in LAYERS:
        assert sorted(scalar_series(accs, f"effective_heads/{name}")) == [2, 4]  # step 0: weights only


@needs_hf
def test_hf_effective_heads_equal_head_diversity_of_the_update(hf_run):
    _, _, reference, accs = hf_run
    for step in (2, 4):
        seen = reference.batches[step]
        assert len(seen) == 2
        ref = head_diversity(reference.model_at(step), inputs=seen)
        for i, name in enumerate(LAYERS):
            eff = scalar_series(accs, f"effective_heads/{name}")
            assert eff[step] == pytest.approx(ref.layers[i].effective_heads, rel=1e-4)


@needs_hf
def test_hf_images_and_hooks_removed(hf_run):
    model, _, _, accs = hf_run
    images = {t: acc.Images(t) for acc in accs for t in acc.Tags()["images"]}
    for p in PROJECTIONS:
        assert [e.step for e in images[f"overlap/{p}"]] == [0, 2, 4]
    from hdi_monitor.models import find_attention_layers

    watched = [model] + [m for layer in find_attention_layers(model) for m in layer.module.modules()]
    for module in watched:
        assert not module._forward_hooks, module
    assert len(model._forward_pre_hooks) == 1  # only the Reference callback's own hook is left


@needs_hf
def test_hf_gpt2_log_dir_and_every_step(tmp_path):
    from hdi_monitor.integrations import HDITrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    monitor = HDITrainerCallback(
        every_n_steps=1,
        projections=("key",),
        activations=False,
        measure_at_start=False,
        log_dir=tmp_path / "hdi",
        strict=True,
        detector=None,
    )
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path, max_steps=3), train_dataset=MaskedDataset(), callbacks=[monitor]
    )
    trainer.train()
    accs = read_events(tmp_path / "hdi")
    reference = head_diversity(model)  # lr = 0: every update sees these weights
    for layer in reference.layers:
        series = scalar_series(accs, f"hdi/key/{layer.name}")
        assert sorted(series) == [1, 2, 3]
        assert all(v == pytest.approx(layer.hdi["key"], rel=1e-6) for v in series.values())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@needs_hf
def test_hf_default_tensorboard_report_is_one_run_with_the_loss(tmp_path):
    """Issue 24: with the Trainer's ``report_to="tensorboard"`` and no writer given, the loss and the
    HDI are written by one writer into one run (one event file in one folder), on one step axis."""
    from hdi_monitor.integrations import HDITrainerCallback

    model = tiny_bert()
    monitor = HDITrainerCallback(every_n_steps=2, projections=("key",), activations=False, detector=None, strict=True)
    args = training_args(tmp_path, max_steps=4, report_to="tensorboard")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=MaskedDataset(), callbacks=[monitor])
    trainer.train()
    files = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer, one run
    accs = read_events(files[0].parent)
    assert sorted(scalar_series(accs, "train/loss")) == [1, 2, 3, 4]
    reference = head_diversity(model)  # lr = 0: every update sees these weights
    for layer in reference.layers:
        series = scalar_series(accs, f"hdi/key/{layer.name}")
        assert sorted(series) == [0, 2, 4]
        assert all(v == pytest.approx(layer.hdi["key"], rel=1e-6) for v in series.values())
    # a second train() on the same Trainer gets the Trainer's new writer, in the same run folder
    trainer.train()
    assert {f.parent for f in (tmp_path / "out").rglob("events.out.tfevents.*")} == {files[0].parent}


@needs_hf
def test_hf_callback_arguments_are_checked(tmp_path):
    from hdi_monitor.integrations import HDITrainerCallback

    with pytest.raises(ValueError, match="every_n_steps"):
        HDITrainerCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="projection"):
        HDITrainerCallback(projections=("keys",))
    with pytest.raises(ValueError, match="writer or log_dir"):
        HDITrainerCallback(writer=SummaryWriter(str(tmp_path)), log_dir=tmp_path)
    with pytest.raises(TypeError, match="SummaryWriter"):
        HDITrainerCallback(writer="runs")


def test_hf_callback_without_transformers_says_how_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "hdi_monitor.integrations.hf_trainer", raising=False)
    import hdi_monitor.integrations as integrations

    monkeypatch.delitem(integrations.__dict__, "HDITrainerCallback", raising=False)
    with pytest.raises(ImportError, match=r"from a checkout of hdi-monitor, pip install -e '\.\[hf\]'"):
        integrations.HDITrainerCallback  # noqa: B018
    assert integrations.HDITracker is HDITracker  # the plain-loop API needs no transformers


# -------------------------------------------------------------------------------------- examples


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_plain_loop_runs(tmp_path, capsys):
    example = _load_example("plain_loop")
    tracker = example.main(
        [
            "--out",
            str(tmp_path),
            "--steps",
            "3",
            "--every",
            "2",
            "--images-every",
            "2",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--layers",
            "1",
        ]
    )
    assert [h["step"] for h in tracker.history] == [0, 2]
    accs = read_events(tmp_path)
    assert sorted(scalar_series(accs, "hdi/key/encoder.layers.0.self_attn")) == [0, 2]
    assert sorted(scalar_series(accs, "loss")) == [0, 1, 2]
    assert "tensorboard --logdir" in capsys.readouterr().out


@needs_hf
def test_example_hf_trainer_runs(tmp_path, capsys):
    example = _load_example("hf_trainer")
    monitor = example.main(
        ["--out", str(tmp_path), "--steps", "4", "--every", "2", "--images-every", "2", "--grad-accum", "2"]
    )
    assert [h["step"] for h in monitor.history] == [0, 2, 4]
    runs = {f.parent for f in tmp_path.rglob("events.out.tfevents.*")}
    assert len(runs) == 1  # one TensorBoard run: the Trainer's loss and the HDI
    accs = read_events(runs.pop())
    assert sorted(scalar_series(accs, "hdi/key/transformer.h.0.attn")) == [0, 2, 4]
    assert sorted(scalar_series(accs, "train/loss")) == [2, 4]  # logging_steps=every: the same steps


@pytest.mark.slow
@needs_hf
@pytest.mark.filterwarnings("ignore::hdi_monitor.DiversityWarning")  # the events this test counts
def test_hf_resume_from_checkpoint_restores_history_and_detector(tmp_path):
    """Item 4 (issue 12): HDITrainerCallback is an ExportableState; resume_from_checkpoint brings back
    its history, events and detector, so the resumed run equals an uninterrupted one."""
    from hdi_monitor.integrations import HDITrainerCallback

    def callback():
        return HDITrainerCallback(
            every_n_steps=1,
            projections=("key",),
            max_tokens=16,
            log_dir=str(tmp_path / "tb"),
            detector=SaturationDetector(patience=3, warmup_steps=0),
            warn_on=("saturation",),
            log_images_every_n_steps=0,
            strict=True,
        )

    def run(out: str, cb, resume=None, max_steps=6):
        args = training_args(tmp_path / out, max_steps=max_steps, save_strategy="steps", save_steps=3)
        trainer = transformers.Trainer(model=tiny_bert(), args=args, train_dataset=MaskedDataset(), callbacks=[cb])
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = callback()
    with pytest.warns(DiversityWarning, match="saturation"):
        run("whole", whole)
    assert [h["step"] for h in whole.history] == [0, 1, 2, 3, 4, 5, 6]
    assert any(e.kind == "saturation" for e in whole.tracker.events)  # lr = 0: flat, fires at step 3

    with pytest.warns(DiversityWarning, match="saturation"):
        run("split", callback(), max_steps=6)
    checkpoint = tmp_path / "split" / "out" / "checkpoint-3"
    assert (checkpoint / "trainer_state.json").is_file()
    resumed = callback()
    run("split", resumed, resume=str(checkpoint))
    assert resumed.history == whole.history
    assert [e.to_dict() for e in resumed.tracker.events] == [e.to_dict() for e in whole.tracker.events]
    assert resumed.tracker.detector.state_dict() == whole.tracker.detector.state_dict()

    fresh = callback()  # a new Trainer without a checkpoint starts afresh
    run("fresh", fresh, max_steps=2)
    assert [h["step"] for h in fresh.history] == [0, 1, 2]
