"""Cheap revalidation of the watched layers (module identity, submodules, parameter shapes) and the
messages the tracker writes when they change or hold dead heads."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from hdi_monitor.models import AttentionLayer
from hdi_monitor.monitor.record import layer_tag
from hdi_monitor.report import ACTIVATIONS, DiversityReport

__all__ = ["describe_change", "heads_text", "invalid_head_notes", "naming_hint", "signature", "submodule"]


def signature(module: nn.Module | None, path: str | None) -> tuple[Any, ...]:
    """What must stay the same for a watched layer to be still valid: where it sits in the model,
    the module object itself, its submodules and its parameters' shapes (a cheap check, no
    rediscovery)."""
    if module is None:
        return (path, None, (), ())
    subs = tuple((n, id(m)) for n, m in module.named_modules())
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return (path, id(module), subs, shapes)


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    module: Any = model
    for part in path.split(".") if path else ():
        module = getattr(module, "_modules", {}).get(part)
        if module is None:
            return None
    return module


def heads_text(layer: AttentionLayer) -> str:
    kv = f", {layer.num_kv_heads} key/value heads" if layer.num_kv_heads != layer.num_heads else ""
    return f"{layer.num_heads} heads of width {layer.head_dim}{kv}"


def describe_change(old: AttentionLayer, new: AttentionLayer | None) -> str:
    if new is None:
        return f"{old.name}: no longer an attention layer of the model; it is not measured any more"
    what = "module replaced" if new.module is not old.module else "parameters changed"
    if (new.num_heads, new.num_kv_heads, new.head_dim) != (old.num_heads, old.num_kv_heads, old.head_dim):
        return f"{old.name}: {what}, {heads_text(old)} -> {heads_text(new)}; measuring the new module from now on"
    return f"{old.name}: {what} ({heads_text(new)}); measuring the new module from now on"


def naming_hint(model: nn.Module, limit: int = 10) -> str:
    names = [n for n, _ in model.named_modules() if n]
    likely = [n for n in names if re.search(r"attn|attention", n, re.IGNORECASE)]
    shown = (likely or names)[:limit]
    more = ", ..." if len(likely or names) > limit else ""
    return (
        f"\nModules of this model{' that look like attention' if likely else ''}: {', '.join(shown)}{more}. "
        "Select layers with layers=<regex or list of these names>, or describe a layout the built-in families "
        "do not know with spec=hdi_monitor.AttentionSpec(modules=..., query=..., key=..., value=..., output=..., "
        "num_heads=...)."
    )


def invalid_head_notes(report: DiversityReport, projections: Sequence[str], seen: set[tuple[str, str]]) -> list[str]:
    """One note the first time a layer and projection has dead (all-zero) or non-finite heads
    (``seen`` remembers the pairs already noted, and is updated). The projection `ACTIVATIONS` (``"activations"``)
    is the head outputs: heads whose contribution to the layer output had zero variance."""
    notes = []
    for layer in report.layers:
        for projection in projections:
            bad = layer.invalid_heads.get(projection) or []
            if bad and (layer.name, projection) not in seen:
                seen.add((layer.name, projection))
                if projection == ACTIVATIONS:
                    notes.append(
                        f"{layer.name} (head outputs): head(s) {bad} contributed nothing to the layer output "
                        f"(zero variance over {layer.num_tokens} tokens); effective heads are over the "
                        f"{layer.num_heads - len(bad)} live head(s) of {layer.num_heads} "
                        f"(scalar invalid_heads/activations/{layer_tag(layer.name)})"
                    )
                    continue
                total = layer.num_kv_heads if projection in ("key", "value") else layer.num_heads
                notes.append(
                    f"{layer.name} ({projection}): head(s) {bad} are dead (all zero) or non-finite; "
                    f"its HDI is over the {total - len(bad)} valid head(s) of {total} "
                    f"(scalar invalid_heads/{projection}/{layer_tag(layer.name)})"
                )
    return notes
