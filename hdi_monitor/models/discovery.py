"""Find the attention layers of a model: `discover_attention`, `find_attention_layers`."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from torch import nn
from torch.nn.parameter import is_lazy

from hdi_monitor.models._parametrize import preserved_parametrizations
from hdi_monitor.models.base import (
    AdapterMismatch,
    AttentionLayer,
    SkippedModule,
    registered_adapters,
)
from hdi_monitor.models.layout import FUSED_NAMES, class_refusal, fused_refusal
from hdi_monitor.models.layouts import NOT_ATTENTION, REFUSED, REFUSED_PACKAGES
from hdi_monitor.models.spec import AttentionSpec, as_specs

__all__ = ["Discovery", "discover_attention", "find_attention_layers", "skipped_message", "unwrapped_name"]

#: Name segments that wrappers insert (FSDP1, activation checkpointing); reported names leave them out.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

_SPEC_EXAMPLE = (
    '    spec = AttentionSpec(modules=r"blocks\\.\\d+\\.attn$", query="wq", key="wk", value="wv",\n'
    '                         output="wo", num_heads=8)\n'
    "    head_diversity(model, spec=spec)"
)


def _display(name: str) -> str:
    return name if name else "<root>"


def unwrapped_name(name: str) -> str:
    """``name`` without the segments FSDP1 and activation-checkpoint wrappers insert, so a layer is
    reported under the same name with and without them
    (``layers.0._fsdp_wrapped_module.self_attn`` -> ``layers.0.self_attn``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


#: Class names that say "attention".
_ATTENTION_CLASS = re.compile(r"attention|attn", re.IGNORECASE)
#: Child names that say "attention projection".
_QKV_CHILDREN = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "q",
        "k",
        "v",
        "wq",
        "wk",
        "wv",
        "to_q",
        "to_k",
        "to_v",
        "q_lin",
        "k_lin",
        "v_lin",
        "query_proj",
        "key_proj",
        "value_proj",
        *FUSED_NAMES,
    }
)


@dataclass(frozen=True)
class Discovery:
    """What `discover_attention` found.

    Attributes:
        layers: the attention layers that are measured, in module order.
        skipped: every attention-like module that is not measured, with the reason, in module order.
    """

    layers: list[AttentionLayer]
    skipped: list[SkippedModule]


def _looks_like_attention(module: nn.Module) -> bool:
    if next(module.parameters(), None) is None or NOT_ATTENTION.fullmatch(type(module).__name__):
        return False
    if _ATTENTION_CLASS.search(type(module).__name__):
        return True
    children = {n for n, _ in module.named_children()}
    return len(children & _QKV_CHILDREN) >= 2 or bool(children & set(FUSED_NAMES))


