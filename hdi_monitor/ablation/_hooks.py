"""Edit head outputs at the input of the output projection: ablation, gates, means.

Every supported family delivers its concatenated head outputs ``o`` (``(..., H * d)``, head-major)
at the input of its output projection, so one forward pre-hook there can replace ``o`` by an edited
``o'``: heads zeroed, heads set to their mean output, or heads scaled by a gate ``xi_h``. The one
exception is ``nn.MultiheadAttention``, which calls ``F.linear`` on ``out_proj`` directly
(pytorch #78109): there a forward hook on the module adds ``(o' - o) @ W_O^T`` to its output, with
``o`` recomputed from the call's inputs by the adapter's output hook (dropout-free). Both give the
layer output ``W_O o' + b``. Hooks are removed on exit, also on exceptions; no parameter, buffer or
flag of the model is left changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor._validation import check_index
from hdi_monitor.models import AttentionLayer, find_attention_layers
from hdi_monitor.models.hooks import batch_mask, call_model, eval_mode, iter_batches
from hdi_monitor.models.torch_mha import hold_fastpath_off

__all__ = ["check_heads", "edit_head_outputs", "head_output_means", "output_module", "resolve_layers"]

Edit = Callable[[Tensor], Tensor]
"""``edit(o) -> o'`` on ``(..., H * d)`` concatenated head outputs."""


def output_module(layer: AttentionLayer) -> nn.Module | None:
    """The module whose input is the layer's concatenated head output (None for ``torch_mha``)."""
    return getattr(layer, "output_module", None) or getattr(layer, "_output_module", None)


def resolve_layers(model: nn.Module, layers: Sequence[AttentionLayer] | None = None) -> dict[str, AttentionLayer]:
    """``{name: layer}`` for ``layers`` or, when None, every attention layer discovery finds."""
    if layers is None:
        with torch.no_grad():
            layers = find_attention_layers(model)
    return {layer.name: layer for layer in layers}


def check_heads(heads: Mapping[str, Iterable[int]], by_name: Mapping[str, AttentionLayer]) -> dict[str, list[int]]:
    """Validate ``{layer name: head indices}``; returns sorted, de-duplicated lists.

    Head indices are an iterable of integers (a list, tuple, range, integer tensor or numpy
    array); a string or bytes (``"01"`` would read as heads 0 and 1), a bare integer, floats and
    bools are refused.

    Raises:
        TypeError: heads that are not an iterable of integers, naming the layer.
        ValueError: an unknown layer name, or a head index outside ``0..num_heads - 1``.
    """
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads must be a mapping {{layer name: [head indices]}}, got {type(heads).__name__}")
    out: dict[str, list[int]] = {}
    for name, idx in heads.items():
        if name not in by_name:
            known = ", ".join(list(by_name)[:8]) + (", ..." if len(by_name) > 8 else "")
            raise ValueError(f"no attention layer named {name!r}; the model has: {known or 'none'}")
        try:
            if isinstance(idx, (str, bytes, bytearray)):
                raise TypeError
            items = list(idx)  # also a 0-d tensor's "iteration over a 0-d tensor"
        except TypeError:
            raise TypeError(
                f"{name}: head indices must be a sequence of integers (e.g. [0, 1]), got {type(idx).__name__} {idx!r}"
            ) from None
        h = by_name[name].num_heads
        values = sorted({check_index(f"{name}: head index", i) for i in items})
        bad = [i for i in values if not 0 <= i < h]
        if bad:
            raise ValueError(f"{name}: head indices {bad} out of range (the layer has {h} heads, 0..{h - 1})")
        out[name] = values
    return out


def _split(o: Tensor, heads: int) -> Tensor:
    return rearrange(o, "... (h d) -> ... h d", h=heads)


def _merge(o: Tensor) -> Tensor:
    return rearrange(o, "... h d -> ... (h d)")


def _replace_first(args: tuple, kwargs: dict, edit: Edit) -> tuple[tuple, dict]:
    if args:
        return (edit(args[0]), *args[1:]), kwargs
    if not kwargs:
        raise ValueError("the output module was called without an input")
    key = next(iter(kwargs))
    return args, {**kwargs, key: edit(kwargs[key])}


