"""Reading the full weights of a sharded attention layer: the one place that knows about FSDP.

* Plain, DDP and FSDP2 (``fully_shard``, DTensor parameters) modules need nothing here: DTensor
  weights are gathered by `head_weights` itself
  (``.full_tensor()``), and `full_weights` does nothing.
* FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``, used by Lightning's
  ``FSDPStrategy``) keeps every parameter as a piece of a flat 1-D shard outside the forward pass.
  `full_weights` unshards only the FSDP unit(s) that own one attention layer's parameters
  (``summon_full_params(unit, recurse=False, writeback=False)``), so the extra memory is one unit
  (typically one transformer block), and frees them on exit.

FSDP1 rule: the root FSDP module must be lazily initialised before any nested unit is summoned,
or the nested unit makes itself root and the next forward pass fails. Hence the ``root`` argument:
the FSDP1 root (in Lightning ``trainer.strategy.model``), or a module with no FSDP1 wrapper above
it, whose outermost FSDP1 units are then the roots. Until a root has been lazily initialised (by
its first forward pass or summon), `full_weights` summons it first (``recurse=False``: only
its own parameters, once).

* DeepSpeed ZeRO-3 keeps every parameter partitioned (shape ``[0]`` outside the forward pass;
  the full shape is ``ds_shape``). `full_weights` gathers one attention layer's parameters with
  ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)`` (read only: nothing is written
  back) and partitions them again on exit, so the extra memory is one layer.
* Tensor parallelism (DTensor ``Shard`` placements on a ``tp`` mesh dimension, alone or with FSDP2
  on a 2-D mesh) needs nothing here either: ``.full_tensor()`` gathers over every mesh dimension.
  Head counts are read from these full shapes (`hdi_monitor.models.tensor_parallel`).

Summoning and gathering are collectives: every rank must enter `full_weights` for the same layers
in the same order.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from hdi_monitor.models.base import AttentionLayer
from hdi_monitor.models.tensor_parallel import zero3_params

__all__ = ["contains_fsdp1", "full_weights", "fsdp1_units", "gathers_weights", "is_fsdp1_module"]

_FSDP1_NEEDS_ROOT = (
    "{name!r}: its parameters are FSDP1 (FullyShardedDataParallel) flat shards, and reading its full weights "
    "needs the FSDP1 root module, which is not known. Pass it: HDITracker(model, fsdp_root=fsdp_model), "
    "compute_report(layers, fsdp_root=fsdp_model), or measure the FSDP-wrapped model itself "
    "(in Lightning, HDIMonitor passes trainer.strategy.model automatically)."
)


def _fsdp1_class() -> type[Any] | None:
    """``FullyShardedDataParallel`` if it was ever imported (no model can be FSDP1 otherwise)."""
    mod = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    return getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None


def is_fsdp1_module(module: object) -> bool:
    """True if ``module`` is an FSDP1 ``FullyShardedDataParallel`` wrapper (not FSDP2 ``fully_shard``)."""
    cls = _fsdp1_class()
    return cls is not None and isinstance(module, cls)


def contains_fsdp1(module: nn.Module) -> bool:
    """True if ``module`` is or contains an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    return _fsdp1_class() is not None and any(is_fsdp1_module(m) for m in module.modules())


# root -> {id(module): (outermost FSDP1 ancestor-or-self, nearest FSDP1 ancestor-or-self)}
_OWNERS: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[nn.Module | None, nn.Module | None]]] = (
    weakref.WeakKeyDictionary()
)


def _owner_map(root: nn.Module) -> dict[int, tuple[nn.Module | None, nn.Module | None]]:
    owners = _OWNERS.get(root)
    if owners is None:
        owners = {}
        stack: list[tuple[nn.Module, nn.Module | None, nn.Module | None]] = [(root, None, None)]
        while stack:
            module, top, near = stack.pop()
            if is_fsdp1_module(module):
                top, near = top or module, module
            owners[id(module)] = (top, near)
            stack.extend((child, top, near) for child in module.children())
        _OWNERS[root] = owners
    return owners


