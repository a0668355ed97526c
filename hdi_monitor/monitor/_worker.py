"""`ImageWorker`: draws and writes the pictures of image steps on a background thread.

The training step only builds an `hdi_monitor.monitor.render.ImageJob` (copies of a few small
tensors) and hands it over with `ImageWorker.submit`; PNG encoding and the sinks' image and
histogram writes happen on the worker's thread. Nothing the training thread does waits for it:

* the queue is bounded: when it is full, `submit` drops the job and returns False at once (the
  caller notes it);
* the worker takes no lock that the training thread takes (a sink is written by two threads: the
  scalars on the training thread, the pictures here; the built-in sinks are thread-safe), so a
  slow image upload never holds a training step;
* every wait is bounded (`wait` and `close` take a timeout): a renderer or a sink that never
  returns costs the pictures it holds, named in a note, never the run. A worker that did not
  finish in time is abandoned (a daemon thread: it ends with the process) and a new one takes the
  next job.

Failures (a renderer or a sink that raises) never reach the training step: they are kept as
notes, which the publisher takes with `ImageWorker.take_notes` and reports (or raises, when
strict) from the training thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hdi_monitor.monitor.render import ImageJob, Renderer

__all__ = ["ImageWorker", "Stuck"]

#: Writes a job's images to the sinks (runs on the worker); returns notes about failures.
Writer = Callable[[ImageJob, dict[str, bytes], Sequence[Any]], list[tuple[str, Exception]]]


class Stuck(TimeoutError):
    """The worker did not finish its jobs within the wait's bound: their pictures are not written."""


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
        self._size = queue_size
        self._queue: queue.Queue[tuple[ImageJob, Sequence[Any]] | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._notes: list[tuple[str, Exception]] = []
        self._lock = threading.Lock()  # the notes and the pending steps: held for a few bytecodes only
        self._pending: list[int] = []  # steps submitted and not finished, oldest first
        self.dropped = 0  #: jobs dropped because the queue was full
        self.done = 0  #: jobs finished (written or failed)

    @property
    def pending(self) -> list[int]:
        """The steps whose pictures are queued or being drawn."""
        with self._lock:
            return list(self._pending)

    def submit(self, job: ImageJob, sinks: Sequence[Any]) -> bool:
        """Queue a job; False (nothing queued, nothing waited for) when the queue is full."""
        if self._thread is None or not self._thread.is_alive():
            self._start()
        try:
            self._queue.put_nowait((job, list(sinks)))
        except queue.Full:
            self.dropped += 1
            return False
        with self._lock:
            self._pending.append(job.step)
        return True

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="hdi-monitor-images", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> None:
        """Block until every queued job is written (or failed), at most ``timeout`` seconds.

        Raises:
            Stuck: the jobs did not finish in time. The worker is abandoned with them (their
                pictures are lost, named in the message) and the next `submit` starts a new one.
        """
        q = self._queue
        deadline = time.monotonic() + max(0.0, timeout)
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                q.all_tasks_done.wait(left)
            finished = not q.unfinished_tasks
        if finished:
            return
        lost = self.pending
        self._abandon()
        raise Stuck(
            f"the pictures of step(s) {lost} were not written: the renderer or an image sink did not return "
            f"within {timeout:g} s (that worker is abandoned; later pictures get a new one)"
        )

    def _abandon(self) -> None:
        """Leave the stuck thread with its queue and start afresh (nothing waits for it any more)."""
        self._queue = queue.Queue(maxsize=self._size)
        self._thread = None
        with self._lock:
            self._pending = []

    def close(self, timeout: float) -> None:
        """Wait for the queued jobs (at most ``timeout`` seconds, see `wait`), then stop the thread
        (a later `submit` starts a new one).

        Raises:
            Stuck: as `wait`.
        """
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self.wait(timeout)
        self._queue.put_nowait(None)  # the queue is empty now: there is room
        thread.join(timeout)
        self._thread = None

    def take_notes(self) -> list[tuple[str, Exception]]:
        """The failures since the last call, as ``(what, error)``."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def _run(self, jobs: queue.Queue[tuple[ImageJob, Sequence[Any]] | None]) -> None:
        # One intra-op thread for this thread's torch work (the principal angles): torch's thread
        # count is per calling thread under OpenMP, so training keeps its own. Two OpenMP teams on
        # the same cores (the training thread's and this one's) spin against each other: with the
        # default 2 threads on 2 cores, 3 image steps cost 12.8 s of CPU instead of 2.2 s.
        import torch

        torch.set_num_threads(1)
        # the queue is this thread's own: an abandoned worker never takes a later job
        while True:
            item = jobs.get()
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
                if jobs is not self._queue:
                    return  # abandoned meanwhile: its jobs were named as lost; say nothing more
                with self._lock:
                    self._notes += notes
                    self.done += 1
                    if job.step in self._pending:
                        self._pending.remove(job.step)
            finally:
                jobs.task_done()
