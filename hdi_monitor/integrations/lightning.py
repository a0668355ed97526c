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
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from hdi_monitor.models.sharding import contains_fsdp1
from hdi_monitor.monitor.config import DetectorArg, MonitorConfig, check_detector
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.sinks import LoggerSink, Sink, TensorBoardSink
from hdi_monitor.monitor.tracker import HDITracker, Measurement

__all__ = ["HDIMonitor"]


class HDIMonitor(Callback):
    """Measure attention-head diversity every ``every_n_steps`` optimizer steps and log it.

    Quick start::

        from hdi_monitor import HDIMonitor, SaturationDetector
        trainer = L.Trainer(callbacks=[HDIMonitor(every_n_steps=100)], logger=TensorBoardLogger("runs"))
        # early-warning settings live on the detector (Lightning's EarlyStopping vocabulary)
        HDIMonitor(every_n_steps=100, detector=SaturationDetector(patience=5, warmup_steps=500))

    Args:
        config: what to measure and how often (see `MonitorConfig`); default ``MonitorConfig()``.
        detector: the early-warning detector of the HDI series (saturation, collapse, redundant
            pairs): a configured `SaturationDetector`, ``"default"`` (``SaturationDetector()``:
            ``patience=10``, ``min_delta=0.002``, ``warmup_steps=1000``, ``collapse_delta=0.05``,
            ``redundancy_threshold=0.9``) or None (no early warnings). Each new run gets an
            untouched copy; the run's detector is `HDIMonitor.tracker`'s.
        activation_detector: the detector of the effective-heads series, in heads;
            ``"default"`` takes ``detector``'s ``patience``, ``warmup_steps`` and
            ``redundancy_threshold`` with thresholds in heads
            (``hdi_monitor.monitor.config.ACTIVATION_MIN_DELTA``, ``ACTIVATION_COLLAPSE_DELTA``),
            and is off when ``detector`` is None.
        state_key: tells two monitors apart in a checkpoint.
        **fields: `MonitorConfig` fields, applied over ``config`` (``every_n_steps``,
            ``projections``, ``weighting``, ``layers``, ``spec``, ``log_images_every_n_steps``,
            ``activations``, ``max_tokens``, ``on_saturation``, ``strict``, ``seed``):
            ``HDIMonitor(every_n_steps=50)`` is ``HDIMonitor(MonitorConfig(every_n_steps=50))``.
            With ``on_saturation="stop"`` training stops on saturation or collapse (every rank
            agrees through the strategy's boolean reduction).

    Every argument is checked here; an unknown keyword raises TypeError naming the valid fields.
    What needs the model is checked in ``setup``, before the first step: a model without a
    recognised attention layer, or a ``layers`` filter that matches none, raises a ``ValueError``
    naming the model's modules (training has not started, so nothing is lost). Only failures
    during training become warnings.

    State: ``trainer.fit`` called again on the same Trainer continues the history and the
    early-warning detector (the step axis keeps increasing, as Lightning's does); a new Trainer
    starts afresh unless it resumes from a checkpoint, which restores both.
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        state_key: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__()
        if state_key is not None and not isinstance(state_key, str):
            raise TypeError(f"state_key must be a string, got {type(state_key).__name__}")
        if config is None:
            # a literal MonitorConfig(**fields) call: LightningCLI (jsonargparse) reads the fields that
            # **fields accepts from it, so YAML can give them as init_args of HDIMonitor
            MonitorConfig.check_fields(fields, owner="HDIMonitor")
            config = MonitorConfig(**fields)
            fields = {}
        self.config = MonitorConfig.build(config, fields, owner="HDIMonitor")
        self.detector = check_detector("detector", detector)
        self.activation_detector = check_detector("activation_detector", activation_detector)
        self.every_n_steps = self.config.every_n_steps
        self.projections = self.config.projections
        self.on_saturation = self.config.on_saturation
        self.strict = self.config.strict
        self._state_key = state_key
        self.tracker: HDITracker | None = None
        self._restored: dict[str, Any] | None = None
        self._trainer: weakref.ref[pl.Trainer] | None = None  # the Trainer the tracker belongs to

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def state_key(self) -> str:
        if self._state_key is not None:
            return self._generate_state_key(key=self._state_key)
        return self._generate_state_key(every_n_steps=self.every_n_steps, projections=self.projections)

    @property
    def history(self) -> History:
        """The measured steps' scalars, bounded (rows read ``{"step": s, "hdi/key/<layer>": ..., ...}``)."""
        if self.tracker is not None:
            return self.tracker.history
        return History.from_state((self._restored or {}).get("history", []), self.config.history_budget)

    @property
    def last_measurement(self) -> Measurement | None:
        return self.tracker.last_measurement if self.tracker is not None else None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        sinks: list[Sink] = []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    sinks.append(TensorBoardSink(logger.experiment))
                else:
                    sinks.append(LoggerSink(logger))
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
        self.tracker.finish()
        if self.on_saturation == "stop":
            # collective: every rank measures the same steps, so every rank reaches this call
            stop = trainer.strategy.reduce_boolean_decision(self.tracker.stop_requested, all=False)
            if stop:
                trainer.should_stop = True

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
        else:
            self._restored = dict(state_dict)
