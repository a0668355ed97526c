"""`HDITracker`: when to measure, the step counter, resume state and the error policy.

The tracker only schedules. A measured step is a `hdi_monitor.measure.step.MeasuredStep` (the one
weight read, the capture of the step's forward passes, the collectives) started from the model's
`hdi_monitor.measure.watch.ModelWatch`; its frozen `Measurement` goes to the
`hdi_monitor.monitor._publish.Publisher` (detectors, history, warnings, sinks, pictures). The
settings are one `hdi_monitor.config.MonitorConfig`, read in place.

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

Step ``s`` reports the weights of step ``s``'s forward pass (read in ``begin``) and that pass's
activations (``W_O`` read at capture, so ``finish()`` may follow the optimizer step): the HDI at
``s`` sits beside the loss of ``s``. Nothing runs on other steps, nothing is drawn on the training
step. Error policy: a failure inside monitoring skips that measurement with one
`MonitoringWarning` (``strict=True`` raises, for tests); misconfiguration raises at `setup`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from hdi_monitor.config import MonitorConfig
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.measure import MeasuredStep, Measurement, ModelWatch, StepFailed
from hdi_monitor.monitor import _resume as resume
from hdi_monitor.monitor._publish import DetectorArg, KernelDetectorArg, Publisher, Renderer
from hdi_monitor.monitor._warnings import warn
from hdi_monitor.monitor.sinks import Sink

__all__ = ["HDITracker", "Measurement", "MonitorConfig", "MonitoringWarning"]


class _Via:
    """An attribute of the tracker that lives on one of its parts (read and set there)."""

    def __init__(self, part: str, name: str, doc: str) -> None:
        self.part, self.name, self.__doc__ = part, name, doc

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class HDITracker:
    """Measure head diversity every ``config.every_n_steps`` optimizer steps.

    Args:
        model: the model to watch (any ``nn.Module``; attention layers are found by discovery).
        config: what to measure and how often (see `MonitorConfig`); default ``MonitorConfig()``.
        writer: a ``SummaryWriter``; shorthand for ``sinks=[TensorBoardSink(writer)]``.
        sinks: where results go (see `hdi_monitor.monitor.sinks`).
        detector: early-warning detector for the HDI series: a `SaturationDetector` (used as
            given: its events and state are the tracker's), ``"default"`` (``SaturationDetector()``)
            or None (no HDI early warnings).
        activation_detector: early-warning detector for the effective-heads series (thresholds in
            heads) and for redundant head pairs by output correlation; ``"default"`` derives it
            from ``detector`` (see `hdi_monitor.monitor.detector.resolve_detectors`), None turns it off.
        fsdp_root: for FSDP1 (``FullyShardedDataParallel``) models, the root FSDP module, when
            ``model`` is not that root itself (it defaults to ``model`` when ``model`` is an FSDP1
            module). The Lightning callback sets it to ``trainer.strategy.model``.
        renderer: draws the pictures of an image step on the background thread (an
            `hdi_monitor.monitor.render.ImageJob` -> ``{tag: PNG bytes}``); default
            `hdi_monitor.monitor.render.render_job`. A renderer that raises or is slow never
            fails or holds training.
        kernel_detector: early warnings from the kernel statistics (``kernel_stats=True``): entropy
            collapse and logit blow-up (`KernelDetector`). ``"default"``: ``KernelDetector`` with the
            HDI detector's warmup when ``detector`` is not None and ``kernel_stats`` is on, else
            None; None turns them off.
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
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        fsdp_root: nn.Module | None = None,
        renderer: Renderer | None = None,
        kernel_detector: KernelDetectorArg = "default",
        **fields: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if fsdp_root is not None and not isinstance(fsdp_root, nn.Module):
            raise TypeError(f"fsdp_root must be a torch.nn.Module or None, got {type(fsdp_root).__name__}")
        self.config = config = MonitorConfig.build(config, fields, owner="HDITracker")
        self.publisher = Publisher(
            config,
            sinks=sinks,
            writer=writer,
            detector=detector,
            activation_detector=activation_detector,
            kernel_detector=kernel_detector,
            renderer=renderer,
        )
        self.watch = ModelWatch(model, config, fsdp_root=fsdp_root)
        self.disabled = False
        self._image_every = config.image_every_n_steps  # the config is frozen: read once
        self._current: MeasuredStep | None = None  # the measured step under way on this rank
        self._scheduled: int | None = None  # its step, set even if this rank's start failed
        self._last_step = -1
        self._step = 0  # own step counter for step()/capture()

    # ------------------------------------------------------------------ what it holds (on its parts)
    model = _Via("watch", "model", "The watched model.")
    generator = _Via("watch", "generator", "The monitor's own generator (the token subsample), saved with the state.")
    layers = _Via("watch", "layers", "The watched attention layers (found on first use).")
    activations = _Via("watch", "activations", "True if head outputs are captured.")
    activations_off = _Via("watch", "activations_off", "Why head outputs cannot be captured (None: they can).")
    fsdp_root = _Via("watch", "fsdp_root", "The FSDP1 root the weights are read through (the callbacks set it late).")
    agree = _Via("watch", "agree", "``flag -> AND over the ranks`` run in `finish` (replace it to count it in tests).")
    history = _Via("publisher", "history", "The bounded history of the measured steps.")
    events = _Via("publisher", "events", "The early-warning events (the last 1000).")
    last_measurement = _Via("publisher", "last", "The last published `Measurement`.")
    stop_requested = _Via("publisher", "stop_requested", 'An event asked to stop (``on_event="stop"``).')
    sinks = _Via("publisher", "sinks", "Where results go (a list; assign a new one to change them).")
    renderer = _Via("publisher", "renderer", "Draws an image step's pictures on the background worker.")
    dashboard = _Via("publisher", "dashboard", "Layout, kept summaries and pictures of this run.")
    detector = _Via("publisher", "detector", "The detector of the HDI series (None: off).")
    activation_detector = _Via("publisher", "activation_detector", "The detector of the head outputs (None: off).")
    kernel_detector = _Via("publisher", "kernel_detector", "The detector of the kernel statistics (None: off).")
    current_step = property(lambda self: self._step, doc="The step counter used by `capture` and `step`.")

    @property
    def last_token_counts(self) -> list[int]:
        """Tokens per layer in the last measurement (after the multi-rank sum), in layer order."""
        m = self.publisher.last
        return [] if m is None else [n for la in m.report.layers if (n := m.token_counts.get(la.name)) is not None]

    # ------------------------------------------------------------------ schedule
    def setup(self) -> list[Any]:
        """Find the attention layers now and check that every rank watches the same; call before
        training (the integrations do).

        Raises:
            ValueError: no attention layer was found, or the ``layers`` filter matches none; the
                message names the model's modules and says how to pass ``layers`` or ``spec``.
            TypeError: ``layers`` or ``spec`` has the wrong type.
        """
        for note in self.watch.setup():
            warn(note, UserWarning if "not measured" in note else MonitoringWarning, rank_zero_only=True)
        return self.watch.layers

    def should_measure(self, step: int) -> bool:
        """True if ``step`` is a measured step not measured before (so resumed runs never repeat)."""
        return not self.disabled and step % self.config.every_n_steps == 0 and step > self._last_step

    @property
    def measuring(self) -> bool:
        """True between `begin` of a measured step and `finish`, even if this rank's measurement
        failed (so that every rank still takes part in `finish`)."""
        return self._scheduled is not None or self._current is not None

    def begin(self, step: int, batch: Any = None) -> bool:
        """Start (or, for further micro-batches of the same step, continue) a measurement; True if
        step ``step`` is being measured. Reads the weights now, before the optimizer step, and
        attaches the capture of this forward pass."""
        if self._scheduled != step:
            if not self.should_measure(step):
                return False
            self._start(step)
        # a step whose measurement failed (a hook error, say) stays skipped until finish()
        current = self._current
        if current is None or current.dropped:
            return False
        with self._guard("capturing head outputs"):
            current.attach(batch)
        return not current.dropped

    def _start(self, step: int) -> None:
        self.stop_capture()
        self._current, self._scheduled = None, step  # an unfinished earlier measurement is dropped
        if not self.watch.found:
            self.setup()  # a model the monitor cannot watch fails here, before its first step
        every = self._image_every
        image = bool(every) and step % every == 0
        angles = image and bool(self.sinks)
        self._current = MeasuredStep.start(self.watch, step, image=image, angles=angles, on_error=self._failed)

    def _failed(self, err: Exception) -> None:
        """The weight read (a `StepFailed`) or a hook inside the forward pass failed: the step is
        dropped (the ranks agree in `finish`), training goes on; strict: raise."""
        if isinstance(err, StepFailed) and err.error is not None:
            self._skip(err.error, err.what)
        else:
            self._skip(err, "capturing head outputs")

    def stop_capture(self) -> None:
        """Remove every hook (idempotent). Call before backward so recomputed forwards are not counted."""
        if self._current is not None:
            self._current.stop_capture()

    def finish(self) -> Measurement | None:
        """Finish the measurement under way: collectives, record, warnings, sinks. None if nothing
        was measured. Under ``torch.distributed`` a collective: call it on every rank at the same steps."""
        current, self._current, self._scheduled = self._current, None, None
        if current is None:
            return None  # not a measured step: no collective, no host sync
        try:
            measurement = current.finish()
        except StepFailed as failed:
            if failed.error is not None:
                self._skip(failed.error, failed.what)
            return None
        self._last_step = max(self._last_step, measurement.step)
        with self._guard("writing the measurement"):
            return self.publisher.publish(measurement)
        return None

    @contextlib.contextmanager
    def capture(self, batch: Any = None) -> Iterator[bool]:
        """Context manager around the forward pass of the current step (plain loops); yields True
        if this step is measured. Hooks are removed on exit, also on exceptions."""
        measured = self.begin(self._step, batch)
        try:
            yield measured
        finally:
            self.stop_capture()

    def step(self) -> Measurement | None:
        """Call once per optimizer step in a plain loop, after ``backward()``: finishes the current
        step's measurement and advances the step counter; returns the measurement, if any. Without
        `capture` the step is measured from the weights only, read here: call it before
        ``optimizer.step()`` so they are the weights of this step's forward."""
        if self._scheduled != self._step:
            self.begin(self._step)  # weights-only measurement when capture() was not used
            if self._current is not None:
                self._current.forward_expected = False
        result = self.finish()
        self._step += 1
        return result

    def measure(self, inputs: Any = None, *, step: int | None = None) -> Measurement | None:
        """Measure now, whatever the schedule; with ``inputs`` (a batch or an iterable of batches)
        run them through the model (eagerly, in eval mode, under no_grad) for the head-output and
        kernel statistics. ``step`` defaults to the step counter, or the step after the last measured
        one when that is later (the series' steps keep increasing)."""
        self._start(max(self._step, self._last_step + 1) if step is None else step)
        if (current := self._current) is not None and inputs is None:
            current.forward_expected = False
        elif current is not None:
            with self._guard("running inputs through the model"):
                current.run(inputs)
        return self.finish()

    def flush(self) -> None:
        """Wait until every queued picture is written, report what failed, flush the sinks."""
        with self._guard("flushing the sinks"):
            self.publisher.flush()

    def close(self) -> None:
        """End of a run (or an exception): remove hooks, drop any unfinished measurement, draw the
        pictures of the last measured step if it was not an image step, wait for the pictures,
        flush the sinks. The tracker can be used again afterwards (a second ``fit``)."""
        self.stop_capture()
        self._current = self._scheduled = None
        with self._guard("drawing the last measured step"):
            self.publisher.finish_run()
        self.flush()

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            self.stop_capture()
            if self._current is not None:  # dropped on this rank; the ranks still agree in finish()
                self._current.dropped = True
            self._skip(err, what)

    def _skip(self, err: Exception, what: str) -> None:
        if self.config.strict:
            raise err
        warn(
            f"hdi-monitor: error while {what}; training goes on, this measurement is skipped "
            f"({type(err).__name__}: {err}). Pass strict=True to raise instead.",
            MonitoringWarning,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The publisher's state (history, events, detectors), the last measured step, the step
        counter, the subsample generator's state and each layer's head-output calls at the last
        measured step (plain Python types: JSON-ready, loadable with ``torch.load(...,
        weights_only=True)``)."""
        return {
            **self.publisher.state_dict(),
            "generator": resume.generator_state(self.generator),
            "settings": resume.settings(self.config.every_n_steps, self.config.projections),
            "last_step": self._last_step,
            "step": self._step,
            "calls": dict(self.watch.calls),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` (a history longer than ``config.history_budget`` is downsampled).

        Raises:
            TypeError, ValueError: ``state`` is not a tracker state (the message names what is wrong).
        """
        state = resume.check_state(state)
        self.publisher.load_state_dict(state)
        now = resume.settings(self.config.every_n_steps, self.config.projections)
        changed = resume.reconcile(state.get("settings"), now, self.publisher.history)
        if changed:
            warn(changed, MonitoringWarning, rank_zero_only=True)
        self._last_step, self._step = int(state.get("last_step", -1)), int(state.get("step", 0))
        self.watch.calls = {str(name): int(n) for name, n in (state.get("calls") or {}).items()}
        if state.get("generator") is not None:
            resume.restore_generator(self.generator, state["generator"])
