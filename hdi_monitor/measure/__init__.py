"""The measured step: from a model to a frozen record of one measured step.

Modules (data flows down the list):

* `watch` (`ModelWatch`): what is watched in a model (the layers, compiled parts, the monitor's
  own generator, what was said once per layer), kept across measured steps; starts each step.
* `step` (`MeasuredStep`): one measured step, from the weight read to its record; the one place
  whose collectives run on every rank in a fixed order.
* `capture`: the hooks of one forward pass (head outputs, kernel calls, call counts);
  `compiled`: the side forward of compiled parts of a model (their graphs are never hooked).
* `accumulators` (`Accumulator`, `sync_accumulators`): named states with a reduce kind and one
  packed multi-rank sum; `covariance` and `kernel`: the two accumulators.
* `measurement` (`Measurement`, `Series`): the frozen record and the typed key of a scalar series.
* `ranks`: do all ranks watch the same? (one check at setup) and the per-step agreement.
* `oneshot` (`head_diversity`): the one-shot report of a model, through the same step.

From outside, use `Measurement`, `Series`, `head_diversity`, the accumulators and `sync_accumulators`;
the tracker (`hdi_monitor.monitor.tracker`) is the only user of `ModelWatch` and `MeasuredStep`.
Nothing here knows Lightning, sinks or warnings: a step returns notes, and its caller says them.
"""

from hdi_monitor.measure.accumulators import Accumulator, sync_accumulators
from hdi_monitor.measure.covariance import HeadCovarianceAccumulator
from hdi_monitor.measure.kernel import KernelStatsAccumulator, KernelStatsCapture
from hdi_monitor.measure.measurement import Measurement, Series, layer_tag
from hdi_monitor.measure.oneshot import head_diversity
from hdi_monitor.measure.step import MeasuredStep, StepFailed
from hdi_monitor.measure.watch import ModelWatch

__all__ = [
    "Accumulator",
    "HeadCovarianceAccumulator",
    "KernelStatsAccumulator",
    "KernelStatsCapture",
    "MeasuredStep",
    "Measurement",
    "ModelWatch",
    "Series",
    "StepFailed",
    "head_diversity",
    "layer_tag",
    "sync_accumulators",
]
