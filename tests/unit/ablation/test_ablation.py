"""Head ablation, importance, redundancy ranking and pruning, on tiny models of four families.

References are independent of the hooks under test: the output projection applied by hand to the
captured head outputs, and copies of the model whose out-projection columns (or q/k/v rows) are
edited directly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hdi_monitor.ablation import ablate_heads, head_output_means
from hdi_monitor.models import find_attention_layers

transformers = pytest.importorskip("transformers")

FAMILIES = ("torch_mha", "bert", "gpt2", "llama")
D, H = 32, 4


def _build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "torch_mha":
        layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=64, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    elif family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=50,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=50,
            n_embd=D,
            n_layer=2,
            n_head=H,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2Model(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=50,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            max_position_embeddings=32,
            attention_bias=True,
        )
        model = transformers.LlamaModel(cfg)
    model = model.double().eval()
    with torch.no_grad():  # random biases, so that mean ablation differs from zero ablation
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _batch(family: str, seed: int = 1, batch: int = 3, tokens: int = 7):
    g = torch.Generator().manual_seed(seed)
    if family == "torch_mha":
        return torch.randn(batch, tokens, D, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 50, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _run(model: nn.Module, batch) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def _out_weight_bias(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = rearrange(layer.head_weights("output"), "h m d -> m (h d)")
    mod = layer.module.out_proj if layer.family == "torch_mha" else layer.output_module
    return w, mod.bias


def _out_param(model: nn.Module, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The out-projection weight in (D, H d) view (Conv1D transposed) and its bias, of ``model``'s copy."""
    mod = dict(model.named_modules())[layer.name]
    if layer.family == "torch_mha":
        return mod.out_proj.weight, mod.out_proj.bias
    if layer.family == "bert":
        return mod.output.dense.weight, mod.output.dense.bias
    if layer.family == "gpt2":
        return mod.c_proj.weight.T, mod.c_proj.bias
    return mod.o_proj.weight, mod.o_proj.bias


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_ablation_equals_out_projection_of_zeroed_head_outputs(family):
    model = _build(family)
    layers = find_attention_layers(model)
    layer = layers[1]
    batch = _batch(family)
    captured = []
    with layer.attach_output_hook(lambda o, _k: captured.append(o.clone())), torch.no_grad():
        _run(model, batch)
    (o,) = captured
    seen = []
    target = layer.module if family == "torch_mha" else layer.output_module
    with torch.no_grad(), ablate_heads(model, {layer.name: [0, 2]}):
        # registered after the ablation's hooks, so it sees the edited output (MHA: post-hook order)
        hook = target.register_forward_hook(
            lambda _m, _a, out: seen.append((out[0] if isinstance(out, tuple) else out).clone())
        )
        try:
            _run(model, batch)
        finally:
            hook.remove()
    o_ref = o.clone()
    d = layer.head_dim
    for h in (0, 2):
        o_ref[..., h * d : (h + 1) * d] = 0
    w, b = _out_weight_bias(layer)
    expected = F.linear(o_ref, w, b)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], expected, atol=1e-6, rtol=0)
    assert (seen[0] - F.linear(o, w, b)).abs().max() > 1e-3  # the ablation changed something


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablation_equals_model_with_edited_out_projection(family, mode):
    model = _build(family)
    layers = find_attention_layers(model)
    batch = _batch(family)
    heads = {layers[0].name: [1], layers[1].name: [0, 3]}
    means = head_output_means(model, [_batch(family, seed=5), _batch(family, seed=6)]) if mode == "mean" else None
    with torch.no_grad(), ablate_heads(model, heads, mode, means=means):
        got = _run(model, batch)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in layers:
            w, b = _out_param(ref, layer)
            d = layer.head_dim
            for h in heads[layer.name]:
                cols = slice(h * d, (h + 1) * d)
                if mode == "mean":  # W_O,h E[o_h] moves into the bias
                    b += w[:, cols] @ means[layer.name][cols]
                w[:, cols] = 0
        expected = _run(ref, batch)
        full = _run(model, batch)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert (got - full).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["torch_mha", "bert"])
