"""A checkpoint never decides where the Hugging Face callback writes (issue 30, item 11).

With ``TrainingArguments(restore_callback_states_from_checkpoint=True)`` transformers rebuilds each
stateful callback from the ``args`` saved in ``trainer_state.json`` (``type(cb)(**args)``) and then
sets every saved ``attributes`` entry on it. A ``log_dir`` written into that file (by hand, or by a
checkpoint from someone else) was honoured: the resumed run wrote its event files there. The
reference is the file system: every file the resumed run writes is listed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hdi_monitor.exceptions import MonitoringWarning  # noqa: E402
from hdi_monitor.integrations import HDITrainerCallback  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, 50, (10,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(10, dtype=torch.long), "labels": ids.clone()}


def _train(out: Path, callback: HDITrainerCallback, max_steps: int, resume: Path | None = None, **extra):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
        use_cpu=True, logging_steps=1, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, **extra,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(cfg)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def _files(root: Path) -> set[Path]:
    return {Path(d) / f for d, _, names in os.walk(root) for f in names}


def _callback(log_dir: Path) -> HDITrainerCallback:
    return HDITrainerCallback(every_n_steps=1, projections=("key",), log_dir=str(log_dir), log_images_every_n_steps=0)


@pytest.mark.parametrize("tamper", ["args", "attributes"])
def test_a_checkpoint_cannot_choose_where_the_callback_writes(tmp_path, tamper):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _train(run / "out", _callback(run / "tb"), max_steps=2)
    state_file = run / "out" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    saved = state["stateful_callbacks"]["HDITrainerCallback"]
    assert "log_dir" not in saved["args"]  # a checkpoint holds no path of the callback's
    if tamper == "args":
        saved["args"]["log_dir"] = str(elsewhere)
    else:  # transformers sets every saved attribute on the rebuilt callback
        saved["attributes"].update({"log_dir": str(elsewhere), "writer": str(elsewhere), "_own_writer": None})
    state_file.write_text(json.dumps(state))
    before = _files(tmp_path)

    with pytest.warns(MonitoringWarning, match="log_dir") as caught:
        trainer = _train(
            run / "out",
            _callback(run / "tb"),
            max_steps=4,
            resume=run / "out" / "checkpoint-2",
            restore_callback_states_from_checkpoint=True,
        )
    said = [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]
    assert len(said) == 1 and "never where files go" in said[0]  # the tampering is named, once
    written = _files(tmp_path) - before
    assert not elsewhere.exists()
    assert written and all(run in f.parents for f in written), sorted(map(str, written))
    assert any((run / "tb") in f.parents and f.name.startswith("events.out.tfevents") for f in written)
    # the monitor's state is restored all the same: the measurements before the checkpoint are kept
    monitor = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HDITrainerCallback))
    assert [row["step"] for row in monitor.history] == [0, 1, 2, 3, 4]
