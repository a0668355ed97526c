"""Projection modules and their effective weights: ``nn.Linear``, Hugging Face ``Conv1D``, LoRA.

Every weight the adapters read goes through `linear_weight`, which returns the weight that the
module applies in its forward pass, in ``nn.Linear`` layout ``(out, in)``:

* ``nn.Linear`` (and subclasses such as ``FalconLinear``): ``weight``.
* Hugging Face ``Conv1D`` (GPT-2): ``weight`` is ``(in, out)`` with ``y = x @ W + b``; transposed.
* peft LoRA layers (``peft.tuners.lora.LoraLayer`` wrapping a linear or Conv1D ``base_layer``):
  ``W + sum over active adapters of scaling * B @ A`` (peft's own ``get_delta_weight``), the base
  weight alone when the adapters are merged or disabled. DoRA is refused (its magnitude vector
  rescales the columns, which this sum does not describe).
* loralib-style ``nn.Linear`` subclasses (``lora_A`` ``(r, in)``, ``lora_B`` ``(out, r)`` parameters,
  ``scaling``, ``merged``): ``W + scaling * B @ A`` unless ``merged``.

The sum is formed on the fly, in the weights' device and dtype (float32 at least), and is never
written back: the module is left as it was. Nothing here imports peft or transformers.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import Tensor, nn

from hdi_monitor.exceptions import AdapterMismatch
from hdi_monitor.models.tensor_parallel import full_weight, logical_shape

__all__ = ["base_layer", "in_features", "is_conv1d", "is_lora", "is_projection", "linear_weight", "out_features"]


def is_conv1d(m: Any) -> bool:
    """Hugging Face ``Conv1D`` (detected without importing transformers): weight ``(nx, nf)``."""
    w = getattr(m, "weight", None)
    return (
        isinstance(m, nn.Module)
        and type(m).__name__ == "Conv1D"
        and isinstance(getattr(m, "nf", None), int)
        and isinstance(w, Tensor)
        and len(logical_shape(w)) == 2
    )


def _is_peft_lora(m: Any) -> bool:
    return (
        isinstance(m, nn.Module)
        and isinstance(getattr(m, "base_layer", None), nn.Module)
        and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(m, "lora_B", None), nn.ModuleDict)
    )


def _is_loralib(m: Any) -> bool:
    return (
        isinstance(m, nn.Linear)
        and isinstance(getattr(m, "lora_A", None), nn.Parameter)
        and isinstance(getattr(m, "lora_B", None), nn.Parameter)
    )


def is_lora(m: Any) -> bool:
    """A peft LoRA layer or a loralib-style LoRA ``nn.Linear``."""
    return _is_peft_lora(m) or _is_loralib(m)


def is_projection(m: Any) -> TypeGuard[nn.Module]:
    """A module whose forward is a linear map that `linear_weight` can read."""
    if _is_peft_lora(m):
        return is_projection(m.base_layer)
    return isinstance(m, nn.Linear) or is_conv1d(m)


def base_layer(m: Any) -> Any:
    """The module a peft LoRA layer wraps (``m`` itself for any other module)."""
    return m.base_layer if _is_peft_lora(m) else m


_base = base_layer


def out_features(m: nn.Module) -> int:
    """Output width of a projection module (from the weight's shape: works on meta/lazy-free modules)."""
    b = _base(m)
    shape = logical_shape(b.weight)  # the full shape under ZeRO-3 (a partitioned weight is [0])
    return shape[1] if is_conv1d(b) else shape[0]


def in_features(m: nn.Module) -> int:
    """Input width of a projection module."""
    b = _base(m)
    shape = logical_shape(b.weight)
    return shape[0] if is_conv1d(b) else shape[1]


def _float(t: Tensor) -> Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _tensor_attr(m: Any, name: str) -> Tensor:
    """``m.<name>`` as a tensor, or `AdapterMismatch` (projection classes are read by attribute name)."""
    t = getattr(m, name, None)
    if not isinstance(t, Tensor):
        raise AdapterMismatch(f"{type(m).__name__}.{name} is a {type(t).__name__}, not a tensor")
    return t


def _peft_weight(m: Any) -> Tensor:  # a peft LoraLayer, duck-typed (peft is optional)
    base = m.base_layer
    w = full_weight(base.weight)
    if getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
        return w
    active = [a for a in getattr(m, "active_adapters", []) if a in m.lora_A]
    if not active:
        return w
    use_dora = getattr(m, "use_dora", {})
    dora = [a for a in active if use_dora.get(a, False)]
    if dora:
        raise AdapterMismatch(
            f"{type(m).__name__}: DoRA adapters {dora} rescale the weight's columns; their effective weight "
            "is not W + scaling * B @ A and is not supported (merge them first: model.merge_and_unload())"
        )
    total = _float(w).clone()
    for a in active:
        a_w = _float(full_weight(m.lora_A[a].weight))
        b_w = _float(full_weight(m.lora_B[a].weight))
        if a_w.ndim != 2 or b_w.ndim != 2:
            raise AdapterMismatch(f"{type(m).__name__}: adapter {a!r} is not a linear LoRA (A {tuple(a_w.shape)})")
        delta = (b_w @ a_w) * float(m.scaling[a])  # nn.Linear layout (out, in)
        if getattr(m, "fan_in_fan_out", False):
            delta = delta.T  # the base weight is stored (in, out) (Conv1D)
        total = total + delta.to(total.dtype)
    return total


def _loralib_weight(m: Any) -> Tensor:  # a loralib layer, duck-typed
    w = full_weight(_tensor_attr(m, "weight"))
    if getattr(m, "fan_in_fan_out", False):
        w = w.T
    if getattr(m, "merged", False) or int(getattr(m, "r", 1) or 0) == 0:
        return w
    a_w = _float(full_weight(_tensor_attr(m, "lora_A")))
    b_w = _float(full_weight(_tensor_attr(m, "lora_B")))
    return _float(w) + (b_w @ a_w) * float(m.scaling)


def linear_weight(m: nn.Module) -> Tensor:
    """The weight ``m`` applies, in ``nn.Linear`` layout ``(out, in)``, detached and gathered.

    LoRA layers give their effective weight (see the module docstring). The parameter's dtype is kept
    for plain modules; a LoRA sum is in float32 at least.
    """
    if _is_peft_lora(m):
        w = _peft_weight(m)
        return w.T if is_conv1d(m.base_layer) else w
    if _is_loralib(m):
        return _loralib_weight(m)
    w = full_weight(_tensor_attr(m, "weight"))
    return w.T if is_conv1d(m) else w