def test_ablation_restores_the_model_also_on_exceptions(family):
    model = _build(family)
    layer = find_attention_layers(model)[0]
    batch = _batch(family)
    with torch.no_grad():
        before = _run(model, batch)
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    fastpath = torch.backends.mha.get_fastpath_enabled()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), ablate_heads(model, {layer.name: [0, 1]}):
        assert (_run(model, batch) - before).abs().max() > 1e-3
        raise RuntimeError("boom")
    with torch.no_grad():
        after = _run(model, batch)
    assert torch.equal(after, before)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks_before
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_head_output_means_match_masked_average():
    model = _build("bert")
    layer = find_attention_layers(model)[0]
    batch = _batch("bert")
    captured = []
    with layer.attach_output_hook(lambda o, _k: captured.append(o)), torch.no_grad():
        _run(model, batch)
    keep = batch["attention_mask"].bool()
    expected = captured[0][keep].mean(0)
    got = head_output_means(model, batch)[layer.name]
    torch.testing.assert_close(got, expected.to(torch.float64), atol=1e-12, rtol=0)


def test_ablation_rejects_bad_input():
    model = _build("bert")
    name = find_attention_layers(model)[0].name
    with pytest.raises(ValueError, match="no attention layer named 'nope'"), ablate_heads(model, {"nope": [0]}):
        pass
    with pytest.raises(ValueError, match=r"out of range \(the layer has 4 heads"), ablate_heads(model, {name: [4]}):
        pass
    with pytest.raises(ValueError, match="needs means"), ablate_heads(model, {name: [0]}, "mean"):
        pass
    with pytest.raises(ValueError, match="mode must be"), ablate_heads(model, {name: [0]}, "drop"):  # type: ignore[arg-type]
        pass


# ------------------------------------------------------------------------------------- importance


def _loss(model: nn.Module, batch) -> torch.Tensor:
    out = _run(model, batch)
    r = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
    return ((out @ r).tanh() ** 2).mean()


def _loss_with_scaled_head(model: nn.Module, layer, head: int, scale: float, batch) -> float:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        w, _ = _out_param(ref, layer)
        w[:, head * layer.head_dim : (head + 1) * layer.head_dim] *= scale  # W_O (xi o) = (xi W_O) o
        return float(_loss(ref, batch))


@pytest.mark.parametrize("family", FAMILIES)
def test_head_importance_matches_finite_differences_of_the_gate(family):
    from hdi_monitor.ablation import head_importance

    model = _build(family)
    layers = find_attention_layers(model)
    batches = [_batch(family, seed=2), _batch(family, seed=3)]
    first = next(model.parameters())
    first.grad = torch.full_like(first, 0.5)
    grads_before = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    raw = head_importance(model, batches, _loss, normalize=False)
    # central differences; eps = 1e-3 because LlamaRMSNorm computes in float32 even for a float64 model
    eps = 1e-3
    for layer in layers:
        expected = torch.zeros(layer.num_heads, dtype=torch.float64)
        for h in range(layer.num_heads):
            for batch in batches:
                up = _loss_with_scaled_head(model, layer, h, 1 + eps, batch)
                down = _loss_with_scaled_head(model, layer, h, 1 - eps, batch)
                expected[h] += abs(up - down) / (2 * eps) / len(batches)
        assert expected.max() > 1e-4
        torch.testing.assert_close(raw[layer.name].double(), expected, rtol=1e-3, atol=1e-5)
    normed = head_importance(model, batches, _loss)
    for layer in layers:
        torch.testing.assert_close(normed[layer.name], raw[layer.name] / raw[layer.name].norm(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():  # only the gates were differentiated
        before = grads_before[n]
        assert (p.grad is None) if before is None else torch.equal(p.grad, before), n
    assert model.training is False


# ---------------------------------------------------------------------------------------- ranking


def _planted_bert():
    """Tiny BERT whose layer 1 has head 3 an exact copy of head 1 (q, k, v rows and o columns)."""
    model = _build("bert")
    att = model.encoder.layer[1].attention
    d = D // H
    src, dst = slice(1 * d, 2 * d), slice(3 * d, 4 * d)
    with torch.no_grad():
        for lin in (att.self.query, att.self.key, att.self.value):
            lin.weight[dst] = lin.weight[src]
            lin.bias[dst] = lin.bias[src]
        att.output.dense.weight[:, dst] = att.output.dense.weight[:, src]
    return model


def _spectral_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a.T @ b).square().sum() / ((a.T @ a).norm() * (b.T @ b).norm()))


