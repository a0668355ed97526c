"""The weight-only logit bound in the report, and the update entropy, against independent references.

* The report's ``logit_bound`` against a brute force from the checkpoint tensors themselves (each
  head's ``W_Q,h`` and ``W_K,g(h)`` sliced here from the raw parameters, a dense float64 SVD of the
  ``D x D`` matrix ``W_Q,h W_K,g(h)^T``, or the two heads' largest singular values for rotary
  layers, times the family's scale written here): BERT (with random biases, left out), GPT-2 (fused
  Conv1D ``c_attn``, with the per-layer scale of ``scale_attn_by_inverse_layer_idx``), Llama
  (rotary, grouped queries) and ``nn.MultiheadAttention`` (packed ``in_proj_weight``, and separate
  weights with ``kdim != embed_dim``).
* ``update_entropy`` of the head tensors the layers read, between the weights before and after an
  AdamW step, against a dense float64 SVD of each head's ``D x D`` change ``Delta``, for the same
  families.
* What the bound means: on bias-free models the bound times the step's largest query-input and
  key-input norms (captured by forward pre-hooks here) is never below the largest logit the kernel
  capture measures on the same step (``HDITracker(kernel_stats=True).measure``); for QK-norm models
  the bound alone is. Where inputs can be chosen (a cross-attention ``nn.MultiheadAttention``, a
  custom QK-norm module) the bound is reached.
* Every family of the shared family table (`family_cases.CASES`): the declared scale times the
  weights' bilinear form gives the kernel's own logit, for every query/key pair where the family is
  declared not rotated (so neither the scale nor "not rotated" is a guess) and at token 0, where
  rotary embeddings are the identity, where it is rotary; and the bound holds over every
  query/key pair of the batch.
* The declared QK-norm classes compute the formula the table gives them (their own forward on
  random weights), and the docs tables are the tables in the code.
"""

from __future__ import annotations

import importlib
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_cases import CASES, build
from torch import Tensor, nn

from hdi_monitor import HDITracker
from hdi_monitor.functional.bilinear import update_entropy
from hdi_monitor.measure.oneshot import head_diversity
from hdi_monitor.models import LAYOUTS, AttentionSpec, LogitRule, discover_attention
from hdi_monitor.models.kernel_capture import KernelCall, KernelCapture
from hdi_monitor.models.logits import INVERSE_SQRT_D, QK_NORMS, LogitForm, _gains
from hdi_monitor.report import compute_report

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------ raw checkpoint heads


def _heads(rows: Tensor, heads: int) -> list[Tensor]:
    """``nn.Linear``-layout rows ``(heads * d, D)`` as ``heads`` float64 ``(D, d)`` blocks ``W_h``."""
    d = rows.shape[0] // heads
    return [rows[h * d : (h + 1) * d].detach().double().T for h in range(heads)]


def _brute_bound(wq: list[Tensor], wk: list[Tensor], scale: float, rotary: bool) -> Tensor:
    group = len(wq) // len(wk)
    out = []
    for h, q in enumerate(wq):
        k = wk[h // group]
        if rotary:
            out.append(torch.linalg.svdvals(q)[0] * torch.linalg.svdvals(k)[0] * scale)
        else:
            out.append(torch.linalg.svdvals(q @ k.T)[0] * scale)  # dense D x D (D x kdim)
    return torch.stack(out)


def _brute_entropy(q0: list[Tensor], k0: list[Tensor], q1: list[Tensor], k1: list[Tensor]) -> Tensor:
    group = len(q0) // len(k0)
    out = []
    for h in range(len(q0)):
        g = h // group
        delta = (q1[h] - q0[h]) @ k0[g].T + q0[h] @ (k1[g] - k0[g]).T  # dense D x D
        s2 = torch.linalg.svdvals(delta).square()
        p = s2 / s2.sum()
        p = p[p > 0]
        out.append(-(p * p.log()).sum())
    return torch.stack(out)


def _bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37
    )
    model = transformers.BertModel(cfg)
    with torch.no_grad():  # real biases: the bound leaves them out
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _bert_raw(model: nn.Module) -> list[tuple[list[Tensor], list[Tensor], float, bool]]:
    return [
        (_heads(lay.attention.self.query.weight, 4), _heads(lay.attention.self.key.weight, 4), 1 / math.sqrt(8), False)
        for lay in model.encoder.layer
    ]


