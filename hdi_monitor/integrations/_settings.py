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
from hdi_monitor.events import DiversityEvent
from hdi_monitor.functional.diversity import Weighting
from hdi_monitor.measure.measurement import Measurement
from hdi_monitor.models.spec import AttentionSpec
from hdi_monitor.monitor.detector import DetectorArg, check_detector
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.tracker import HDITracker
from hdi_monitor.report import Projection

__all__ = ["MonitorSettings"]


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class MonitorSettings:
    """The settings of a monitoring callback (a base class: use `HDIMonitor` or
    `HDITrainerCallback`).

    Args:
        (every `MonitorConfig` field, documented there; the text below is completed from it when
            the module is imported, for ``help()`` and LightningCLI)
        detector: the early-warning detector of the HDI series (saturation, collapse, redundant
            pairs): a configured `SaturationDetector`, ``"default"`` (``SaturationDetector()``:
            ``patience=3``, ``min_delta=0.01``, a warm-up of 10 measurements,
            ``collapse_delta=0.01``, ``redundancy_threshold=0.9``, the settings the warnings study
            chose) or None (no early warnings). Each new run gets an
            untouched copy; the run's detector is the callback's ``tracker.detector``.
        activation_detector: the detector of the effective-heads series, in heads;
            ``"default"`` takes ``detector``'s warm-up and ``redundancy_threshold`` with the window
            and thresholds in heads the study chose (``hdi_monitor.monitor.detector.ACTIVATION_PATIENCE``,
            ``ACTIVATION_MIN_DELTA``, ``ACTIVATION_COLLAPSE_DELTA``; a configured ``detector``
            passes on its ``patience``), and is off when ``detector`` is None.
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
        on_event: EventAction = DEFAULTS.on_event,
        warn_on: Sequence[str] | None = DEFAULTS.warn_on,
        strict: bool = DEFAULTS.strict,
        seed: int = DEFAULTS.seed,
        loss_tag: str | None = DEFAULTS.loss_tag,
        max_image_layers: int = DEFAULTS.max_image_layers,
        max_histogram_layers: int = DEFAULTS.max_histogram_layers,
        history_budget: int = DEFAULTS.history_budget,
        image_queue_size: int = DEFAULTS.image_queue_size,
        kernel_stats: bool = DEFAULTS.kernel_stats,
        update_entropy: bool = DEFAULTS.update_entropy,
        on_saturation: EventAction | None = DEFAULTS.on_saturation,
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
            on_event=on_event,
            warn_on=_tuple(warn_on),
            strict=strict,
            seed=seed,
            loss_tag=loss_tag,
            max_image_layers=max_image_layers,
            max_histogram_layers=max_histogram_layers,
            history_budget=history_budget,
            image_queue_size=image_queue_size,
            kernel_stats=kernel_stats,
            update_entropy=update_entropy,
            on_saturation=on_saturation,
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

    # ------------------------------------------------------------------ results (both callbacks)
    tracker: HDITracker | None = None

    def _restored_state_dict(self) -> dict[str, Any]:
        """The tracker state restored from a checkpoint and not yet applied (the callback's own)."""
        return {}

    @property
    def history(self) -> History:
        """The measured steps' scalars, bounded (rows read ``{"step": s, "hdi/key/<layer>": ..., ...}``)."""
        if self.tracker is not None:
            return self.tracker.history
        return History.from_state(self._restored_state_dict().get("history", []), self.config.history_budget)

    @property
    def events(self) -> list[DiversityEvent]:
        """The early-warning events of the run so far (the last 1000; also in the Text tab)."""
        return list(self.tracker.events) if self.tracker is not None else []

    @property
    def last_measurement(self) -> Measurement | None:
        """The last published measurement of the run (None before the first)."""
        return self.tracker.last_measurement if self.tracker is not None else None


def _with_settings_doc(doc: str) -> str:
    """``doc`` with the placeholder line of its Args section replaced by `MonitorConfig`'s own Args
    entries: each setting is documented once, in the config."""
    source = MonitorConfig.__doc__ or ""
    start = source.index("    Args:\n") + len("    Args:\n")
    end = source.index("\n\n", start)
    first = doc.index("        (every `MonitorConfig` field")
    last = doc.index("        detector: the early-warning detector")
    return doc[:first] + source[start:end] + "\n" + doc[last:]


MonitorSettings.__doc__ = _with_settings_doc(MonitorSettings.__doc__ or "")