def _looks_fsdp1(module: nn.Module) -> bool:
    """Without a root: does this module hold FSDP1-managed parameters?

    True if it contains an FSDP1 wrapper, if a parameter is an FSDP1 view into a flat parameter
    (``use_orig_params=True`` marks them ``_fsdp_flattened``), or if it has no registered parameter
    but holds plain tensors whose storage is freed (``use_orig_params=False`` replaces parameters
    with views into the unsharded flat parameter, whose storage FSDP1 frees outside the forward).
    """
    if _fsdp1_class() is None:
        return False
    if any(is_fsdp1_module(m) for m in module.modules()):
        return True
    params = list(module.parameters())
    if params:
        return any(getattr(p, "_fsdp_flattened", False) for p in params)
    return any(
        isinstance(v, Tensor) and v.numel() > 0 and v.untyped_storage().size() == 0
        for m in module.modules()
        for v in vars(m).values()
    )


def _initialised(root: nn.Module) -> bool:
    """True once an FSDP1 root has been lazily initialised (its first forward pass or summon)."""
    return getattr(root, "_is_root", None) is True


def fsdp1_units(module: nn.Module, root: nn.Module | None = None, *, name: str | None = None) -> list[nn.Module]:
    """The FSDP1 units to summon, in order, to read every parameter of ``module`` in full.

    These are the root first, if it has not been initialised yet and does not own ``module``
    itself; the nearest FSDP1 wrapper around ``module``; then the FSDP1 units nested inside
    ``module``, outer ones first. The list is empty for modules FSDP1 does not manage.

    Args:
        module: an attention module (``AttentionLayer.module``).
        root: the FSDP1 root, or a module with no FSDP1 wrapper above it.
        name: the module's name for error messages.

    Raises:
        ValueError: ``module`` is FSDP1-managed and ``root`` is None, or ``module`` is not inside ``root``.
    """
    label = name if name is not None else type(module).__name__
    if root is None:
        if _looks_fsdp1(module):
            raise ValueError(_FSDP1_NEEDS_ROOT.format(name=label))
        return []
    owners = _owner_map(root)
    if id(module) not in owners:
        raise ValueError(
            f"{label} is not a submodule of fsdp_root ({type(root).__name__}); pass the outermost "
            "FSDP-wrapped model (the FSDP1 root) as fsdp_root"
        )
    top, near = owners[id(module)]
    units: list[nn.Module] = []
    if top is not None and top is not near and not _initialised(top):
        units.append(top)
    if near is not None:
        units.append(near)
    units += [m for m in module.modules() if m is not module and is_fsdp1_module(m)]  # pre-order: outer first
    return units


def gathers_weights(layer: AttentionLayer, root: nn.Module | None = None) -> bool:
    """True if reading ``layer``'s weights is a collective: DTensor (FSDP2, tensor parallel), ZeRO-3
    or FSDP1 parameters."""
    if any(callable(getattr(p, "full_tensor", None)) for p in layer.module.parameters()):
        return True
    if zero3_params(layer.module):
        return True
    if root is None:
        return _looks_fsdp1(layer.module)
    return bool(fsdp1_units(layer.module, root, name=layer.name))


@contextlib.contextmanager
def full_weights(layer: AttentionLayer | nn.Module, root: nn.Module | None = None) -> Iterator[None]:
    """Inside this context the weights of ``layer`` are complete on every rank.

    For FSDP1 it summons the units of `fsdp1_units` with ``recurse=False, writeback=False``
    (read only; changes are not written back) and reshards them on exit; for DeepSpeed ZeRO-3 it
    gathers the layer's partitioned parameters with ``deepspeed.zero.GatheredParameters(params,
    modifier_rank=None)`` (read only) and partitions them again on exit; for anything else it does
    nothing. A collective under FSDP1 and ZeRO-3: every rank must enter it for the same layers in
    the same order. Must not be used inside the forward or backward pass.

    Args:
        layer: an `AttentionLayer` or its module.
        root: the FSDP1 root (``trainer.strategy.model`` in Lightning), or a module with no FSDP1
            wrapper above it. Needed only for FSDP1.

    Raises:
        ValueError: the layer is FSDP1-managed and ``root`` is None, or it is not inside ``root``.
    """
    module = layer.module if isinstance(layer, AttentionLayer) else layer
    zero3 = zero3_params(module)
    if zero3:
        import deepspeed  # a ZeRO-3 parameter exists only where deepspeed is installed

        with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
            yield
        return
    if isinstance(layer, AttentionLayer):
        units = fsdp1_units(layer.module, root, name=layer.name)
    else:
        units = fsdp1_units(layer, root)
    if not units:
        yield
        return
    fsdp = _fsdp1_class()
    assert fsdp is not None
    with contextlib.ExitStack() as stack:
        for unit in units:
            stack.enter_context(fsdp.summon_full_params(unit, recurse=False, writeback=False))
        yield
