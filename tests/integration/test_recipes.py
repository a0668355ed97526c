"""The Lightning recipes of docs/integrations/lightning.md (keep the best weights, stop a run that
diverges) run as written on the demo model, shortened only by exact substitutions: on a healthy
run the kept checkpoint is the one with the lowest validation loss (checked by recomputing that
loss from the checkpoint's own weights) and training is not stopped early; on a run made to
diverge (a high learning rate, no QK-norm) `EarlyStopping` stops it (issue 31)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from hdi_monitor.contrib.demo import CharDataModule, CharLM

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "integrations" / "lightning.md"

#: The key the divergence recipe watches: one constant here and in the page's recipe.
DIVERGENCE_SIGNAL = "val_loss"

# a run may flag redundant heads on the way (not what these tests are about)
pytestmark = pytest.mark.filterwarnings("ignore::hdi_monitor.DiversityWarning")

STEPS, VAL_EVERY, VAL_BATCHES = 120, 20, 4
DATA_KW = {"train_samples": 4000, "val_samples": 64}
DATA = "CharDataModule(" + ", ".join(f"{k}={v}" for k, v in DATA_KW.items()) + ")"


def _recipe(marker: str) -> str:
    """The page's one Python block that contains ``marker``."""
    from integration.test_docs import extract_blocks

    found = [b.code for b in extract_blocks(PAGE) if b.lang == "python" and marker in b.code]
    assert len(found) == 1, f"{PAGE.name}: expected one recipe block with {marker!r}, found {len(found)}"
    return found[0]


def _shortened(code: str, lr: float, callbacks: str) -> str:
    """The recipe with exact substitutions: the demo model small, the run short, a recorder added."""
    subs = [
        ("CharLM()", f"CharLM(d_model=32, num_heads=4, num_layers=2, lr={lr!r})"),
        ("CharDataModule()", DATA),
        ("max_steps=1200", f"max_steps={STEPS}, enable_progress_bar=False, limit_val_batches={VAL_BATCHES}"),
        ("val_check_interval=200", f"val_check_interval={VAL_EVERY}"),
        ("every_n_steps=25", "every_n_steps=10, log_images_every_n_steps=0"),
        (callbacks, callbacks[:-1] + ", recorder]"),
    ]
    for old, new in subs:
        assert code.count(old) == 1, f"the recipe no longer contains {old!r} once"
        code = code.replace(old, new)
    return code


class _ValRecorder(Callback):
    """Every validation's loss and step, read as they happen (the reference the checkpoint is held to)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["val_loss"])


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the model is tiny, and on a busy 2-core machine two threads spin-wait
    (measured: 37 s of CPU for one 120-step run on two threads, 3 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, _ValRecorder]:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    pl.seed_everything(0, verbose=False)
    recorder = _ValRecorder()
    namespace: dict = {"__name__": "__recipe__", "recorder": recorder}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the docs' own recipe
    return namespace, recorder


def _val_loss_of(weights: CharLM) -> float:
    """The validation loss of ``weights`` on the batches Lightning validated on, computed directly."""
    dm = CharDataModule(**DATA_KW)  # the same data module the recipe ran on
    dm.setup("fit")
    losses = []
    weights.eval()
    with torch.no_grad():
        for i, batch in enumerate(dm.val_dataloader()):
            if i == VAL_BATCHES:
                break
            losses.append(float(weights._loss(batch)))
    return sum(losses) / len(losses)  # equal batch sizes: Lightning's batch-weighted mean is this


@pytest.mark.parametrize("lr", [3e-3, 0.1], ids=["learning", "plateau"])
def test_checkpoint_recipe_keeps_the_best_validation_weights(lr, tmp_path, monkeypatch):
    ns, recorder = _run(_shortened(_recipe("ModelCheckpoint("), lr, "callbacks=[monitor, best]"), tmp_path, monkeypatch)
    trainer, best, monitor = ns["trainer"], ns["best"], ns["monitor"]
    assert trainer.global_step == STEPS  # not stopped
    assert sorted(recorder.losses) == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
    best_step = min(recorder.losses, key=recorder.losses.__getitem__)
    ckpt = torch.load(best.best_model_path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == best_step
    # independent of the checkpoint's bookkeeping: its weights give the lowest validation loss seen
    kept = CharLM.load_from_checkpoint(best.best_model_path, map_location="cpu")
    assert _val_loss_of(kept) == pytest.approx(recorder.losses[best_step], rel=1e-5)
    assert _val_loss_of(kept) == pytest.approx(min(recorder.losses.values()), rel=1e-5)
    # the HDI was logged beside the loss
    assert [h["step"] for h in monitor.history] == list(range(0, STEPS, 10))
    assert all(0.0 < h["hdi/key/mean"] <= 1.0 for h in monitor.history)
    if lr == 0.1:  # on the plateau the best weights are not the last ones: the choice is real
        assert best_step < STEPS


def test_divergence_recipe_lets_a_healthy_run_finish(tmp_path, monkeypatch):
    code = _recipe("EarlyStopping(")
    assert f'DIVERGENCE_SIGNAL = "{DIVERGENCE_SIGNAL}"' in code
    ns, recorder = _run(_shortened(code, 3e-3, "callbacks=[monitor, stop]"), tmp_path, monkeypatch)
    trainer, stop = ns["trainer"], ns["stop"]
    assert trainer.global_step == STEPS and stop.stopped_epoch == 0 and stop.wait_count == 0
    assert max(recorder.losses.values()) < math.log(128)  # far from the threshold, 2 ln 128


def test_divergence_recipe_stops_a_diverging_run(tmp_path, monkeypatch):
    """Learning rate 1.0 on the demo model (pre-norm, no QK-norm): by the first validation the
    validation loss is far above the threshold (twice a uniform guess's ln 128), and the recipe
    stops the run there."""
    ns, recorder = _run(_shortened(_recipe("EarlyStopping("), 1.0, "callbacks=[monitor, stop]"), tmp_path, monkeypatch)
    trainer, monitor = ns["trainer"], ns["monitor"]
    first = min(recorder.losses)
    assert not math.isfinite(recorder.losses[first]) or recorder.losses[first] > 2 * math.log(128)
    assert trainer.should_stop and trainer.global_step == first < STEPS
    assert list(recorder.losses) == [first]  # stopped at the first validation past the threshold
    # the head signal that rose first: the logit bound, more than a hundredfold by the first measurement
    bounds = [h["logit_bound/max"] for h in monitor.history]
    assert bounds[1] > 100 * bounds[0]
