"""`head_diversity`: the one-shot report of a model, measured through the same
`hdi_monitor.measure.step.MeasuredStep` as a training run's measured steps."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hdi_monitor._validation import check_int
from hdi_monitor.config import MonitorConfig
from hdi_monitor.functional.diversity import Weighting
from hdi_monitor.measure.step import MeasuredStep
from hdi_monitor.measure.watch import ModelWatch
from hdi_monitor.models import AttentionSpec
from hdi_monitor.models.base import PROJECTIONS
from hdi_monitor.models.sharding import is_fsdp1_module
from hdi_monitor.report import DiversityReport, Progress, Projection

__all__ = ["head_diversity"]


def _raise(err: Exception) -> None:
    raise err


def head_diversity(
    model: nn.Module,
    *,
    projections: Sequence[Projection] | Projection = PROJECTIONS,
    weighting: Weighting = "spectral",
    spec: AttentionSpec | Sequence[AttentionSpec] | None = None,
    layers: str | Sequence[str] | None = None,
    inputs: Any = None,
    max_tokens: int | None = None,
    progress: Progress | None = None,
    call: nn.Module | str | None = None,
) -> DiversityReport:
    """Head diversity of every attention layer of ``model``.

    Args:
        model: the model (any ``nn.Module`` with attention layers of a supported family, or ``spec``).
        projections: which of ``"query"``, ``"key"``, ``"value"``, ``"output"`` to measure.
        weighting: ``"spectral"`` (default) or ``"uniform"`` subspace overlap.
        spec: one `AttentionSpec` or a list, for modules no built-in family covers; combines with
            the built-in families (a spec wins where both match).
        layers: a regex (``re.search`` on qualified names) or a list of exact layer names.
        inputs: optional batches for head-output covariance statistics: one batch (a dict is called
            as ``model(**batch)``, a tuple as ``model(*batch)``, a tensor as ``model(batch)``) or an
            iterable of batches (a list of dicts or tensors, a DataLoader, ...). Tokens are
            restricted to real ones where the hook gives a mask (``nn.MultiheadAttention`` with a
            ``key_padding_mask``) and, for dict batches, by ``batch[layer.mask_key]`` (e.g.
            ``attention_mask``). The model runs in eval mode (restored afterwards) under no_grad;
            inputs must already be on the model's device.
        max_tokens: cap on the tokens each layer takes over all the batches (a random subsample
            drawn with a private generator, seeded 0).
        progress: called with the number of work units just done, for a progress bar:
            ``len(layers) * len(projections)`` layer measurements, then one per batch of
            ``inputs``; ``tqdm(total=...).update`` fits.
        call: the module the ``inputs`` are passed to, or its qualified name in ``model``: a
            submodule that holds the attention layers, for a model without a ``forward`` of its own
            (a LightningModule that calls ``self.net(x)`` in its ``training_step``); default
            ``model`` itself.

    Returns:
        A `DiversityReport`; ``print(report)`` shows a table. Attention-like modules that are not
        measured are in ``report.skipped`` with the reason (and in the table) and named in one
        warning.

    Raises:
        TypeError, ValueError: bad arguments; a model without a recognised attention layer; with
            ``inputs``, a layer that received fewer than two real tokens (the message says why).

    This rank measures alone (no collective), except that an FSDP1 model
    (``FullyShardedDataParallel``) is read one FSDP unit at a time when ``model`` is the FSDP root
    itself (a collective: call it on every rank then).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if max_tokens is not None:
        check_int("max_tokens", max_tokens)
    config = MonitorConfig(
        projections=(projections,) if isinstance(projections, str) else tuple(projections),
        weighting=weighting,
        spec=tuple(spec) if isinstance(spec, list) else spec,  # type: ignore[arg-type]
        layers=tuple(layers) if isinstance(layers, list) else layers,  # type: ignore[arg-type]
        activations=inputs is not None,
        max_tokens=max_tokens,
        log_images_every_n_steps=0,
    )
    watch = ModelWatch(model, config, fsdp_root=model if is_fsdp1_module(model) else None, collectives=False)
    with torch.no_grad():
        for note in watch.setup():
            warnings.warn(note, UserWarning, stacklevel=2)
        step = MeasuredStep.start(watch, 0, image=False, on_error=_raise, progress=progress)
        if inputs is not None and step.run(inputs, progress, call=_call_target(model, call)) == 0:
            raise ValueError("inputs held no batch")
        measurement = step.finish()
    if inputs is not None:
        missing = [la for la in measurement.report.layers if la.effective_heads is None]
        if missing:
            said = " ".join(measurement.notes)
            raise ValueError(
                f"{missing[0].name}: no head-output statistics: {measurement.token_counts.get(missing[0].name, 0)} "
                f"real token(s) reached it (at least 2 are needed; check that the inputs reach this layer and that "
                f"its token mask keeps real tokens). {said}".rstrip()
            )
    return measurement.report


def _call_target(model: nn.Module, call: nn.Module | str | None) -> nn.Module | None:
    if call is None or isinstance(call, nn.Module):
        return call
    if not isinstance(call, str):
        raise TypeError(f"call must be a module, the name of a submodule or None, got {type(call).__name__}")
    try:
        return model.get_submodule(call)
    except AttributeError as err:
        raise ValueError(f"call={call!r}: {type(model).__name__} has no submodule of that name") from err
