"""``HDIMonitor``: the Lightning callback, a thin shell over `HDITracker`.

Step axis: a measurement of optimizer step ``s`` is logged at ``s`` =
``trainer.fit_loop.epoch_loop._batches_that_stepped`` as seen in ``on_train_batch_start``, the same
step that ``self.log`` gives that batch's training loss. The weights are measured in
``on_train_batch_start`` (the weights that produce that loss), head outputs are captured during
that batch's forward pass (hooks come off in ``on_before_backward``, so a forward recomputed by
gradient checkpointing is not counted twice), and results are computed and written in
``on_before_optimizer_step``, once backward is done (or in ``on_train_batch_end`` when no
optimizer step happened). The head-output statistics use the ``W_O`` of the forward pass, read
when the head outputs are captured, so the optimizer step cannot change them.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from hdi_monitor.integrations._settings import MonitorSettings
from hdi_monitor.integrations.loggers import sinks_for_loggers
from hdi_monitor.measure.measurement import Series
from hdi_monitor.models.sharding import contains_fsdp1
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.tracker import HDITracker

__all__ = ["HDIMonitor", "published_metrics"]


def published_metrics(series: Mapping[Series, float]) -> dict[str, float]:
    """The scalars of a measurement (`Measurement.series`) that `HDIMonitor` also puts in
    ``trainer.callback_metrics``, under their logged names, chosen by typed key (no tag is
    parsed): the model-mean HDI per projection (``hdi/<projection>/mean``), the mean effective heads
    (``effective_heads/mean``) and the event counts (``diversity_events/<kind>``). Non-finite
    values are left out."""
    out: dict[str, float] = {}
    for key, value in series.items():
        wanted = (
            (key.family == "hdi" and key.layer is None and key.stat == "mean")
            or (key.family == "effective_heads" and key.layer is None and key.stat == "mean")
            or key.family == "diversity_events"
        )
        if wanted and math.isfinite(float(value)):
            out[key.tag] = float(value)
    return out


class HDIMonitor(MonitorSettings, Callback):
    """Measure attention-head diversity every ``every_n_steps`` optimizer steps and log it.

    Quick start:

    ```python
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import EarlyStopping
    from lightning.pytorch.loggers import TensorBoardLogger
    from hdi_monitor import HDIMonitor, SaturationDetector

    trainer = L.Trainer(callbacks=[HDIMonitor(every_n_steps=100)], logger=TensorBoardLogger("runs"))
    # early-warning settings live on the detector (Lightning's EarlyStopping vocabulary)
    HDIMonitor(every_n_steps=100, detector=SaturationDetector(patience=5, warmup_measurements=10))
    # the HDI describes the heads, it is not a quality metric: stop a diverging run on the loss
    EarlyStopping(monitor="val_loss", mode="min", divergence_threshold=10.0)
    ```

    Where it writes: to every logger of the Trainer. TensorBoard, Weights & Biases, MLflow and
    Comet loggers get the scalars, heatmaps, histograms and event texts (see
    `hdi_monitor.integrations.loggers`); other loggers (CSV, ...) get the scalars, with a one-time
    note that the pictures go elsewhere.

    ``trainer.callback_metrics``: on every measured step the model-mean HDI per projection
    (``hdi/<projection>/mean``), the mean effective heads (``effective_heads/mean``) and the event
    counts (``diversity_events/<kind>``) are put there under their logged names (see
    `published_metrics`), on every rank, so stock callbacks can read them; between measured steps
    they keep the last measured value. The HDI falls from the chance level as a model learns, so
    ``mode="max"`` on it selects the least-trained weights: checkpoint on the validation loss (the
    recipes in ``docs/integrations/lightning.md``).

    Settings: every argument of `hdi_monitor.integrations._settings.MonitorSettings` (the
    `MonitorConfig` fields, ``detector``, ``activation_detector`` and ``state_key``), named in the
    signature, with the defaults of `hdi_monitor.config.DEFAULTS`.

    A finished `MonitorConfig` is passed with `HDIMonitor.from_config`. Every argument is checked
    when the callback is made. What
    needs the model is checked in ``setup``, before the first step: a model without a recognised
    attention layer, or a ``layers`` filter that matches none, raises a ``ValueError`` naming the
    model's modules (training has not started, so nothing is lost). Only failures during
    training become warnings.

    State: ``trainer.fit`` called again on the same Trainer continues the history and the
    early-warning detector (the step axis keeps increasing, as Lightning's does); a new Trainer
    starts afresh unless it resumes from a checkpoint, which restores both.
    """

    tracker: HDITracker | None = None
    _restored: dict[str, Any] | None = None
    _trainer: weakref.ref[pl.Trainer] | None = None  # the Trainer the tracker belongs to

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def state_key(self) -> str:
        if self._state_key is not None:
            return self._generate_state_key(key=self._state_key)
        # not the settings: a run resumed with another every_n_steps or projections gets its state
        # back (and is told what changed); two monitors in one Trainer need a state_key each
        return self._generate_state_key()

    def _restored_state_dict(self) -> dict[str, Any]:
        return dict(self._restored or {})

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # one sink per logger (TensorBoard, W&B, MLflow and Comet take pictures too; the others
        # scalars only, with a note); only rank 0 writes
        sinks = sinks_for_loggers(trainer.loggers) if trainer.is_global_zero else []
        if not trainer.loggers:
            rank_zero_warn(
                "HDIMonitor: the Trainer has no logger; measurements are kept in `HDIMonitor.history` only. "
                "Pass `logger=TensorBoardLogger(...)` to get the dashboards."
            )
        same_run = (
            self.tracker is not None
            and self._trainer is not None
            and self._trainer() is trainer
            and self.tracker.model is pl_module
        )
        if same_run:
            # fit called again on the same Trainer: history, detector and step axis continue
            assert self.tracker is not None
            self.tracker.sinks = sinks
        else:
            # untouched detector copies: two runs never share detector state
            self.tracker = HDITracker(
                pl_module,
                self.config,
                sinks=sinks,
                detector=copy.deepcopy(self.detector),
                activation_detector=copy.deepcopy(self.activation_detector),
            )
            self._trainer = weakref.ref(trainer)
        if self._restored is not None:
            self.tracker.load_state_dict(self._restored)
            self._restored = None
        if not is_overridden("configure_model", pl_module):
            # fail now, before the first step, if the model cannot be watched (raises ValueError);
            # layers built in configure_model are checked in on_fit_start
            self.tracker.setup()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.tracker is None:
            return
        if self._restored is not None:  # state restored after setup (the usual order)
            self.tracker.load_state_dict(self._restored)
            self._restored = None
        # FSDPStrategy (FSDP1) wraps the model in its setup, which runs after ours; its outermost
        # module is the FSDP root, which must be known to read weights one FSDP unit at a time
        root = trainer.strategy.model
        if self.tracker.fsdp_root is None and isinstance(root, nn.Module) and contains_fsdp1(root):
            self.tracker.fsdp_root = root
        self.tracker.setup()  # discover again: parameters are configured and wrapped by the strategy
        if len(self.tracker.history):
            # a resumed run: the restored last measurement is what stock callbacks see until the next one
            self._publish(trainer, self._last_row(self.tracker.history))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker is not None and not trainer.sanity_checking:
            self.tracker.begin(trainer.fit_loop.epoch_loop._batches_that_stepped, batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.tracker is not None:
            self.tracker.stop_capture()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # backward is done (W_O was read at capture time): finish here
        self._finish(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker is None:
            return
        self.tracker.stop_capture()
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            self._finish(trainer)  # no optimizer step happened (e.g. training_step returned None)

    def _finish(self, trainer: pl.Trainer) -> None:
        if self.tracker is None or not self.tracker.measuring:
            return  # not a measured step (the same on every rank)
        if self.tracker.finish() is not None and (measurement := self.tracker.last_measurement) is not None:
            # what stock callbacks (EarlyStopping, ModelCheckpoint) read, under the logged names
            self._publish(trainer, measurement.series)
        if self.config.on_event == "stop":
            # collective: every rank measures the same steps, so every rank reaches this call
            stop = trainer.strategy.reduce_boolean_decision(self.tracker.stop_requested, all=False)
            if stop:
                trainer.should_stop = True

    @staticmethod
    def _last_row(history: History) -> dict[Series, float]:
        keys = history.keys()
        return {key: float(history.column(key)[-1]) for key in keys}

    @staticmethod
    def _publish(trainer: pl.Trainer, series: Mapping[Series, float]) -> None:
        """What stock callbacks (EarlyStopping, ModelCheckpoint) read, under the logged names."""
        for tag, value in published_metrics(series).items():
            trainer.callback_metrics[tag] = torch.tensor(value, dtype=torch.float64)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.tracker is not None:
            self.tracker.stop_capture()

    def state_dict(self) -> dict[str, Any]:
        if self.tracker is not None:
            return self.tracker.state_dict()
        return dict(self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Usually called after `setup` and before `on_fit_start` (applied there, once every other
        # restore step is done); strategies that restore after setup (FSDP, ModelParallel,
        # DeepSpeed) call it after `on_fit_start`, when the tracker exists: load it directly then.
        if self.tracker is not None:
            self.tracker.load_state_dict(state_dict)
            self._restored = None
            trainer = self._trainer() if self._trainer is not None else None
            if trainer is not None and len(self.tracker.history):  # after on_fit_start: published here
                self._publish(trainer, self._last_row(self.tracker.history))
        else:
            self._restored = dict(state_dict)
