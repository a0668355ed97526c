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
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from hdi_monitor.functional.diversity import Weighting
from hdi_monitor.integrations.loggers import sinks_for_loggers
from hdi_monitor.models.sharding import contains_fsdp1
from hdi_monitor.models.spec import AttentionSpec
from hdi_monitor.monitor.config import DEFAULTS, DetectorArg, EventAction, MonitorConfig, check_detector
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.tracker import HDITracker, Measurement
from hdi_monitor.report import Projection

__all__ = ["HDIMonitor", "published_metrics"]


def published_metrics(scalars: Mapping[str, float]) -> dict[str, float]:
    """The scalars of a measurement that `HDIMonitor` also puts in ``trainer.callback_metrics``,
    under their logged names: the model-mean HDI per projection (``hdi/<projection>/mean``), the
    mean effective heads (``effective_heads/mean``) and the event counts
    (``diversity_events/<kind>``). Non-finite values are left out."""
    out: dict[str, float] = {}
    for tag, value in scalars.items():
        parts = tag.split("/")
        wanted = (
            (len(parts) == 3 and parts[0] == "hdi" and parts[2] == "mean")
            or tag == "effective_heads/mean"
            or (len(parts) == 2 and parts[0] == "diversity_events")
        )
        if wanted and math.isfinite(float(value)):
            out[tag] = float(value)
    return out