def _attach_edit(layer: AttentionLayer, edit: Edit) -> list[Any]:
    """Hooks that make ``layer``'s output ``W_O edit(o) + b``; returns handles to remove."""
    target = output_module(layer)
    if target is not None and layer.family != "torch_mha":

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _replace_first(args, kwargs, edit)

        return [target.register_forward_pre_hook(pre_hook, with_kwargs=True)]
    if layer.family != "torch_mha" or not isinstance(layer.module, nn.MultiheadAttention):
        raise ValueError(
            f"{layer.name}: family {layer.family!r} exposes no output module, so its head outputs cannot be edited"
        )
    stash: list[Tensor] = []
    # The adapter's observe-only hook recomputes o from the call's inputs. The MHA fast path is held
    # off while attached (an analysis, not a training run): a nested batch from nn.TransformerEncoder
    # would give a nested output, to which the padded correction below cannot be added.
    fastpath = hold_fastpath_off()
    try:
        observe = layer.attach_output_hook(lambda o, _keep: stash.append(o))
        w_out = rearrange(layer.head_weights("output"), "h m d -> m (h d)")
    except BaseException:
        fastpath.remove()
        raise

    def post_hook(_mod: nn.Module, _args: tuple, output: Any) -> Any:
        o = stash.pop()
        delta = (edit(o) - o).to(w_out.dtype) @ w_out.T.to(o.device)
        if isinstance(output, tuple):
            return (output[0] + delta.to(output[0].dtype), *output[1:])
        return output + delta.to(output.dtype)

    return [fastpath, observe, layer.module.register_forward_hook(post_hook)]


@contextlib.contextmanager
def edit_head_outputs(layers: Mapping[str, AttentionLayer], edits: Mapping[str, Edit]) -> Iterator[None]:
    """While active, layer ``name``'s head outputs ``o`` are replaced by ``edits[name](o)``."""
    handles: list[Any] = []
    try:
        for name, edit in edits.items():
            handles.extend(_attach_edit(layers[name], edit))
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()


def zero_edit(heads: Sequence[int], num_heads: int) -> Edit:
    """``o'`` with the slices of ``heads`` set to zero."""

    def edit(o: Tensor) -> Tensor:
        keep = torch.ones(num_heads, dtype=o.dtype, device=o.device)
        keep[list(heads)] = 0
        return _merge(_split(o, num_heads) * keep[:, None])

    return edit


def mean_edit(heads: Sequence[int], num_heads: int, mean: Tensor) -> Edit:
    """``o'`` with the slices of ``heads`` set to their mean output ``mean`` (``(H * d,)``)."""

    def edit(o: Tensor) -> Tensor:
        drop = torch.zeros(num_heads, dtype=torch.bool, device=o.device)
        drop[list(heads)] = True
        m = _split(mean.to(device=o.device, dtype=o.dtype), num_heads)
        return _merge(torch.where(drop[:, None], m, _split(o, num_heads)))

    return edit


def gate_edit(gate: Tensor, num_heads: int) -> Edit:
    """``o'_h = gate_h o_h`` (differentiable in ``gate``)."""

    def edit(o: Tensor) -> Tensor:
        return _merge(_split(o, num_heads) * gate.to(o.dtype)[:, None])

    return edit


def _collect_into(collect: Callable[..., None], name: str, mask: Tensor | None, o: Tensor, keep: Tensor | None) -> None:
    collect(name, mask, o, keep)


def head_output_means(
    model: nn.Module, batches: Any, *, layers: Sequence[AttentionLayer] | None = None
) -> dict[str, Tensor]:
    """Mean head output ``E[o]`` of every layer over the real tokens of ``batches``.

    The reference for ``ablate_heads(..., mode="mean")``. Tokens are restricted by the batch's
    ``attention_mask`` (the layer's ``mask_key``) when the batch is a dict holding one of the right
    shape, and by the padding mask ``nn.MultiheadAttention`` receives. Runs in eval mode (restored
    afterwards) under no_grad; sums in float64.

    Args:
        model: the model.
        batches: one batch or an iterable of batches (see `hdi_monitor.head_diversity`).
        layers: the attention layers (default: all that discovery finds).

    Returns:
        ``{layer name: (H * d,) float64 mean}``, on the layer's device.

    Raises:
        ValueError: no batch, or a layer that saw no token.
    """
    by_name = resolve_layers(model, layers)
    sums: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}

    def collect(name: str, mask: Tensor | None, o: Tensor, keep: Tensor | None) -> None:
        if mask is not None and tuple(mask.shape) == tuple(o.shape[:-1]):
            mask = mask.to(device=o.device, dtype=torch.bool)
            keep = mask if keep is None else keep & mask
        flat = o.reshape(-1, o.shape[-1]).to(torch.float64)
        w = (
            torch.ones(flat.shape[0], dtype=torch.float64, device=o.device)
            if keep is None
            else keep.reshape(-1).to(torch.float64)
        )
        sums[name] = sums.get(name, 0) + w @ flat
        counts[name] = counts.get(name, 0) + w.sum()

    seen = 0
    with torch.no_grad(), eval_mode(model):
        for batch in iter_batches(batches):
            handles = []
            try:
                for name, layer in by_name.items():
                    mask = batch_mask(batch, layer.mask_key)
                    handles.append(layer.attach_output_hook(partial(_collect_into, collect, name, mask)))
                call_model(model, batch)
            finally:
                for h in handles:
                    h.remove()
            seen += 1
    if seen == 0:
        raise ValueError("batches held no batch")
    out = {}
    for name in by_name:
        if name not in counts or float(counts[name]) == 0:
            raise ValueError(f"{name}: no token reached this layer, so it has no mean head output")
        out[name] = sums[name] / counts[name]
    return out
