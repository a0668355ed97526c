"""Capture head outputs of attention layers into covariance accumulators.

Shared by `hdi_monitor.head_diversity` (one-shot, ``inputs=``) and
`hdi_monitor.HDITracker` (during training). Family knowledge stays in the adapters: each
`AttentionLayer` knows how to deliver its concatenated head outputs
``o`` and a keep-mask; this module only routes them, adding the batch's padding mask when the batch
is a dict holding the layer's ``mask_key`` with a matching shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor.functional.covariance import HeadCovarianceAccumulator
from hdi_monitor.models import AttentionLayer

__all__ = ["attach_output_hooks", "call_model", "iter_batches", "batch_mask", "eval_mode"]


def batch_mask(batch: Any, key: str | None) -> Tensor | None:
    """The token mask ``batch[key]`` when the batch is a mapping holding a tensor there."""
    if key is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    return mask if isinstance(mask, Tensor) else None


def _on_output(acc: HeadCovarianceAccumulator, mask: Tensor | None, o: Tensor, keep: Tensor | None) -> None:
    if mask is not None and tuple(mask.shape) == tuple(o.shape[:-1]):
        mask = mask.to(device=o.device, dtype=torch.bool)
        keep = mask if keep is None else keep & mask
    acc.update(o.detach(), keep)


def attach_output_hooks(
    layers: Sequence[AttentionLayer],
    accumulators: Sequence[HeadCovarianceAccumulator | None],
    batch: Any = None,
    on_error: Callable[[Exception], None] | None = None,
) -> list[Any]:
    """Feed every layer's head outputs into its accumulator; returns handles to ``.remove()``.

    With ``on_error``, an exception inside a hook goes to ``on_error(err)`` instead of the forward pass.
    """
    handles = []
    try:
        for layer, acc in zip(layers, accumulators, strict=True):
            if acc is not None:
                fn = partial(_on_output, acc, batch_mask(batch, layer.mask_key))
                handles.append(layer.attach_output_hook(fn, on_error=on_error))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


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


def output_accumulator(layer: AttentionLayer, **kwargs: Any) -> HeadCovarianceAccumulator:
    """A covariance accumulator for ``layer`` that reads the layer's own ``W_O`` in every update
    (inside the forward pass: the weights that produced the head outputs); ``kwargs`` go to
    `HeadCovarianceAccumulator`."""
    return HeadCovarianceAccumulator(
        layer.num_heads,
        layer.head_dim,
        w_out=partial(layer.head_weights, "output"),
        model_dim=layer.model_dim,
        **kwargs,
    )