def _gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=3, n_head=4, scale_attn_by_inverse_layer_idx=True)
    return transformers.GPT2Model(cfg)


def _gpt2_raw(model: nn.Module) -> list[tuple[list[Tensor], list[Tensor], float, bool]]:
    out = []
    for i, block in enumerate(model.h):
        w = block.attn.c_attn.weight  # Conv1D (D, 3D), y = x @ W: [q | k | v] columns
        q, k = w[:, :32].T, w[:, 32:64].T
        out.append((_heads(q, 4), _heads(k, 4), 1 / math.sqrt(8) / (i + 1), False))  # 1/sqrt(d) / (layer + 1)
    return out


def _llama(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **kw,
    )  # fmt: skip
    return transformers.LlamaModel(cfg)


def _llama_raw(model: nn.Module) -> list[tuple[list[Tensor], list[Tensor], float, bool]]:
    return [
        (_heads(lay.self_attn.q_proj.weight, 4), _heads(lay.self_attn.k_proj.weight, 2), 1 / math.sqrt(8), True)
        for lay in model.layers
    ]


class _TwoMHA(nn.Module):
    """A packed self-attention MHA and a cross-attention MHA with ``kdim != embed_dim``."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.cross = nn.MultiheadAttention(16, 2, kdim=12, vdim=12, batch_first=True)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = self.self_attn(x, x, x, need_weights=False)[0]
        return self.cross(x, memory, memory, need_weights=False)[0]


def _mha(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _TwoMHA()


def _mha_raw(model: nn.Module) -> list[tuple[list[Tensor], list[Tensor], float, bool]]:
    w = model.self_attn.in_proj_weight  # (3E, E): rows [q | k | v]
    cross = model.cross
    return [
        (_heads(w[:16], 4), _heads(w[16:32], 4), 1 / math.sqrt(4), False),
        (_heads(cross.q_proj_weight, 2), _heads(cross.k_proj_weight, 2), 1 / math.sqrt(8), False),
    ]


FAMILIES = {
    "bert": (_bert, _bert_raw),
    "gpt2": (_gpt2, _gpt2_raw),
    "llama": (_llama, _llama_raw),
    "mha": (_mha, _mha_raw),
}


def _loss(family: str, model: nn.Module) -> Tensor:
    g = torch.Generator().manual_seed(5)
    if family == "mha":
        out = model(torch.randn(2, 6, 16, generator=g), torch.randn(2, 5, 12, generator=g))
    else:
        out = model(input_ids=torch.randint(0, 50, (2, 7), generator=g)).last_hidden_state
    return out.square().mean()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_report_logit_bound_matches_dense_svd_of_the_checkpoint_heads(family: str) -> None:
    make, raw = FAMILIES[family]
    model = make()
    report = head_diversity(model, projections=("query", "key"))
    refs = raw(model)
    assert len(report.layers) == len(refs)
    for lay, (wq, wk, scale, rotary) in zip(report.layers, refs, strict=True):
        assert lay.logit_bound_rule == ("rotary" if rotary else "bilinear")
        assert lay.logit_bound is not None and lay.logit_bound.dtype == torch.float64
        ref = _brute_bound(wq, wk, scale, rotary)
        torch.testing.assert_close(lay.logit_bound, ref, rtol=RTOL, atol=0)
        assert lay.to_dict()["logit_bound"] == pytest.approx(ref.tolist(), rel=RTOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_update_entropy_of_the_layers_heads_matches_dense_svd_across_an_optimizer_step(family: str) -> None:
    make, raw = FAMILIES[family]
    model = make()
    layers = discover_attention(model).layers
    before = [(lay.head_weights("query").clone(), lay.head_weights("key").clone()) for lay in layers]
    raw_before = raw(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(family, model).backward()
    opt.step()
    raw_after = raw(model)
    for lay, (q0, k0), (rq0, rk0, _, _), (rq1, rk1, _, _) in zip(layers, before, raw_before, raw_after, strict=True):
        q1, k1 = lay.head_weights("query"), lay.head_weights("key")
        got = update_entropy(q0, k0, q1, k1, kv_map=lay.kv_map)
        ref = _brute_entropy(rq0, rk0, rq1, rk1)
        assert not torch.equal(q0, q1)  # the step changed the heads
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        assert ((got > 0) & (got <= math.log(2 * q0.shape[-1]) + 1e-9)).all()


# ------------------------------------------------------------------------- what the bound means


def _input_norms(modules: dict[str, nn.Module], found: dict[str, float]) -> list:
    """Forward pre-hooks recording the largest row norm of each module's first input."""

    def hook(name: str):
        def pre(_m, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            found[name] = max(found.get(name, 0.0), float(x.detach().double().norm(dim=-1).max()))

        return pre

    return [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in modules.items()]


def _measure(model: nn.Module, batch: object, **kw) -> object:
    tracker = HDITracker(model, kernel_stats=True, activations=False, max_tokens=None, strict=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = tracker.measure(batch)
    assert m is not None
    return m


def test_llama_bound_times_input_norms_is_never_below_the_kernels_max_logit() -> None:
    model = _llama(initializer_range=0.3, attention_bias=False)  # bias-free, grouped queries, rotary
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 50, (3, 11), generator=g)}
    norms: dict[str, float] = {}
    hooks = []
    for i, lay in enumerate(model.layers):
        hooks += _input_norms({f"{i}.q": lay.self_attn.q_proj, f"{i}.k": lay.self_attn.k_proj}, norms)
    try:
        m = _measure(model, batch)
    finally:
        for h in hooks:
            h.remove()
    for i, lay in enumerate(m.report.layers):
        assert lay.logit_bound_rule == "rotary" and lay.max_attention_logit is not None
        ceiling = lay.logit_bound * norms[f"{i}.q"] * norms[f"{i}.k"]
        assert (lay.max_attention_logit <= ceiling * (1 + 1e-6)).all(), (lay.max_attention_logit, ceiling)
        assert (lay.max_attention_logit > 0.05 * ceiling).all()  # a bound on the scale of the logits it bounds


