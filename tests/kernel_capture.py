"""What a model feeds its attention kernel, captured during its own forward pass (test helper).

The reference for every family test and for ``benchmarks/coverage.py``: transformers 5 routes
attention through its attention-function registry (``ALL_ATTENTION_FUNCTIONS``), whose ``sdpa``
entry is wrapped here to record each call's per-head ``q``, ``k``, ``v`` (``(B, heads, T, d)``,
after rotary embeddings and q/k norms) and output (``(B, T, H, d)``). Families that do not use the
registry (Bloom, Falcon) are captured at their own head-split method; litgpt at its
``scaled_dot_product_attention`` method; x-transformers at ``Attend.forward``.

:func:`check_layers` compares an extraction with these tensors at token position 0, where rotary
embeddings are the identity, with every bias of the model set to zero (so ``q_h = x W_h``):

* per-head ``x @ W_q,h``, ``x @ W_k,g``, ``x @ W_v,g`` equal the kernel's ``q``, ``k``, ``v`` heads
  (through the module's own q/k norm where it has one);
* the hooked head outputs ``o`` equal the kernel's output, and ``sum_h W_O,h o_h`` equals the output
  projection's own output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models import AttentionLayer


@dataclass
class KernelCall:
    module: nn.Module
    q: Tensor  # (B, H, T, d)
    k: Tensor  # (B, H_k, T, d)   H_k = H_kv, or H where the module repeats k itself
    v: Tensor
    out: Tensor | None = None  # (B, T, H, d)


@dataclass
class Captured:
    calls: dict[int, KernelCall] = field(default_factory=dict)  # id(module) -> last call
    inputs: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # id(layer module) -> (x, kv input)


def _record(cap: Captured, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None) -> None:
    cap.calls[id(module)] = KernelCall(
        module, q.detach(), k.detach(), v.detach(), None if out is None else out.detach()
    )


@contextlib.contextmanager
def capture_kernels(model: nn.Module, cap: Captured) -> Iterator[Captured]:
    """Record every attention-kernel call of ``model`` while inside the block."""
    undo: list[Callable[[], None]] = []
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
        original = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def wrapped(module, query, key, value, attention_mask, **kw):
            out, weights = original(module, query, key, value, attention_mask, **kw)
            _record(cap, module, query, key, value, out)
            return out, weights

        ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped

        def restore() -> None:
            if had_local:
                ALL_ATTENTION_FUNCTIONS["sdpa"] = original
            else:
                del ALL_ATTENTION_FUNCTIONS["sdpa"]

        undo.append(restore)
    except ImportError:
        pass
    import sys

    patched: set[str] = set()
    for m in model.modules():  # eager attention: the modeling file's own eager_attention_forward
        modname = type(m).__module__
        mod = sys.modules.get(modname)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None or modname in patched:
            continue
        patched.add(modname)

        def eager(module, query, key, value, attention_mask, *a, _fn=fn, **kw):
            out, weights = _fn(module, query, key, value, attention_mask, *a, **kw)
            _record(cap, module, query, key, value, out)
            return out, weights

        mod.eager_attention_forward = eager
        undo.append(lambda _mod=mod, _fn=fn: setattr(_mod, "eager_attention_forward", _fn))
    for m in model.modules():
        cls = type(m).__name__
        if cls.startswith("Bloom") and hasattr(m, "_reshape"):
            orig = m._reshape

            def bloom(fused, _m=m, _orig=orig):
                q, k, v = _orig(fused)  # (B, H, T, d)
                _record(cap, _m, q, k, v, None)
                return q, k, v

            m._reshape = bloom
            undo.append(lambda _m=m: delattr(_m, "_reshape"))
        elif cls.startswith("Falcon") and hasattr(m, "_split_heads"):
            orig = m._split_heads

            def falcon(fused, _m=m, _orig=orig):
                q, k, v = _orig(fused)  # (B, T, H, d)
                _record(cap, _m, *(t.transpose(1, 2) for t in (q, k, v)), None)
                return q, k, v

            m._split_heads = falcon
            undo.append(lambda _m=m: delattr(_m, "_split_heads"))
        elif type(m).__module__.startswith("litgpt") and hasattr(m, "scaled_dot_product_attention"):
            orig = m.scaled_dot_product_attention

            def lit(q, k, v, mask=None, *a, _m=m, _orig=orig, **kw):
                out = _orig(q, k, v, mask, *a, **kw)  # (B, T, H, d)
                _record(cap, _m, q, k, v, out)
                return out

            m.scaled_dot_product_attention = lit
            undo.append(lambda _m=m: delattr(_m, "scaled_dot_product_attention"))
        elif type(m).__module__.startswith("x_transformers") and cls == "Attention" and hasattr(m, "attend"):
            attend = m.attend
            orig = attend.forward

            def xt(q, k, v, *a, _m=m, _orig=orig, **kw):
                res = _orig(q, k, v, *a, **kw)
                out = res[0] if isinstance(res, tuple) else res  # (B, H, T, d)
                _record(cap, _m, q, k, v, out.transpose(1, 2))
                return res

            attend.forward = xt
            undo.append(lambda _a=attend: delattr(_a, "forward"))
    try:
        yield cap
    finally:
        for fn in reversed(undo):
            fn()


def zero_biases(model: nn.Module) -> None:
    """Set every bias parameter of ``model`` to zero (so projections are linear maps)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("_bias"):
                p.zero_()


