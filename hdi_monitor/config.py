"""`MonitorConfig`: the one settings object of the tracker and the integrations.

`HDITracker` takes a `MonitorConfig` (or its fields as keyword arguments). The Lightning
`HDIMonitor` and the Hugging Face `HDITrainerCallback` name every field in their own signatures
(typed, defaulted and documented, so IDEs, ``help()``, the API pages and LightningCLI see them) and
build a `MonitorConfig` from them; ``HDIMonitor.from_config(config)`` takes a finished one. The
defaults come from here only (`DEFAULTS`), and each field's documentation is written once here and
repeated word for word in the callbacks' ``Args`` (a test compares them). The early-warning
detectors are not settings but stateful objects: they are passed beside the config as
``detector=`` / ``activation_detector=`` (see `resolve_detectors`).

Adding a setting: add the field (with its type, default and a line in the docstring) and its
check in `MonitorConfig.__post_init__`, then the same parameter, default ``DEFAULTS.<field>``, and
docstring line to `HDIMonitor.__init__` and `HDITrainerCallback.__init__`;
``tests/unit/test_validation.py`` fails until every field is named in both signatures.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

from hdi_monitor import evidence
from hdi_monitor._validation import check_bool, check_choice, check_choices, check_int, check_regex
from hdi_monitor.events import DiversityEvent
from hdi_monitor.evidence import KINDS_WITH_METRIC, SIGNALS
from hdi_monitor.functional.diversity import Weighting
from hdi_monitor.models import PROJECTIONS, AttentionSpec
from hdi_monitor.models.base import Projection
from hdi_monitor.models.spec import as_specs

__all__ = [
    "DEFAULTS",
    "DEFAULT_HISTORY_BUDGET",
    "MAX_HISTORY_BUDGET",
    "DEFAULT_MAX_HISTOGRAM_LAYERS",
    "DEFAULT_MAX_IMAGE_LAYERS",
    "EventAction",
    "MonitorConfig",
    "WARN_ON_NAMES",
    "SEED_MAX",
]

#: The largest ``seed``: ``torch.Generator.manual_seed`` takes ``[0, 2**64 - 1]``.
SEED_MAX = 2**64 - 1

#: What a measured step's early-warning events trigger (``on_event``).
EventAction = Literal["warn", "log", "stop"] | Callable[[DiversityEvent], Any]
#: The names ``warn_on`` takes: a signal (`hdi_monitor.evidence.SIGNALS`, e.g. ``"saturation/hdi"``)
#: or an event kind with a metric (``"saturation"``, ``"collapse"``: both of its signals).
WARN_ON_NAMES: tuple[str, ...] = (*KINDS_WITH_METRIC, *SIGNALS)
#: Default of ``max_image_layers``: layers tiled in one overlap/correlation image at most.
DEFAULT_MAX_IMAGE_LAYERS = 16
#: Default of ``max_histogram_layers``: layers with a principal-angle histogram of their own at most.
DEFAULT_MAX_HISTOGRAM_LAYERS = 8
#: Default of ``history_budget``: measured steps kept in the history.
DEFAULT_HISTORY_BUDGET = 512
#: The largest ``history_budget`` (its rows are preallocated: 8 MiB per series at this size).
MAX_HISTORY_BUDGET = 1 << 20


@dataclass(frozen=True)
class MonitorConfig:
    """What to measure and how often: the settings shared by `HDITracker`, `HDIMonitor` and
    `HDITrainerCallback`. Every field is checked once, here, when the config is made, so a bad
    value fails before training starts.

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
        on_event: what the early-warning events do. ``"warn"`` (default): at most one line per
            measured step for the events of the signals in ``warn_on`` (a `DiversityWarning`,
            written above the progress bar), and one summary line at the end of the run;
            ``"log"``: nothing is printed, every event is still recorded (``monitor.events``, the
            Text tab, the event-count scalars); ``"stop"``: warn, and stop training at the first
            event of a signal in ``warn_on``; or a callable, which receives every `DiversityEvent`
            (nothing is printed). Every event is detected, recorded and drawn whatever this is.
        warn_on: which signals warn (and stop, with ``on_event="stop"``): signal names
            (``"saturation/hdi"``, ``"saturation/effective_heads"``, ``"collapse/hdi"``,
            ``"collapse/effective_heads"``, ``"redundancy"``, ``"entropy_collapse"``,
            ``"logit_blowup"``, ``"logit_bound"``, ``"update_entropy"``) or the kinds
            ``"saturation"`` and ``"collapse"`` (both metrics); ``()`` warns on none. None (default)
            warns on `hdi_monitor.evidence.DEFAULTS_ON`, the signals that beat every baseline of the
            warnings study out of sample (see ``docs/early-warnings.md``).
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
            It is preallocated: 8 bytes per series per kept step (7 series per layer, 9 with
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
        on_saturation: deprecated alias of ``on_event`` (the name in 0.1.0; removed in 0.3.0): a
            value given here is taken as ``on_event``, with a ``FutureWarning``.

    What needs the model (an attention layer found, a ``layers`` filter that matches) is checked
    when the tracker is set up, before the first step.
    """

    every_n_steps: int = 100
    projections: tuple[Projection, ...] = PROJECTIONS
    weighting: Weighting = "spectral"
    layers: str | tuple[str, ...] | None = None
    spec: AttentionSpec | tuple[AttentionSpec, ...] | None = None
    log_images_every_n_steps: int | None = None
    activations: bool = True
    max_tokens: int | None = 4096
    on_event: EventAction = "warn"
    warn_on: tuple[str, ...] | None = None
    strict: bool = False
    seed: int = 0
    loss_tag: str | None = None
    max_image_layers: int = DEFAULT_MAX_IMAGE_LAYERS
    max_histogram_layers: int = DEFAULT_MAX_HISTOGRAM_LAYERS
    history_budget: int = DEFAULT_HISTORY_BUDGET
    image_queue_size: int = 2
    kernel_stats: bool = False
    update_entropy: bool = False
    on_saturation: EventAction | None = None

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps)
        object.__setattr__(self, "projections", check_choices("projections", self.projections, PROJECTIONS))
        check_choice("weighting", self.weighting, Weighting)
        object.__setattr__(self, "layers", _check_layers(self.layers))
        try:
            specs = as_specs(self.spec)
        except TypeError as err:
            raise TypeError(
                f"{err} ({self.spec!r}); families are found without one, a spec describes a layout they do not know"
            ) from None
        object.__setattr__(self, "spec", None if not specs else specs[0] if len(specs) == 1 else specs)
        if self.log_images_every_n_steps is not None:
            check_int("log_images_every_n_steps", self.log_images_every_n_steps, low=0)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens)
        if self.on_saturation is not None:
            _deprecated_on_saturation(self.on_saturation, self.on_event)
            object.__setattr__(self, "on_event", self.on_saturation)
            object.__setattr__(self, "on_saturation", None)
        if not callable(self.on_event) and self.on_event not in ("warn", "log", "stop"):
            raise ValueError(f"on_event must be 'warn', 'log', 'stop' or a callable, got {self.on_event!r}")
        object.__setattr__(self, "warn_on", _check_warn_on(self.warn_on))
        check_bool("activations", self.activations)
        check_bool("strict", self.strict)
        check_int("seed", self.seed, low=0, high=SEED_MAX)
        if self.loss_tag is not None and (not isinstance(self.loss_tag, str) or not self.loss_tag):
            raise ValueError(f"loss_tag must be a non-empty scalar tag or None, got {self.loss_tag!r}")
        check_int("max_image_layers", self.max_image_layers)
        check_int("max_histogram_layers", self.max_histogram_layers)
        check_int("history_budget", self.history_budget, low=4, high=MAX_HISTORY_BUDGET)
        check_int("image_queue_size", self.image_queue_size)
        check_bool("kernel_stats", self.kernel_stats)
        check_bool("update_entropy", self.update_entropy)

    @property
    def warned_signals(self) -> frozenset[str]:
        """The signals whose events warn: ``warn_on`` as signal names (a kind with a metric stands
        for both of its signals), or `hdi_monitor.evidence.DEFAULTS_ON` when it is None."""
        names = evidence.DEFAULTS_ON if self.warn_on is None else self.warn_on
        out: set[str] = set()
        for name in names:
            out.update(s for s in SIGNALS if s.startswith(f"{name}/")) if name in KINDS_WITH_METRIC else out.add(name)
        return frozenset(out)

    @property
    def image_every_n_steps(self) -> int:
        """``log_images_every_n_steps`` with its default filled in (``10 * every_n_steps``)."""
        return 10 * self.every_n_steps if self.log_images_every_n_steps is None else self.log_images_every_n_steps

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the fields, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_fields(cls, fields: Mapping[str, Any], *, owner: str) -> None:
        """TypeError naming the valid fields if ``fields`` (keyword arguments of ``owner``) holds a
        name that is not a field; the six former detector arguments get a pointed hint."""
        unknown = [k for k in fields if k not in cls.field_names()]
        if unknown:
            raise TypeError(
                f"{owner} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the settings are "
                f"{', '.join(cls.field_names())}"
            )

    @classmethod
    def build(cls, config: MonitorConfig | None, fields: Mapping[str, Any], *, owner: str) -> MonitorConfig:
        """``config`` with ``fields`` (keyword arguments of ``owner``) applied over it; the default
        config when both are empty. Unknown names raise TypeError naming the valid fields."""
        if config is not None and not isinstance(config, MonitorConfig):
            raise TypeError(f"config must be a MonitorConfig or None, got {type(config).__name__}")
        cls.check_fields(fields, owner=owner)
        if config is None:
            return cls(**fields)
        return dataclasses.replace(config, **fields) if fields else config

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (``projections``, ``layers`` and ``warn_on`` as lists; ``spec`` and
        a callable ``on_event`` as they are; not the deprecated ``on_saturation``)."""
        out = {f: getattr(self, f) for f in self.field_names() if f != "on_saturation"}
        out["projections"] = list(self.projections)
        if self.warn_on is not None:
            out["warn_on"] = list(self.warn_on)
        if isinstance(self.layers, tuple):
            out["layers"] = list(self.layers)
        return out


def _check_warn_on(warn_on: Any) -> tuple[str, ...] | None:
    """``warn_on`` as a tuple of known names (a single string is one name); ValueError listing the
    known names for any other."""
    if warn_on is None:
        return None
    if isinstance(warn_on, str):
        warn_on = (warn_on,)
    if not isinstance(warn_on, Sequence) or not all(isinstance(n, str) for n in warn_on):
        raise TypeError(f"warn_on must be None or a sequence of signal names, got {warn_on!r}")
    unknown = [n for n in warn_on if n not in WARN_ON_NAMES]
    if unknown:
        raise ValueError(
            f"warn_on names unknown signal(s) {', '.join(map(repr, unknown))}; the known names are "
            f"{', '.join(WARN_ON_NAMES)} (None: the evidence-backed defaults, (): none)"
        )
    return tuple(dict.fromkeys(warn_on))


def _deprecated_on_saturation(value: Any, on_event: Any) -> None:
    """The ``FutureWarning`` of the deprecated ``on_saturation``, attributed to the caller's line
    (the first frame outside hdi-monitor); ValueError when ``on_event`` says something else."""
    if on_event != "warn" and on_event != value:
        raise ValueError(f"give on_event, not on_saturation (its deprecated name): got both ({on_event!r}, {value!r})")
    package = os.path.dirname(os.path.abspath(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: our caller
    while frame is not None and (
        frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename.startswith("<")
    ):
        frame, level = frame.f_back, level + 1
    del frame
    warnings.warn(
        f"on_saturation is deprecated and will be removed in 0.3.0: pass on_event={value!r} instead (the same "
        "values, plus 'log'; which signals warn is warn_on=)",
        FutureWarning,
        stacklevel=level,
    )


def _check_layers(layers: Any) -> str | tuple[str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        check_regex("layers", layers)
        return layers
    if not isinstance(layers, Sequence) or not all(isinstance(n, str) for n in layers):
        raise TypeError("layers must be a regex string or a sequence of qualified layer names")
    if not layers:
        raise ValueError("layers=[] selects no attention layer; give None to watch every layer")
    return tuple(layers)


#: The default settings: the one place the callbacks' signature defaults come from.
DEFAULTS = MonitorConfig()
