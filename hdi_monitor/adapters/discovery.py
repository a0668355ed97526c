"""Find the attention layers of a model: :func:`find_attention_layers`."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

from torch import nn

from hdi_monitor.adapters.base import (
    AdapterMismatch,
    AttentionLayer,
    AttentionSpec,
    _parameters_not_ready,
    registered_adapters,
)

__all__ = ["find_attention_layers", "unwrapped_name"]

#: Name segments that wrappers insert (FSDP1, activation checkpointing); reported names leave them out.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

_SPEC_EXAMPLE = (
    "    spec = AttentionSpec(modules=r\"blocks\\.\\d+\\.attn\", query=\"wq\", key=\"wk\", value=\"wv\",\n"
    "                         output=\"wo\", num_heads=8)\n"
    "    head_diversity(model, spec=spec)"
)


def _display(name: str) -> str:
    return name if name else "<root>"


def unwrapped_name(name: str) -> str:
    """``name`` without the segments FSDP1 and activation-checkpoint wrappers insert, so a layer is
    reported under the same name with and without them
    (``layers.0._fsdp_wrapped_module.self_attn`` -> ``layers.0.self_attn``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def find_attention_layers(
    model: nn.Module,
    spec: AttentionSpec | None = None,
    layers: str | Sequence[str] | None = None,
) -> list[AttentionLayer]:
    """Find the attention layers of ``model``, in module order.

    Args:
        model: any ``nn.Module``.
        spec: describes the attention modules of a model no built-in adapter knows; when given, it
            replaces the built-in families (only modules it matches are reported).
        layers: keep only some layers: a regex (``re.search`` on the qualified name) or a list of
            exact qualified names.

    Returns:
        One :class:`AttentionLayer` per attention module, named as in ``model.named_modules()``
        without wrapper segments (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``; see
        :func:`unwrapped_name`); ``spec`` regexes and ``layers`` see these names too. A matched
        module's descendants are not searched, so an ``nn.MultiheadAttention`` inside an
        ``nn.TransformerEncoderLayer`` or a ``BertSelfAttention`` inside a ``BertAttention`` is
        reported once. Layers whose parameters are on the meta device or uninitialised (lazy) are
        skipped with a warning.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``spec``/``layers`` has the wrong type.
        ValueError: no attention layer was found, every one was skipped, or ``layers`` selects none.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if spec is not None and not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec or None, got {type(spec).__name__}")
    adapters = registered_adapters()
    found: list[AttentionLayer] = []
    skipped: list[str] = []
    inside: str | None = None  # qualified name of the last matched module (pre-order traversal)
    for raw_name, module in model.named_modules():
        if inside is not None and (inside == "" or raw_name.startswith(inside + ".")):
            continue
        inside = None
        name = unwrapped_name(raw_name)
        if spec is not None:
            if not spec.matches(name, module):
                continue
            build = spec.build
            family = spec.family
        else:
            adapter = next((a for a in adapters if a.match(name, module)), None)
            if adapter is None:
                continue
            build = adapter.build
            family = adapter.family
        inside = raw_name
        not_ready = _parameters_not_ready(module)
        if not_ready:
            warnings.warn(
                f"hdi_monitor: skipping attention layer {_display(name)!r} ({family}): parameters "
                f"{not_ready[:4]} are on the meta device or uninitialised; materialise the model "
                "(e.g. run a forward pass or load weights) before measuring it",
                stacklevel=2,
            )
            skipped.append(name)
            continue
        try:
            found.append(build(name, module))
        except AdapterMismatch as exc:
            if spec is not None:
                raise
            warnings.warn(f"hdi_monitor: skipping {_display(name)!r}: {exc}", stacklevel=2)
            skipped.append(name)
    if not found:
        cls = type(model).__name__
        if skipped:
            raise ValueError(
                f"found {len(skipped)} attention layer(s) in {cls} but skipped all of them (see the warnings), "
                f"e.g. {[_display(n) for n in skipped[:3]]}"
            )
        if spec is not None:
            raise ValueError(
                f"AttentionSpec(modules={spec.modules!r}) matched no module of {cls}; a regex must match the "
                f"whole qualified name. Some module names: {_some_names(model)}"
            )
        families = ", ".join(f"{a.family} ({a.classes})" for a in adapters)
        raise ValueError(
            f"no attention layer found in {cls}. Families searched: {families}. "
            f"For other models describe the attention modules with an AttentionSpec, e.g.\n{_SPEC_EXAMPLE}"
        )
    return _select(found, layers)


def _some_names(model: nn.Module, limit: int = 8) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    return names[:limit] + (["..."] if len(names) > limit else [])


def _select(found: list[AttentionLayer], layers: str | Sequence[str] | None) -> list[AttentionLayer]:
    if layers is None:
        return found
    available = [lay.name for lay in found]
    preview = available[:6] + (["..."] if len(available) > 6 else [])
    if isinstance(layers, str):
        try:
            pattern = re.compile(layers)
        except re.error as exc:
            raise ValueError(f"layers is not a valid regex: {layers!r} ({exc})") from exc
        chosen = [lay for lay in found if pattern.search(lay.name)]
        if not chosen:
            raise ValueError(f"layers={layers!r} matches none of the {len(found)} attention layers: {preview}")
        return chosen
    if not isinstance(layers, Sequence) or not all(isinstance(n, str) for n in layers):
        raise TypeError("layers must be a regex string or a sequence of qualified layer names")
    unknown = [n for n in layers if n not in available]
    if unknown:
        raise ValueError(f"layers {unknown} are not attention layers of this model; available: {preview}")
    if not layers:
        raise ValueError(f"layers=[] selects no attention layer; available: {preview}")
    wanted = set(layers)
    return [lay for lay in found if lay.name in wanted]
