"""Head-output covariance on real model families against brute force.

For each family the reference materialises every head's contribution ``c_h = W_O,h o_h`` from head
outputs captured independently of the adapters (the model's own output-projection input, or, for
``nn.MultiheadAttention``, per-head attention probabilities returned by the module itself) and the
output-projection weight read straight from the module. ``C`` from ``head_diversity(inputs=...)``
must match to 1e-6 relative (elementwise, with an absolute floor of 1e-6 of the largest entry:
the MHA reference recomputes head outputs in float64 while the module runs in float32), with and
without padding, over several accumulated batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hdi_monitor import head_diversity

transformers = pytest.importorskip("transformers")

H, D = 4, 32
D_HEAD = D // H


def brute_force_covariance(contributions: torch.Tensor) -> torch.Tensor:
    """contributions (N, H, D) in float64 -> C (H, H), population moments, explicit loops."""
    c = contributions - contributions.mean(0)
    n, heads, _ = c.shape
    out = torch.empty(heads, heads, dtype=torch.float64)
    for i in range(heads):
        for j in range(heads):
            out[i, j] = (c[:, i] * c[:, j]).sum() / n
    return out


def contributions_linear(o: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """o (N, H*d), nn.Linear-style out weight (D, H*d) -> (N, H, D): c_h = W[:, h*d:(h+1)*d] o_h."""
    o, weight = o.double(), weight.double()
    parts = [o[:, h * D_HEAD : (h + 1) * D_HEAD] @ weight[:, h * D_HEAD : (h + 1) * D_HEAD].T for h in range(H)]
    return torch.stack(parts, dim=1)


def batches_with_padding(padded: bool, n_batches: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n_batches):
        length = 5 + b
        ids = torch.randint(3, 60, (3, length), generator=g)
        mask = torch.ones(3, length, dtype=torch.long)
        if padded:
            mask[1, -2:] = 0
            mask[2, -(length - 1) :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def capture_inputs(module: nn.Module, model: nn.Module, batches) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        handle.remove()
    return seen


def check(model, out_proj_of, weight_of, padded: bool) -> None:
    model.eval()
    batches = batches_with_padding(padded)
    report = head_diversity(model, inputs=batches)
    assert len(report.layers) == 2
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        seen = capture_inputs(out_proj_of(module), model, batches)
        o = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(seen, batches, strict=True)])
        reference = brute_force_covariance(contributions_linear(o, weight_of(module)))
        assert layer.num_tokens == sum(int(b["attention_mask"].sum()) for b in batches)
        torch.testing.assert_close(
            layer.covariance.double(), reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item()
        )
        corr = reference / torch.sqrt(torch.outer(reference.diag(), reference.diag()))
        torch.testing.assert_close(layer.correlation.double(), corr, rtol=1e-6, atol=1e-8)
        assert layer.effective_heads == pytest.approx(
            H * reference.diag().sum().item() / reference.sum().item(), rel=1e-6
        )


@pytest.mark.parametrize("padded", [False, True])
def test_bert(padded):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, intermediate_size=48
    )
    model = transformers.BertModel(cfg)
    check(model, lambda m: m.output.dense, lambda m: m.output.dense.weight, padded)


@pytest.mark.parametrize("padded", [False, True])
def test_gpt2(padded):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=D, n_layer=2, n_head=H, n_positions=32)
    model = transformers.GPT2Model(cfg)
    # Conv1D computes x @ W with W of shape (in, out): as an nn.Linear weight that is W.T
    check(model, lambda m: m.c_proj, lambda m: m.c_proj.weight.T, padded)


@pytest.mark.parametrize("padded", [False, True])
def test_llama_grouped_query(padded):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
    )
    model = transformers.LlamaModel(cfg)
    check(model, lambda m: m.o_proj, lambda m: m.o_proj.weight, padded)


@pytest.mark.parametrize("padded", [False, True])
def test_torch_multihead_attention(padded):
    """Reference head outputs from the module's own per-head attention probabilities."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 48, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 6 + b, D, generator=g) for b in range(3)]
    masks = []
    for x in xs:
        kpm = torch.zeros(x.shape[:2], dtype=torch.bool)
        if padded:
            kpm[1, -2:] = True
            kpm[2, -4:] = True
        masks.append(kpm)
    batches = [{"src": x, "src_key_padding_mask": m} for x, m in zip(xs, masks, strict=True)]
    report = head_diversity(model, inputs=batches)

    # layer inputs, captured from the encoder itself
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [
        model.layers[i].self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen[i].append(a[0]), with_kwargs=True
        )
        for i in range(2)
    ]
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            for b in batches:
                model(**b)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
        for h in handles:
            h.remove()
    for i, layer_report in enumerate(report.layers):
        attn = model.layers[i].self_attn
        contribs = []
        for x, kpm in zip(seen[i], masks, strict=True):
            with torch.no_grad():
                _, probs = attn(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
            w_v = attn.in_proj_weight[2 * D :].double()
            b_v = attn.in_proj_bias[2 * D :].double()
            v = x.double() @ w_v.T + b_v  # (B, T, D)
            v = v.view(*v.shape[:2], H, D_HEAD).transpose(1, 2)  # (B, H, T, d)
            o = (probs.double() @ v).transpose(1, 2).reshape(*x.shape[:2], D)  # (B, T, H*d)
            contribs.append(contributions_linear(o[~kpm], attn.out_proj.weight))
        reference = brute_force_covariance(torch.cat(contribs))
        torch.testing.assert_close(
            layer_report.covariance.double(), reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item()
        )
        assert layer_report.num_tokens == sum(int((~m).sum()) for m in masks)
