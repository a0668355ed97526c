"""Attention discovery: every family's head weights and head outputs against the model's own forward.

For each family a tiny model is built from a config. The references are the model's own
computations: the outputs of its projection modules (captured with forward hooks), its attention
probabilities (eager attention, ``output_attentions=True``) and its attention modules' outputs.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor import head_diversity
from hdi_monitor.models import (
    PROJECTIONS,
    AttentionLayer,
    AttentionSpec,
    find_attention_layers,
    registered_adapters,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ATOL = 1e-5
D, H, HKV, V, T = 32, 4, 2, 64, 7


def close(a: Tensor, b: Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------- capture helpers


class Capture:
    """Forward hooks that record (args, kwargs, output) of modules, last call wins."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.calls: dict[str, tuple[tuple, dict, object]] = {}
        self.handles = [m.register_forward_hook(self._hook(k), with_kwargs=True) for k, m in modules.items()]

    def _hook(self, key: str):
        def hook(_m, args, kwargs, output):
            self.calls[key] = (args, kwargs, output)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def check_qkv(layer: AttentionLayer, sources: dict[str, tuple[nn.Module, int]], run: Callable[[], object]) -> None:
    """x @ W_h + bias slice equals the slice of the projection module's own output, for every head."""
    mods = {f"m{id(m)}": m for m, _ in sources.values()}
    cap = Capture(mods)
    try:
        run()
    finally:
        cap.remove()
    for proj in ("query", "key", "value"):
        mod, start = sources[proj]
        args, _, y = cap.calls[f"m{id(mod)}"]
        x = args[0]
        w = layer.head_weights(proj)
        heads, d_in, d = w.shape
        assert heads == layer.heads_for(proj)
        assert d == layer.head_dim and d_in == x.shape[-1]
        assert w.dtype == mod.weight.dtype and w.device == mod.weight.device and not w.requires_grad
        bias = getattr(mod, "bias", None)
        for h in range(heads):
            sl = slice(start + h * d, start + (h + 1) * d)
            got = x @ w[h] + (bias[sl] if bias is not None else 0)
            close(got, y[..., sl])


def check_output(layer: AttentionLayer, out_mod: nn.Module, run: Callable[[], object]) -> None:
    """sum_h W_O,h o_h + bias equals the out-projection's own output."""
    cap = Capture({"o": out_mod})
    try:
        run()
    finally:
        cap.remove()
    args, _, y = cap.calls["o"]
    o = rearrange(args[0], "... (h d) -> ... h d", h=layer.num_heads)
    w_o = layer.head_weights("output")
    assert w_o.shape == (layer.num_heads, layer.model_dim, layer.head_dim)
    bias = getattr(out_mod, "bias", None)
    got = torch.einsum("...hd,hmd->...m", o, w_o) + (bias if bias is not None else 0)
    close(got, y)


def check_hook(
    layer: AttentionLayer,
    finish: Callable[[Tensor, tuple, dict], Tensor],
    real: Callable[[object], Tensor],
    run: Callable[[], object],
) -> Tensor:
    """The hooked o, finished by the module's own out-projection, reproduces the module's output."""
    got: list[tuple[Tensor, Tensor | None]] = []
    cap = Capture({"attn": layer.module})
    handle = layer.attach_output_hook(lambda o, keep: got.append((o, keep)))
    try:
        run()
    finally:
        handle.remove()
        cap.remove()
    assert len(got) == 1
    o, keep = got[0]
    assert o.shape[-1] == layer.num_heads * layer.head_dim and not o.requires_grad
    args, kwargs, output = cap.calls["attn"]
    close(finish(o, args, kwargs), real(output))
    # removed: no further calls
    run()
    assert len(got) == 1
    return o


def check_o_from_probs(
    layer: AttentionLayer, o: Tensor, probs: Tensor, value_in: Tensor, v_bias: Tensor | None
) -> None:
    """o_h = A_h @ v_{g(h)} with the model's own attention probabilities (query head h uses kv group h // (H/H_kv))."""
    w_v = layer.head_weights("value")
    group = layer.num_heads // layer.num_kv_heads
    d = layer.head_dim
    o_heads = rearrange(o, "b t (h d) -> b h t d", h=layer.num_heads)
    for h in range(layer.num_heads):
        g = h // group
        v = value_in @ w_v[g] + (v_bias[g * d : (g + 1) * d] if v_bias is not None else 0)
        close(o_heads[:, h], probs[:, h] @ v)


# --------------------------------------------------------------------------- HF families