def test_similarity_and_ranking_find_planted_duplicate_heads():
    from hdi_monitor.ablation import (
        head_similarity,
        redundancy_ranking,
        redundancy_scores,
    )

    model = _planted_bert()
    layers = find_attention_layers(model)
    sim = head_similarity(model)
    l1 = layers[1]
    s = sim[l1.name]
    assert s[1, 3] == pytest.approx(1.0, abs=1e-6)
    # an ordinary pair equals the mean over projections of the spectral overlap, computed by hand
    expected = (
        sum(
            _spectral_overlap(l1.head_weights(p)[0], l1.head_weights(p)[2]) for p in ("query", "key", "value", "output")
        )
        / 4
    )
    assert float(s[0, 2]) == pytest.approx(expected, abs=1e-6)
    off = ~torch.eye(H, dtype=torch.bool)
    assert sim[layers[0].name][off].max() < 0.9
    order = redundancy_ranking(sim)
    scores = redundancy_scores(sim)
    assert [(n, h) for n, h, _ in scores] == order
    assert scores[0][2] == pytest.approx(1.0, abs=1e-6)
    # brute force: the second score is the largest r_h over all layers once the first head is gone
    rest = {lay.name: [h for h in range(H) if (lay.name, h) != order[0]] for lay in layers}
    brute = max(float(sim[n][h, j]) for n, hs in rest.items() for h in hs for j in hs if j != h)
    assert scores[1][2] == pytest.approx(brute, abs=1e-6)
    assert brute < 0.99
    assert order[0][0] == l1.name and order[0][1] in (1, 3)
    twin = 4 - order[0][1]  # 1 <-> 3
    # once one copy is gone the other is no more redundant than the ordinary heads
    assert order[1] != (l1.name, twin)
    assert sorted(order) == sorted((lay.name, h) for lay in layers for h in range(H))
    assert [name for name, _ in order[-2:]] != [l1.name, l1.name]  # each layer's last head comes last


def test_similarity_output_correlation_view_matches_hand_computation():
    from hdi_monitor.ablation import head_similarity

    model = _planted_bert()
    layer = find_attention_layers(model)[1]
    batch = _batch("bert")
    captured = []
    with layer.attach_output_hook(lambda o, _k: captured.append(o)), torch.no_grad():
        _run(model, batch)
    o = captured[0][batch["attention_mask"].bool()]  # (tokens, H d)
    w = layer.head_weights("output").double()  # (H, D, d)
    c = torch.einsum("hmd,thd->htm", w, rearrange(o, "t (h d) -> t h d", h=H)).reshape(H, -1, D)
    c = c - c.mean(1, keepdim=True)
    cov = torch.einsum("itm,jtm->ij", c, c)
    corr = cov / torch.sqrt(cov.diagonal()[:, None] * cov.diagonal()[None, :])
    sim = head_similarity(model, projections=(), inputs=batch)[layer.name]
    torch.testing.assert_close(sim.double(), corr.clamp_min(0).fill_diagonal_(1.0), atol=1e-5, rtol=0)
    assert sim[1, 3] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="at least one view"):
        head_similarity(model, projections=())


