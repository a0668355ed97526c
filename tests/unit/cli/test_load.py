"""`hdi-monitor report CKPT --module M --inputs F` on a LightningModule without ``forward()``
(issue 31): the inputs run through the network its ``training_step`` calls, found as the
submodule holding every attention layer, or named with ``--call``; never an internal error."""

from __future__ import annotations

import json
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch

from hdi_monitor import head_diversity
from hdi_monitor.cli import main

MODULE = textwrap.dedent(
    """
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 16)
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def forward(self, tokens):
            return self.encoder(self.embed(tokens))

    class NoForward(pl.LightningModule):  # trains self.net in training_step; no forward() of its own
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.head = nn.Linear(16, 20)

        def training_step(self, batch, batch_idx):
            return self.head(self.net(batch)).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class TwoNets(NoForward):  # two networks each holding attention: which one runs the inputs is not known
        def __init__(self):
            super().__init__()
            self.other = Net()
    """
)


@pytest.fixture
def ckpts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nofwd.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("nofwd", None)
    import nofwd

    paths = {}
    for name in ("NoForward", "TwoNets"):
        torch.manual_seed(0)
        module = getattr(nofwd, name)()
        trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.strategy.connect(module)
        path = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        paths[name] = (path, module)
    tokens = torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    return paths, tokens, tmp_path


def test_a_lightning_module_without_forward_is_measured_through_its_network(ckpts, capsys):
    paths, tokens, tmp = ckpts
    path, module = paths["NoForward"]
    code = main(["report", str(path), "--module", "nofwd.NoForward", "--inputs", str(tmp / "tokens.pt"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = json.loads(out)
    # the reference: the same network's own report on the same tokens (one-shot, the module's net called)
    reference = head_diversity(module.net, inputs=tokens).to_dict()
    assert [la["name"] for la in got["layers"]] == [f"net.{la['name']}" for la in reference["layers"]]
    for g, r in zip(got["layers"], reference["layers"], strict=True):
        assert g["num_tokens"] == r["num_tokens"] == 21
        assert g["effective_heads"] == pytest.approx(r["effective_heads"], rel=1e-9)
    # the same through --call
    code = main(
        [
            "report",
            str(path),
            "--module",
            "nofwd.NoForward",
            "--inputs",
            str(tmp / "tokens.pt"),
            "--call",
            "net",
            "--json",
        ]
    )
    assert code == 0 and json.loads(capsys.readouterr().out)["layers"][0]["num_tokens"] == 21


def test_an_ambiguous_module_gets_a_one_line_error_naming_the_option(ckpts, capsys):
    paths, _, tmp = ckpts
    path, _ = paths["TwoNets"]
    code = main(["report", str(path), "--module", "nofwd.TwoNets", "--inputs", str(tmp / "tokens.pt")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "internal error" not in err
    assert "has no forward()" in lines[0] and "pass --call NAME" in lines[0] and "net, head, other" in lines[0]
    code = main(
        ["report", str(path), "--module", "nofwd.TwoNets", "--inputs", str(tmp / "tokens.pt"), "--call", "nope"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--call 'nope': TwoNets has no submodule of that name" in err
