"""Attention discovery: family adapters, the user :class:`AttentionSpec`, :func:`find_attention_layers`.

Built-in families, tried in this order (the first adapter that matches a module wins and its
descendants are not searched): ``torch_mha``, ``timm_vit``, ``vit``, ``bert``, ``gpt2``, ``t5``,
``llama``. Hugging Face and timm modules are recognised by class/attribute structure, so neither
``transformers`` nor ``timm`` is imported. Add a family with :func:`register_adapter`.
"""

from hdi_monitor.adapters import bert, gpt2, llama, t5, timm_vit, torch_mha, vit
from hdi_monitor.adapters.base import (
    PROJECTIONS,
    Adapter,
    AdapterMismatch,
    AttentionLayer,
    AttentionSpec,
    HookHandle,
    register_adapter,
    registered_adapters,
)
from hdi_monitor.adapters.discovery import find_attention_layers
from hdi_monitor.adapters.torch_mha import mha_head_outputs

for _module in (torch_mha, timm_vit, vit, bert, gpt2, t5, llama):
    register_adapter(_module.ADAPTER, first=False)
del _module

__all__ = [
    "PROJECTIONS",
    "Adapter",
    "AdapterMismatch",
    "AttentionLayer",
    "AttentionSpec",
    "HookHandle",
    "find_attention_layers",
    "mha_head_outputs",
    "register_adapter",
    "registered_adapters",
]