def _parameters_not_ready(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters that are on the meta device or uninitialised (lazy)."""
    return [pname for pname, p in module.named_parameters() if is_lazy(p) or p.is_meta]


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def discover_attention(
    model: nn.Module,
    spec: AttentionSpec | Sequence[AttentionSpec] | None = None,
    layers: str | Sequence[str] | None = None,
) -> Discovery:
    """Find the attention layers of ``model`` and name every attention-like module left out.

    Each module is tried, in module order, against the user's specs (in order), then the built-in
    families (`registered_adapters`: torch MHA, MLA, then the layout table of
    `hdi_monitor.models.layouts`). The first that matches reads it; its descendants are not
    searched. A module with a fused q/k/v child whose layout no entry knows is refused, and
    every module that looks like attention (its class name says so, or its children are named like
    q/k/v projections) but is not measured is listed in `Discovery.skipped` with the reason.

    Args:
        model: any ``nn.Module``.
        spec: one `AttentionSpec` or a list; combines with the built-in families (a spec
            wins where both match).
        layers: keep only some layers: a regex (``re.search`` on the qualified name, as
            `AttentionSpec.modules`; anchor it with ``^...$`` for an exact match) or a list of exact
            qualified names. Layers left out this way are not "skipped".

    Returns:
        A `Discovery`. Names are as in ``model.named_modules()`` without wrapper segments
        (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``; see `unwrapped_name`); spec
        regexes and ``layers`` see these names too. A module shared by several parents (ALBERT) is
        one layer.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``spec``/``layers`` has the wrong type.
        ValueError: no attention layer was found, every one was skipped, a spec matches no module,
            a spec does not fit a module it matches, or ``layers`` selects none.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    specs = as_specs(spec)
    adapters = registered_adapters()
    cfg = getattr(model, "config", None)
    root_config = None if isinstance(cfg, nn.Module) else cfg
    # shapes and weights read while building layers must not advance a parametrization
    with preserved_parametrizations(model):
        found, skipped, spec_hits = _walk(model, specs, adapters, root_config)
    unused = [s for s, hits in zip(specs, spec_hits, strict=True) if not hits]
    cls = type(model).__name__
    if unused:
        raise ValueError(
            f"AttentionSpec(modules={unused[0].modules!r}) matched no module of {cls} (the regex is "
            f"searched in each qualified module name, re.search). Some module names: {_some_names(model)}"
        )
    if not found:
        if skipped:
            lines = "\n".join(f"  {_display(s.name)} ({s.class_name}): {s.reason}" for s in skipped[:8])
            raise ValueError(
                f"found {len(skipped)} attention-like module(s) in {cls} but measured none of them:\n{lines}"
            )
        families = ", ".join(f"{a.family} ({a.classes})" for a in adapters)
        raise ValueError(
            f"no attention layer found in {cls}. Families searched: {families}. "
            f"For other models describe the attention modules with an AttentionSpec, e.g.\n{_SPEC_EXAMPLE}"
        )
    return Discovery(layers=_select(found, layers), skipped=skipped)


def _walk(
    model: nn.Module, specs: tuple[AttentionSpec, ...], adapters: tuple, root_config: object
) -> tuple[list[AttentionLayer], list[SkippedModule], list[int]]:
    found: list[AttentionLayer] = []
    skipped: list[SkippedModule] = []
    claimed: list[str] = []  # raw names of modules measured or refused (their subtrees are done)
    spec_hits = [0] * len(specs)
    candidates: list[tuple[str, str, nn.Module]] = []
    inside: str | None = None
    configs = _sub_model_configs(model, root_config)
    modules = dict(model.named_modules())
    for raw_name, module in model.named_modules():
        if inside is not None and _inside(raw_name, inside):
            continue
        inside = None
        name = unwrapped_name(raw_name)
        # each sub-model follows its own model's config (a T5 inside a LightningModule: the decoder's mask)
        sub_config = configs.get(raw_name, root_config)
        hit = next((i for i, s in enumerate(specs) if s.matches(name, module)), None)
        refused = class_refusal(module, REFUSED, REFUSED_PACKAGES) if hit is None else None
        if refused is not None:
            skipped.append(SkippedModule(name, type(module).__name__, refused))
            inside = raw_name
            claimed.append(raw_name)
            continue
        if hit is not None:
            spec_hits[hit] += 1
            build, family = partial(specs[hit].build, root_config=sub_config), specs[hit].family
        else:
            adapter = next((a for a in adapters if a.match(name, module)), None)
            if adapter is None:
                refusal = fused_refusal(name, module)
                if refusal is not None and _looks_like_attention(module):
                    skipped.append(SkippedModule(name, type(module).__name__, refusal))
                    inside = raw_name
                    claimed.append(raw_name)
                elif _looks_like_attention(module):
                    candidates.append((raw_name, name, module))
                continue
            build, family = partial(adapter.build_layer, root_config=sub_config), adapter.family
        inside = raw_name
        claimed.append(raw_name)
        not_ready = _parameters_not_ready(module)
        if not_ready:
            skipped.append(
                SkippedModule(
                    name,
                    type(module).__name__,
                    f"{family}: parameters {not_ready[:4]} are on the meta device or uninitialised; materialise the "
                    "model (e.g. run a forward pass or load weights) before measuring it",
                )
            )
            continue
        try:
            layer = build(name, module)
        except AdapterMismatch as exc:
            if hit is not None:
                raise ValueError(str(exc)) from None
            skipped.append(SkippedModule(name, type(module).__name__, f"{family} layout does not fit: {exc}"))
            continue
        layer.ancestors = _ancestors(raw_name, modules)
        found.append(layer)
    for raw_name, name, module in candidates:
        if any(_inside(raw_name, c) or _inside(c, raw_name) for c in claimed):
            continue  # inside a measured module, or a wrapper of one
        children = [n for n, _ in module.named_children()]
        skipped.append(
            SkippedModule(
                name,
                type(module).__name__,
                f"looks like attention but no known layout matches (children: {children[:8]}); describe it with "
                "AttentionSpec(modules=..., query=..., key=..., value=..., output=...)",
            )
        )
    order = {unwrapped_name(n): i for i, (n, _) in enumerate(model.named_modules())}
    skipped.sort(key=lambda s: order.get(s.name, 0))
    return found, skipped, spec_hits


def _ancestors(raw_name: str, modules: Mapping[str, nn.Module]) -> tuple[nn.Module, ...]:
    """The modules above ``raw_name`` (the root first), from ``dict(model.named_modules())``."""
    parts = raw_name.split(".") if raw_name else []
    paths = [".".join(parts[:i]) for i in range(len(parts))]
    return tuple(modules[p] for p in paths if p in modules)


def _config_of(module: nn.Module) -> object | None:
    cfg = getattr(module, "config", None)
    return None if cfg is None or isinstance(cfg, nn.Module) else cfg


def _is_model_config(cfg: object) -> bool:
    """Whether ``cfg`` describes a model the way a Hugging Face ``PretrainedConfig`` does: a
    ``model_type`` string and a ``to_dict()`` method (every ``PretrainedConfig``, remote-code ones
    included, has both). Duck-typed so that discovery never imports transformers. Training
    hyperparameters kept as ``self.config`` on a wrapper (a dict, an OmegaConf ``DictConfig``, an
    ``argparse.Namespace``) have neither, and are not model configs."""
    if cfg is None or isinstance(cfg, Mapping):
        return False
    return isinstance(getattr(cfg, "model_type", None), str) and callable(getattr(cfg, "to_dict", None))


def _sub_model_configs(model: nn.Module, root_config: object) -> dict[str, object]:
    """For every module name, the config of the model it belongs to: the outermost model config on
    its path (the root first, see `_is_model_config`); when the path holds none, the outermost
    ``config`` of any kind; ``root_config`` when none at all. A Hugging Face model wrapped in a
    LightningModule (or two towers in a user's dual encoder) is read with its own config, however
    deep it sits, even where the wrapper keeps its hyperparameters as ``self.config``."""
    out: dict[str, object] = {}
    for raw_name, module in model.named_modules():
        if raw_name == "":
            out[raw_name] = root_config
            continue
        inherited = out.get(raw_name.rpartition(".")[0], root_config)
        own = _config_of(module)
        # the first config on the path, unless a model config comes after a config of another kind
        replace = inherited is None or (_is_model_config(own) and not _is_model_config(inherited))
        out[raw_name] = own if replace else inherited
    return out


def find_attention_layers(
    model: nn.Module,
    spec: AttentionSpec | Sequence[AttentionSpec] | None = None,
    layers: str | Sequence[str] | None = None,
) -> list[AttentionLayer]:
    """Find the attention layers of ``model``, in module order (see `discover_attention`).

    Attention-like modules that are not measured (unknown fused layouts, meta-device parameters,
    classes no family knows) are named, with the reason, in one warning.

    Args:
        model: any ``nn.Module``.
        spec: one `AttentionSpec` or a list; combines with the built-in families.
        layers: a regex (``re.search`` on the qualified name) or a list of exact qualified names.

    Returns:
        One `AttentionLayer` per measured attention module.

    Raises:
        TypeError, ValueError: as `discover_attention`.
    """
    found = discover_attention(model, spec=spec, layers=layers)
    if found.skipped:
        warnings.warn(skipped_message(found.skipped), UserWarning, stacklevel=2)
    return found.layers


def skipped_message(skipped: Sequence[SkippedModule], limit: int = 12) -> str:
    """One readable message listing the modules that are not measured."""
    lines = [f"  {_display(s.name)} ({s.class_name}): {s.reason}" for s in skipped[:limit]]
    if len(skipped) > limit:
        lines.append(f"  ... and {len(skipped) - limit} more")
    return f"hdi_monitor: {len(skipped)} attention-like module(s) not measured:\n" + "\n".join(lines)


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