class HDIMonitor(Callback):
    """Measure attention-head diversity every ``every_n_steps`` optimizer steps and log it.

    Quick start:

    ```python
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import EarlyStopping
    from lightning.pytorch.loggers import TensorBoardLogger
    from hdi_monitor import HDIMonitor, SaturationDetector

    trainer = L.Trainer(callbacks=[HDIMonitor(every_n_steps=100)], logger=TensorBoardLogger("runs"))
    # early-warning settings live on the detector (Lightning's EarlyStopping vocabulary)
    HDIMonitor(every_n_steps=100, detector=SaturationDetector(patience=5, warmup_steps=500))
    # the model-mean HDI is in trainer.callback_metrics: stock callbacks can watch it
    EarlyStopping(monitor="hdi/key/mean", mode="max", patience=5)
    ```

    Where it writes: to every logger of the Trainer. TensorBoard, Weights & Biases, MLflow and
    Comet loggers get the scalars, heatmaps, histograms and event texts (see
    `hdi_monitor.integrations.loggers`); other loggers (CSV, ...) get the scalars, with a one-time
    note that the pictures go elsewhere.

    ``trainer.callback_metrics``: on every measured step the model-mean HDI per projection
    (``hdi/<projection>/mean``), the mean effective heads (``effective_heads/mean``) and the event
    counts (``diversity_events/<kind>``) are put there under their logged names (see
    `published_metrics`), on every rank, so ``EarlyStopping(monitor="hdi/key/mean", mode="max")``
    and ``ModelCheckpoint(monitor="hdi/key/mean", mode="max")`` work on them; between measured
    steps they keep the last measured value.

    Args:
        every_n_steps: measure at optimizer steps ``0, N, 2N, ...``; nothing runs in between.
        projections: which of ``"query"``, ``"key"``, ``"value"``, ``"output"`` to measure (all
            four by default).
        weighting: ``"spectral"`` (default, no SVD) or ``"uniform"`` subspace overlap.
        layers: keep only these attention layers: a regex searched in the qualified module names,
            or a sequence of exact names. None watches every layer.
        spec: an `AttentionSpec`, or a list of them, for layouts no built-in family knows; specs
            combine with the built-in families (a spec wins where both match).
        log_images_every_n_steps: overlap/correlation heatmaps and principal-angle histograms every
            this many steps (default ``10 * every_n_steps``; 0 turns them off).
        activations: also capture the measured step's head outputs (covariance, effective heads).
        max_tokens: at most this many tokens per layer per measured step (a random subsample
            drawn with the monitor's own generator), shared evenly between the layer's calls in
            the step (micro-batches, a layer applied several times) as counted at the previous
            measured step; None keeps every token.
        on_saturation: ``"warn"`` (one `DiversityWarning` per measured step with events),
            ``"stop"`` (warn, and stop training on saturation or collapse) or a callable that
            receives each `DiversityEvent`.
        strict: raise internal errors instead of turning them into warnings (for tests).
        seed: seed of the monitor's own ``torch.Generator`` (the token subsample), an integer in
            ``[0, 2**64 - 1]`` (what ``torch.Generator.manual_seed`` takes). The global
            generators are never drawn from, so training is bit-identical with and without the
            monitor; the generator state is saved with the monitor's state for resume.
        loss_tag: the scalar tag of the training loss charted beside the HDI in the Custom
            Scalars tab (e.g. ``"train_loss"``); None charts every tag whose last word is ``loss``,
            except validation, evaluation and test losses (``val_loss``, ``eval/loss``).
        max_image_layers: at most this many layers per tiled overlap/correlation image (with more,
            the layers whose HDI moved most since the last image step).
        max_histogram_layers: layers with a principal-angle histogram of their own; with more,
            adjacent layers are grouped into this many histograms.
        history_budget: measured steps kept in the history, the checkpoint and the diversity
            map's columns (from 4 to 1,048,576): the newest half in full, older ones downsampled
            (see `hdi_monitor.monitor.history.History`); memory stays flat however long the run.
            It is preallocated: 8 bytes per series per kept step (6 series per layer, 8 with
            ``kernel_stats``, up to 5 more for a layer with invalid heads, and about 30 for the
            model), plus 16 bytes per kept step: 0.2 MiB for 4 layers at the default 512, 8 MiB
            per series at the maximum.
        image_queue_size: image steps waiting to be drawn on the background thread at most; an
            image step that finds the queue full has its pictures dropped (noted in a warning),
            so drawing never holds the training step.
        kernel_stats: also measure each head's attention kernel on measured steps (opt-in): the
            attention entropy (with its uniform level ``ln(n_keys)``) and the maximum attention
            logit, from the queries and keys the attention kernel receives (at most ``max_tokens``
            queries per kernel call); layers whose kernel cannot be reached are named.
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

    The defaults are those of `MonitorConfig` (`hdi_monitor.monitor.config.DEFAULTS`); a finished
    `MonitorConfig` is passed with `HDIMonitor.from_config`. Every argument is checked here. What
    needs the model is checked in ``setup``, before the first step: a model without a recognised
    attention layer, or a ``layers`` filter that matches none, raises a ``ValueError`` naming the
    model's modules (training has not started, so nothing is lost). Only failures during
    training become warnings.

    State: ``trainer.fit`` called again on the same Trainer continues the history and the
    early-warning detector (the step axis keeps increasing, as Lightning's does); a new Trainer
    starts afresh unless it resumes from a checkpoint, which restores both.
    """

    def __init__(
        self,
        every_n_steps: int = DEFAULTS.every_n_steps,
        *,
        projections: Sequence[Projection] = DEFAULTS.projections,
        weighting: Weighting = DEFAULTS.weighting,
        layers: str | Sequence[str] | None = DEFAULTS.layers,
        spec: AttentionSpec | Sequence[AttentionSpec] | None = None,
        log_images_every_n_steps: int | None = DEFAULTS.log_images_every_n_steps,
        activations: bool = DEFAULTS.activations,
        max_tokens: int | None = DEFAULTS.max_tokens,
        on_saturation: EventAction = DEFAULTS.on_saturation,
        strict: bool = DEFAULTS.strict,
        seed: int = DEFAULTS.seed,
        loss_tag: str | None = DEFAULTS.loss_tag,
        max_image_layers: int = DEFAULTS.max_image_layers,
        max_histogram_layers: int = DEFAULTS.max_histogram_layers,
        history_budget: int = DEFAULTS.history_budget,
        image_queue_size: int = DEFAULTS.image_queue_size,
        kernel_stats: bool = DEFAULTS.kernel_stats,
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        state_key: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(every_n_steps, MonitorConfig):
            raise TypeError(
                "HDIMonitor takes its settings as arguments; pass a MonitorConfig with HDIMonitor.from_config"
            )
        if state_key is not None and not isinstance(state_key, str):
            raise TypeError(f"state_key must be a string, got {type(state_key).__name__}")
        # a literal MonitorConfig call naming every field (checked there, once)
        self.config = MonitorConfig(
            every_n_steps=every_n_steps,
            projections=tuple(projections) if isinstance(projections, list) else projections,  # type: ignore[arg-type]
            weighting=weighting,
            layers=tuple(layers) if isinstance(layers, list) else layers,  # type: ignore[arg-type]
            spec=tuple(spec) if isinstance(spec, list) else spec,  # type: ignore[arg-type]
            log_images_every_n_steps=log_images_every_n_steps,
            activations=activations,
            max_tokens=max_tokens,
            on_saturation=on_saturation,
            strict=strict,
            seed=seed,
            loss_tag=loss_tag,
            max_image_layers=max_image_layers,
            max_histogram_layers=max_histogram_layers,
            history_budget=history_budget,
            image_queue_size=image_queue_size,
            kernel_stats=kernel_stats,
        )
        self.detector = check_detector("detector", detector)
        self.activation_detector = check_detector("activation_detector", activation_detector)
        self._state_key = state_key
        self.tracker: HDITracker | None = None
        self._restored: dict[str, Any] | None = None
        self._trainer: weakref.ref[pl.Trainer] | None = None  # the Trainer the tracker belongs to

    @classmethod
    def from_config(
        cls,
        config: MonitorConfig,
        *,
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        state_key: str | None = None,
    ) -> HDIMonitor:
        """An `HDIMonitor` with the settings of a finished `MonitorConfig` (e.g. one shared with
        an `HDITracker`); the other arguments are those of the constructor."""
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"config must be a MonitorConfig, got {type(config).__name__}")
        return cls(**config.to_dict(), detector=detector, activation_detector=activation_detector, state_key=state_key)

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    def state_key(self) -> str:
        if self._state_key is not None:
            return self._generate_state_key(key=self._state_key)
        # not the settings: a run resumed with another every_n_steps or projections gets its state
        # back (and is told what changed); two monitors in one Trainer need a state_key each
        return self._generate_state_key()

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
            for tag, value in published_metrics(measurement.scalars).items():
                trainer.callback_metrics[tag] = torch.tensor(value, dtype=torch.float64)
        if self.config.on_saturation == "stop":
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
