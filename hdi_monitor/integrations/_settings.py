"""`MonitorSettings`: the settings every integration names in its signature, declared once.

The Lightning `hdi_monitor.integrations.lightning.HDIMonitor` and the Hugging Face
`hdi_monitor.integrations.hf_trainer.HDITrainerCallback` inherit this constructor: every field of
`hdi_monitor.config.MonitorConfig` is a named, typed, defaulted and documented parameter here (so
IDEs, ``help()``, the API pages and LightningCLI see them), turned into one `MonitorConfig` by a
literal call (which jsonargparse follows), with the defaults of `hdi_monitor.config.DEFAULTS`;
the early-warning detectors and the checkpoint key come beside it.

Adding a setting: a field, its check and a docstring line in `MonitorConfig`; the same parameter,
default ``DEFAULTS.<field>`` and docstring line here. ``tests`` fail until both name it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hdi_monitor.config import DEFAULTS, EventAction, MonitorConfig
from hdi_monitor.functional.diversity import Weighting
from hdi_monitor.models.spec import AttentionSpec
from hdi_monitor.monitor.detector import DetectorArg, check_detector
from hdi_monitor.report import Projection

__all__ = ["MonitorSettings"]


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class MonitorSettings:
    """The settings of a monitoring callback (a base class: use `HDIMonitor` or
    `HDITrainerCallback`).

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
            ``kernel_stats``, up to 5 more for a layer with invalid heads, and about 35 for the
            model), plus 16 bytes per kept step: 0.2 MiB for 4 layers at the default 512, 8 MiB
            per series at the maximum.
        image_queue_size: image steps waiting to be drawn on the background thread at most; an
            image step that finds the queue full has its pictures dropped (noted in a warning),
            so drawing never holds the training step.
        kernel_stats: also measure each head's attention kernel on measured steps (opt-in): the
            attention entropy (with its uniform level ``ln(n_keys)``) and the maximum attention
            logit, from the queries and keys the attention kernel receives (at most ``max_tokens``
            queries per kernel call); layers whose kernel cannot be reached are named.
        update_entropy: also compute each head's update entropy (opt-in): the spectral entropy of
            the first-order change of its query-key bilinear form between two consecutive measured
            steps, from the weights; keeps a CPU copy of every watched layer's query and key weights
            from one measured step to the next (their size in the weights' dtype).
        detector: the early-warning detector of the HDI series (saturation, collapse, redundant
            pairs): a configured `SaturationDetector`, ``"default"`` (``SaturationDetector()``:
            ``patience=10``, ``min_delta=0.002``, ``warmup_steps=1000``, ``collapse_delta=0.05``,
            ``redundancy_threshold=0.9``) or None (no early warnings). Each new run gets an
            untouched copy; the run's detector is the callback's ``tracker.detector``.
        activation_detector: the detector of the effective-heads series, in heads;
            ``"default"`` takes ``detector``'s ``patience``, ``warmup_steps`` and
            ``redundancy_threshold`` with thresholds in heads
            (``hdi_monitor.monitor.detector.ACTIVATION_MIN_DELTA``, ``ACTIVATION_COLLAPSE_DELTA``),
            and is off when ``detector`` is None.
        state_key: tells two monitors apart in a checkpoint (two monitors in one Trainer need one
            each).

    Every argument is checked here; what needs the model is checked before the first step.

    Raises:
        TypeError: a wrong type (a `MonitorConfig` as the first argument: use ``from_config``).
        ValueError: a bad setting.
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
        update_entropy: bool = DEFAULTS.update_entropy,
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        state_key: str | None = None,
    ) -> None:
        if isinstance(every_n_steps, MonitorConfig):
            raise TypeError(
                f"{type(self).__name__} takes its settings as arguments; pass a MonitorConfig with "
                f"{type(self).__name__}.from_config"
            )
        if state_key is not None and not isinstance(state_key, str):
            raise TypeError(f"state_key must be a string, got {type(state_key).__name__}")
        super().__init__()
        # a literal MonitorConfig call naming every field (checked there, once)
        self.config = MonitorConfig(
            every_n_steps=every_n_steps,
            projections=_tuple(projections),
            weighting=weighting,
            layers=_tuple(layers),
            spec=_tuple(spec),
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
            update_entropy=update_entropy,
        )
        self.detector = check_detector("detector", detector)
        self.activation_detector = check_detector("activation_detector", activation_detector)
        self._state_key = state_key

    @classmethod
    def from_config(cls, config: MonitorConfig, **kwargs: Any) -> Any:
        """A callback with the settings of a finished `MonitorConfig` (e.g. one shared with an
        `HDITracker`); ``kwargs`` are the constructor's other arguments (``detector``, ...)."""
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"config must be a MonitorConfig, got {type(config).__name__}")
        return cls(**config.to_dict(), **kwargs)
