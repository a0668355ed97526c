"""``HDITrainerCallback`` with ``TrainingArguments(torch_compile=True)``: the compiled graph stays whole.

The Trainer (through accelerate) trains ``torch.compile(model)`` and hands callbacks the uncompiled
model. The callback must never put a hook inside the compiled region: it takes each measured
micro-batch with a pre-hook on the compiled wrapper and runs a side forward of the uncompiled model
(`hdi_monitor.monitor.compiled`). Checked against the run without the callback (Dynamo's graph and
graph-break counters, ``torch._dynamo.utils.counters``, and every weight bit for bit) and against
``head_diversity`` of the same weights with ``inputs=`` the same batch (recorded by the data
collator, outside the compiled code). ``backend="aot_eager"`` tests the same guards as inductor,
fast on CPU. GPT-2 keeps its dropout (0.1): the side forward runs in eval mode and draws from no
generator, or the trained weights would differ.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hdi_monitor import head_diversity

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

PROJECTIONS = ("query", "key", "value", "output")
STEPS, EVERY, ACCUMULATE = 5, 2, 2  # 2 micro-batches per update
MEASURED = [0, 2, 4]  # 0: the initial weights (no forward); 2, 4: weights and head outputs


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Sequences of 12 tokens, the last 3 of them padding."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 50, (12,), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(12, dtype=torch.long)
        ids[9:], mask[9:] = 0, 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


class Recorder(transformers.TrainerCallback):
    """The weights at the start of each update (``on_step_begin``) and, as the collator, every
    batch in the order the Trainer trains on them; no hook on the model."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.batches: list[dict[str, torch.Tensor]] = []

    def collate(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = transformers.default_data_collator(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(tmp_path: Path, monitor=None, steps: int = STEPS, accumulate: int = ACCUMULATE):
    """Train ``steps`` updates of ``accumulate`` micro-batches (lr > 0, dropout on) of a compiled model; return the model, the trainer, the recorder and
    Dynamo's counters of this run."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_gpt2()
    recorder = Recorder()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    callbacks = [recorder] + ([monitor] if monitor is not None else [])
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), data_collator=recorder.collate, callbacks=callbacks
    )
    try:
        trainer.train()
        counters = {
            "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "graph_break": dict(torch._dynamo.utils.counters["graph_break"]),
        }
    finally:
        torch._dynamo.reset()
    return model, trainer, recorder, counters


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hdi_monitor.integrations import HDITrainerCallback

    plain = train(tmp_path_factory.mktemp("plain"))
    monitor = HDITrainerCallback(
        every_n_steps=EVERY,
        log_images_every_n_steps=0,
        max_tokens=None,
        detector=None,
        strict=True,
        log_dir=tmp_path_factory.mktemp("tb"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = train(tmp_path_factory.mktemp("watched"), monitor)
    return plain, watched, monitor, caught


def test_trainer_compiles_the_model(runs):
    """The premise: the Trainer trains a torch.compile wrapper of the model the callback gets."""
    from torch._dynamo.eval_frame import OptimizedModule

    (model, trainer, _, counters), _, _, _ = runs
    assert isinstance(trainer.model_wrapped, OptimizedModule)
    assert trainer.model_wrapped._orig_mod is model
    assert counters["unique_graphs"] >= 1


def test_compiled_graphs_unchanged_by_the_callback(runs):
    """Same number of graphs and the same graph breaks, measured steps included."""
    (_, _, _, plain), (_, _, _, watched), monitor, _ = runs
    assert [int(row["step"]) for row in monitor.history] == MEASURED  # steps 2 and 4 were measured
    assert watched == plain


def test_training_bit_identical_with_and_without_the_callback(runs):
    (plain, *_), (watched, *_), _, _ = runs
    before = tiny_gpt2().state_dict()
    after = watched.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it did train
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, after[name]), name


def test_measurements_equal_head_diversity_of_the_update(runs):
    """Step k: the weights at the start of update k, and the head outputs of update k's micro-batches
    through them (eval mode, as ``head_diversity(inputs=...)`` runs)."""
    _, (_, _, recorder, _), monitor, caught = runs
    assert not [w for w in caught if "hdi-monitor" in str(w.message)], [str(w.message) for w in caught]
    rows = {int(row["step"]): row for row in monitor.history}
    for step in (2, 4):
        model = tiny_gpt2()
        model.load_state_dict(recorder.states[step])
        first = (step - 1) * ACCUMULATE  # update k trains on micro-batches (k-1)A .. kA-1
        batches = [{k: v for k, v in b.items() if k != "labels"} for b in recorder.batches[first : first + ACCUMULATE]]
        weights = head_diversity(model, projections=PROJECTIONS)
        acts = head_diversity(model, inputs=batches)  # every micro-batch of the update, once
        for layer, act in zip(weights.layers, acts.layers, strict=True):
            for projection in PROJECTIONS:
                assert rows[step][f"hdi/{projection}/{layer.name}"] == pytest.approx(layer.hdi[projection], rel=1e-6)
            assert rows[step][f"effective_heads/{layer.name}"] == pytest.approx(act.effective_heads, rel=1e-5)
        # one micro-batch alone gives other statistics: the check above can fail
        other = head_diversity(model, inputs=batches[:1])
        assert other.layers[0].effective_heads != pytest.approx(acts.layers[0].effective_heads, rel=1e-5)


def test_no_hook_left_and_no_hook_while_training(runs):
    _, (model, trainer, _, _), _, _ = runs
    for module in (trainer.model_wrapped, *model.modules()):
        assert not module._forward_hooks and not module._forward_pre_hooks, module


def test_first_compiled_call_measured(tmp_path):
    """every_n_steps=1: the wrapper's pre-hook is there when Dynamo first traces, and every update
    runs a side forward; graphs, breaks and weights are still those of the run without the callback."""
    from hdi_monitor.integrations import HDITrainerCallback

    plain = train(tmp_path / "plain", steps=2, accumulate=1)
    monitor = HDITrainerCallback(
        every_n_steps=1, log_images_every_n_steps=0, detector=None, strict=True, log_dir=tmp_path / "tb"
    )
    watched = train(tmp_path / "watched", monitor, steps=2, accumulate=1)
    assert [int(row["step"]) for row in monitor.history] == [0, 1, 2]
    assert all(
        torch.isfinite(torch.tensor(row[f"effective_heads/transformer.h.{i}.attn"]))
        for row in monitor.history
        if row["step"] > 0
        for i in range(2)
    )
    assert watched[3] == plain[3]
    after = watched[0].state_dict()
    for name, tensor in plain[0].state_dict().items():
        assert torch.equal(tensor, after[name]), name


def test_model_compiled_before_the_trainer(tmp_path):
    """``Trainer(torch.compile(model))``: the callback gets the wrapper itself and hooks nothing
    inside it; graphs, breaks and weights equal the run without the callback."""
    from hdi_monitor.integrations import HDITrainerCallback

    def run(monitor):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = tiny_gpt2()
        compiled = torch.compile(model, backend="aot_eager")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,  # the wrapper's forward takes (*args, **kwargs)
        )
        callbacks = [monitor] if monitor is not None else []
        try:
            transformers.Trainer(model=compiled, args=args, train_dataset=Tokens(), callbacks=callbacks).train()
            counters = (
                torch._dynamo.utils.counters["stats"]["unique_graphs"],
                dict(torch._dynamo.utils.counters["graph_break"]),
            )
        finally:
            torch._dynamo.reset()
        return model, compiled, counters

    plain, _, plain_counters = run(None)
    monitor = HDITrainerCallback(
        every_n_steps=1, log_images_every_n_steps=0, detector=None, strict=True, log_dir=tmp_path / "tb"
    )
    watched, compiled, counters = run(monitor)
    assert counters == plain_counters and counters[0] >= 1
    after = watched.state_dict()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, after[name]), name
    rows = list(monitor.history)
    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    for row in rows[1:]:  # torch.compile(m) puts the model under `_orig_mod`, and so its tags
        for i in range(2):
            assert torch.isfinite(torch.tensor(row[f"effective_heads/_orig_mod.transformer.h.{i}.attn"]))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in compiled.modules())


def test_compiled_trainer_not_found_measures_weights_only_and_says_so(tmp_path):
    """``torch_compile=True`` but no Trainer on the stack to take the compiled wrapper from (the
    callback driven by hand): no hook on the model, activation statistics off, one warning."""
    from transformers.trainer_callback import TrainerControl, TrainerState

    from hdi_monitor.exceptions import MonitoringWarning
    from hdi_monitor.integrations import HDITrainerCallback

    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile=True, torch_compile_backend="aot_eager"
    )
    monitor = HDITrainerCallback(every_n_steps=1, detector=None, strict=True, log_dir=tmp_path / "tb")
    with pytest.warns(MonitoringWarning, match="torch_compile is set but the Trainer's compiled model was not found"):
        monitor.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    try:
        assert monitor.tracker is not None and not monitor.tracker.activations
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        assert [int(row["step"]) for row in monitor.history] == [0]  # the weights at the start
        assert "hdi/key/transformer.h.0.attn" in monitor.history[-1]
    finally:
        monitor.close()