def _inputs_hook(cap: Captured, layer: AttentionLayer):
    def hook(_m, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        kv = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))
        if kv is None and len(args) > 1 and isinstance(args[1], Tensor) and args[1].shape[-1] == x.shape[-1]:
            kv = None  # positional second args are masks/embeddings in HF modules
        kv = x if kv is None else kv
        if x.dim() == 2:  # unbatched (tokens, D): Qwen-VL vision towers
            x, kv = x[None], kv[None]
        cap.inputs[id(layer.module)] = (x.detach(), kv.detach())

    return layer.module.register_forward_pre_hook(hook, with_kwargs=True)


def _call_for(cap: Captured, layer: AttentionLayer) -> KernelCall | None:
    if id(layer.module) in cap.calls:
        return cap.calls[id(layer.module)]
    for m in layer.module.modules():
        if id(m) in cap.calls:
            return cap.calls[id(m)]
    return None


def _normed(layer: AttentionLayer, which: str, per_head: Tensor, heads: int) -> Tensor:
    """Apply the module's own q/k norm (per head, or over all heads) to ``(B, heads, d)``."""
    mod = layer.module
    names = {
        "q": ("q_norm", "q_layernorm", "query_layernorm", "query_norm", "qk_norm"),
        "k": ("k_norm", "k_layernorm", "key_layernorm", "key_norm", "qk_norm"),
    }[which]
    norm = next((getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), nn.Module)), None)
    if norm is None:
        return per_head
    w = getattr(norm, "weight", None)
    size = w.shape[0] if isinstance(w, Tensor) else getattr(norm, "normalized_shape", (per_head.shape[-1],))[0]
    if size == per_head.shape[-1]:
        return norm(per_head)
    full = norm(rearrange(per_head, "b h d -> b (h d)"))
    return rearrange(full, "b (h d) -> b h d", h=heads)


def _projection_children(layer: AttentionLayer) -> dict[str, nn.Module]:
    """The child module each of q/k/v reads from, found by weight storage (fused children included)."""
    out = {}
    for proj in ("query", "key", "value"):
        try:
            ptr = layer.head_weights(proj).untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        for m in layer.module.modules():
            w = getattr(m, "weight", None)
            if m is not layer.module and isinstance(w, Tensor) and w.untyped_storage().data_ptr() == ptr:
                out[proj] = m
                break
    return out


def run_and_check(
    model: nn.Module,
    layers: list[AttentionLayer],
    run: Callable[[], object],
    atol: float = 1e-5,
) -> dict[str, str]:
    """Run ``run()`` once with kernels captured; check every layer. Returns ``{layer: "ok" | reason}``.

    Layers whose module never called a captured kernel are reported as "no kernel call".
    """
    cap = Captured()
    outs: dict[str, list[Tensor]] = {}
    out_calls: dict[str, tuple[Tensor, Tensor]] = {}
    handles = [_inputs_hook(cap, lay) for lay in layers]
    child_inputs: dict[tuple[str, str], Tensor] = {}
    for lay in layers:
        for proj, child in _projection_children(lay).items():

            def pre(_m, args, n=lay.name, p=proj):
                x = args[0].detach()
                child_inputs[(n, p)] = x[None] if x.dim() == 2 else x

            handles.append(child.register_forward_pre_hook(pre))
    for lay in layers:
        handles.append(lay.attach_output_hook(lambda o, keep, n=lay.name: outs.setdefault(n, []).append(o)))
        if lay.output_module is not None:

            def post(_m, args, output, n=lay.name):
                out_calls[n] = (args[0].detach(), output.detach())

            handles.append(lay.output_module.register_forward_hook(post))
    try:
        with torch.no_grad(), capture_kernels(model, cap):
            run()
    finally:
        for h in handles:
            h.remove()
    return {
        lay.name: _check_one(
            lay,
            cap,
            outs.get(lay.name),
            out_calls.get(lay.name),
            atol,
            {p: x for (n, p), x in child_inputs.items() if n == lay.name},
        )
        for lay in layers
    }


