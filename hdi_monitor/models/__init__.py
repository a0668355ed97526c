"""Attention discovery: the family table, the user `AttentionSpec`, `discover_attention`.

Built-in families, tried in this order (the first that matches a module wins and its descendants
are not searched): ``torch_mha`` and ``mla`` (code), then the declarative layout table
(`hdi_monitor.models.layouts.LAYOUTS`: ``timm_vit``, ``vit``, ``bert``, ``deberta``,
``gpt2``, ``gpt_bigcode``, ``falcon``, ``gpt_neox``, ``bloom``, ``phi3``, ``vision_qkv``, ``blip``,
``modernbert``, ``persimmon``, ``litgpt``, ``t5``, ``llama``, ``bart``, ``phi``, ``conformer``,
``ctrl``, ``bert_attention``, ``distilbert``, ``albert``, ``x_transformers``, ``wqkvo``). Modules
are recognised by class and attribute structure, so neither ``transformers`` nor ``timm`` is
imported. User specs are tried before all of them; add a family with `register_adapter`.

Each layer also says how it forms its logits (``layer.logit_form``: position scheme, scale,
QK-norm; `hdi_monitor.models.logits`), declared per class on the table entries (`LogitRule`) and on
`AttentionSpec`, for the weight-only logit bound.
"""

from hdi_monitor.models import mla, torch_mha
from hdi_monitor.models.base import (
    PROJECTIONS,
    Adapter,
    AdapterMismatch,
    AttentionLayer,
    HookHandle,
    SkippedModule,
    register_adapter,
    registered_adapters,
)
from hdi_monitor.models.discovery import Discovery, discover_attention, find_attention_layers
from hdi_monitor.models.layout import Layout, layout_adapters
from hdi_monitor.models.layouts import LAYOUTS
from hdi_monitor.models.logits import LogitForm, LogitRule
from hdi_monitor.models.spec import AttentionSpec
from hdi_monitor.models.torch_mha import mha_head_outputs

for _adapter in (torch_mha.ADAPTER, mla.ADAPTER, *layout_adapters(LAYOUTS)):
    register_adapter(_adapter, first=False)
del _adapter

__all__ = [
    "LAYOUTS",
    "PROJECTIONS",
    "Adapter",
    "AdapterMismatch",
    "AttentionLayer",
    "AttentionSpec",
    "Discovery",
    "HookHandle",
    "Layout",
    "LogitForm",
    "LogitRule",
    "SkippedModule",
    "discover_attention",
    "find_attention_layers",
    "mha_head_outputs",
    "register_adapter",
    "registered_adapters",
]