@dataclass
class HFCase:
    name: str
    family: str
    make: Callable[[], nn.Module]
    batch: Callable[[], dict]
    n_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    sources: Callable[[nn.Module], dict[str, tuple[nn.Module, int]]]  # query/key/value -> (module, offset)
    out_module: Callable[[nn.Module], nn.Module]
    mask_key: str | None = "attention_mask"


def _ids_batch(pad: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if pad:
        mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _t5_batch() -> dict:
    b = _ids_batch()
    g = torch.Generator().manual_seed(1)
    dec = torch.randint(3, V, (2, 5), generator=g)
    dmask = torch.ones(2, 5, dtype=torch.long)
    dmask[0, -1] = 0
    return {**b, "decoder_input_ids": dec, "decoder_attention_mask": dmask}


def _vit_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}


def _make(config_cls, **kw) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        cfg = config_cls(**kw)
        return transformers.AutoModel.from_config(cfg, attn_implementation="eager").eval()

    return make


_LLAMA_KW = dict(
    vocab_size=V,
    hidden_size=D,
    num_hidden_layers=2,
    num_attention_heads=H,
    num_key_value_heads=HKV,
    intermediate_size=37,
    max_position_embeddings=64,
)
_llama_sources = lambda m: {"query": (m.q_proj, 0), "key": (m.k_proj, 0), "value": (m.v_proj, 0)}  # noqa: E731

