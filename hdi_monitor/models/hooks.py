"""Running a model on batches: how a batch is called, iterated, put in eval mode, and where its
token mask is.

Shared by the measured step (`hdi_monitor.measure`), `hdi_monitor.head_diversity` and the
ablation tools. Routing head outputs into accumulators is the measured step's job
(`hdi_monitor.measure.capture`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["batch_mask", "call_model", "eval_mode", "iter_batches"]


def batch_mask(batch: Any, key: str | None) -> Tensor | None:
    """The token mask ``batch[key]`` when the batch is a mapping holding a tensor there."""
    if key is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    return mask if isinstance(mask, Tensor) else None


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run one batch: a mapping as ``model(**batch)``, a tuple/list as ``model(*batch)``, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def iter_batches(inputs: Any) -> Iterable[Any]:
    """``inputs`` as an iterable of batches: a tensor, mapping or tuple is one batch; a list of
    mappings/tensors/tuples, a DataLoader or any other iterable is many."""
    if isinstance(inputs, (Tensor, Mapping, tuple)):
        return [inputs]
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], (Tensor, Mapping, tuple, list)):
        return [inputs]
    if isinstance(inputs, Iterable):
        return inputs
    raise TypeError(
        f"inputs must be a batch (tensor, dict, tuple) or an iterable of batches, got {type(inputs).__name__}"
    )


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every module of ``model`` in eval mode (no dropout) and restore each one's flag after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
