"""`ModelWatch`: what is watched in a model, kept across measured steps; it starts each
`hdi_monitor.measure.step.MeasuredStep`.

It holds the attention layers (found once, checked cheaply at every measured step and found again
when they changed), the compiled parts of the model (never hooked: measured through a side
forward), the monitor's own random generator (the token subsample; never a global one), how often
each layer's head-output hook ran at the last measured step (how ``max_tokens`` is shared), and
what has already been said once per layer. Every rank checks at `setup` that all ranks watch the
same layers with the same settings (one small collective).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hdi_monitor.config import MonitorConfig
from hdi_monitor.measure import ranks
from hdi_monitor.measure.compiled import CompiledUnit, compiled_units
from hdi_monitor.measure.update_entropy import UpdateEntropy
from hdi_monitor.models import AttentionLayer, SkippedModule, discover_attention, find_attention_layers
from hdi_monitor.models.discovery import skipped_message
from hdi_monitor.models.sharding import gathers_weights, is_fsdp1_module
from hdi_monitor.models.tensor_parallel import data_parallel_group

__all__ = ["ModelWatch"]


def _signature(module: nn.Module | None, path: str | None) -> tuple[Any, ...]:
    """What must stay the same for a watched layer to be still valid: where it sits in the model,
    the module object itself, its submodules and its parameters' shapes (a cheap check, no
    rediscovery)."""
    if module is None:
        return (path, None, (), ())
    subs = tuple((n, id(m)) for n, m in module.named_modules())
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return (path, id(module), subs, shapes)


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    module: Any = model
    for part in path.split(".") if path else ():
        module = getattr(module, "_modules", {}).get(part)
        if module is None:
            return None
    return module


def heads_text(layer: AttentionLayer) -> str:
    """``"8 heads of width 64, 2 key/value heads"``."""
    kv = f", {layer.num_kv_heads} key/value heads" if layer.num_kv_heads != layer.num_heads else ""
    return f"{layer.num_heads} heads of width {layer.head_dim}{kv}"


def _describe_change(old: AttentionLayer, new: AttentionLayer | None) -> str:
    if new is None:
        return f"{old.name}: no longer an attention layer of the model; it is not measured any more"
    what = "module replaced" if new.module is not old.module else "parameters changed"
    if (new.num_heads, new.num_kv_heads, new.head_dim) != (old.num_heads, old.num_kv_heads, old.head_dim):
        return f"{old.name}: {what}, {heads_text(old)} -> {heads_text(new)}; measuring the new module from now on"
    return f"{old.name}: {what} ({heads_text(new)}); measuring the new module from now on"


def naming_hint(model: nn.Module, limit: int = 10) -> str:
    """The modules that look like attention, and how to pass ``layers`` or ``spec``."""
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


def _alone(flag: bool) -> bool:
    """The agreement of one rank measuring alone: its own flag."""
    return flag


class ModelWatch:
    """The watched layers of ``model`` and what measured steps share (see the module docstring).

    Args:
        model: the model.
        config: the settings (projections, weighting, layers, spec, activations, max_tokens,
            kernel_stats, seed, and the schedule for the rank check).
        fsdp_root: for FSDP1 models, the root FSDP module (see `hdi_monitor.report.compute_report`);
            default: ``model`` itself when it is one.
        collectives: run the multi-rank collectives (the rank check at setup, the agreement and the
            data-parallel sums at every measured step); False measures this rank alone (the one-shot
            `hdi_monitor.head_diversity`, which one rank may call by itself; weights that are
            sharded are still gathered).
    """

    def __init__(
        self, model: nn.Module, config: MonitorConfig, *, fsdp_root: nn.Module | None = None, collectives: bool = True
    ) -> None:
        self.model = model
        self.config = config
        self.fsdp_root = fsdp_root if fsdp_root is not None else (model if is_fsdp1_module(model) else None)
        self.collectives = collectives
        # private RNG for the token subsample: the global generators are never drawn from
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.agree: ranks.Agree = ranks.all_agree if collectives else _alone
        """``flag -> AND over the ranks``, the collective a measured step runs twice in `finish`."""
        self.activations_off: str | None = None  # why head outputs cannot be captured (None: they can)
        self.units: list[CompiledUnit] = []  # compiled parts of the model (never hooked)
        # True once Dynamo traced a hook of a measured step: the model runs inside a torch.compile region
        # the monitor was not given, and the training forward is not hooked any more (weights only)
        self.compiled_outside = False
        self.calls: dict[str, int] = {}  # head-output calls per layer at the last measured forward
        self.said: set[tuple[str, str]] = set()  # (what, layer) already said once per layer
        self.updates = UpdateEntropy() if config.update_entropy else None  # the previous step's W_Q, W_K
        self.skipped: list[SkippedModule] = []  # attention-like modules found but not measured, with the reason
        self._layers: list[AttentionLayer] | None = None
        self._data_parallel: tuple[bool, Any] | None = None
        self._sharded: tuple[nn.Module | None, list[bool]] | None = None
        self._signatures: list[tuple[Any, ...]] = []

    @property
    def activations(self) -> bool:
        """True if head outputs are captured: ``config.activations``, unless the model cannot be
        intercepted (see `activations_off`)."""
        return self.config.activations and self.activations_off is None

    @property
    def layers(self) -> list[AttentionLayer]:
        """The watched attention layers (found on first use)."""
        if self._layers is None:
            self.setup()
        assert self._layers is not None
        return self._layers

    @property
    def found(self) -> bool:
        """True once `setup` has found the layers."""
        return self._layers is not None

    def setup(self) -> list[str]:
        """Find the attention layers and check that every rank watches the same; returns what to
        say once: the attention-like modules that are not measured (`skipped`, with the reason) and a
        model compiled whole, whose head outputs cannot be measured.

        Raises:
            ValueError: no attention layer was found, or the ``layers`` filter matches none; the
                message names the model's modules and says how to pass ``layers`` or ``spec``.
            TypeError: ``layers`` or ``spec`` has the wrong type.
        """
        try:
            discovery = discover_attention(self.model, spec=self.config.spec, layers=self.config.layers)
        except ValueError as err:
            # the other ranks wait in the agreement check below: take part in it, so that they
            # raise too (naming this rank) instead of waiting until the process group times out
            if self.collectives:
                with contextlib.suppress(ValueError):
                    ranks.check_ranks_agree({**self._fingerprint([]), "number of layers": ranks.NO_LAYERS})
            raise ValueError(
                f"hdi-monitor cannot watch {type(self.model).__name__}: {err}{naming_hint(self.model)}"
            ) from err
        found, self.skipped = discovery.layers, list(discovery.skipped)
        notes = [skipped_message(self.skipped)] if self.skipped else []
        notes += self._set_layers(found)
        if self.collectives:
            ranks.check_ranks_agree(self._fingerprint(found))  # one small collective: all ranks watch the same
        if self.activations or self.config.kernel_stats:  # the statistics summed over the data-parallel ranks
            _ = self.data_parallel  # a mesh whose data-parallel ranks cannot be known raises here, before training
        return notes

    @property
    def sharded(self) -> list[bool]:
        """Per layer, whether reading its weights is a collective (DTensor, ZeRO-3 or FSDP1
        parameters: `hdi_monitor.models.sharding.gathers_weights`), found once per set of layers
        and FSDP1 root."""
        layers = self.layers
        if self._sharded is None or self._sharded[0] is not self.fsdp_root:
            self._sharded = (self.fsdp_root, [gathers_weights(la, self.fsdp_root) for la in layers])
        return self._sharded[1]

    @property
    def data_parallel(self) -> tuple[bool, Any]:
        """``(reduce, group)``: whether and over which ranks the step's statistics are summed (see
        `hdi_monitor.models.tensor_parallel.data_parallel_group`; found once per set of layers, at
        setup when the process group exists then); ``(False, None)`` when this rank measures alone."""
        if not (self.collectives and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False, None
        if self._data_parallel is None:
            self._data_parallel = data_parallel_group(self.layers)
        return self._data_parallel

    def _fingerprint(self, layers: list[AttentionLayer]) -> dict[str, str]:
        return ranks.fingerprint(layers, self.config)

    def _set_layers(self, layers: list[AttentionLayer]) -> list[str]:
        paths = {id(m): n for n, m in self.model.named_modules()}
        self._layers, self._data_parallel, self._sharded = layers, None, None
        self._signatures = [_signature(la.module, paths.get(id(la.module))) for la in layers]
        self.units = compiled_units(self.model)
        stuck = [u for u in self.units if not u.interceptable]
        if not (stuck and self.config.activations and self.activations_off is None):
            return []
        self.activations_off = (
            f"{type(stuck[0].module).__name__} was compiled whole by Lightning (its forward and training_step "
            "are compiled, so there is no eager call to take the head outputs from without changing the "
            "compiled graph)"
        )
        return [
            f"hdi-monitor: {self.activations_off}. Activation statistics (covariance, effective heads) are off; "
            "the weight-based HDI is measured. Compile the attention blocks instead (torch.compile(block) or "
            "block.compile()) to keep them, or pass activations=False to silence this warning."
        ]

    def revalidate(self) -> tuple[list[AttentionLayer], list[str]]:
        """The layers, checked cheaply: every watched layer must still be the module in the model
        with the same parameter shapes; if not, they are found again and the changes are returned
        as notes."""
        layers = self.layers
        stale = [
            la
            for la, sig in zip(layers, self._signatures, strict=True)
            if sig[0] is None or _signature(_submodule(self.model, sig[0]), sig[0]) != sig
        ]
        if not stale:
            return layers, []
        try:
            found = find_attention_layers(self.model, spec=self.config.spec, layers=self.config.layers)
        except ValueError as err:
            names = ", ".join(la.name for la in stale)
            raise ValueError(f"attention layer(s) {names} changed and the model no longer matches: {err}") from err
        new = {la.name: la for la in found}
        old = {la.name: la for la in layers}
        notes = [_describe_change(la, new.get(la.name)) for la in stale]
        notes += [f"{n}: new attention layer, measured from now on ({heads_text(new[n])})" for n in new.keys() - old]
        self._set_layers(found)
        return found, notes

    def once(self, what: str, layer: str) -> bool:
        """True the first time ``(what, layer)`` is asked (then remembered): for notes said once per layer."""
        key = (what, layer)
        if key in self.said:
            return False
        self.said.add(key)
        return True

    def eager_model(self) -> nn.Module:
        """The module to call for an eager side pass: the original of a compiled root wrapper."""
        units = self.units
        if len(units) == 1 and units[0].path == "" and units[0].kind == "wrapper":
            return units[0].original
        return self.model
