"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2): per-head composed projections.

MLA projects the model width down to small latents and back up per head:

* query: ``q_h = W_UQ,h diag(g_q) rms(W_DQ x)`` (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), or
  ``q_proj`` where there is no query LoRA (``q_lora_rank=None``);
* key and value: ``c = diag(g_kv) rms(W_DKV x)`` (the first ``kv_lora_rank`` rows of
  ``kv_a_proj_with_mqa``, then ``kv_a_layernorm``); ``k_h = W_UK,h c``, ``v_h = W_UV,h c`` (row
  blocks of ``kv_b_proj``);
* output: head ``h``'s columns of ``o_proj``.

The RMS normalisation divides by one positive scalar per token, which changes no subspace, so the
per-head maps from the model width are the composed linear maps
``W_DQ^T diag(g_q) W_UQ,h^T`` (``D x (d_nope + d_rope)``), ``W_DKV^T diag(g_kv) W_UK,h^T``
(``D x d_nope``) and ``W_DKV^T diag(g_kv) W_UV,h^T`` (``D x d_v``). The RoPE part of the key
(the last ``qk_rope_head_dim`` rows of ``kv_a_proj_with_mqa``) is one vector shared by every head:
it is left out of the per-head key subspaces (it would make every pair of heads overlap) and the
report says so. Head outputs are the input of ``o_proj``, as elsewhere.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.models.base import Adapter, AdapterMismatch, AttentionLayer
from hdi_monitor.models.layout import default_mask_key
from hdi_monitor.models.logits import LogitForm
from hdi_monitor.models.tensor_parallel import tensor_parallel_of
from hdi_monitor.models.weights import is_projection, linear_weight

__all__ = ["ADAPTER", "LOGIT_REFUSAL", "ROPE_NOTE"]

ROPE_NOTE = "MLA: the RoPE key part shared by all heads is left out of the per-head key subspaces"
LOGIT_REFUSAL = (
    "MLA: the logit is the sum of a per-head term through the RMS-normalised latents and a RoPE term with the key "
    "part shared by all heads; the composed per-head maps do not bound it"
)


def _int(module: nn.Module, attr: str) -> int | None:
    v = getattr(module, attr, None)
    if v is None:
        v = getattr(getattr(module, "config", None), attr, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _match(name: str, module: nn.Module) -> bool:
    return (
        all(is_projection(getattr(module, p, None)) for p in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        and isinstance(getattr(module, "kv_a_layernorm", None), nn.Module)
        and (is_projection(getattr(module, "q_proj", None)) or is_projection(getattr(module, "q_b_proj", None)))
    )


def _norm_weight(norm: nn.Module, size: int) -> Tensor:
    g = getattr(norm, "weight", None)
    if not isinstance(g, Tensor) or g.shape != (size,):
        raise AdapterMismatch(f"{type(norm).__name__}: expected a ({size},) scale, got {getattr(g, 'shape', None)}")
    return g.detach().float()


def _build(name: str, module: nn.Module, root_config: Any = None) -> AttentionLayer:
    if tensor_parallel_of(module, name) is not None:
        raise AdapterMismatch(
            f"{name}: {type(module).__name__} is split by tensor parallelism, and its latent projections have no "
            "known per-rank split; not measured"
        )
    mla: Any = module  # an MLA attention class of some library: its children are read by name
    cls = type(module).__name__
    dims = {
        a: _int(module, a) for a in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    }
    missing = [a for a, v in dims.items() if v is None]
    if missing:
        raise AdapterMismatch(f"{name}: {cls} looks like Multi-head Latent Attention but has no {missing}")
    heads, nope, rope, dv, rank = (
        dims[a] for a in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    assert heads and nope and rope and dv and rank
    q_lora = is_projection(getattr(module, "q_b_proj", None)) and getattr(module, "q_proj", None) is None

    def query() -> Tensor:
        if not q_lora:
            return linear_weight(mla.q_proj)
        w_dq = linear_weight(mla.q_a_proj).float()  # (r_q, D)
        g = _norm_weight(mla.q_a_layernorm, w_dq.shape[0])
        return linear_weight(mla.q_b_proj).float() @ (g[:, None] * w_dq)  # (H (nope + rope), D)

    def latent() -> Tensor:
        w = linear_weight(mla.kv_a_proj_with_mqa).float()[:rank]  # (r_kv, D); RoPE rows left out
        return _norm_weight(mla.kv_a_layernorm, rank)[:, None] * w

    def up(part: slice) -> Tensor:
        w_b = rearrange(linear_weight(mla.kv_b_proj).float(), "(h e) r -> h e r", h=heads)[:, part]
        return rearrange(w_b @ latent(), "h e m -> (h e) m")

    out = mla.o_proj
    shapes = {
        "query": (heads * (nope + rope), linear_weight(mla.q_proj if not q_lora else mla.q_b_proj).shape[0]),
        "kv_b": (heads * (nope + dv), linear_weight(mla.kv_b_proj).shape[0]),
        "o_proj": (heads * dv, linear_weight(out).shape[1]),
    }
    for label, (want, got) in shapes.items():
        if want != got:
            raise AdapterMismatch(f"{name}: {cls}: {label} has {got} features, expected {want} for {heads} heads")
    model_dim = linear_weight(out).shape[0]
    return AttentionLayer(
        name,
        module,
        family="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=dv,
        model_dim=model_dim,
        weights={
            "query": query,
            "key": lambda: up(slice(0, nope)),
            "value": lambda: up(slice(nope, nope + dv)),
            "output": lambda: linear_weight(out),
        },
        output_module=out,
        mask_key=default_mask_key(name, module, root_config),
        projection_dims={"query": nope + rope, "key": nope, "value": dv, "output": dv},
        notes=(ROPE_NOTE,),
        logit_form=LogitForm.refused(LOGIT_REFUSAL),
    )


ADAPTER = Adapter(
    family="mla",
    classes="DeepseekV2Attention, DeepseekV3Attention (Multi-head Latent Attention; Kimi K2)",
    match=_match,
    build=_build,
)
