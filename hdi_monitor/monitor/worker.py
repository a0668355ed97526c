"""`ImageWorker`: draws and writes the pictures of image steps on a background thread.

The training step only builds an `hdi_monitor.monitor.render.ImageJob` (copies of a few small
tensors) and hands it over with `ImageWorker.submit`; PNG encoding and the sinks' image and
histogram writes happen on the worker's thread. The queue is bounded: when it is full, `submit`
drops the job and returns False at once (the caller notes it), so the training step never waits.

Writes to a sink are serialised with the sink's lock (`SinkLocks`): the worker's image writes and
the training thread's scalar writes never interleave inside one sink.

Failures (a renderer or a sink that raises) never reach the training step: they are kept as
notes, which the tracker takes with `ImageWorker.take_notes` and reports (or raises, when strict)
from the training thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hdi_monitor.monitor.render import ImageJob, Renderer

__all__ = ["ImageWorker", "SinkLocks"]


class SinkLocks:
    """One lock per sink (by identity), shared by the training thread and the worker."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def __call__(self, sink: Any) -> threading.Lock:
        with self._guard:
            lock = self._locks.get(id(sink))
            if lock is None:
                lock = self._locks[id(sink)] = threading.Lock()
            return lock


#: Writes a job's images to the sinks (runs on the worker); returns notes about failures.
Writer = Callable[[ImageJob, dict[str, bytes], Sequence[Any]], list[tuple[str, Exception]]]


class ImageWorker:
    """A daemon thread with a bounded queue of image jobs.

    Args:
        renderer: draws a job's images (``job -> {tag: png}``).
        write: writes the images and histograms of a job to the sinks; returns
            ``(what, error)`` for each failure.
        queue_size: jobs waiting at most (>= 1).
    """

    def __init__(self, renderer: Renderer, write: Writer, queue_size: int) -> None:
        self.renderer = renderer
        self._write = write
        self._queue: queue.Queue[tuple[ImageJob, Sequence[Any]] | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._notes: list[tuple[str, Exception]] = []
        self._lock = threading.Lock()
        self.dropped = 0  #: jobs dropped because the queue was full
        self.done = 0  #: jobs finished (written or failed)

    def submit(self, job: ImageJob, sinks: Sequence[Any]) -> bool:
        """Queue a job; False (nothing queued, nothing waited for) when the queue is full."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="hdi-monitor-images", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((job, list(sinks)))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def wait(self) -> None:
        """Block until every queued job is written (or failed)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Wait for the queued jobs, then stop the thread (a later `submit` starts a new one)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._queue.join()
        self._queue.put(None)
        thread.join()
        self._thread = None

    def take_notes(self) -> list[tuple[str, Exception]]:
        """The failures since the last call, as ``(what, error)``."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                job, sinks = item
                notes: list[tuple[str, Exception]] = []
                try:
                    images = dict(self.renderer(job))
                except Exception as err:  # noqa: BLE001 - reported by the training thread
                    notes.append((f"drawing the images of step {job.step}", err))
                    images = {}
                notes += self._write(job, images, sinks)
                with self._lock:
                    self._notes += notes
                    self.done += 1
            finally:
                self._queue.task_done()