def test_torch_mha_bias_free_bound_holds_on_a_step_and_is_reached_by_its_singular_vectors() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, bias=False, batch_first=True)
    norms: dict[str, float] = {}

    def pre(_m, args, kwargs):
        for name, x in zip(("q", "k"), (args[0], args[1]), strict=True):
            norms[name] = max(norms.get(name, 0.0), float(x.detach().double().norm(dim=-1).max()))

    handle = layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        m = _measure(layer, torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(2)))
    finally:
        handle.remove()
    (lay,) = m.report.layers
    assert lay.logit_bound_rule == "bilinear"
    assert (lay.max_attention_logit <= lay.logit_bound * norms["q"] * norms["k"] * (1 + 1e-6)).all()

    # reached: a unit query input and a unit key input along the top singular pair of W_Q,0 W_K,0^T
    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 4, bias=False, batch_first=True)

        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            return self.mha(x, y, y, need_weights=False)[0]

    torch.manual_seed(3)
    cross = Cross()
    w = cross.mha.in_proj_weight.detach().double()
    u, _, vh = torch.linalg.svd(w[:4].T @ w[16:20])  # head 0: rows [0:4] query, [16:20] key
    x, y = u[:, 0].float()[None, None], vh[0].float()[None, None]  # (1, 1, 16) each, unit norm
    (lay,) = _measure(cross, (x, y)).report.layers
    assert float(lay.max_attention_logit[0]) == pytest.approx(float(lay.logit_bound[0]), rel=1e-5)
    assert (lay.max_attention_logit <= lay.logit_bound * (1 + 1e-6)).all()


