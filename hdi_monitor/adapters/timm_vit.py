"""timm Vision Transformer attention (``timm.layers.Attention``, ``AttentionRope``).

``qkv`` is one ``nn.Linear`` ``(3 * num_heads * head_dim, dim)`` whose output is reshaped to
``(3, num_heads, head_dim)``: rows ``[0:A]`` query, ``[A:2A]`` key, ``[2A:3A]`` value with
``A = num_heads * head_dim`` (``attn_dim``), each head-major. ``AttentionRope(qkv_fused=False)``
has separate ``q_proj``/``k_proj``/``v_proj`` instead. ``proj`` is the out-projection; the hook is
a pre-hook on it. With ``scale_norm=True`` timm normalises the concatenated head outputs before
``proj``, so the hooked ``o`` is the normalised one. Detected by structure (``qkv``/``proj``
``nn.Linear`` and ``num_heads``), so timm need not be installed; older timm without a ``head_dim``
attribute is handled by inferring it from ``qkv``.
"""

from __future__ import annotations

from torch import Tensor, nn

from hdi_monitor.adapters.base import Adapter, AdapterMismatch, AttentionLayer, full_weight, int_attr, is_linear

__all__ = ["ADAPTER"]


def _match(name: str, module: nn.Module) -> bool:
    if not is_linear(getattr(module, "proj", None)) or int_attr(module, "num_heads") is None:
        return False
    if is_linear(getattr(module, "qkv", None)):
        return True
    return all(is_linear(getattr(module, p, None)) for p in ("q_proj", "k_proj", "v_proj"))


def _build(name: str, module: nn.Module) -> AttentionLayer:
    heads = int_attr(module, "num_heads")
    assert heads is not None
    proj = module.proj
    qkv = getattr(module, "qkv", None)
    if is_linear(qkv):
        if qkv.out_features % 3:
            raise AdapterMismatch(f"{name}: qkv has {qkv.out_features} outputs, not 3 equal blocks")
        inner = qkv.out_features // 3

        def block(i: int):
            return lambda: full_weight(qkv.weight)[i * inner : (i + 1) * inner]

        weights = {"query": block(0), "key": block(1), "value": block(2)}
    else:
        q, k, v = module.q_proj, module.k_proj, module.v_proj
        inner = q.out_features
        if k.out_features != inner or v.out_features != inner:
            raise AdapterMismatch(f"{name}: q/k/v_proj widths differ ({inner}, {k.out_features}, {v.out_features})")
        weights = {"query": lambda: q.weight, "key": lambda: k.weight, "value": lambda: v.weight}
    head_dim = int_attr(module, "head_dim")
    if head_dim is None:
        if inner % heads:
            raise AdapterMismatch(f"{name}: qkv blocks of {inner} features do not divide into {heads} heads")
        head_dim = inner // heads
    if inner != heads * head_dim or proj.in_features != inner:
        raise AdapterMismatch(
            f"{name}: qkv blocks of {inner} and proj input {proj.in_features} do not match {heads} heads x "
            f"head_dim {head_dim}"
        )

    def out() -> Tensor:
        return proj.weight

    weights["output"] = out
    return AttentionLayer(
        name,
        module,
        family="timm_vit",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        model_dim=proj.out_features,
        weights=weights,
        output_module=proj,
        mask_key=None,
    )


ADAPTER = Adapter(
    family="timm_vit",
    classes="timm Attention / AttentionRope (packed qkv (3*H*d, dim) + proj, or q/k/v_proj + proj)",
    match=_match,
    build=_build,
)
