"""GPT-2 layout attention: Hugging Face ``GPT2Attention`` (and nanoGPT-style blocks).

``c_attn`` packs query, key and value; ``c_proj`` is the out-projection. In Hugging Face GPT-2 both
are ``Conv1D`` modules whose weight is ``(in, out)`` and ``y = x @ W + b``, i.e. transposed relative
to ``nn.Linear``: ``c_attn.weight`` is ``(D, 3D)`` with columns ``[0:D]`` query, ``[D:2D]`` key and
``[2D:3D]`` value. Cross-attention (``is_cross_attention``) keeps the query in ``q_attn`` ``(D, D)``
and key/value in ``c_attn`` ``(D, 2D)``. nanoGPT-style modules with ``nn.Linear`` ``c_attn``
``(3D, D)`` and ``n_head`` are read in ``nn.Linear`` layout. The hook is a pre-hook on ``c_proj``
(the attention's own, not the MLP's).
"""

from __future__ import annotations

from torch import Tensor, nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, full_weight, int_attr, is_linear

__all__ = ["ADAPTER"]


def _is_conv1d(m: object) -> bool:
    """Hugging Face ``Conv1D`` (detected without importing transformers): weight ``(nx, nf)``."""
    w = getattr(m, "weight", None)
    return (
        isinstance(m, nn.Module)
        and type(m).__name__ == "Conv1D"
        and isinstance(getattr(m, "nf", None), int)
        and isinstance(w, Tensor)
        and w.ndim == 2
    )


def _proj(m: object) -> bool:
    return _is_conv1d(m) or is_linear(m)


def _match(name: str, module: nn.Module) -> bool:
    return (
        _proj(getattr(module, "c_attn", None))
        and _proj(getattr(module, "c_proj", None))
        and int_attr(module, "num_heads", "n_head") is not None
    )


def _linear_layout(m: nn.Module) -> Tensor:
    """Gathered weight in ``nn.Linear`` ``(out, in)`` layout (a transposed view for Conv1D)."""
    w = full_weight(m.weight)
    return w.T if _is_conv1d(m) else w


def _out_features(m: nn.Module) -> int:
    return m.weight.shape[1] if _is_conv1d(m) else m.weight.shape[0]


def _in_features(m: nn.Module) -> int:
    return m.weight.shape[0] if _is_conv1d(m) else m.weight.shape[1]


def _build(name: str, module: nn.Module) -> AttentionLayer:
    heads = int_attr(module, "num_heads", "n_head")
    assert heads is not None
    c_attn, c_proj = module.c_attn, module.c_proj
    q_attn = getattr(module, "q_attn", None)
    cross = bool(getattr(module, "is_cross_attention", False)) and _proj(q_attn)
    packed = 2 if cross else 3
    width = _out_features(c_attn)
    if width % packed:
        raise AdapterMismatch(f"{name}: c_attn has {width} output features, not {packed} equal blocks")
    inner = width // packed  # heads * head_dim
    if inner % heads:
        raise AdapterMismatch(f"{name}: c_attn blocks of {inner} features do not divide into {heads} heads")
    head_dim = inner // heads
    if _in_features(c_proj) != inner:
        raise AdapterMismatch(f"{name}: c_proj reads {_in_features(c_proj)} features, expected {inner}")

    def block(i: int) -> Tensor:
        return _linear_layout(c_attn)[i * inner : (i + 1) * inner]

    if cross:
        weights = {
            "query": lambda: _linear_layout(q_attn),
            "key": lambda: block(0),
            "value": lambda: block(1),
        }
    else:
        weights = {"query": lambda: block(0), "key": lambda: block(1), "value": lambda: block(2)}
    weights["output"] = lambda: _linear_layout(c_proj)
    return AttentionLayer(
        name,
        module,
        family="gpt2",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        model_dim=_out_features(c_proj),
        weights=weights,
        output_module=c_proj,
        mask_key="attention_mask",
    )


ADAPTER = Adapter(
    family="gpt2",
    classes="GPT2Attention (self- and cross-attention; Conv1D c_attn/c_proj), nanoGPT-style "
    "c_attn/c_proj nn.Linear with n_head",
    match=_match,
    build=_build,
)
