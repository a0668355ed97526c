"""LoRA: measured on the effective weight W + scaling * B @ A, merged on the fly, never written back.

References: peft's own ``merge_and_unload()`` model (the HDI of the wrapped model equals that of
the merged one), and for a loralib-style layer the linear map its own forward applies. On main a
peft-wrapped model had no attention layer (peft's ``lora.Linear`` is not an ``nn.Linear``) and a
loralib-style layer was read on its frozen base weight.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hdi_monitor import head_diversity
from hdi_monitor.models import find_attention_layers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

D, H, V = 32, 4, 64
ALL = ("query", "key", "value", "output")


def _llama():
    return transformers.LlamaModel(
        transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=2,
            intermediate_size=37,
            max_position_embeddings=64,
        )
    )


def _gpt2():
    return transformers.GPT2Model(transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=H))


def _bert():
    return transformers.BertModel(
        transformers.BertConfig(
            vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, intermediate_size=37
        )
    )


def _bart():
    return transformers.BartModel(
        transformers.BartConfig(
            vocab_size=V,
            d_model=D,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=H,
            decoder_attention_heads=H,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
        )
    )


CASES = {
    "llama": (_llama, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "gpt2": (_gpt2, ["c_attn", "c_proj"], True),  # Conv1D: fan_in_fan_out
    "bert": (_bert, ["query", "key", "value", "attention.output.dense"], False),
    "bart": (_bart, ["q_proj", "k_proj", "v_proj", "out_proj"], False),
}


def _hdi(model) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = head_diversity(model, projections=ALL)
    return [{p: lay.hdi[p] for p in ALL} for lay in report.layers]


@pytest.mark.parametrize("name", list(CASES))
def test_peft_lora_hdi_equals_merged_model(name):
    make, targets, fan_in_fan_out = CASES[name]
    torch.manual_seed(0)
    base = make().eval()
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, fan_in_fan_out=fan_in_fan_out
    )
    wrapped = peft.get_peft_model(base, cfg).eval()
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    merged = copy.deepcopy(wrapped).merge_and_unload()
    got, ref = _hdi(wrapped), _hdi(merged)
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref, strict=True):
        for p in ALL:
            assert abs(g[p] - r[p]) < 1e-6, (p, g[p], r[p])
    # the LoRA update moves the HDI: measuring the frozen base would not be the same
    plain = _hdi(_base_copy(wrapped))
    assert max(abs(g[p] - b[p]) for g, b in zip(got, plain, strict=True) for p in ALL) > 1e-3
    # never written back
    after = wrapped.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _base_copy(wrapped):
    """The model with its LoRA layers removed and the frozen base weights kept (peft's ``unload``)."""
    return copy.deepcopy(wrapped).unload()


def test_peft_merged_or_disabled_adapters_read_the_base_weight():
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(
        _llama().eval(),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
        ),
    )
    effective = find_attention_layers(wrapped)[0].head_weights("key")
    wrapped.merge_adapter()  # peft writes W + BA into the base weight itself
    torch.testing.assert_close(find_attention_layers(wrapped)[0].head_weights("key"), effective)
    wrapped.unmerge_adapter()
    with wrapped.disable_adapter():
        base = find_attention_layers(wrapped)[0]
        k_proj = base.module.k_proj.base_layer
        torch.testing.assert_close(base.head_weights("key"), k_proj.weight.view(2, 8, D).transpose(1, 2))


class LoRALinear(nn.Linear):
    """loralib.Linear as published (microsoft/LoRA, loralib/layers.py): W + (alpha / r) B A."""

    def __init__(self, in_features: int, out_features: int, r: int = 4, lora_alpha: int = 8) -> None:
        super().__init__(in_features, out_features)
        self.r, self.lora_alpha, self.scaling = r, lora_alpha, lora_alpha / r
        self.lora_A = nn.Parameter(torch.randn(r, in_features) / math.sqrt(in_features))
        self.lora_B = nn.Parameter(torch.randn(out_features, r))
        self.weight.requires_grad = False
        self.merged = False
        self.fan_in_fan_out = False

    def forward(self, x):
        result = F.linear(x, self.weight, bias=self.bias)
        return result + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def test_loralib_style_linear_is_measured_on_its_effective_weight():
    torch.manual_seed(0)
    model = _llama().eval()
    for layer in model.layers:
        attn = layer.self_attn
        for child in ("q_proj", "k_proj", "v_proj", "o_proj"):
            old = getattr(attn, child)
            new = LoRALinear(old.in_features, old.out_features)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.zero_()
            setattr(attn, child, new)
    lay = find_attention_layers(model)[0]
    k = lay.module.k_proj
    # reference: the linear map the module's own forward applies (columns of forward(I))
    with torch.no_grad():
        applied = k(torch.eye(D)).T  # (out, in)
    torch.testing.assert_close(lay.head_weights("key"), applied.view(2, 8, D).transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lay.head_weights("key"), k.weight.view(2, 8, D).transpose(1, 2), atol=1e-3)