HF_CASES = [
    HFCase(
        "bert",
        "bert",
        _make(
            transformers.BertConfig,
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        _ids_batch,
        2,
        H,
        H,
        D // H,
        lambda m: {"query": (m.self.query, 0), "key": (m.self.key, 0), "value": (m.self.value, 0)},
        lambda m: m.output.dense,
    ),
    HFCase(
        "roberta",
        "bert",
        _make(
            transformers.RobertaConfig,
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        _ids_batch,
        2,
        H,
        H,
        D // H,
        lambda m: {"query": (m.self.query, 0), "key": (m.self.key, 0), "value": (m.self.value, 0)},
        lambda m: m.output.dense,
    ),
    HFCase(
        "gpt2",
        "gpt2",
        _make(transformers.GPT2Config, vocab_size=V, n_embd=D, n_layer=2, n_head=H, bos_token_id=0, eos_token_id=0),
        _ids_batch,
        2,
        H,
        H,
        D // H,
        lambda m: {"query": (m.c_attn, 0), "key": (m.c_attn, D), "value": (m.c_attn, 2 * D)},
        lambda m: m.c_proj,
    ),
    HFCase(
        "llama",
        "llama",
        _make(transformers.LlamaConfig, **_LLAMA_KW),
        _ids_batch,
        2,
        H,
        HKV,
        D // H,
        _llama_sources,
        lambda m: m.o_proj,
    ),
    HFCase(
        "mistral",
        "llama",
        _make(transformers.MistralConfig, **_LLAMA_KW),
        _ids_batch,
        2,
        H,
        HKV,
        D // H,
        _llama_sources,
        lambda m: m.o_proj,
    ),
    HFCase(
        "qwen2",
        "llama",
        _make(transformers.Qwen2Config, **{**_LLAMA_KW, "num_key_value_heads": 1}),
        _ids_batch,
        2,
        H,
        1,
        D // H,
        _llama_sources,
        lambda m: m.o_proj,
    ),
    HFCase(
        "t5",
        "t5",
        _make(
            transformers.T5Config,
            vocab_size=V,
            d_model=D,
            d_kv=6,
            d_ff=37,
            num_layers=2,
            num_decoder_layers=1,
            num_heads=H,
        ),
        _t5_batch,
        2 + 2,
        H,
        H,
        6,
        lambda m: {"query": (m.q, 0), "key": (m.k, 0), "value": (m.v, 0)},
        lambda m: m.o,
    ),
    HFCase(
        "vit",
        "vit",
        _make(
            transformers.ViTConfig,
            image_size=16,
            patch_size=8,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            intermediate_size=37,
        ),
        _vit_batch,
        2,
        H,
        H,
        D // H,
        lambda m: {"query": (m.q_proj, 0), "key": (m.k_proj, 0), "value": (m.v_proj, 0)},
        lambda m: m.o_proj,
        mask_key=None,
    ),
]


@pytest.fixture(scope="module", params=HF_CASES, ids=[c.name for c in HF_CASES])
def hf(request):
    case: HFCase = request.param
    model = case.make()
    return case, model, find_attention_layers(model)


def test_hf_discovery_counts(hf):
    case, model, layers = hf
    assert len(layers) == case.n_layers
    names = [lay.name for lay in layers]
    assert len(set(names)) == len(names)
    modules = dict(model.named_modules())
    for lay in layers:
        assert modules[lay.name] is lay.module
        assert lay.family == case.family
        assert (lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.model_dim) == (
            case.heads,
            case.kv_heads,
            case.head_dim,
            D,
        )
        if case.name == "t5":
            expected = "decoder_attention_mask" if lay.name.startswith("decoder") else "attention_mask"
            assert lay.mask_key == expected
        else:
            assert lay.mask_key == case.mask_key
    # no layer is nested inside another one
    for a in names:
        assert not any(b != a and b.startswith(a + ".") for b in names)


def test_hf_head_weights_reproduce_projections(hf):
    case, model, layers = hf
    batch = case.batch()
    with torch.no_grad():
        for lay in layers:
            check_qkv(lay, case.sources(lay.module), lambda: model(**batch))
            check_output(lay, case.out_module(lay.module), lambda: model(**batch))


def _finisher(case: HFCase, lay: AttentionLayer) -> tuple[Callable, Callable]:
    mod = lay.module
    if case.family == "bert":

        def finish(o, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            return mod.output(o, hidden)  # BertSelfOutput: LayerNorm(dense(o) + hidden)
    else:
        out = case.out_module(mod)

        def finish(o, args, kwargs):
            return out(o)

    return finish, lambda output: output[0]


def test_hf_output_hook_reproduces_attention_output(hf):
    case, model, layers = hf
    batch = case.batch()
    with torch.no_grad():
        for lay in layers:
            finish, real = _finisher(case, lay)
            check_hook(lay, finish, real, lambda: model(**batch))


def test_hf_head_outputs_follow_attention_probs(hf):
    """Head h of the hooked o is A_h @ v_{h // group}: heads of o, W_V and the kv grouping agree."""
    case, model, layers = hf
    batch = case.batch()
    os_: dict[str, Tensor] = {}
    handles = [lay.attach_output_hook(lambda o, k, n=lay.name: os_.__setitem__(n, o)) for lay in layers]
    v_mods = {lay.name: case.sources(lay.module)["value"][0] for lay in layers}
    cap = Capture(v_mods)
    try:
        with torch.no_grad():
            out = model(**batch, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
        cap.remove()
    if case.name == "t5":
        probs = [*out.encoder_attentions]
        for self_a, cross_a in zip(out.decoder_attentions, out.cross_attentions, strict=True):
            probs += [self_a, cross_a]
    else:
        probs = list(out.attentions)
    assert len(probs) == len(layers)
    for lay, a in zip(layers, probs, strict=True):
        mod, start = case.sources(lay.module)["value"]
        args, _, _ = cap.calls[lay.name]
        bias = getattr(mod, "bias", None)
        v_bias = None if bias is None else bias[start : start + lay.num_kv_heads * lay.head_dim]
        check_o_from_probs(lay, os_[lay.name], a, args[0], v_bias)


def test_t5_decoder_layers_and_cross_attention_inputs():
    case = next(c for c in HF_CASES if c.name == "t5")
    model = case.make()
    layers = find_attention_layers(model)
    names = [lay.name for lay in layers]
    assert names == [
        "encoder.block.0.layer.0.SelfAttention",
        "encoder.block.1.layer.0.SelfAttention",
        "decoder.block.0.layer.0.SelfAttention",
        "decoder.block.0.layer.1.EncDecAttention",
    ]


def test_gpt2_cross_attention():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=D, n_layer=1, n_head=H, add_cross_attention=True, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2Model(cfg).eval()
    layers = find_attention_layers(model)
    assert [lay.name for lay in layers] == ["h.0.attn", "h.0.crossattention"]
    cross = layers[1]
    enc = torch.randn(2, 5, D)
    batch = _ids_batch()
    run = lambda: model(**batch, encoder_hidden_states=enc)  # noqa: E731
    m = cross.module
    with torch.no_grad():
        check_qkv(cross, {"query": (m.q_attn, 0), "key": (m.c_attn, 0), "value": (m.c_attn, D)}, run)
        check_output(cross, m.c_proj, run)
        check_hook(cross, lambda o, a, k: m.c_proj(o), lambda out: out[0], run)


def test_nanogpt_style_linear_c_attn():
    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head, self.n_embd = H, D
            self.c_attn = nn.Linear(D, 3 * D)
            self.c_proj = nn.Linear(D, D)

        def forward(self, x):
            q, k, v = self.c_attn(x).split(D, dim=2)
            q, k, v = (rearrange(t, "b t (h d) -> b h t d", h=H) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(rearrange(y, "b h t d -> b t (h d)"))

    torch.manual_seed(0)
    model = nn.Sequential(CausalSelfAttention())
    (lay,) = find_attention_layers(model)
    assert lay.family == "gpt2" and lay.num_heads == H and lay.head_dim == D // H
    x = torch.randn(2, T, D)
    m = model[0]
    with torch.no_grad():
        check_qkv(lay, {"query": (m.c_attn, 0), "key": (m.c_attn, D), "value": (m.c_attn, 2 * D)}, lambda: model(x))
        check_output(lay, m.c_proj, lambda: model(x))


# --------------------------------------------------------------------------- timm


class Attention(nn.Module):
    """Same class name, structure and forward as timm.layers.Attention (qkv packed as (3, H, d), proj).

    The class name matters: a fused qkv layout is only read for the classes known to use it.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_dim = dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        x = x.transpose(1, 2).reshape(b, n, self.attn_dim)
        return self.proj(self.norm(x))


class TimmStyleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.attn = Attention(D, H)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


def _timm_checks(model: nn.Module, x: Tensor, n_blocks: int) -> None:
    layers = find_attention_layers(model)
    assert len(layers) == n_blocks
    for lay in layers:
        assert lay.family == "timm_vit" and lay.name.endswith("attn") and lay.mask_key is None
        m = lay.module
        a = m.num_heads * m.head_dim
        with torch.no_grad():
            check_qkv(lay, {"query": (m.qkv, 0), "key": (m.qkv, a), "value": (m.qkv, 2 * a)}, lambda: model(x))
            check_output(lay, m.proj, lambda: model(x))
            check_hook(lay, lambda o, args, kw, m=m: m.proj(o), lambda out: out, lambda: model(x))


def test_timm_style_standin():
    torch.manual_seed(0)
    model = nn.Sequential(TimmStyleBlock(), TimmStyleBlock()).eval()
    _timm_checks(model, torch.randn(2, 5, D), 2)


def _timm_importable() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # timm pulls torchvision, which may not import alongside this torch
        return False
    return True


@pytest.mark.skipif(
    not _timm_importable(),
    reason="timm is not importable: it needs torchvision, and no torchvision build matches the CPU torch that CI "
    "installs, so CI cannot run this test (PITFALLS); run it where a matching torchvision is installed",
)
def test_real_timm_vit():
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=0).eval()
    x = torch.randn(1, 3, 32, 32)
    layers = find_attention_layers(model)
    assert [lay.name for lay in layers] == ["blocks.0.attn", "blocks.1.attn"]
    m = layers[0].module
    a = m.num_heads * m.head_dim
    with torch.no_grad():
        check_qkv(layers[0], {"query": (m.qkv, 0), "key": (m.qkv, a), "value": (m.qkv, 2 * a)}, lambda: model(x))
        check_output(layers[0], m.proj, lambda: model(x))


# --------------------------------------------------------------------------- torch MHA


def _mha_probs_reference(mha: nn.MultiheadAttention, lay: AttentionLayer, q_in, k_in, v_in, **kw):
    """Check W_Q, W_K (via the module's own per-head attention weights) and W_V, W_O (via its output)."""
    out, probs = mha(q_in, k_in, v_in, need_weights=True, average_attn_weights=False, **kw)
    if mha.batch_first:
        q_b, k_b, v_b = q_in, k_in, v_in
    else:
        q_b, k_b, v_b = (t.transpose(0, 1) for t in (q_in, k_in, v_in))
        out = out.transpose(0, 1)
    e, d = mha.embed_dim, mha.head_dim
    bias = mha.in_proj_bias
    wq, wk, wv, wo = (lay.head_weights(p) for p in PROJECTIONS)
    assert wk.shape[1] == mha.kdim and wv.shape[1] == mha.vdim
    total = mha.out_proj.bias.clone()
    kpm = kw.get("key_padding_mask")
    for h in range(mha.num_heads):
        sl = slice(h * d, (h + 1) * d)
        qh = q_b @ wq[h] + bias[sl]
        kh = k_b @ wk[h] + bias[e:][sl]
        vh = v_b @ wv[h] + bias[2 * e :][sl]
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
        if kpm is not None:
            scores = scores.masked_fill(kpm[:, None, :], float("-inf"))
        a = scores.softmax(-1)
        close(a, probs[:, h])
        total = total + (a @ vh) @ wo[h].T
    close(total, out)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("separate", [False, True], ids=["packed", "kdim_vdim"])
def test_mha_head_weights(batch_first, separate):
    torch.manual_seed(0)
    kw = {"kdim": 24, "vdim": 20} if separate else {}
    mha = nn.MultiheadAttention(D, H, batch_first=batch_first, **kw).eval()
    (lay,) = find_attention_layers(nn.ModuleDict({"attn": mha}))
    assert lay.name == "attn" and lay.family == "torch_mha"
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.model_dim) == (H, H, D // H, D)
    shape = (2, 5) if batch_first else (5, 2)
    src = (2, 6) if batch_first else (6, 2)
    q = torch.randn(*shape, D)
    k = torch.randn(*src, mha.kdim)
    v = torch.randn(*src, mha.vdim)
    with torch.no_grad():
        _mha_probs_reference(mha, lay, q, k, v)
        kpm = torch.zeros(2, 6, dtype=torch.bool)
        kpm[1, -2:] = True
        _mha_probs_reference(mha, lay, q, k, v, key_padding_mask=kpm)


def _hook_run(lay: AttentionLayer, call: Callable[[], tuple[Tensor, object]]):
    got = []
    with lay.attach_output_hook(lambda o, keep: got.append((o, keep))):
        with torch.no_grad():
            out = call()
    assert len(got) == 1
    return got[0][0], got[0][1], out


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_output_hook_self_attention(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=batch_first).eval()
    (lay,) = find_attention_layers(mha)
    assert lay.name == ""
    b, t = 3, 6
    x = torch.randn(b, t, D) if batch_first else torch.randn(t, b, D)
    kpm = torch.zeros(b, t, dtype=torch.bool)
    kpm[1, -2:] = True
    kpm[2, -1:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(t)
    for kwargs in (
        {},
        {"key_padding_mask": kpm},
        {"attn_mask": causal, "is_causal": True},
        {"key_padding_mask": kpm, "attn_mask": causal.isinf()},
    ):
        o, keep, (out, _) = _hook_run(lay, lambda kwargs=kwargs: mha(x, x, x, **kwargs))
        assert o.shape == x.shape
        close(mha.out_proj(o), out)
        if "key_padding_mask" in kwargs:
            expected_keep = ~kpm if batch_first else (~kpm).T
            assert keep.dtype == torch.bool and torch.equal(keep, expected_keep)
            assert keep.shape == o.shape[:-1]
        else:
            assert keep is None
    # a float key_padding_mask: -inf counts as padding
    fkpm = torch.zeros(b, t).masked_fill(kpm, float("-inf"))
    o, keep, (out, _) = _hook_run(lay, lambda: mha(x, x, x, key_padding_mask=fkpm))
    close(mha.out_proj(o), out)
    assert torch.equal(keep, ~kpm if batch_first else (~kpm).T)


def test_mha_output_hook_cross_attention_and_extras():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, kdim=24, vdim=20, batch_first=True, add_bias_kv=True, add_zero_attn=True).eval()
    (lay,) = find_attention_layers(mha)
    q, k, v = torch.randn(2, 5, D), torch.randn(2, 6, 24), torch.randn(2, 6, 20)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, -3:] = True
    attn_mask = torch.zeros(2 * H, 5, 6).masked_fill(torch.rand(2 * H, 5, 6) < 0.3, float("-inf"))
    attn_mask[..., 0] = 0.0
    o, keep, (out, _) = _hook_run(lay, lambda: mha(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask))
    close(mha.out_proj(o), out)
    assert keep is None  # the padding mask describes the keys, not the query tokens


def test_mha_output_hook_unbatched():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H).eval()
    (lay,) = find_attention_layers(mha)
    x = torch.randn(5, D)
    o, keep, (out, _) = _hook_run(lay, lambda: mha(x, x, x))
    assert o.shape == (5, D)
    close(mha.out_proj(o), out)


def test_mha_output_hook_in_training_mode_without_dropout():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True)  # training mode, dropout 0
    (lay,) = find_attention_layers(mha)
    x = torch.randn(2, 5, D, requires_grad=True)
    got = []
    with lay.attach_output_hook(lambda o, keep: got.append(o)):
        out, _ = mha(x, x, x)
    assert not got[0].requires_grad
    close(mha.out_proj(got[0]), out.detach())


def test_transformer_encoder_layers_found_once_and_hook_with_fast_path():
    """In eval mode nn.TransformerEncoder hands its layers a nested tensor (the padded batch without
    its padding); the hook reads it padded again, with the padding as its keep mask, and the global
    fast-path flag is never touched (switching it off changed which weights a training forward
    reads). Reference: the MHA's own output projection of the recomputed head outputs."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=37, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    layers = find_attention_layers(model)
    assert [lay.name for lay in layers] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(lay.family == "torch_mha" for lay in layers)
    x = torch.randn(3, 6, D)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    with torch.no_grad():
        ref = model(x, src_key_padding_mask=kpm)  # may take the fused fast path (nested tensors)
    got = {}
    cap = Capture({lay.name: lay.module for lay in layers})
    handles = [lay.attach_output_hook(lambda o, k, n=lay.name: got.__setitem__(n, (o, k))) for lay in layers]
    try:
        assert torch.backends.mha.get_fastpath_enabled()  # never switched off
        with torch.no_grad():
            out = model(x, src_key_padding_mask=kpm)
    finally:
        for h in handles:
            h.remove()
        cap.remove()
    assert torch.backends.mha.get_fastpath_enabled()
    keep = ~kpm
    out = out.to_padded_tensor(0.0) if out.is_nested else out
    close(out[keep], ref[keep])  # the hooks do not change the model's output on real tokens
    for lay in layers:
        o, k = got[lay.name]
        assert torch.equal(k, keep)
        _, _, (attn_out, _) = cap.calls[lay.name]
        assert attn_out.is_nested  # the nested path was taken: the case this test is about
        close(lay.module.out_proj(o)[keep], attn_out.to_padded_tensor(0.0)[keep])


def test_transformer_decoder_layer_self_and_cross_attention():
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(D, H, dim_feedforward=37, dropout=0.0, batch_first=False).eval()
    model = nn.TransformerDecoder(dec, num_layers=1)
    layers = find_attention_layers(model)
    assert [lay.name for lay in layers] == ["layers.0.self_attn", "layers.0.multihead_attn"]
    tgt, mem = torch.randn(5, 2, D), torch.randn(6, 2, D)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    mem_kpm = torch.zeros(2, 6, dtype=torch.bool)
    mem_kpm[1, -2:] = True
    tgt_kpm = torch.zeros(2, 5, dtype=torch.bool)
    tgt_kpm[0, -1] = True
    got = {}
    cap = Capture({lay.name: lay.module for lay in layers})
    handles = [lay.attach_output_hook(lambda o, k, n=lay.name: got.__setitem__(n, (o, k))) for lay in layers]
    try:
        with torch.no_grad():
            model(
                tgt,
                mem,
                tgt_mask=tgt_mask,
                tgt_is_causal=True,
                tgt_key_padding_mask=tgt_kpm,
                memory_key_padding_mask=mem_kpm,
            )
    finally:
        for h in handles:
            h.remove()
        cap.remove()
    for lay in layers:
        o, keep = got[lay.name]
        _, _, (attn_out, _) = cap.calls[lay.name]
        close(lay.module.out_proj(o), attn_out)
    assert torch.equal(got["layers.0.self_attn"][1], (~tgt_kpm).T)
    assert got["layers.0.multihead_attn"][1] is None
    # cross-attention weights: keys read the memory
    with torch.no_grad():
        _mha_probs_reference(dec.multihead_attn, layers[1], tgt, mem, mem, key_padding_mask=mem_kpm)


# --------------------------------------------------------------------------- AttentionSpec


class CustomAttention(nn.Module):
    def __init__(self, dim: int = D, heads: int = H, kv_heads: int = HKV) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x):
        q = rearrange(self.wq(x), "b t (h d) -> b h t d", h=self.heads)
        k = rearrange(self.wk(x), "b t (h d) -> b h t d", h=self.kv_heads)
        v = rearrange(self.wv(x), "b t (h d) -> b h t d", h=self.kv_heads)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.wo(rearrange(o, "b h t d -> b t (h d)"))


class CustomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.ModuleDict({"attn": CustomAttention(), "attn_norm": nn.LayerNorm(D)}) for _ in range(3)]
        )

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk["attn"](blk["attn_norm"](x))
        return x


def test_spec_attribute_paths():
    torch.manual_seed(0)
    model = CustomModel().eval()
    # out of the box: the structural wq/wk/wv/wo entry, head counts from the module's heads/kv_heads
    auto = find_attention_layers(model)
    assert [(lay.family, lay.num_heads, lay.num_kv_heads) for lay in auto] == [("wqkvo", H, HKV)] * 3
    spec = AttentionSpec(
        modules=r"blocks\.\d+\.attn$", query="wq", key="wk", value="wv", output="wo", num_heads=H, num_kv_heads=HKV
    )
    layers = find_attention_layers(model, spec=spec)
    assert [lay.name for lay in layers] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]  # not attn_norm
    unanchored = AttentionSpec(
        modules=r"blocks\.\d+\.attn", query="wq", key="wk", value="wv", output="wo", num_heads=H, num_kv_heads=HKV
    )  # re.search: also finds blocks.0.attn_norm
    with pytest.raises(ValueError, match=r"blocks\.0\.attn_norm: .*'wo' does not resolve.*anchor it"):
        find_attention_layers(model, spec=unanchored)
    x = torch.randn(2, T, D)
    for lay in layers:
        assert (lay.family, lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.model_dim) == ("spec", H, HKV, D // H, D)
        m = lay.module
        with torch.no_grad():
            check_qkv(lay, {"query": (m.wq, 0), "key": (m.wk, 0), "value": (m.wv, 0)}, lambda: model(x))
            check_output(lay, m.wo, lambda: model(x))
            check_hook(lay, lambda o, a, k, m=m: m.wo(o), lambda out: out, lambda: model(x))


def test_spec_callables_and_predicate():
    torch.manual_seed(0)
    model = nn.Sequential(TimmStyleBlock())
    a = D
    spec = AttentionSpec(
        modules=lambda name, m: isinstance(m, Attention),
        query=lambda m: m.qkv.weight[:a],
        key=lambda m: m.qkv.weight[a : 2 * a],
        value=lambda m: m.qkv.weight[2 * a :],
        output="proj.weight",
        output_module="proj",
        num_heads=H,
        family="custom",
    )
    with pytest.warns(UserWarning, match="slices of one fused weight"):
        (lay,) = find_attention_layers(model, spec=spec)
    assert lay.name == "0.attn" and lay.family == "custom" and lay.head_dim == D // H
    m = lay.module
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        check_qkv(lay, {"query": (m.qkv, 0), "key": (m.qkv, a), "value": (m.qkv, 2 * a)}, lambda: model(x))
        check_hook(lay, lambda o, *_: m.proj(o), lambda out: out, lambda: model(x))


def test_spec_shape_errors_name_projection_and_numbers():
    model = CustomModel()
    with pytest.raises(ValueError, match=r"32 head-output features do not split into 5 heads"):
        find_attention_layers(
            model,
            spec=AttentionSpec(modules=r"blocks\.0\.attn", query="wq", key="wk", value="wv", output="wo", num_heads=5),
        )
    with pytest.raises(ValueError, match=r"4 key/value heads given, the weights have 2"):
        find_attention_layers(
            model,
            spec=AttentionSpec(
                modules=r"blocks\.0\.attn", query="wq", key="wk", value="wv", output="wo", num_heads=4, num_kv_heads=4
            ),
        )
    with pytest.raises(ValueError, match="does not resolve.*'nope'"):
        find_attention_layers(
            model,
            spec=AttentionSpec(
                modules=r"blocks\.0\.attn", query="nope", key="wk", value="wv", output="wo", num_heads=4
            ),
        )
    with pytest.raises(ValueError, match="matched no module of CustomModel"):
        find_attention_layers(
            model, spec=AttentionSpec(modules="^attn$", query="wq", key="wk", value="wv", output="wo", num_heads=4)
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        AttentionSpec(modules="x", query="wq", key="wk", value="wv", output="wo", num_heads=4, num_kv_heads=3)
    with pytest.raises(TypeError, match="AttentionSpec.key"):
        AttentionSpec(modules="x", query="wq", key=3, value="wv", output="wo", num_heads=4)
    with pytest.raises(ValueError, match="not a valid regex"):
        AttentionSpec(modules="(", query="wq", key="wk", value="wv", output="wo", num_heads=4)


# --------------------------------------------------------------------------- bad input, filters


def test_no_attention_error_lists_families_and_spec_example():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError) as info:
        find_attention_layers(model)
    msg = str(info.value)
    assert "Sequential" in msg
    for adapter in registered_adapters():
        assert adapter.family in msg
    assert "AttentionSpec(" in msg
    with pytest.raises(TypeError, match="nn.Module"):
        find_attention_layers("not a model")  # type: ignore[arg-type]


def test_meta_and_lazy_layers_are_skipped_with_warning():
    with torch.device("meta"):
        meta = nn.MultiheadAttention(D, H)
    model = nn.ModuleDict({"real": nn.MultiheadAttention(D, H), "ghost": meta})
    with pytest.warns(UserWarning, match=r"ghost \(MultiheadAttention\).*meta device or uninitialised"):
        layers = find_attention_layers(model)
    assert [lay.name for lay in layers] == ["real"]
    with pytest.raises(ValueError, match=r"measured none of them:\n  ghost .*meta device"):
        find_attention_layers(nn.ModuleDict({"ghost": meta}))

    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.LazyLinear(D) for _ in range(4))

    lazy_model = nn.ModuleDict({"a": Lazy(), "b": CustomAttention(kv_heads=H)})
    spec = AttentionSpec(modules="a|b", query="wq", key="wk", value="wv", output="wo", num_heads=H)
    with pytest.warns(UserWarning, match=r"a \(Lazy\).*uninitialised"):
        layers = find_attention_layers(lazy_model, spec=spec)
    assert [lay.name for lay in layers] == ["b"]


def test_layers_filter():
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, H, batch_first=True), num_layers=3, enable_nested_tensor=False
    )
    assert [lay.name for lay in find_attention_layers(model, layers=r"layers\.[02]\.")] == [
        "layers.0.self_attn",
        "layers.2.self_attn",
    ]
    assert [lay.name for lay in find_attention_layers(model, layers=["layers.1.self_attn"])] == ["layers.1.self_attn"]
    with pytest.raises(ValueError, match=r"matches none.*layers\.0\.self_attn"):
        find_attention_layers(model, layers="decoder")
    with pytest.raises(ValueError, match=r"\['layers\.9\.self_attn'\] are not attention layers.*available"):
        find_attention_layers(model, layers=["layers.9.self_attn"])
    with pytest.raises(ValueError, match="selects no attention layer"):
        find_attention_layers(model, layers=[])


def test_head_weights_rejects_unknown_projection():
    (lay,) = find_attention_layers(nn.MultiheadAttention(D, H))
    with pytest.raises(ValueError, match=re.escape(str(PROJECTIONS))):
        lay.head_weights("keys")


@pytest.mark.slow
def test_discovery_does_not_import_transformers_for_plain_torch():
    import subprocess
    import sys

    code = (
        "import sys, torch; from hdi_monitor.models import find_attention_layers;"
        "find_attention_layers(torch.nn.MultiheadAttention(8, 2));"
        "assert 'transformers' not in sys.modules and 'timm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_hooks_are_removed_and_warnings_quiet():
    mha = nn.MultiheadAttention(D, H, batch_first=True)
    (lay,) = find_attention_layers(mha)
    h = lay.attach_output_hook(lambda o, k: None)
    assert len(mha._forward_pre_hooks) == 1
    h.remove()
    h.remove()  # idempotent
    assert len(mha._forward_pre_hooks) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_attention_layers(mha)


def test_dtensor_parameters_are_gathered():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or a process group already exists")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(D, H)
        (lay,) = find_attention_layers(mha)
        ref = {p: lay.head_weights(p).clone() for p in PROJECTIONS}
        mha.in_proj_weight = nn.Parameter(distribute_tensor(mha.in_proj_weight.detach(), mesh, [Shard(0)]))
        mha.out_proj.weight = nn.Parameter(distribute_tensor(mha.out_proj.weight.detach(), mesh, [Shard(0)]))
        assert isinstance(mha.in_proj_weight, DTensor)
        for p in PROJECTIONS:
            w = lay.head_weights(p)
            assert not isinstance(w, DTensor) and torch.equal(w, ref[p])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min, -1e9])
def test_float_key_padding_masks_mark_the_same_padding_as_bool_ones(fill):
    """A float key_padding_mask is additive: -inf, finfo.min and -1e9 all mask a key (its weight
    underflows to 0). Each marks the same padded tokens as the bool mask: 9 real tokens of 15 (it
    counted finfo.min and -1e9 rows as real: 15)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, key_padding_mask=pad)[0]

    net = Net().eval()
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1:] = True
    float_pad = torch.zeros(3, 5).masked_fill(pad, fill)
    with torch.no_grad():  # the module itself masks those keys alike
        close(net(x, float_pad)[~pad], net(x, pad)[~pad])
    by_bool = head_diversity(net, inputs=(x, pad), max_tokens=None).layers[0]
    by_float = head_diversity(net, inputs=(x, float_pad), max_tokens=None).layers[0]
    assert by_bool.num_tokens == by_float.num_tokens == int((~pad).sum()) == 9
    assert by_float.effective_heads == pytest.approx(by_bool.effective_heads, rel=1e-6)
