"""``hdi-monitor allocate --runs``: the allocation advisor fitted from runs logged with the monitor.

The test logs its own sweep: tiny causal transformers (``nn.TransformerEncoder``, width 16, every
split H x d_k) trained a few steps with `HDITracker` writing to a ``SummaryWriter`` in ``tmp_path``,
each run's N in TensorBoard's hparams plugin. The held-out metric each run logs (``val_loss``) is
drawn from a known allocation law (a few steps of training say nothing about allocation), so the
references are independent of the reader: the numbers the test itself logged, fitted through the
Python API, and the known law's best split. TensorBoard stores scalars as float32, so the test
logs float32 numbers and fits exactly those.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from hdi_monitor import HDITracker
from hdi_monitor.cli import main
from hdi_monitor.contrib.allocation import AllocationLaw, AllocationRun, fit_allocation_law, recommend_allocation

pytest.importorskip("scipy")
pytest.importorskip("tensorboard")

D = 16
SIZES = (1e3, 1e4, 1e5)
TRUE_LAW = AllocationLaw(sigma2=0.5, a=1.0, alpha=1.0, c=2.0, beta=1.0, rho=0.2)


class _TinyLM(nn.Module):
    def __init__(self, width: int, heads: int, vocab: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(x), mask=self.causal, is_causal=True) @ self.embed.weight.T


def _log_run(path, heads: int, width: int, n: float | None, loss: float, *, seed: int = 0, steps: int = 3) -> dict:
    """Train a tiny model a few steps with the monitor, log ``val_loss`` and N; return what was logged."""
    torch.manual_seed(seed)
    model = _TinyLM(width, heads)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = SummaryWriter(str(path))
    tracker = HDITracker(model, writer=writer, every_n_steps=1, log_images_every_n_steps=0)
    x = torch.randint(0, 16, (4, 8))
    try:
        for _ in range(steps):
            with tracker.capture(x):
                out = model(x)
            nn.functional.cross_entropy(out.reshape(-1, 16), x.roll(-1, 1).reshape(-1)).backward()
            tracker.step()
            opt.step()
            opt.zero_grad()
    finally:
        tracker.close()
    if n is not None:
        exp, ssi, sei = hparams({"train_tokens": n, "heads": heads}, {})
        for summary in (exp, ssi, sei):
            assert writer.file_writer is not None
            writer.file_writer.add_summary(summary)
    value = float(np.float32(loss))  # what TensorBoard keeps
    writer.add_scalar("val_loss", value, steps)
    writer.close()
    corr = tracker.history[-1].get("head_correlation/mean") if heads > 1 else None
    return {
        "H": heads,
        "d_k": width // heads,
        "N": n,
        "loss": value,
        "corr": None if corr is None else float(np.float32(corr)),
    }


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(0)
    logged = []
    for n in SIZES:
        for heads in (1, 2, 4, 8, 16):
            d = D // heads
            loss = TRUE_LAW.predict(heads, d, n) * math.exp(0.01 * rng.standard_normal())
            logged.append(_log_run(root / f"N{n:g}_H{heads}", heads, D, n, loss))
    return root, logged


def _cli_json(tmp_path, capsys, argv):
    out = tmp_path / "rec.json"
    rc = main(["allocate", *argv, "--json", str(out), "--force"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(out.read_text()), captured.out


def test_runs_recommendation_equals_the_python_api_fit(sweep, tmp_path, capsys):
    root, logged = sweep
    got, text = _cli_json(tmp_path, capsys, ["--runs", str(root), "--metric", "val_loss", "--out", str(tmp_path)])
    # the same numbers through the Python API: the split, N, loss and correlation the test logged
    runs = [AllocationRun(r["H"], r["d_k"], r["N"], r["loss"], r["corr"]) for r in logged]
    fit = fit_allocation_law(runs)
    assert fit.rho_source == "measured"
    rec = recommend_allocation(D, max(SIZES), fit.law, min_head_dim=1, max_head_dim=D)
    assert (got["recommendation"]["num_heads"], got["recommendation"]["head_dim"]) == (rec.num_heads, rec.head_dim)
    assert got["recommendation"]["predicted_loss"] == pytest.approx(rec.predicted_loss, rel=1e-6)
    assert got["law"] == pytest.approx(fit.law.as_dict(), rel=1e-6, abs=1e-9)
    read = sorted((r["num_heads"], r["n_train"], r["loss"], r["correlation"]) for r in got["runs"])
    assert read == sorted((r["H"], r["N"], r["loss"], r["corr"]) for r in logged)
    assert len(got["fit"]["residuals"]) == 15
    assert f"Recommended: H={rec.num_heads} heads x d_k={rec.head_dim}" in text
    assert "Residuals (ln predicted - ln measured):" in text
    assert (tmp_path / "allocation.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_fit_finds_the_generating_laws_best_split(sweep, tmp_path, capsys):
    root, logged = sweep
    # the losses came from TRUE_LAW with its own rho, so fit rho rather than use the measured one
    got, _ = _cli_json(tmp_path, capsys, ["--runs", str(root), "--metric", "val_loss", "--no-correlation"])
    best = recommend_allocation(D, max(SIZES), TRUE_LAW, min_head_dim=1, max_head_dim=D)
    assert (got["recommendation"]["num_heads"], got["recommendation"]["head_dim"]) == (best.num_heads, best.head_dim)
    assert all(r["correlation"] is not None for r in got["runs"] if r["num_heads"] > 1)  # read, but not used
    assert got["fit"]["rho_source"] == "fitted"


def test_tokens_argument_replaces_hparams(tmp_path, capsys):
    for heads in (2, 4):
        _log_run(tmp_path / f"r{heads}", heads, 8, None, 1.0 + heads / 10)
    got_err = main(["allocate", "--runs", str(tmp_path), "--metric", "val_loss"])
    assert got_err == 2 and "N unknown" in capsys.readouterr().err
    # two runs cannot determine the law, but the reader got N from --tokens: the fit says so
    rc = main(["allocate", "--runs", str(tmp_path), "--metric", "val_loss", "--tokens", "5000"])
    err = capsys.readouterr().err
    assert rc == 2 and "2 runs cannot determine" in err and len(err.strip().splitlines()) == 1
    # Lightning's hparams.yaml beside the event files gives N too
    from hdi_monitor.contrib.allocation.runs import read_logged_run

    (tmp_path / "r2" / "hparams.yaml").write_text("train_tokens: 1234\nlr: 0.003\n")
    run = read_logged_run(tmp_path / "r2", "val_loss")
    assert (run.num_heads, run.head_dim, run.n_train, run.loss) == (2, 4, 1234.0, float(np.float32(1.2)))


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("one_split", "have the same split H=4 x d_k=4"),
        ("one_width", "every run has head width d_k=4"),
        ("missing_metric", "no scalar 'test_loss' (--metric)"),
        ("not_monitored", "no 'hdi_levels' text"),
        ("empty", "holds no TensorBoard event files"),
    ],
)
def test_bad_sweeps_get_one_line_and_exit_2(tmp_path, capsys, case, match):
    metric = "val_loss"
    if case == "one_split":
        for seed in range(3):
            _log_run(tmp_path / f"s{seed}", 4, 16, 1e4, 1.0 + seed / 10, seed=seed)
    elif case == "one_width":
        for heads in (2, 4):
            _log_run(tmp_path / f"h{heads}", heads, 4 * heads, 1e4, 1.0)
    elif case == "missing_metric":
        for heads in (2, 4):
            _log_run(tmp_path / f"h{heads}", heads, 16, 1e4, 1.0)
        metric = "test_loss"
    elif case == "not_monitored":
        with SummaryWriter(str(tmp_path / "plain")) as w:
            w.add_scalar("val_loss", 1.0, 0)
    else:
        (tmp_path / "nothing").mkdir()
    rc = main(["allocate", "--runs", str(tmp_path), "--metric", metric])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("hdi-monitor allocate: error:") and match in err, err
    assert len(err.strip().splitlines()) == 1


def test_runs_needs_metric_and_budget_needs_runs(tmp_path, capsys):
    assert main(["allocate", "--runs", str(tmp_path)]) == 2
    assert "--runs needs --metric" in capsys.readouterr().err
    assert main(["allocate", "--train-size", "100"]) == 2
    assert "--budget required" in capsys.readouterr().err
    assert main(["allocate", "--budget", "64", "--train-size", "100", "--metric", "x"]) == 2
    assert "--metric only apply with --runs" in capsys.readouterr().err