def _close(a: Tensor, b: Tensor, atol: float) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-4)


def _check_one(lay, cap: Captured, outs, out_call, atol: float, inputs: dict[str, Tensor]) -> str:
    call = _call_for(cap, lay)
    if call is None:
        return "no kernel call"
    if id(lay.module) not in cap.inputs:
        return "no input captured"
    x, kv_in = cap.inputs[id(lay.module)]
    x0 = x[:, 0].float()
    problems = []
    for proj, which, t, src in (
        ("query", "q", call.q, x0),
        ("key", "k", call.k, kv_in[:, 0].float()),
        ("value", "v", call.v, kv_in[:, 0].float()),
    ):
        if proj in inputs:  # what the projection child itself read (pre-norms, position embeddings included)
            src = inputs[proj][:, 0].float()
        w = lay.head_weights(proj).float()  # (h, D_in, d)
        mine = torch.einsum("bm,hmd->bhd", src, w)
        if which in ("q", "k"):
            mine = _normed(lay, which, mine, w.shape[0])
        ref = t[:, :, 0].float()  # (B, H_t, d)
        if lay.family == "mla":
            # MLA: the kernel's key is [k_nope | k_rope]; the shared RoPE part is left out of the extraction.
            # The query's RoPE part may be stored interleaved (rope_interleave): compare the no-RoPE part.
            # Latents pass an RMS norm: equal up to one positive scalar per token across all heads.
            nope = lay.projection_dims["key"]
            ref, mine = ref[..., :nope], mine[..., :nope]
            mine = mine / mine.flatten(1).norm(dim=1)[:, None, None]
            ref = ref / ref.flatten(1).norm(dim=1)[:, None, None]
        if ref.shape[1] != mine.shape[1]:
            if proj == "query" or ref.shape[1] != lay.num_heads:
                problems.append(f"{proj}: kernel has {ref.shape[1]} heads, extraction {mine.shape[1]}")
                continue
            mine = mine[:, [lay.kv_head(h) for h in range(lay.num_heads)]]  # module repeated k/v itself
        if mine.shape == ref.shape and not _close(mine, ref, atol):
            # some modules scale q (OPT, Whisper: by 1/sqrt(d)), q and k (YaRN rotary attention_scaling) or v
            # (MiMo's value scale) before the kernel: one positive constant, the same subspace
            c = float((mine * ref).sum() / (mine * mine).sum().clamp_min(1e-30))
            if c > 0:
                mine = mine * c
        if not _close(mine, ref, atol):
            err = (mine - ref).abs().max().item() if mine.shape == ref.shape else float("nan")
            problems.append(f"{proj}: max error {err:.2e}")
    gated = False
    if not outs:
        problems.append("output hook never fired")
    else:
        o = outs[-1]
        if o.dim() == 2:
            o = o[None]
            out_call = None if out_call is None else (out_call[0][None], out_call[1][None])
        if call.out is not None:
            ref = rearrange(call.out, "b t h d -> b t (h d)")
            # an elementwise output gate (o * sigmoid(g), Qwen3-Next style) sits between the kernel and the
            # out-projection: the hooked o is then the gated head output, still one slot per head
            gated = not _close(o, ref, atol)
        if out_call is not None:
            w_o = lay.head_weights("output").float()
            got = torch.einsum("bthd,hmd->btm", rearrange(o.float(), "b t (h d) -> b t h d", h=lay.num_heads), w_o)
            if not _close(got, out_call[1], atol):
                problems.append("sum_h W_O,h o_h differs from the output projection")
    if problems:
        return "; ".join(problems)
    if gated:
        return "ok (gated head outputs)" if out_call is not None else "hooked o differs from the kernel output"
    return "ok"
