"""The monitor: when to measure, and everything after a measured step (detectors, history, sinks,
pictures). No Lightning here; the callbacks in `hdi_monitor.integrations` are thin shells over it.

Modules that may be used from outside (see the API reference):

* `tracker`: `HDITracker`, the schedule, the step counter, resume state and the error policy.
  Per measured step it calls the step three times (begin, stop capture, finish, in
  `hdi_monitor.measure.step.MeasuredStep`) and hands the frozen record to the publisher.
* `detector`: `SaturationDetector` (saturation, collapse, redundant heads; the events are
  `hdi_monitor.events.DiversityEvent`).
* `kernel_detector`: `KernelDetector` (entropy collapse, logit blow-up).
* `history`: `History`, the bounded columnar store of every measured step's scalars.
* `sinks`: the `Sink` protocol, `TensorBoardSink`, `LoggerSink` (a Lightning logger's own calls:
  W&B, MLflow) and `MemorySink`.
* `render`: the dashboard pictures, encoded straight from the tensors (colour tables, PNGs).

Private to the monitor (names may change without notice):

* `_publish`: `Publisher`, everything after a measured step, from its record to the sinks.
* `_tags`: the one place where a record's values become scalar tag names.
* `_dashboard`: what the TensorBoard dashboards show (layouts, image tags, the levels text).
* `_worker`: the background thread that draws and writes the pictures of image steps.
* `_resume`: resuming with changed settings.
* `_warnings`, `_canvas`, `_colormaps`: warning attribution and the pictures' drawing helpers.
"""
