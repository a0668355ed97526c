"""Framework-free measurement driver.

`HDITracker` keeps the schedule (when to measure), the capture of head outputs (hooks on only
for a measured step; compiled models through a side forward), the collectives (every rank in
the same order) and the state for resume. Everything else lives in modules named for its job:

* `hdi_monitor.report.compute_report`: the weights, read once per measured step (HDI, levels,
  overlaps; principal angles on image steps from the same read);
* `hdi_monitor.monitor.record`: the typed record of a measured step (`Measurement`);
* `hdi_monitor.monitor.tags`: record -> scalar tags; `hdi_monitor.monitor.history`: the bounded
  columnar history; `hdi_monitor.monitor.detector`: the early warnings;
* `hdi_monitor.monitor.publish`: the record to the sinks (scalars on the training thread,
  pictures prepared by `hdi_monitor.monitor.dashboard`, drawn by `hdi_monitor.monitor.render` on
  the background `hdi_monitor.monitor.worker`);
* `hdi_monitor.monitor.compiled`: head outputs of torch.compile'd models;
* `hdi_monitor.monitor.config`: the settings, read from ``tracker.config`` (never copied).

Two ways to drive it:

* **Plain PyTorch loop** (the tracker counts optimizer steps itself):

  ```python
  tracker = HDITracker(model, every_n_steps=100, writer=SummaryWriter("runs/x"))
  for batch in loader:
      with tracker.capture(batch):      # hooks on only if this step is measured
          loss = model(**batch).loss
      loss.backward()
      tracker.step()                    # finish the measurement, advance the step
      optimizer.step(); optimizer.zero_grad()
  tracker.close()                       # waits for the pictures; draws the last step's
  ```

* **Explicit** (what the callbacks do): ``begin(step, batch)`` before the forward pass,
  ``stop_capture()`` before backward, ``finish()`` any time after backward.

``finish()`` may come before or after the optimizer step: the head-output accumulators combine
each captured head output with the output projection ``W_O`` as it is in the forward pass, at
capture time, so ``finish()`` reads no weight (it sums the accumulators over the ranks and makes
one device-to-host transfer for every layer's statistics). The weights are read once, in
``begin``.

A measured step ``s`` reports the weights that produced step ``s``'s forward pass (measured in
``begin``, before the optimizer changes them) and the activations of that forward pass, so the HDI
point at ``s`` sits beside the training loss of step ``s``.

Nothing is drawn on the training step: on an image step ``finish()`` copies the few small tensors
the pictures need and queues them for a background thread (`hdi_monitor.monitor.worker`), which
encodes the PNGs and writes them; `flush` and `close` wait for it. A full queue drops the
pictures of that step (noted in that step's MonitoringWarning). `close` also draws the pictures
of the run's last measured step when it was not an image step (without principal-angle
histograms: those need the weights of that step).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.functional._numerics import no_autocast
from hdi_monitor.functional.covariance import (
    HeadCovarianceAccumulator,
    compute_results,
)
from hdi_monitor.functional.kernel import KernelStatsAccumulator, compute_kernel_results, sync_kernel_accumulators
from hdi_monitor.models import AttentionLayer, find_attention_layers
from hdi_monitor.models.hooks import (
    CallCounts,
    attach_capture,
    call_model,
    eval_mode,
    iter_batches,
    output_accumulator,
)
from hdi_monitor.models.kernel_capture import KernelStatsCapture
from hdi_monitor.models.sharding import is_fsdp1_module
from hdi_monitor.models.tensor_parallel import data_parallel_group, sync_data_parallel
from hdi_monitor.monitor import gaps, ranks, resume
from hdi_monitor.monitor._layers import (
    describe_change,
    heads_text,
    invalid_head_notes,
    naming_hint,
    signature,
    submodule,
)
from hdi_monitor.monitor._warnings import dispatch_events, warn
from hdi_monitor.monitor.compiled import CompiledUnit, capture_side_forward, compiled_units, intercept
from hdi_monitor.monitor.config import (
    ACTIVATION_COLLAPSE_DELTA,
    ACTIVATION_MIN_DELTA,
    DetectorArg,
    MonitorConfig,
    resolve_detectors,
)
from hdi_monitor.monitor.dashboard import Dashboard
from hdi_monitor.monitor.detector import DiversityEvent, KernelDetector, feed_report
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.publish import Publisher
from hdi_monitor.monitor.record import Measurement
from hdi_monitor.monitor.render import Renderer, render_job
from hdi_monitor.monitor.sinks import Sink, TensorBoardSink
from hdi_monitor.monitor.tags import scalar_tags
from hdi_monitor.report import ACTIVATIONS, AngleWork, compute_report

__all__ = [
    "HDITracker",
    "Measurement",
    "MonitorConfig",
    "MonitoringWarning",
    "ACTIVATION_MIN_DELTA",
    "ACTIVATION_COLLAPSE_DELTA",
    "MAX_EVENTS",
]

#: Early-warning events kept in `HDITracker.events` (and its state): the most recent ones.
MAX_EVENTS = 1000


@dataclass
class _Pending:
    step: int
    report: Any  # DiversityReport
    accumulators: list[HeadCovarianceAccumulator | None]
    forward_expected: bool = True  # False for weight-only measurements (step() without capture())
    angle_work: list[AngleWork] = field(default_factory=list)  # angles left for the worker
    counts: CallCounts = field(default_factory=CallCounts)  # module / head-output hook calls per layer
    kernel: KernelStatsCapture | None = None  # kernel statistics of this step (kernel_stats on)
    kernel_accumulators: list[KernelStatsAccumulator] = field(default_factory=list)  # one per layer, in order
    kernel_off: dict[str, str] = field(default_factory=dict)  # layer -> why the tracker did not capture it
    dropped: bool = False  # a hook failed in this forward: the measurement is skipped, side forwards too


class HDITracker:
    """Measure head diversity every ``config.every_n_steps`` optimizer steps.

    Args:
        model: the model to watch (any ``nn.Module``; attention layers are found by discovery).
        config: what to measure and how often (see `MonitorConfig`); default ``MonitorConfig()``.
        writer: a ``SummaryWriter``; shorthand for ``sinks=[TensorBoardSink(writer)]``.
        sinks: where results go (see `hdi_monitor.monitor.sinks`).
        detector: early-warning detector for the HDI series: a `SaturationDetector` (used as
            given: its events and state are the tracker's), ``"default"`` (``SaturationDetector()``)
            or None (the default here: no HDI early warnings; the callbacks default to
            ``"default"``).
        activation_detector: early-warning detector for the effective-heads series (thresholds in
            heads) and for redundant head pairs by output correlation; ``"default"`` derives it
            from ``detector`` (see `resolve_detectors`), None (the default here) turns it off.
        fsdp_root: for FSDP1 (``FullyShardedDataParallel``) models, the root FSDP module, when
            ``model`` is not that root itself (it defaults to ``model`` when ``model`` is an FSDP1
            module). Weights are then read one FSDP unit at a time (see
            `full_weights`). The Lightning callback sets it to
            ``trainer.strategy.model``. Can also be set later through the attribute.
        renderer: draws the pictures of an image step on the background thread (an
            `hdi_monitor.monitor.render.ImageJob` -> ``{tag: PNG bytes}``); default
            `hdi_monitor.monitor.render.render_job`. A renderer that raises or is slow never
            fails or holds training.
        kernel_detector: early warnings from the kernel statistics (``kernel_stats=True``): entropy
            collapse and logit blow-up (`KernelDetector`, thresholds from the warnings study). ``"default"``:
            ``KernelDetector(warmup_steps=...)`` with the HDI detector's warmup when ``detector``
            is not None and ``kernel_stats`` is on, else None; None turns them off.
        **fields: `MonitorConfig` fields, applied over ``config``:
            ``HDITracker(model, every_n_steps=50)`` is ``HDITracker(model, MonitorConfig(every_n_steps=50))``.

    Raises:
        TypeError: an unknown keyword (the message names the valid fields), or a wrong type.
        ValueError: a bad setting (checked by `MonitorConfig`).
    """

    def __init__(
        self,
        model: nn.Module,
        config: MonitorConfig | None = None,
        *,
        writer: Any = None,
        sinks: Sequence[Sink] = (),
        detector: DetectorArg = None,
        activation_detector: DetectorArg = None,
        fsdp_root: nn.Module | None = None,
        renderer: Renderer | None = None,
        kernel_detector: KernelDetector | Literal["default"] | None = "default",
        **fields: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if fsdp_root is not None and not isinstance(fsdp_root, nn.Module):
            raise TypeError(f"fsdp_root must be a torch.nn.Module or None, got {type(fsdp_root).__name__}")
        if renderer is not None and not callable(renderer):
            raise TypeError(f"renderer must be callable (ImageJob -> {{tag: png}}), got {type(renderer).__name__}")
        config = MonitorConfig.build(config, fields, owner="HDITracker")
        detectors = resolve_detectors(detector, activation_detector, activations=config.activations)
        if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
            raise TypeError(f"sinks must be a sequence of sinks, got {type(sinks).__name__}")
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise TypeError(
                    f"every sink needs log_scalars, log_images, log_histograms, log_text, log_layout and flush; "
                    f"got {type(sink).__name__}"
                )
        self.model = model
        self.config = config
        # private RNG for the token subsample: the global generators are never drawn from
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.sinks: list[Sink] = list(sinks)
        if writer is not None:
            self.sinks.append(TensorBoardSink(writer))
        self.detector, self.activation_detector = detectors
        if isinstance(kernel_detector, str):
            if kernel_detector != "default":
                raise ValueError(
                    f"kernel_detector must be a KernelDetector, 'default' or None, got {kernel_detector!r}"
                )
            on = config.kernel_stats and self.detector is not None
            kernel_detector = KernelDetector(warmup_steps=self.detector.warmup_steps) if on and self.detector else None
        elif kernel_detector is not None and not isinstance(kernel_detector, KernelDetector):
            raise TypeError(
                f"kernel_detector must be a KernelDetector, 'default' or None, got {type(kernel_detector).__name__}"
            )
        self.kernel_detector: KernelDetector | None = kernel_detector
        if fsdp_root is None and is_fsdp1_module(model):
            fsdp_root = model
        self.fsdp_root: nn.Module | None = fsdp_root
        self.agree: ranks.Agree = ranks.all_agree
        """``flag -> AND over the ranks``, the collective `finish` runs on measured steps (default
        ``hdi_monitor.monitor.ranks.all_agree``); replace it to count or simulate it (tests)."""

        self.history = History(config.history_budget)
        self.events: list[DiversityEvent] = []
        self.last_measurement: Measurement | None = None
        self.last_token_counts: list[int] = []  # tokens per layer in the last measurement (after sync)
        self.stop_requested = False
        self.disabled = False
        self.activations_off: str | None = None  # why head outputs cannot be captured (None: they can)
        self._layers: list[AttentionLayer] | None = None
        self._signatures: list[tuple[Any, ...]] = []  # per layer: (path, module, parameter shapes)
        self._units: list[CompiledUnit] = []  # compiled parts of the model (never hooked)
        self._notes: list[str] = []  # MonitoringWarning lines of the measurement under way (one warning)
        self._invalid_seen: set[tuple[str, str]] = set()  # (layer, projection) already warned about
        self._gap_seen: tuple[set[str], set[str]] = (set(), set())  # layers told: hook never fired / < 2 tokens
        self._calls: dict[str, int] = {}  # head-output calls per layer at the last measured forward
        self._kernel_seen: set[str] = set()  # layers told: kernel statistics not measured
        self._pending: _Pending | None = None
        self._scheduled: int | None = None  # step of the measurement under way (set even if it failed)
        self._handles: list[Any] = []
        self._last_step = -1
        self._step = 0  # own step counter for step()/capture()
        dashboard = Dashboard(  # layout, summary scalars, pictures
            loss_tag=config.loss_tag,
            max_image_layers=config.max_image_layers,
            max_histogram_layers=config.max_histogram_layers,
        )
        # the sinks' side: scalars here, pictures on a background worker
        self.publisher = Publisher(config, dashboard, renderer if renderer is not None else render_job)

    @property
    def dashboard(self) -> Dashboard:
        """Layout, summary scalars and pictures of this run (`Dashboard`)."""
        return self.publisher.dashboard

    @dashboard.setter
    def dashboard(self, dashboard: Dashboard) -> None:
        self.publisher.dashboard = dashboard

    @property
    def renderer(self) -> Renderer:
        """Draws the pictures of an image step on the background worker (see ``renderer``)."""
        return self.publisher.renderer

    @renderer.setter
    def renderer(self, renderer: Renderer) -> None:
        self.publisher.renderer = renderer

    @property
    def activations(self) -> bool:
        """True if head outputs are captured: ``config.activations``, unless the model cannot be
        intercepted (see `activations_off`)."""
        return self.config.activations and self.activations_off is None

    # ------------------------------------------------------------------ public driving API
    @property
    def layers(self) -> list[AttentionLayer]:
        """The attention layers being watched (found on first use, see `setup`)."""
        if self._layers is None:
            self.setup()
        assert self._layers is not None
        return self._layers

    def setup(self) -> list[AttentionLayer]:
        """Find the attention layers now; call before training (the integrations do).

        Raises:
            ValueError: no attention layer was found, or the ``layers`` filter matches none; the
                message names the model's modules and says how to pass ``layers`` or ``spec``.
            TypeError: ``layers`` or ``spec`` has the wrong type.
        """
        try:
            found = find_attention_layers(self.model, spec=self.config.spec, layers=self.config.layers)
        except ValueError as err:
            # the other ranks wait in the agreement check below: take part in it, so that they
            # raise too (naming this rank) instead of waiting until the process group times out
            with contextlib.suppress(ValueError):
                ranks.check_ranks_agree({**self._fingerprint([]), "number of layers": ranks.NO_LAYERS})
            raise ValueError(
                f"hdi-monitor cannot watch {type(self.model).__name__}: {err}{naming_hint(self.model)}"
            ) from err
        self._set_layers(found)
        ranks.check_ranks_agree(self._fingerprint(found))  # one small collective: all ranks watch the same
        return found

    def _fingerprint(self, layers: list[AttentionLayer]) -> dict[str, str]:
        c = self.config
        return ranks.fingerprint(
            layers,
            every_n_steps=c.every_n_steps,
            log_images_every_n_steps=c.image_every_n_steps,
            projections=c.projections,
            weighting=c.weighting,
            activations=c.activations,
            max_tokens=c.max_tokens,
            kernel_stats=c.kernel_stats,
        )

    def _set_layers(self, layers: list[AttentionLayer]) -> None:
        paths = {id(m): n for n, m in self.model.named_modules()}
        self._layers = layers
        self._find_units()
        self._signatures = [signature(la.module, paths.get(id(la.module))) for la in layers]

    def _revalidate(self) -> list[AttentionLayer]:
        """Check, cheaply, that every watched layer is still the module in the model with the same
        parameter shapes; if not, rediscover once and note what changed (one MonitoringWarning)."""
        layers = self.layers
        stale = [
            la
            for la, sig in zip(layers, self._signatures, strict=True)
            if sig[0] is None or signature(submodule(self.model, sig[0]), sig[0]) != sig
        ]
        if not stale:
            return layers
        try:
            found = find_attention_layers(self.model, spec=self.config.spec, layers=self.config.layers)
        except ValueError as err:
            names = ", ".join(la.name for la in stale)
            raise ValueError(f"attention layer(s) {names} changed and the model no longer matches: {err}") from err
        new = {la.name: la for la in found}
        old = {la.name: la for la in layers}
        for la in stale:
            self._notes.append(describe_change(la, new.get(la.name)))
        for name in new.keys() - old.keys():
            self._notes.append(f"{name}: new attention layer, measured from now on ({heads_text(new[name])})")
        self._set_layers(found)
        return found

    @property
    def current_step(self) -> int:
        """The step counter used by `capture` and `step`."""
        return self._step

    def should_measure(self, step: int) -> bool:
        """True if ``step`` is a measured step not measured before (so resumed runs never repeat)."""
        return not self.disabled and step % self.config.every_n_steps == 0 and step > self._last_step

    def begin(self, step: int, batch: Any = None) -> bool:
        """Start (or, for further micro-batches of the same step, continue) a measurement.

        Measures the weights now, before the optimizer step, and attaches head-output hooks when
        ``activations`` is on. Returns True if step ``step`` is being measured.
        """
        if self._scheduled != step:
            if not self.should_measure(step):
                return False
            self._scheduled = step
            self._start(step)
        # the first or a further micro-batch of the step under way; a step whose measurement failed
        # (a hook error, say) is never restarted: it stays skipped until finish()
        if self._pending is None:
            return False
        with self._guard("capturing head outputs"):
            self._attach(batch)
        return self._pending is not None

    @property
    def measuring(self) -> bool:
        """True between `begin` of a measured step and `finish`, even if this rank's
        measurement failed (so that every rank still takes part in `finish`)."""
        return self._scheduled is not None or self._pending is not None

    def _start(self, step: int) -> None:
        """Read the weights (the one read of this step) and set up the accumulators."""
        self.stop_capture()
        self._pending = None  # an unfinished earlier measurement (e.g. after an exception) is dropped
        self._notes = []
        if self._layers is None:
            self.setup()  # a model the monitor cannot watch fails here, before its first step
        with self._guard("measuring weights"), no_autocast():
            layers = self._revalidate()
            # the one weight read of this step; on image steps the principal angles come from the
            # same read (CPU weights: a copy, finished on the worker; gathered or accelerator
            # weights: computed now)
            work: list[AngleWork] = []
            report = compute_report(
                layers,
                projections=self.config.projections,
                weighting=self.config.weighting,
                fsdp_root=self.fsdp_root,
                angles=work if self._image_step(step) and self.sinks else False,
            )
            accs: list[HeadCovarianceAccumulator | None] = [None] * len(layers)
            if self.activations:
                accs = [
                    output_accumulator(
                        la,
                        max_tokens=self.config.max_tokens,
                        calls=self._calls.get(la.name, 1),  # the budget shared by the calls seen last time
                        generator=self.generator,
                    )
                    for la in layers
                ]
            self._pending = _Pending(step=step, report=report, accumulators=accs, angle_work=work)
            if self.config.kernel_stats:
                self._start_kernel(self._pending, layers)

    def _start_kernel(self, pending: _Pending, layers: list[AttentionLayer]) -> None:
        """The kernel-statistics capture of this step: one accumulator per watched layer, in layer
        order on every rank (the sync visits them in this order), drawing the query subsample from
        the tracker's generator. Layers it cannot measure are noted with the reason."""
        off = pending.kernel_off
        for la in layers:
            if getattr(la, "tensor_parallel", None) is not None:
                off[la.name] = "kernel statistics are not taken under tensor parallelism yet"
            elif any(not u.interceptable and u.contains(la.name) for u in self._units):
                off[la.name] = "the model was compiled whole by Lightning (no eager call to intercept)"
            elif self._units and not any(u.contains(la.name) for u in self._units):
                off[la.name] = (
                    "part of the model is compiled and this layer lies outside the compiled parts: wrapping the "
                    "attention functions for its forward would change the compiled graph's guards"
                )
        # every layer has an accumulator (the sync is the same on every rank); only the others are watched
        accs = [
            KernelStatsAccumulator(la.num_heads, max_tokens=self.config.max_tokens, generator=self.generator)
            for la in layers
        ]
        watched = [la for la in layers if la.name not in off]
        capture = KernelStatsCapture(
            watched, max_tokens=self.config.max_tokens, generator=self.generator, on_error=self._hook_failed
        )
        capture.accumulators.update({la.name: acc for la, acc in zip(layers, accs, strict=True) if la.name not in off})
        pending.kernel, pending.kernel_accumulators = capture, accs

    def stop_capture(self) -> None:
        """Remove every hook (idempotent). Call before backward so recomputed forwards are not counted."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def finish(self) -> Measurement | None:
        """Finish the pending measurement: compute, warn, write to the sinks. None if nothing was pending.

        Under ``torch.distributed`` this is a collective: call it on every rank at the same steps.
        The ranks first agree that all of them hold the measurement (one tiny ``all_reduce``);
        then, with activations, every accumulator is summed over the ranks. No weight is read.
        """
        self.stop_capture()
        if not self.measuring:
            return None  # not a measured step: no collective, no host sync
        pending, self._pending = self._pending, None
        self._scheduled = None
        if not self.agree(pending is not None) or pending is None:
            # some rank failed earlier in this measurement: every rank drops it, so none waits
            # in a collective that the others never reach
            return None
        # Phase 1 runs every collective (accumulator sums) in the same order on every rank; a
        # local failure is recorded, not raised, so the ranks stay in step. Then the ranks agree,
        # and phase 2 (record, detector, sinks: no collective) runs only if all succeeded.
        errors: list[Exception] = []
        with no_autocast():
            self._gather_statistics(pending, errors)
        if not self.agree(not errors):
            self._skip(errors[0] if errors else None, "computing the measurement")
            return None
        with self._guard("writing the measurement"):
            return self._publish(pending)
        return None

    @contextlib.contextmanager
    def capture(self, batch: Any = None) -> Iterator[bool]:
        """Context manager around the forward pass of the current step (plain loops).

        Yields True if this step is measured. Hooks are removed on exit, also on exceptions.
        """
        measured = self.begin(self._step, batch)
        try:
            yield measured
        finally:
            self.stop_capture()

    def step(self) -> Measurement | None:
        """Call once per optimizer step in a plain loop, after ``backward()``.

        Finishes the current step's measurement and advances the step counter. Returns the
        measurement of the step just finished, if any. With `capture`, the weights and ``W_O``
        were read in the forward pass, so ``step()`` may come before or after
        ``optimizer.step()``. Without `capture` the step is measured from the weights only, read
        here: call it before ``optimizer.step()`` so they are the weights of this step's forward.
        """
        if self._scheduled != self._step:
            self.begin(self._step)  # weights-only measurement when capture() was not used
            if self._pending is not None:
                self._pending.forward_expected = False
        result = self.finish()
        self._step += 1
        return result

    def measure(self, inputs: Any = None, *, step: int | None = None) -> Measurement | None:
        """Measure now, whatever the schedule; with ``inputs`` (a batch or an iterable of batches)
        and ``activations`` or ``kernel_stats`` on, run them through the model to collect head-output
        and kernel statistics (eagerly: a ``torch.compile(model)`` wrapper's original module is called)."""
        step = self._step if step is None else step
        self._scheduled = step
        self._start(step)
        if self._pending is not None and inputs is not None and (self.activations or self._pending.kernel is not None):
            model = self._eager_model()
            # like head_diversity(inputs=...): eval mode (no dropout), restored afterwards
            with self._guard("running inputs through the model"), torch.no_grad(), eval_mode(model):
                for batch in iter_batches(inputs):
                    self.stop_capture()
                    self._attach(batch)
                    call_model(model, batch)
        return self.finish()

    def flush(self) -> None:
        """Wait until every queued picture is written, report what failed, flush the sinks."""
        with self._guard("flushing the sinks"):
            self.publisher.flush(self.sinks)

    def close(self) -> None:
        """End of a run (or an exception): remove hooks, drop any unfinished measurement, draw the
        pictures of the last measured step if it was not an image step, wait for the pictures,
        flush the sinks. The tracker can be used again afterwards (a second ``fit``)."""
        self.stop_capture()
        self._pending = None
        self._scheduled = None
        with self._guard("drawing the last measured step"):
            self.publisher.finish_run(self.last_measurement, self.history, self.sinks, activations=self.activations)
        self.flush()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """History (bounded: see `History`), last measured step, events (the last `MAX_EVENTS`),
        detector state, the subsample generator's state, each layer's head-output calls at the
        last measured step (how ``max_tokens`` is shared next) and the layers whose invalid-head
        counts the dashboard keeps logging (plain Python types: JSON-ready, and
        loadable with ``torch.load(..., weights_only=True)``)."""
        return {
            "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii"),
            "settings": resume.settings(self.config.every_n_steps, self.config.projections),
            "history": self.history.state_dict(),
            "last_step": self._last_step,
            "step": self._step,
            "events": [e.to_dict() for e in self.events],
            "detector": self.detector.state_dict() if self.detector is not None else None,
            "activation_detector": (
                self.activation_detector.state_dict() if self.activation_detector is not None else None
            ),
            "kernel_detector": self.kernel_detector.state_dict() if self.kernel_detector is not None else None,
            "calls": dict(self._calls),
            "unhealthy": sorted(self.dashboard.unhealthy),  # per-layer invalid-head charts kept on
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` (also a 0.2 checkpoint, whose list-of-dicts history is converted;
        a history longer than ``config.history_budget`` is downsampled)."""
        self.history.load_state_dict(state.get("history", []))
        now = resume.settings(self.config.every_n_steps, self.config.projections)
        changed = resume.reconcile(state.get("settings"), now, self.history)
        if changed:
            warn(changed, MonitoringWarning, rank_zero_only=True)
        self._last_step = int(state.get("last_step", -1))
        self._step = int(state.get("step", 0))
        self.events = [DiversityEvent.from_dict(e) for e in state.get("events", [])][-MAX_EVENTS:]
        if self.detector is not None and state.get("detector") is not None:
            self.detector.load_state_dict(state["detector"])
        if self.activation_detector is not None and state.get("activation_detector") is not None:
            self.activation_detector.load_state_dict(state["activation_detector"])
        if self.kernel_detector is not None and state.get("kernel_detector") is not None:
            self.kernel_detector.load_state_dict(state["kernel_detector"])
        self._calls = {str(name): int(n) for name, n in (state.get("calls") or {}).items()}
        if state.get("unhealthy") is not None:  # replaces what this tracker logged before the load
            self.dashboard.unhealthy = {str(tag) for tag in state["unhealthy"]}
        if state.get("generator") is not None:
            raw = base64.b64decode(state["generator"])
            self.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            self.stop_capture()
            self._pending = None
            if self.config.strict:
                raise
            warn(
                f"hdi-monitor: error while {what}; training goes on, this measurement is skipped "
                f"({type(err).__name__}: {err}). Pass strict=True to raise instead.",
                MonitoringWarning,
            )

    def _find_units(self) -> None:
        """The compiled parts of the model; a whole LightningModule compiled by Lightning cannot
        be intercepted: its head outputs are not measured (one warning)."""
        self._units = compiled_units(self.model)
        stuck = [u for u in self._units if not u.interceptable]
        if stuck and self.config.activations and self.activations_off is None:
            self.activations_off = (
                f"{type(stuck[0].module).__name__} was compiled whole by Lightning (its forward and training_step "
                "are compiled, so there is no eager call to take the head outputs from without changing the "
                "compiled graph)"
            )
            warn(
                f"hdi-monitor: {self.activations_off}. Activation statistics (covariance, effective heads) are "
                "off; the weight-based HDI is measured. Compile the attention blocks instead "
                "(torch.compile(block) or block.compile()) to keep them, or pass activations=False to silence "
                "this warning.",
                MonitoringWarning,
                rank_zero_only=True,
            )

    def _eager_model(self) -> nn.Module:
        units = self._units
        if len(units) == 1 and units[0].path == "" and units[0].kind == "wrapper":
            return units[0].original
        return self.model

    def _attach(self, batch: Any) -> None:
        """Hooks for this forward: plain hooks on the layers outside compiled parts; for each
        compiled part, an eager interception that runs a side forward with its layers' hooks on
        (see `hdi_monitor.monitor.compiled`)."""
        pending = self._pending
        kernel = pending.kernel if pending is not None else None
        if pending is None or not (self.activations or kernel is not None):
            return
        layers, accs, on_error, counts = self.layers, pending.accumulators, self._hook_failed, pending.counts
        # the compiled unit (index into self._units) each layer lies in, or None
        unit_of = [next((k for k, u in enumerate(self._units) if u.contains(la.name)), None) for la in layers]
        plain = [i for i, k in enumerate(unit_of) if k is None]
        # the kernel capture is never put around a compiled call
        watched = kernel if not self._units and len(pending.kernel_off) < len(layers) else None
        if plain:
            self._handles += attach_capture(
                [layers[i] for i in plain],
                [accs[i] for i in plain],
                batch,
                kernel=watched,
                on_error=on_error,
                counts=counts,
            )
        for k in dict.fromkeys(u for u in unit_of if u is not None):
            members = [i for i, u in enumerate(unit_of) if u == k]
            # the side forward is eager: the kernel capture is safe there
            attach = partial(
                attach_capture,
                [layers[i] for i in members],
                [accs[i] for i in members],
                kernel=kernel,
                on_error=on_error,
                counts=counts,
            )
            unit = self._units[k]
            dropped = partial(getattr, pending, "dropped")
            on_call = partial(capture_side_forward, unit, attach, batch, on_error, dropped=dropped)
            self._handles += [intercept(unit, on_call)]

    def _hook_failed(self, err: Exception) -> None:
        """A head-output hook raised inside the forward pass: drop this measurement (in ``finish``
        every rank then agrees to drop it) and let the forward pass go on; hooks stay attached until
        ``stop_capture`` (removing them inside a hook would change the dict being iterated)."""
        if self.config.strict:
            raise err
        if self._pending is None:
            return  # already dropped (and warned) by an earlier hook of this forward pass
        self._pending.dropped = True
        self._pending = None
        warn(
            f"hdi-monitor: error while capturing head outputs; training goes on, this measurement is skipped "
            f"({type(err).__name__}: {err}). Pass strict=True to raise instead.",
            MonitoringWarning,
        )

    def _gather_statistics(self, pending: _Pending, errors: list[Exception]) -> None:
        """Sum the accumulators over the ranks, then compute every layer's head-output statistics
        with one device-to-host transfer for all of them (no weight is read: the accumulators took
        ``W_O`` at capture time)."""
        self.last_token_counts = []
        if self.activations:
            self._gather_outputs(pending, errors)
        if pending.kernel is not None:
            self._gather_kernel(pending, errors)

    def _gather_outputs(self, pending: _Pending, errors: list[Exception]) -> None:
        """Head-output statistics (see `_gather_statistics`)."""
        pairs = [
            (acc, entry)
            for acc, entry in zip(pending.accumulators, pending.report.layers, strict=True)
            if acc is not None
        ]
        accs = [acc for acc, _ in pairs]
        sync_data_parallel(accs, self.layers)  # collectives first (layer check + two sums), data-parallel ranks
        results: list[Any] = [None] * len(accs)
        try:
            results = compute_results(accs, min_tokens=2)  # caches every token count on the host
        except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
            errors.append(err)
        self.last_token_counts = [acc.num_tokens for acc in accs]
        for (_, entry), result in zip(pairs, results, strict=True):
            if result is None:
                continue
            entry.covariance = result.covariance
            entry.correlation = result.correlation
            entry.effective_heads = result.effective_heads
            entry.mean_correlation = result.mean_correlation
            entry.variance_ratio = result.variance_ratio
            entry.num_tokens = result.num_tokens
            entry.invalid_heads[ACTIVATIONS] = list(result.invalid_heads)
        if pending.forward_expected:
            # each layer's calls this step: the next measured step shares max_tokens between them
            self._calls = {n: c for n, c in pending.counts.output_calls.items() if c > 0}
            # an F.linear output projection, or < 2 real tokens: said once per layer
            outs = {la.name: type(la.output_module).__name__ for la in self.layers}
            self._notes += gaps.silent_hook_notes(pending.counts.silent_layers(), outs, self._gap_seen[0])
            counts = {e.name: n for (_, e), n in zip(pairs, self.last_token_counts, strict=True)}
            self._notes += gaps.few_token_notes(counts, pending.counts.output_calls, self._gap_seen[1])

    def _gather_kernel(self, pending: _Pending, errors: list[Exception]) -> None:
        """Kernel statistics: the per-layer accumulators summed over the data-parallel ranks (the
        same group and the same layer order as the head-output sums, right after them), then one
        host transfer for every layer; layers not measured get None fields and a note (once per
        layer and run)."""
        accs = pending.kernel_accumulators
        reduce, group = data_parallel_group(self.layers)
        if reduce:
            sync_kernel_accumulators(accs, group)  # collective: every rank, every layer, in order
        capture = pending.kernel
        assert capture is not None
        if not pending.forward_expected:
            return  # a weights-only measurement: no forward pass ran
        try:
            results = compute_kernel_results(accs)
        except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
            errors.append(err)
            return
        off = dict(capture.unreachable)
        off.update(pending.kernel_off)
        for entry, result in zip(pending.report.layers, results, strict=True):
            if entry.name in off:
                continue  # never partial: a layer with a refused call reports nothing
            entry.attention_entropy = result.entropy
            entry.attention_entropy_uniform = result.uniform_entropy
            entry.max_attention_logit = result.max_logit
            entry.kernel_queries = result.num_queries
        for name, why in off.items():
            if name not in self._kernel_seen:
                self._kernel_seen.add(name)
                self._notes.append(f"{name}: kernel statistics not measured ({why}); said once per layer")

    def _skip(self, err: Exception | None, what: str) -> None:
        """Drop a measurement that failed on this rank (``err``: warn, or raise when strict) or on
        another rank (None: that rank warns; this one drops it quietly, as when ``begin`` failed)."""
        if err is None:
            return
        if self.config.strict:
            raise err
        reason = f"{type(err).__name__}: {err}"
        warn(
            f"hdi-monitor: error while {what}; training goes on, this measurement is skipped ({reason}). "
            "Pass strict=True to raise instead.",
            MonitoringWarning,
        )

    # ------------------------------------------------------------------ publishing (rank-local)
    def _publish(self, pending: _Pending) -> Measurement:
        """The record of a finished measurement: events, tags, history; then one warning, then
        the sinks (pictures queued for the worker)."""
        report, step = pending.report, pending.step
        config = self.config
        events = feed_report(
            self.detector,
            self.activation_detector if self.activations else None,
            step,
            report,
            projections=config.projections,
            kernel_detector=self.kernel_detector if config.kernel_stats else None,
        )
        detecting = self.detector is not None or (self.activation_detector is not None and self.activations)
        series, scalars = scalar_tags(
            report,
            events,
            dashboard=self.dashboard,
            projections=config.projections,
            activations=self.activations,
            detecting=detecting,
        )
        image = self._image_step(step)
        measurement = Measurement(step=step, report=report, scalars=scalars, events=events, image_step=image)
        # results first, so that no sink can lose them; then the warnings; then the sinks, each alone
        self.history.append(step, series)
        self.events = (self.events + events)[-MAX_EVENTS:]
        self.last_measurement = measurement
        self._last_step = max(self._last_step, step)
        if image and self.sinks:
            with self._guard("preparing the dashboard images"):  # a failure costs the images only
                dropped = self.publisher.queue_pictures(
                    measurement, self.history, self.sinks, activations=self.activations, angle_work=pending.angle_work
                )
                if dropped is not None:
                    self._notes.append(dropped)
        watched = [*config.projections, ACTIVATIONS] if self.activations else config.projections
        self._notes += invalid_head_notes(report, watched, self._invalid_seen)
        self._notes += self.publisher.worker_notes()
        notes, self._notes = self._notes, []
        if notes:
            lines = "\n  ".join(notes)
            warn(
                f"hdi-monitor step {step}: {len(notes)} note(s) (changes in the watched layers, dead heads, "
                f"dashboard writes):\n  {lines}",
                MonitoringWarning,
                rank_zero_only=True,
            )
        if dispatch_events(step, events, self.config.on_saturation):
            self.stop_requested = True
        self.publisher.write(measurement, self.sinks, activations=self.activations)
        return measurement

    def _image_step(self, step: int) -> bool:
        every = self.config.image_every_n_steps
        return bool(every) and step % every == 0
