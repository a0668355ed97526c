"""`Publisher`: a measurement record to the sinks.

The tracker hands each finished record here. Scalars, the Custom Scalars layout (once), the
reference levels (once) and the events' text are written on the calling (training) thread; the
pictures of image steps are prepared as an `hdi_monitor.monitor.render.ImageJob` (copies of a few
small tensors) and drawn and written by the background `hdi_monitor.monitor.worker.ImageWorker`.
Every sink is written alone (a failing sink loses only its own write, warned once) and under its
own lock, so the worker's images and the training thread's scalars never interleave in a sink.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

from torch import Tensor

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.monitor._warnings import warn
from hdi_monitor.monitor.config import MonitorConfig
from hdi_monitor.monitor.dashboard import Dashboard
from hdi_monitor.monitor.gaps import SinkDelivery
from hdi_monitor.monitor.history import History
from hdi_monitor.monitor.record import Measurement, layer_tag
from hdi_monitor.monitor.render import ImageJob, Renderer
from hdi_monitor.monitor.sinks import Sink
from hdi_monitor.monitor.worker import ImageWorker, SinkLocks
from hdi_monitor.report import AngleWork, DiversityReport, fill_angles

__all__ = ["Publisher"]


class Publisher:
    """Writes records to sinks (see the module docstring).

    Args:
        config: the tracker's settings (``strict``, ``projections``, ``image_queue_size``).
        dashboard: layout, summaries and pictures of the run.
        renderer: draws an `ImageJob` (``job -> {tag: PNG bytes}``), on the worker.
    """

    def __init__(self, config: MonitorConfig, dashboard: Dashboard, renderer: Renderer) -> None:
        self.config = config
        self.dashboard = dashboard
        self.renderer = renderer
        self.imaged_step: int | None = None  # last step whose pictures were queued
        self._locks = SinkLocks()
        self._failed_sinks: set[int] = set()  # id() of sinks that failed once (warned once)
        self._delivery = SinkDelivery()  # sinks that have the layout and the levels text
        self._worker = ImageWorker(lambda job: self.renderer(job), self._write_pictures, config.image_queue_size)

    @property
    def dropped(self) -> int:
        """Image steps whose pictures were dropped because the queue was full."""
        return self._worker.dropped

    # ------------------------------------------------------------------ pictures (queued)
    def queue_pictures(
        self,
        m: Measurement,
        history: History,
        sinks: Sequence[Sink],
        *,
        activations: bool,
        angle_work: list[AngleWork] | None = None,
        angles: bool = True,
    ) -> str | None:
        """Prepare the pictures of ``m`` and queue them for the worker; never waits. Returns a note
        when the queue was full (the pictures are dropped)."""
        job = self.dashboard.image_job(
            m.report,
            history,
            step=m.step,
            projections=self.config.projections,
            activations=activations,
            angles=angles and not angle_work,
        )
        if angle_work:
            job = dataclasses.replace(job, late_histograms=partial(self._late_histograms, m.report, angle_work))
        if self._worker.submit(job, sinks):
            self.imaged_step = m.step
            return None
        return (
            f"the dashboard images of step {m.step} were dropped: {self._worker.dropped} image step(s) so far "
            f"found the drawing queue full (image_queue_size={self.config.image_queue_size}); draw less often "
            "(log_images_every_n_steps) or enlarge the queue"
        )

    def finish_run(
        self, last: Measurement | None, history: History, sinks: Sequence[Sink], *, activations: bool
    ) -> None:
        """End of a run: queue the pictures of ``last`` (never dropped) if it was not an image step
        (no angle histograms: they need that step's weights), then wait for the worker and stop it."""
        if last is not None and self.imaged_step != last.step and self.config.image_every_n_steps and sinks:
            self._worker.wait()  # room in the queue: the last pictures are never dropped
            self.queue_pictures(last, history, sinks, activations=activations, angles=False)
        self._worker.close()

    def _late_histograms(self, report: DiversityReport, work: list[AngleWork]) -> dict[str, Tensor]:
        """On the worker: the deferred principal angles (into the record), then the histograms."""
        fill_angles(report, work)
        per_projection: dict[str, dict[str, Tensor]] = {
            p: {la.name: la.angles[p] for la in report.layers if p in la.angles} for p in self.config.projections
        }
        return self.dashboard.histograms(per_projection)

    def _write_pictures(self, job: ImageJob, images: dict[str, bytes], sinks: Sequence[Sink]) -> list[Any]:
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
            try:
                with self._locks(sink):
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
    def flush(self, sinks: Sequence[Sink]) -> None:
        """Wait for the queued pictures, report what failed (one warning), flush every sink.

        Raises:
            Exception: with ``strict``, the first failure.
        """
        self._worker.wait()
        notes = self.worker_notes()
        if notes:
            warn("hdi-monitor: " + "; ".join(notes), MonitoringWarning, rank_zero_only=True)
        for sink in sinks:
            with self._locks(sink):
                sink.flush()

    def write(self, m: Measurement, sinks: Sequence[Sink], *, activations: bool) -> None:
        """Scalars, layout, levels and events to every sink, each guarded alone and under its lock:
        a failing sink loses only its own write."""
        if not sinks:
            return
        projections = self.config.projections
        layout = levels = None
        if self._delivery.pending(sinks):  # until every sink has them (a failed write is retried next step)
            names: dict[str, list[str]] = {
                p: [layer_tag(la.name) for la in m.report.layers if la.hdi.get(p) is not None] for p in projections
            }
            layout = self.dashboard.layout(names, activations=activations, kernel=self.config.kernel_stats)
            levels = self.dashboard.levels_text(m.report, projections)
            self.dashboard.layout_written = True
        first_error: Exception | None = None
        for sink in sinks:
            try:
                with self._locks(sink):
                    if layout is not None and self._delivery.needs(sink):
                        sink.log_layout(layout)
                        if levels is not None:
                            sink.log_text("hdi_levels", levels, m.step)
                        self._delivery.done(sink)
                    sink.log_scalars(dict(m.scalars), m.step)
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
