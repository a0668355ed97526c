"""`Publisher`: everything after a measured step, from its record to the sinks.

`Publisher.publish` takes a frozen `hdi_monitor.measure.measurement.Measurement` and:

1. feeds the early-warning detectors (the HDI series, the effective heads, the kernel statistics)
   and makes the step's scalar series (`hdi_monitor.monitor._tags`), typed keys throughout;
2. returns the published record (a new frozen `Measurement` with the events and series) after
   appending it to the bounded history and the kept events, so that no sink can lose them;
3. says what the step noticed in one `MonitoringWarning` (layer changes, dead or non-finite heads,
   dashboard writes that failed) and hands the events on (`dispatch_events`, per ``on_event`` and
   ``warn_on``: one warning line for the warned signals, a user callable, or a request to stop);
   says at the first measured step until when the detectors warm up, and at the end of the run
   how many events it had (`Publisher.finish_run`);
4. writes the scalars, the Custom Scalars layout (once per sink) and the events' text to every sink
   on the calling (training) thread, each sink alone and under its own lock;
5. on image steps, prepares the pictures (`hdi_monitor.monitor._dashboard.Dashboard.image_job`:
   copies of a few small tensors) and queues them for the background `ImageWorker`, which draws
   them, computes the principal angles left for it, and writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

from torch import Tensor

from hdi_monitor.config import MonitorConfig
from hdi_monitor.events import DiversityEvent
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.measure.measurement import Measurement, layer_tag
from hdi_monitor.monitor._dashboard import Dashboard
from hdi_monitor.monitor._tags import scalar_tags
from hdi_monitor.monitor._warnings import dispatch_events, run_summary, say, warn
from hdi_monitor.monitor._worker import ImageWorker, Stuck
from hdi_monitor.monitor.detector import DetectorArg, SaturationDetector, resolve_detectors
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.kernel_detector import KernelDetector
from hdi_monitor.monitor.render import Renderer, render_job
from hdi_monitor.monitor.sinks import Sink, TensorBoardSink, takes_pictures
from hdi_monitor.report import ACTIVATIONS, AngleWork, DiversityReport, compute_angles

__all__ = ["MAX_EVENTS", "WAIT_SECONDS", "DetectorArg", "KernelDetectorArg", "Publisher", "Renderer", "feed_report"]

#: A kernel-detector argument: a configured `KernelDetector`, None (off), or ``"default"``.
KernelDetectorArg = KernelDetector | Literal["default"] | None

#: Early-warning events kept (`Publisher.events`, the tracker's state): the most recent ones.
MAX_EVENTS = 1000
#: The longest the training thread waits for the picture worker (`Publisher.wait_timeout`'s default),
#: in `Publisher.flush`, at the end of a run and before a checkpoint: a renderer or an image sink
#: that does not return within it costs the pictures it holds (named), never the run.
WAIT_SECONDS = 60.0


def feed_report(
    detector: SaturationDetector | None,
    activation_detector: SaturationDetector | None,
    step: int,
    report: DiversityReport,
    *,
    projections: Sequence[str],
    kernel_detector: KernelDetector | None = None,
) -> list[DiversityEvent]:
    """Feed one measured step's report to the detectors: per projection every layer's HDI (with its
    overlap matrix for the redundancy check) and the mean over layers (as layer ``"mean"``); to
    ``activation_detector`` every layer's effective heads (with its correlation matrix); to
    ``kernel_detector`` every layer's kernel statistics (mean entropy over heads, its uniform level,
    the largest logit), where measured. A layer named ``mean``, ``min`` or ``max`` is fed as
    ``<name>_layer``, so it never mixes with the mean. Returns the new events."""
    events: list[DiversityEvent] = []
    if detector is not None:
        for projection in projections:
            chances = []
            for layer in report.layers:
                value = layer.hdi.get(projection)
                if value is None:
                    continue
                chance = layer.chance_hdi[projection]
                chances.append(chance)
                events += detector.update(
                    step,
                    layer_tag(layer.name),
                    projection,  # type: ignore[arg-type]
                    value,
                    chance=chance,
                    pairwise=layer.overlap.get(projection),
                )
            mean = report.mean_hdi(projection)
            if mean is not None and chances:
                chance = sum(chances) / len(chances)
                events += detector.update(step, "mean", projection, mean, chance=chance)  # type: ignore[arg-type]
    if activation_detector is not None:
        for layer in report.layers:
            if layer.effective_heads is None:
                continue
            events += activation_detector.update(
                step,
                layer_tag(layer.name),
                "activations",
                layer.effective_heads,
                metric="effective_heads",
                pairwise=layer.correlation,
            )
    if kernel_detector is not None:
        for layer in report.layers:
            if layer.attention_entropy is None and layer.max_attention_logit is None:
                continue
            events += kernel_detector.update(
                step,
                layer_tag(layer.name),
                entropy=layer.mean_attention_entropy,
                uniform=layer.mean_attention_entropy_uniform,
                max_logit=layer.max_attention_logit_max,
            )
    return events


def invalid_head_notes(report: DiversityReport, projections: Sequence[str], seen: set[tuple[str, str]]) -> list[str]:
    """One note the first time a layer and projection has dead (all-zero) or non-finite heads
    (``seen`` remembers the pairs already noted, and is updated). The projection `ACTIVATIONS`
    (``"activations"``) is the head outputs: heads whose contribution to the layer output had zero
    variance or was not finite."""
    notes = []
    for layer in report.layers:
        for projection in projections:
            bad = layer.invalid_heads.get(projection) or []
            if not bad or (layer.name, projection) in seen:
                continue
            seen.add((layer.name, projection))
            if projection == ACTIVATIONS:
                nonfinite = [h for h in bad if h in layer.nonfinite_heads]
                dead = [h for h in bad if h not in layer.nonfinite_heads]
                what = []
                if dead:
                    what.append(
                        f"head(s) {dead} contributed nothing to the layer output (zero variance over "
                        f"{layer.num_tokens} tokens)"
                    )
                if nonfinite:
                    what.append(
                        f"head(s) {nonfinite} gave non-finite outputs (NaN or inf) over {layer.num_tokens} tokens"
                    )
                notes.append(
                    f"{layer.name} (head outputs): {'; '.join(what)}; effective heads "
                    f"are over the {layer.num_heads - len(bad)} live head(s) of {layer.num_heads} "
                    f"(scalar invalid_heads/activations/{layer_tag(layer.name)})"
                )
                continue
            total = layer.num_kv_heads if projection in ("key", "value") else layer.num_heads
            notes.append(
                f"{layer.name} ({projection}): head(s) {bad} are dead (all zero) or non-finite; "
                f"its HDI is over the {total - len(bad)} valid head(s) of {total} "
                f"(scalar invalid_heads/{projection}/{layer_tag(layer.name)})"
            )
    return notes


class Publisher:
    """Publishes measured steps (see the module docstring). One per tracker.

    Args:
        config: the tracker's settings (read in place: ``strict``, ``projections``,
            ``kernel_stats``, ``on_event``, ``warn_on``, the picture settings, ``history_budget``).
        sinks: where results go; ``writer`` (a ``SummaryWriter``) adds a `TensorBoardSink`.
        detector, activation_detector: see `hdi_monitor.monitor.detector.resolve_detectors`.
        kernel_detector: a `KernelDetector`, None, or ``"default"`` (one with the HDI detector's
            warmup when ``detector`` is on and ``kernel_stats`` is set).
        renderer: draws an `hdi_monitor.monitor.render.ImageJob` (``job -> {tag: PNG bytes}``), on
            the worker; default `hdi_monitor.monitor.render.render_job`.

    Raises:
        TypeError, ValueError: a sink, detector or renderer of the wrong kind.
    """

    def __init__(
        self,
        config: MonitorConfig,
        *,
        sinks: Sequence[Sink] = (),
        writer: Any = None,
        detector: DetectorArg = "default",
        activation_detector: DetectorArg = "default",
        kernel_detector: KernelDetectorArg = "default",
        renderer: Renderer | None = None,
    ) -> None:
        if renderer is not None and not callable(renderer):
            raise TypeError(f"renderer must be callable (ImageJob -> {{tag: png}}), got {type(renderer).__name__}")
        if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
            raise TypeError(f"sinks must be a sequence of sinks, got {type(sinks).__name__}")
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise TypeError(
                    "every sink needs log_scalars, log_images, log_histograms, log_text, log_layout and flush; "
                    f"got {type(sink).__name__}"
                )
        hdi, act = resolve_detectors(detector, activation_detector, activations=config.activations)
        if isinstance(kernel_detector, str):
            if kernel_detector != "default":
                raise ValueError(
                    f"kernel_detector must be a KernelDetector, 'default' or None, got {kernel_detector!r}"
                )
            kernel_detector = (
                KernelDetector(warmup_measurements=hdi.warmup_measurements, warmup_steps=hdi.warmup_steps)
                if config.kernel_stats and hdi
                else None
            )
        elif kernel_detector is not None and not isinstance(kernel_detector, KernelDetector):
            raise TypeError(
                f"kernel_detector must be a KernelDetector, 'default' or None, got {type(kernel_detector).__name__}"
            )
        self.config = config
        self.detector = hdi
        self.activation_detector = act
        self.kernel_detector = kernel_detector
        self.renderer: Renderer = renderer if renderer is not None else render_job
        self.sinks: list[Sink] = [*sinks, *([TensorBoardSink(writer)] if writer is not None else [])]
        self.dashboard = Dashboard(
            loss_tag=config.loss_tag,
            max_image_layers=config.max_image_layers,
            max_histogram_layers=config.max_histogram_layers,
        )
        self.history = History(config.history_budget)
        self.events: list[DiversityEvent] = []
        self.last: Measurement | None = None
        self.stop_requested = False
        self.imaged_step: int | None = None  # last step whose pictures were queued
        self._run: list[int] = []  # this run's published measurements: [count, events, first step]
        self._explained: set[str] = set()  # signals whose evidence this run's warnings have stated
        self._invalid_seen: set[tuple[str, str]] = set()
        self.wait_timeout = WAIT_SECONDS
        """Seconds the training thread waits for the picture worker at most (see `WAIT_SECONDS`)."""
        self._failed_sinks: set[int] = set()  # id() of sinks that failed once (warned once)
        self._delivered: set[int] = set()  # id() of sinks that have the layout and the levels text
        self._worker = ImageWorker(lambda job: self.renderer(job), self._write_pictures, config.image_queue_size)

    @property
    def dropped(self) -> int:
        """Image steps whose pictures were dropped because the queue was full."""
        return self._worker.dropped

    @property
    def pending_pictures(self) -> list[int]:
        """The steps whose pictures are queued or being drawn."""
        return self._worker.pending

    # ------------------------------------------------------------------ the record
    def publish(self, m: Measurement, *, notes: Sequence[str] = ()) -> Measurement:
        """Publish one measured step (see the module docstring); returns the published record.

        Args:
            m: the measured step's record (``m.activations``: head outputs were measured, so their
                detector and charts are on).
            notes: more to say in the step's one warning (the tracker's own).

        Raises:
            Exception: with ``strict``, the first failure of a sink or of the picture worker.
        """
        config, activations = self.config, m.activations
        events = feed_report(
            self.detector,
            self.activation_detector if activations else None,
            m.step,
            m.report,
            projections=config.projections,
            kernel_detector=self.kernel_detector if config.kernel_stats else None,
        )
        detecting = self.detector is not None or (self.activation_detector is not None and activations)
        series = scalar_tags(
            m.report,
            events,
            dashboard=self.dashboard,
            projections=config.projections,
            activations=activations,
            detecting=detecting,
        )
        published = dataclasses.replace(m, events=tuple(events), series=series, angle_work=())
        if not self._run:
            self._run = [0, 0, m.step]
            line = self.warmup_line(m.step)
            if line is not None:
                say(line)
        self._run[0] += 1
        self._run[1] += len(events)
        # results first, so that no sink can lose them; then the warnings; then the sinks, each alone
        self.history.append(m.step, series)
        self.events = (self.events + events)[-MAX_EVENTS:]
        self.last = published
        said = [*m.notes, *notes]
        if m.image_step and self.sinks:
            said += self._queue_pictures(published, activations=activations, angle_work=m.angle_work)
        watched = [*config.projections, ACTIVATIONS] if activations else list(config.projections)
        said += invalid_head_notes(m.report, watched, self._invalid_seen)
        said += self.worker_notes()
        if said:
            lines = "\n  ".join(said)
            warn(
                f"hdi-monitor step {m.step}: {len(said)} note(s) (changes in the watched layers, dead heads, "
                f"dashboard writes):\n  {lines}",
                MonitoringWarning,
                rank_zero_only=True,
            )
        if events and dispatch_events(
            m.step, events, config.on_event, config.warned_signals, explained=self._explained
        ):
            self.stop_requested = True
        self._write(published, activations=activations)
        return published

    # ------------------------------------------------------------------ pictures (queued)
    def _queue_pictures(
        self, m: Measurement, *, activations: bool, angle_work: Sequence[AngleWork] = (), angles: bool = True
    ) -> list[str]:
        """Prepare the pictures of ``m`` and queue them for the worker; never waits. Returns a note
        when the queue was full (the pictures are dropped)."""
        job = self.dashboard.image_job(
            m.report,
            self.history,
            step=m.step,
            projections=self.config.projections,
            activations=activations,
            angles=angles and not angle_work,
        )
        if angle_work:
            job = dataclasses.replace(job, late_histograms=partial(self._late_histograms, m.report, list(angle_work)))
        if self._worker.submit(job, self.sinks):
            self.imaged_step = m.step
            return []
        return [
            f"the dashboard images of step {m.step} were dropped: {self._worker.dropped} image step(s) so far "
            f"found the drawing queue full (image_queue_size={self.config.image_queue_size}); draw less often "
            "(log_images_every_n_steps) or enlarge the queue"
        ]

    def _late_histograms(self, report: DiversityReport, work: list[AngleWork]) -> dict[str, Tensor]:
        """On the worker: the deferred principal angles (their own result: the record is not
        changed), then the histograms."""
        angles = compute_angles(report, work)
        return self.dashboard.histograms({p: angles.get(p, {}) for p in self.config.projections})

    def _write_pictures(self, job: Any, images: dict[str, bytes], sinks: Sequence[Sink]) -> list[Any]:
        """On the worker: the images and histograms of one job to every sink, each alone and under
        its lock."""
        failures: list[tuple[str, Exception]] = []
        histograms = dict(job.histograms)
        if job.late_histograms is not None:
            try:
                histograms.update(job.late_histograms())
            except Exception as err:  # noqa: BLE001 - reported by the training thread
                failures.append((f"computing the principal angles of step {job.step}", err))
        if not images and not histograms:
            return failures
        for sink in sinks:
            if not takes_pictures(sink):  # scalars only (LoggerSink): never called off the training thread
                continue
            try:  # no lock shared with the training thread: a slow upload never holds a step
                if images:
                    sink.log_images(dict(images), job.step)
                if histograms:
                    sink.log_histograms(dict(histograms), job.step)
                sink.flush()
            except Exception as err:  # noqa: BLE001 - one sink's failure must not cost the others
                failures.append((f"sink:{id(sink)}:{type(sink).__name__}:{job.step}", err))
        return failures

    def worker_notes(self) -> list[str]:
        """Failures of the worker since the last call, as note lines (a sink's failure only the
        first time); strict: raise the first."""
        lines = []
        for what, err in self._worker.take_notes():
            if self.config.strict:
                raise err
            if what.startswith("sink:"):
                _, ident, name, step = what.split(":", 3)
                if int(ident) in self._failed_sinks:
                    continue
                self._failed_sinks.add(int(ident))
                lines.append(
                    f"sink {name} failed writing the images of step {step} ({type(err).__name__}: {err}); its "
                    "later failures are not reported again"
                )
            else:
                lines.append(f"error while {what} ({type(err).__name__}: {err}); those images are skipped")
        return lines

    # ------------------------------------------------------------------ on the calling thread
    def flush(self) -> None:
        """Wait for the queued pictures (at most `wait_timeout` seconds), report what failed or was
        lost (one warning), flush every sink.

        Raises:
            Exception: with ``strict``, the first failure.
        """
        notes = self._drain()
        notes += self.worker_notes()
        if notes:
            warn("hdi-monitor: " + "; ".join(notes), MonitoringWarning, rank_zero_only=True)
        for sink in self.sinks:
            sink.flush()

    def _drain(self) -> list[str]:
        """Wait for the queued pictures, at most `wait_timeout` seconds; what was lost, as notes."""
        try:
            self._worker.wait(self.wait_timeout)
        except Stuck as lost:
            if self.config.strict:
                raise
            return [str(lost)]
        return []

    def finish_run(self) -> None:
        """End of a run: queue the pictures of the last measured step (never dropped) if it was not
        an image step (no angle histograms: they need that step's weights), then wait for the
        worker and stop it."""
        last = self.last
        notes: list[str] = []
        if last is not None and self.imaged_step != last.step and self.config.image_every_n_steps and self.sinks:
            notes += self._drain()  # room in the queue: the last pictures are not dropped
            notes += self._queue_pictures(last, activations=last.activations, angles=False)
        try:
            self._worker.close(self.wait_timeout)
        except Stuck as lost:
            if self.config.strict:
                raise
            notes.append(str(lost))
        if notes:
            warn("hdi-monitor: " + "; ".join(notes), MonitoringWarning, rank_zero_only=True)
        self._summarize_run()

    @property
    def speaks(self) -> bool:
        """True when the run's lines are written (``on_event`` is ``"warn"`` or ``"stop"``; ``"log"``
        and a callable print nothing)."""
        return self.config.on_event in ("warn", "stop")

    def _warmup(self) -> Any:
        """The detector whose warm-up the run's lines describe (the HDI detector, else the kernel
        detector), or None when no detector is on."""
        if self.detector is not None:
            return self.detector
        return self.kernel_detector if self.config.kernel_stats else None

    def warmup_line(self, first_step: int) -> str | None:
        """The one line said at a run's first measured step: until which step the detectors warm
        up, and which signals warn (None when nothing is said: no detector, or ``on_event`` is
        ``"log"`` or a callable)."""
        detector = self._warmup()
        if detector is None or not self.speaks:
            return None
        every = self.config.every_n_steps
        # measurements fed before this one (this one is already fed): a resumed or continued run's
        before = detector.seen - 1 if isinstance(detector, SaturationDetector) and detector.seen else 0
        left = detector.warmup_measurements - before
        if detector.warmup_steps is not None:
            until = f"until step {detector.warmup_steps}"
        elif left <= 0:
            until = f"no longer ({before} measurements before step {first_step})"
        else:
            last = first_step + (left - 1) * every
            until = f"until step {last} ({detector.warmup_measurements} measurements, every {every} steps)"
        warned = sorted(self.config.warned_signals)
        says = f"warn on {', '.join(warned)}" if warned else "log their events, none warns (warn_on=)"
        line = f"hdi-monitor: early-warning detectors warm up {until}; they {says}"
        return line if len(line) <= 200 else f"hdi-monitor: early-warning detectors warm up {until}"

    def _summarize_run(self) -> None:
        """The end-of-run line: that the run ended inside the warm-up, or its events (warned and
        logged); nothing with ``on_event="log"`` or a callable."""
        if not self._run:
            return
        count, n_events, _ = self._run
        self._run = []
        self._explained = set()
        if not self.speaks or self.last is None:
            return
        detector = self._warmup()
        if detector is None:
            warming = False
        elif detector.warmup_steps is not None:
            warming = self.last.step < detector.warmup_steps
        elif isinstance(detector, SaturationDetector):
            warming = detector.seen <= detector.warmup_measurements
        else:
            warming = count <= detector.warmup_measurements
        if n_events == 0 and warming:
            say(
                f"hdi-monitor: the run ended inside the early-warning warm-up (step {self.last.step}, {count} "
                "measurement(s)): no event could fire; see warmup_measurements"
            )
        elif detector is not None or n_events:
            events = self.events[-n_events:] if n_events else []
            line = run_summary(events, self.config.warned_signals, count)
            if not n_events and isinstance(detector, SaturationDetector) and detector.warmup_steps is None:
                needed = detector.warmup_measurements + detector.patience + 1
                if detector.seen < needed:
                    line += f"; saturation is first judged at measurement {needed}"
            say(line)

    def _write(self, m: Measurement, *, activations: bool) -> None:
        """Scalars, layout, levels and events to every sink, each guarded alone and under its lock:
        a failing sink loses only its own write."""
        sinks = self.sinks
        if not sinks:
            return
        projections = self.config.projections
        layout = levels = None
        if any(id(s) not in self._delivered for s in sinks):  # until every sink has them (retried next step)
            names: dict[str, list[str]] = {
                p: [layer_tag(la.name) for la in m.report.layers if la.hdi.get(p) is not None] for p in projections
            }
            layout = self.dashboard.layout(
                names,
                activations=activations,
                kernel=self.config.kernel_stats,
                bounds=any(la.logit_bound is not None for la in m.report.layers),
                updates=self.config.update_entropy,
            )
            levels = self.dashboard.levels_text(m.report, projections)
            self.dashboard.layout_written = True
        first_error: Exception | None = None
        scalars = m.scalars
        for sink in sinks:
            try:
                if layout is not None and id(sink) not in self._delivered:
                    sink.log_layout(layout)
                    if levels is not None:
                        sink.log_text("hdi_levels", levels, m.step)
                    self._delivered.add(id(sink))
                sink.log_scalars(dict(scalars), m.step)
                for event in m.events:
                    sink.log_text(f"diversity_events/{event.kind}", event.message, m.step)
                sink.flush()
            except Exception as err:  # noqa: BLE001 - one sink's failure must not cost the others
                first_error = first_error or err
                if id(sink) not in self._failed_sinks and not self.config.strict:
                    self._failed_sinks.add(id(sink))
                    warn(
                        f"hdi-monitor: sink {type(sink).__name__} failed at step {m.step} ({type(err).__name__}: {err}); "
                        "its write is skipped, the other sinks, history and events are kept. Later failures of "
                        "this sink are not reported again.",
                        MonitoringWarning,
                    )
        if first_error is not None and self.config.strict:
            raise first_error

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """History, kept events, detector states and the dashboard's kept invalid-head charts
        (plain Python types). The pictures still queued are written first (a bounded wait), so a
        run killed after its checkpoint has them; what could not be written is named in a warning."""
        lost = self._drain()
        if lost:
            warn("hdi-monitor: before the checkpoint: " + "; ".join(lost), MonitoringWarning, rank_zero_only=True)
        return {
            "history": self.history.state_dict(),
            "events": [e.to_dict() for e in self.events],
            "detector": self.detector.state_dict() if self.detector is not None else None,
            "activation_detector": (
                self.activation_detector.state_dict() if self.activation_detector is not None else None
            ),
            "kernel_detector": self.kernel_detector.state_dict() if self.kernel_detector is not None else None,
            "unhealthy": sorted(self.dashboard.unhealthy),  # per-layer invalid-head charts kept on
            "explained": sorted(self._explained),  # signals whose evidence this run's warnings stated
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` (the history first; see `hdi_monitor.monitor.history.History`)."""
        self.history.load_state_dict(state.get("history", []))
        self.events = [DiversityEvent.from_dict(e) for e in state.get("events", [])][-MAX_EVENTS:]
        for name in ("detector", "activation_detector", "kernel_detector"):
            target = getattr(self, name)
            if target is not None and state.get(name) is not None:
                target.load_state_dict(state[name])
        self._explained = {str(s) for s in state.get("explained", [])}
        if state.get("unhealthy") is not None:  # replaces what this publisher logged before the load
            self.dashboard.unhealthy = {str(tag) for tag in state["unhealthy"]}