def test_qwen3_qk_norm_bound_is_never_below_the_kernels_max_logit_whatever_the_inputs() -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=50, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.Qwen3Model(cfg)
    with torch.no_grad():
        for lay in model.layers:  # gains far from 1, and large weights: the norm, not the weights, bounds the logits
            lay.self_attn.q_norm.weight.normal_(0, 2)
            lay.self_attn.k_norm.weight.normal_(0, 2)
            lay.self_attn.q_proj.weight.mul_(50)
    g = torch.Generator().manual_seed(1)
    m = _measure(model, {"input_ids": torch.randint(0, 50, (3, 11), generator=g)})
    for lay in m.report.layers:
        assert lay.logit_bound_rule == "qk_norm"
        assert (lay.max_attention_logit <= lay.logit_bound * (1 + 1e-6)).all()
        assert (lay.max_attention_logit > 0.05 * lay.logit_bound).all()


class _QKNormAttention(nn.Module):
    """Identity projections, a per-head RMSNorm on queries and keys with random gains, no rotation."""

    def __init__(self, heads: int = 2, d: int = 4) -> None:
        super().__init__()
        width = heads * d
        self.heads, self.d = heads, d
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(d, eps=1e-12), nn.RMSNorm(d, eps=1e-12)
        with torch.no_grad():
            for lin in (self.q, self.k, self.v, self.o):
                lin.weight.copy_(torch.eye(width))
            self.q_norm.weight.normal_(0, 1.5)
            self.k_norm.weight.normal_(0, 1.5)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        def split(t: Tensor) -> Tensor:
            return t.unflatten(-1, (self.heads, self.d)).transpose(1, 2)  # (B, H, T, d)

        q, k, v = self.q_norm(split(self.q(x))), self.k_norm(split(self.k(y))), split(self.v(y))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))


def test_a_custom_qk_norm_module_declared_by_spec_reaches_its_bound() -> None:
    torch.manual_seed(4)
    module = _QKNormAttention()
    spec = AttentionSpec(
        modules=r"^$", query="q", key="k", value="v", output="o", num_heads=2,
        logits=LogitRule(rotary=False, scale=INVERSE_SQRT_D),
    )  # fmt: skip
    gq, gk = module.q_norm.weight.detach().double(), module.k_norm.weight.detach().double()
    i = int((gq * gk).abs().argmax())
    sign = float(torch.sign(gq[i] * gk[i]))
    # head 1's coordinate i: after its RMSNorm it is sqrt(d) e_i, the largest a normalised head can be
    x = torch.zeros(1, 1, 8)
    x[0, 0, 4 + i] = 1.0
    m = _measure(module, (x, sign * x), spec=spec)
    (lay,) = m.report.layers
    assert lay.logit_bound_rule == "qk_norm"
    ref = (gq * gk).abs().max() * 4 / math.sqrt(4)  # max_i |g_q,i g_k,i| * radius^2 * scale
    torch.testing.assert_close(lay.logit_bound, torch.full((2,), float(ref), dtype=torch.float64), rtol=1e-6, atol=0)
    assert float(lay.max_attention_logit[1]) == pytest.approx(float(ref), rel=1e-5)


# ---------------------------------------------------------------------- every family of the table