def test_importance_combined_random_and_selection():
    from hdi_monitor.ablation import (
        combined_ranking,
        importance_ranking,
        random_ranking,
        select_heads,
    )

    imp = {"a": torch.tensor([0.5, 0.1, 0.9]), "b": torch.tensor([0.2, 0.05])}
    order = importance_ranking(imp)
    assert order == [("b", 1), ("a", 1), ("b", 0), ("a", 0), ("a", 2)]
    other = [("a", 2), ("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    # mean positions: b1 (0+4)/2=2, a1 (1+3)/2=2, b0 2, a0 (3+1)/2=2, a2 (4+0)/2=2 -> all tie, first order's
    assert combined_ranking(order, other) == order
    x, y, z = ("a", 0), ("a", 1), ("b", 0)
    assert combined_ranking([x, y, z], [z, x, y]) == [x, z, y]  # mean positions 0.5, 1.0, 1.5
    state = torch.random.get_rng_state()
    r1, r2 = random_ranking({"a": 3, "b": 2}, seed=7), random_ranking({"a": 3, "b": 2}, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator was not drawn from
    assert r1 == r2 and sorted(r1) == sorted(order)
    assert r1 == [
        [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)][i]
        for i in torch.randperm(5, generator=torch.Generator().manual_seed(7)).tolist()
    ]
    # b keeps one head: ("b", 0) is skipped once ("b", 1) went
    assert select_heads(order, 3, {"a": 3, "b": 2}) == {"a": [0, 1], "b": [1]}
    with pytest.raises(ValueError, match=r"count must be in 0\.\.3"):
        select_heads(order, 4, {"a": 3, "b": 2})


# ---------------------------------------------------------------------------------------- pruning


@pytest.mark.parametrize(
    ("family", "drop"),
    [
        ("bert", {0: [1], 1: [0, 2, 3]}),
        ("gpt2", {0: [0, 3], 1: [2]}),
        ("llama", {0: [0, 1], 1: [1, 3]}),  # layer 0: a whole key/value group goes; layer 1: groups of 1 and 1
        ("llama", {1: [0]}),  # unequal groups (1 and 2 query heads left): key/value heads are copied
    ],
)
def test_pruned_model_equals_ablated_model(family, drop):
    from hdi_monitor.ablation import count_parameters, prune_heads

    model = _build(family)
    layers = find_attention_layers(model)
    heads = {layers[i].name: h for i, h in drop.items()}
    batch = _batch(family)
    with torch.no_grad(), ablate_heads(model, heads):
        ablated = _run(model, batch)
    before = count_parameters(model)
    pruned = copy.deepcopy(model)
    unequal = family == "llama" and drop == {1: [0]}
    if unequal:
        with pytest.warns(UserWarning, match="unequal sizes"):
            prune_heads(pruned, heads)
    else:
        prune_heads(pruned, heads)
    with torch.no_grad():
        got = _run(pruned, batch)
    torch.testing.assert_close(got, ablated, atol=1e-5, rtol=0)
    after = {lay.name: lay for lay in find_attention_layers(pruned)}
    d = D // H
    expected_removed = 0
    for lay in layers:
        gone = len(heads.get(lay.name, []))
        assert after[lay.name].num_heads == H - gone
        q_and_o = gone * (2 * D * d + d)  # q rows + bias, o columns
        if family == "llama":
            kv_before = lay.num_kv_heads
            kv_after = after[lay.name].num_kv_heads
            expected_removed += q_and_o + (kv_before - kv_after) * 2 * (D * d + d)
        else:
            expected_removed += q_and_o + gone * 2 * (D * d + d)  # k and v rows + biases
    assert before - count_parameters(pruned) == expected_removed
    if family == "llama":
        assert [a.num_kv_heads for a in after.values()] == ([1, 2] if not unequal else [2, 3])


def test_prune_refuses_what_it_cannot_do():
    from hdi_monitor.ablation import prune_heads

    mha_model = _build("torch_mha")
    name = find_attention_layers(mha_model)[0].name
    with pytest.raises(ValueError, match=r"family 'torch_mha'.*num_heads \* head_dim == embed_dim.*ablate_heads"):
        prune_heads(mha_model, {name: [0]})
    bert = _build("bert")
    layers = find_attention_layers(bert)
    state = {k: v.clone() for k, v in bert.state_dict().items()}
    with pytest.raises(ValueError, match="cannot remove all 4 heads"):
        prune_heads(bert, {layers[0].name: [0], layers[1].name: [0, 1, 2, 3]})
    assert all(torch.equal(v, state[k]) for k, v in bert.state_dict().items())  # nothing edited
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=50, d_model=D, d_kv=8, num_heads=H, num_layers=1, d_ff=64)
    )
    t5_name = find_attention_layers(t5)[0].name
    with pytest.raises(ValueError, match="no pruning layout for family 't5'"):
        prune_heads(t5, {t5_name: [0]})
