"""Integrations: the Lightning callback, the Hugging Face ``Trainer`` callback, logger sinks.

* Lightning: `hdi_monitor.integrations.lightning.HDIMonitor` (also ``from hdi_monitor import
  HDIMonitor``).
* Hugging Face ``Trainer``: `HDITrainerCallback` (needs ``transformers``; imported on first use,
  so this package imports without it).
* Logger sinks for W&B, MLflow and Comet: `hdi_monitor.integrations.loggers`.
* Plain loop: `HDITracker` itself is the API (re-exported here):

```python
tracker = HDITracker(model, every_n_steps=100, writer=SummaryWriter("runs/x"))
for batch in loader:
    with tracker.capture(batch):          # head outputs of this forward pass, if measured
        loss = loss_fn(model(batch))
    loss.backward()
    tracker.step()                        # finish the measured step, advance the step
    optimizer.step(); optimizer.zero_grad()
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hdi_monitor.monitor.tracker import HDITracker, Measurement

__all__ = ["HDITracker", "HDITrainerCallback", "Measurement"]


def __getattr__(name: str) -> Any:
    if name == "HDITrainerCallback":  # imported on first use: transformers is an optional dependency
        from hdi_monitor.integrations.hf_trainer import HDITrainerCallback

        return HDITrainerCallback
    raise AttributeError(f"module 'hdi_monitor.integrations' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from hdi_monitor.integrations.hf_trainer import HDITrainerCallback