def _child(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _logit_inputs(lay) -> dict[str, nn.Module]:
    """The modules whose first input is the query input and the key input of ``lay``: the
    projection children its layout entry names (the fused one for both, where fused)."""
    if lay.family == "torch_mha":
        return {}
    entry = next(e for e in LAYOUTS if e.family == lay.family and e.matches(lay.name, lay.module))
    query = entry.cross_query or entry.qkv or entry.query
    key = entry.qkv or entry.key
    assert query is not None and key is not None
    return {"q": _child(lay.module, query), "k": _child(lay.module, key)}


def _kernel_logits(call: KernelCall) -> Tensor:
    """``(B, H, T, S)`` float64 logits ``scale * q . k`` of a kernel call, every pair."""
    q, k = call.q.double(), call.k.double()
    heads = q.shape[1]
    kv = call.kv_head_map if call.kv_head_map is not None else torch.arange(heads) // (heads // k.shape[1])
    return call.scale * torch.einsum("bhtd,bhsd->bhts", q, k[:, kv])


#: Kernels the library does not reach (Bloom computes attention itself; Gemma 2 soft-caps its logits).
UNREACHED = {"bloom", "gemma2"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_declared_family_gives_its_kernels_logits_and_bounds_every_logit(case) -> None:
    """Not rotated: the declared scale times ``x W_Q,h W_K,g^T y`` is the kernel's logit for every
    query/key pair. Rotary: the same at token 0, where the rotation is the identity. Every
    family: the bound (times the largest input norms, without QK-norm) is never below a logit."""
    model = build(case)  # biases zeroed
    layers = discover_attention(model).layers
    inputs: dict[str, list[Tensor]] = {}
    calls: dict[str, list[KernelCall]] = {}
    hooks = []
    for lay in layers:
        if lay.logit_form.rule is None:
            continue
        mods = _logit_inputs(lay)
        if lay.family == "torch_mha":

            def mha_pre(_m, args, kwargs, n=lay.name):
                inputs.setdefault(f"{n}.q", []).append(args[0].detach())
                inputs.setdefault(f"{n}.k", []).append(args[1].detach())

            hooks.append(lay.module.register_forward_pre_hook(mha_pre, with_kwargs=True))
        for which, mod in mods.items():

            def pre(_m, args, n=f"{lay.name}.{which}"):
                inputs.setdefault(n, []).append(args[0].detach())

            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad(), KernelCapture(layers, lambda c: calls.setdefault(c.layer, []).append(c)) as cap:
            model(**case.batch())
    finally:
        for h in hooks:
            h.remove()
    report = compute_report(layers, projections=("query", "key"))
    checked = 0
    for lay, res in zip(layers, report.layers, strict=True):
        form = lay.logit_form
        if form.rule is None:
            assert res.logit_bound is None and any("logit bound not computed" in n for n in res.notes)
            assert lay.family == "mla"  # the only family of the table without a bound
            continue
        assert res.logit_bound is not None and torch.isfinite(res.logit_bound).all()
        if lay.name not in calls:
            assert case.id in UNREACHED, (lay.name, cap.unreachable)
            continue
        assert len(calls[lay.name]) == len(inputs[f"{lay.name}.q"])
        wq, wk = lay.head_weights("query").double(), lay.head_weights("key").double()
        kv = [lay.kv_head(h) for h in range(lay.num_heads)]
        for call, x, y in zip(calls[lay.name], inputs[f"{lay.name}.q"], inputs[f"{lay.name}.k"], strict=True):
            logits = _kernel_logits(call)  # (B, H, T, S)
            if form.qk_norm is None and form.rotary is False:
                # not rotated: the declared scale times the bilinear form is the kernel's logit for every pair
                mine = form.scale * torch.einsum("btm,hmd,hnd,bsn->bhts", x.double(), wq, wk[kv], y.double())
                torch.testing.assert_close(mine, logits, rtol=1e-4, atol=1e-7)
            elif form.qk_norm is None:
                # token 0 (query and key), where rotary embeddings are the identity: the declared scale
                x0 = (x[0, 0] if x.dim() == 3 else x[0]).double()
                y0 = (y[0, 0] if y.dim() == 3 else y[0]).double()
                mine = form.scale * torch.einsum("m,hmd,hnd,n->h", x0, wq, wk[kv], y0)
                torch.testing.assert_close(mine, logits[0, :, 0, 0], rtol=1e-4, atol=1e-7)
            if form.qk_norm is None:
                ceiling = res.logit_bound * x.double().norm(dim=-1).max() * y.double().norm(dim=-1).max()
            else:
                ceiling = res.logit_bound
            top = logits.amax(dim=(0, 2, 3))
            assert (top <= ceiling * (1 + 1e-5) + 1e-9).all(), (lay.name, top, ceiling)
            checked += 1
    assert checked or case.id in UNREACHED or all(lay.logit_form.rule is None for lay in layers)


def test_families_of_the_table_resolve_as_declared() -> None:
    """The rule each tested model resolves to (the docs table lists the same declarations)."""
    want = {
        "bert": ("bilinear", None), "gpt2": ("bilinear", None), "llama": ("rotary", None), "t5": ("bilinear", None),
        "qwen3": ("qk_norm", ("head", "head")), "olmo2": ("qk_norm", ("projection", "projection")),
        "gemma3_text": ("qk_norm", ("head", "head")), "persimmon": ("qk_norm", ("head", "head")),
        "falcon_new_gqa": ("rotary", None), "deepseek_v3": (None, None),
    }  # fmt: skip
    for case in CASES:
        if case.id not in want:
            continue
        lay = discover_attention(build(case)).layers[0]
        form = lay.logit_form
        qk = None if form.qk_norm is None else (form.qk_norm.query_over, form.qk_norm.key_over)
        assert (form.rule, qk) == want[case.id], case.id
    # Falcon's position scheme is not declared (rotary or ALiBi by config): the product bound, said so
    falcon = next(c for c in CASES if c.id == "falcon_new_gqa")
    assert any(
        "position scheme not declared" in n for n in discover_attention(build(falcon)).layers[0].logit_form.notes
    )


@pytest.mark.parametrize(
    ("config", "gains"),
    [
        ("Olmo2Config", "weight"),  # over all H d channels of the projection
        ("Gemma3TextConfig", "1+weight"),  # gain 1 + weight
        ("CohereConfig", "weight"),  # (H, d) per-head LayerNorm gains
        ("StableLmConfig", "weight"),  # one LayerNorm per head
    ],
)
def test_qk_norm_gains_rebuild_the_kernels_queries_and_keys_at_token_0(config: str, gains: str) -> None:
    """The gains the report reads, applied to the normalised projection the way the table says,
    give the q and k the kernel receives at token 0 (an RMS or LayerNorm per head or per
    projection)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=50, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if config == "Gemma3TextConfig":
        kw["head_dim"] = 8
    if config == "CohereConfig":
        kw["use_qk_norm"] = True
    if config == "StableLmConfig":
        kw["qk_layernorm"] = True
    model = transformers.AutoModel.from_config(getattr(transformers, config)(**kw), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and ".self_attn." in name:
                p.normal_(0.3, 0.7)
            elif name.endswith("bias"):
                p.zero_()
    (lay,) = discover_attention(model).layers
    qk = lay.logit_form.qk_norm
    assert qk is not None
    x_in: dict[str, Tensor] = {}
    hooks = [
        mod.register_forward_pre_hook(lambda _m, a, n=n: x_in.__setitem__(n, a[0].detach()))
        for n, mod in (("q", lay.module.q_proj), ("k", lay.module.k_proj))
    ]
    calls: list[KernelCall] = []
    try:
        with torch.no_grad(), KernelCapture([lay], calls.append):
            model(input_ids=torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
    read = lay.qk_norm_gains()
    layer_norm = config in ("CohereConfig", "StableLmConfig")  # centred before scaling
    for which, t, g, radius in (
        ("q", calls[0].q, read.query, read.radius_query),
        ("k", calls[0].k, read.key, read.radius_key),
    ):
        w = lay.head_weights("query" if which == "q" else "key").double()
        u = torch.einsum("m,hmd->hd", x_in[which][0, 0].double(), w)  # (heads, d) projection at token 0
        group = u if radius == math.sqrt(lay.head_dim) else u.reshape(1, -1)  # per head, or the whole projection
        if layer_norm:
            group = group - group.mean(-1, keepdim=True)
        normed = (group / group.square().mean(-1, keepdim=True).add(1e-5).sqrt()).reshape(u.shape)
        torch.testing.assert_close(normed * g.double(), t[0, :, 0].double(), rtol=1e-3, atol=1e-4)
    assert qk.query_over == ("projection" if config == "Olmo2Config" else "head")


# --------------------------------------------------------------------------------- report behaviour


def test_no_bound_without_query_and_key_or_when_turned_off() -> None:
    model = _llama()
    for projections in (("query",), ("key", "value")):
        report = head_diversity(model, projections=projections)
        assert all(lay.logit_bound is None and lay.logit_bound_rule is None for lay in report.layers)
        assert "logit bound" not in report.format_table()
        assert "logit_bound" not in report.to_dict()["layers"][0]
    layers = discover_attention(model).layers
    off = compute_report(layers, projections=("query", "key"), logit_bounds=False)
    assert all(lay.logit_bound is None for lay in off.layers)
    with pytest.raises(TypeError):
        compute_report(layers, logit_bounds="yes")  # type: ignore[arg-type]


def test_refused_layers_have_no_bound_and_say_why() -> None:
    mla = discover_attention(build(next(c for c in CASES if c.id == "deepseek_v3"))).layers
    report = compute_report(mla, projections=("query", "key"))
    for lay in report.layers:
        assert lay.logit_bound is None
        assert any(n.startswith("logit bound not computed: MLA") for n in lay.notes)
    # a scaled rotary embedding (YaRN): its attention factor multiplies the logits and is not read
    yarn = _llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 16})  # fmt: skip
    lay = head_diversity(yarn, projections=("query", "key")).layers[0]
    assert lay.logit_bound is None and any("rope_type 'yarn'" in n for n in lay.notes)
    # a QK-norm-like child of an unknown class is refused, never guessed
    module = _QKNormAttention()

    class ScaledNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x: Tensor) -> Tensor:
            return 3 * x * self.weight

    module.k_norm = ScaledNorm()
    spec = AttentionSpec(modules=r"^$", query="q", key="k", value="v", output="o", num_heads=2,
                         logits=LogitRule(rotary=False, scale=INVERSE_SQRT_D))  # fmt: skip
    lay = head_diversity(module, spec=spec, projections=("query", "key")).layers[0]
    assert lay.logit_bound is None and any("ScaledNorm" in n and "not a known plain" in n for n in lay.notes)
    # a spec without logits, and a custom adapter's layer without a form
    spec = AttentionSpec(modules=r"^$", query="q", key="k", value="v", output="o", num_heads=2)
    lay = head_diversity(_QKNormAttention(), spec=spec, projections=("query", "key")).layers[0]
    assert lay.logit_bound is None and any("declares no logits=LogitRule" in n for n in lay.notes)


def test_table_dict_and_non_finite_heads() -> None:
    model = _llama()
    with torch.no_grad():
        model.layers[1].self_attn.q_proj.weight[8:16, 0] = float("nan")  # query head 1 of layer 1
        model.layers[0].self_attn.q_proj.weight[:8] = 0.0  # query head 0 of layer 0: dead, bound 0
    report = head_diversity(model, projections=("query", "key"))
    b0, b1 = report.layers[0].logit_bound, report.layers[1].logit_bound
    assert b0 is not None and b1 is not None
    assert float(b0[0]) == 0.0 and torch.isfinite(b0).all()
    assert torch.isnan(b1[1]) and torch.isfinite(b1[[0, 2, 3]]).all()
    assert report.layers[1].to_dict()["logit_bound"][1] is None
    assert report.layers[1].logit_bound_max == pytest.approx(float(b1[[0, 2, 3]].max()))
    table = report.format_table()
    assert "logit bound" in table.splitlines()[1]
    assert f"{report.layers[1].logit_bound_max:.3f}" in table


def test_logit_form_and_rule_validation() -> None:
    with pytest.raises(ValueError, match="scale"):
        LogitForm(rotary=False)
    assert LogitForm.refused("x").rule is None
    with pytest.raises(TypeError):
        LogitRule(rotary="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LogitRule(scale=-1.0)
    with pytest.raises(TypeError):
        LogitRule(qk_norm=("q_norm",))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AttentionSpec(modules="x", query="q", key="k", value="v", output="o", logits="rotary")  # type: ignore[arg-type]


# --------------------------------------------------------------------- the QK-norm table, the docs


def _expand(pattern: str) -> list[str]:
    """Class names of a table regex of the forms ``A|B`` and ``(A|B|C)Suffix``."""
    m = re.fullmatch(r"\(([\w|]+)\)(\w+)", pattern)
    if m:
        return [p + m.group(2) for p in m.group(1).split("|")]
    assert re.fullmatch(r"[\w|]+", pattern), pattern
    return pattern.split("|")


def _transformers_class(name: str) -> type:
    root = Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        if f"class {name}(" in path.read_text(encoding="utf-8"):
            return getattr(importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}"), name)
    raise LookupError(name)


def _norm_instance(cls: type) -> tuple[nn.Module, int]:
    """A ``cls`` norm over 6 channels (4 heads of 6 for the per-head classes) and its head count."""
    if cls.__name__ == "CohereLayerNorm":
        return cls(hidden_size=(4, 6)), 4
    if cls.__name__ == "StableLmLayerNormPerHead":
        return cls(6, 4), 4
    return cls(6), 1


@pytest.mark.parametrize(
    "entry", [e for e in QK_NORMS if e.module_prefix == "transformers."], ids=lambda e: e.classes[:30]
)
def test_qk_norm_classes_compute_their_declared_formula(entry) -> None:
    """Each declared class, on random weights, is the normalised input times its gain (biases zero)."""
    for name in _expand(entry.classes):
        norm, heads = _norm_instance(_transformers_class(name))
        assert entry.matches(norm)
        with torch.no_grad():
            for pname, p in norm.named_parameters():
                if pname.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0, 1)
        x = torch.randn(3, heads, 6, dtype=torch.float32) * 3 + 1
        got = norm(x if heads > 1 else x[:, 0]).reshape(3, heads, 6).double()
        g, radius = _gains(norm, entry, heads, 6, name)
        assert radius == pytest.approx(math.sqrt(6))
        xd = x.double()
        rms = xd / xd.square().mean(-1, keepdim=True).add(1e-5).sqrt()
        centred = xd - xd.mean(-1, keepdim=True)
        ln = centred / centred.square().mean(-1, keepdim=True).add(1e-5).sqrt()
        ok = [torch.allclose(got, base * g.double(), rtol=1e-3, atol=1e-4) for base in (rms, ln)]
        assert any(ok), name


def _markdown_rows(text: str, start: str, end: str) -> list[str]:
    block = text.split(start, 1)[1].split(end, 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip().startswith("|")]


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _describe(rule: LogitRule) -> list[str]:
    if rule.refusal is not None:
        return ["no bound", "", "", rule.refusal]
    position = {True: "rotary", False: "not rotated", None: "not declared (product bound)"}[rule.rotary]
    scale = f"`{rule.scale}`" if isinstance(rule.scale, str) else str(rule.scale)
    if isinstance(rule.scale, str) and rule.scale != INVERSE_SQRT_D:
        scale = f"attribute `{rule.scale}`"
    qk = "found by name" if rule.qk_norm is None else ", ".join(f"`{n}`" for n in rule.qk_norm)
    return [position, scale, qk, rule.note]


def expected_family_rows() -> list[str]:
    rows = ["| family | classes | position | scale | QK-norm | left out / why not |", "|---|---|---|---|---|---|"]
    seen: set[tuple[str, LogitRule]] = set()
    for entry in LAYOUTS:
        for rule in entry.logits:
            if (entry.family, rule) in seen:
                continue
            seen.add((entry.family, rule))
            classes = _code(rule.classes) if rule.classes else entry.used_by
            if rule.module_prefix not in (None, "transformers."):
                classes += f" in `{rule.module_prefix}`"
            rows.append("| " + " | ".join([f"`{entry.family}`", classes, *_describe(rule)]) + " |")
    rows.append("| `torch_mha` | `nn.MultiheadAttention` | not rotated | `1/sqrt(d)` | none | `bias_k` |")
    rows.append("| `mla` | DeepSeek-V2/V3, Kimi K2 | no bound | | | RMS-normalised latents and a shared RoPE key |")
    return rows


def expected_norm_rows() -> list[str]:
    over = {
        "normalized_shape": "its `normalized_shape`",
        "last": "the weight's last dimension",
        "per_head": "one `LayerNorm(d)` per head",
    }
    rows = ["| classes | gain | normalised over |", "|---|---|---|"]
    for e in QK_NORMS:
        where = "transformers" if e.module_prefix == "transformers." else f"`{e.module_prefix.rstrip('.')}`"
        rows.append(f"| {_code(e.classes)} ({where}) | `{e.gain}` | {over[e.over]} |")
    return rows


def test_docs_tables_are_the_tables_in_the_code() -> None:
    text = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    got = _markdown_rows(text, "<!-- logit-forms:start -->", "<!-- logit-forms:end -->")
    assert got == expected_family_rows(), "\n" + "\n".join(expected_family_rows())
    got = _markdown_rows(text, "<!-- qk-norms:start -->", "<!-- qk-norms:end -->")
    assert got == expected_norm_rows(), "\n" + "\n".join(expected_norm_rows())
