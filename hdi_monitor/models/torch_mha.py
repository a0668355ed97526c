"""``torch.nn.MultiheadAttention``, alone or inside ``nn.TransformerEncoderLayer`` / ``DecoderLayer``.

Weights: packed ``in_proj_weight`` ``(3E, E)`` (rows ``[0:E]`` query, ``[E:2E]`` key, ``[2E:3E]``
value) or, when ``kdim``/``vdim`` differ from ``embed_dim``, separate ``q_proj_weight`` ``(E, E)``,
``k_proj_weight`` ``(E, kdim)``, ``v_proj_weight`` ``(E, vdim)``; ``out_proj.weight`` ``(E, E)``.
Transformer layers hold their attention as ``self_attn`` (and ``multihead_attn`` for the decoder's
cross-attention); the MHA modules themselves are reported, once each, under their qualified names.

Head outputs: ``nn.MultiheadAttention`` calls ``F.linear`` on ``out_proj``'s weight directly, so a
hook on ``out_proj`` never fires (pytorch #78109). The output hook therefore captures the MHA
forward's inputs and recomputes the per-head outputs for that batch under ``no_grad`` (attention
dropout is not applied: the statistics describe the dropout-free outputs). While any such hook is
attached, ``nn.TransformerEncoderLayer`` runs its module-by-module path (its fused path is off
whenever a hook is attached), so the MHA forward and its pre-hook run. The monitor never touches
the global fast-path flag (``torch.backends.mha``): switching it off changed which weights the MHA
forward reads (its fast-path checks read ``in_proj_weight``, one ``spectral_norm`` power step each),
so training would change. In eval mode ``nn.TransformerEncoder`` may hand its layers a nested tensor
(a padded batch without its padding); the hook reads such a self-attention call as the padded batch
with the padding masked (`unnest_self_attention`). Known limit: a frozen eval-mode
``nn.TransformerEncoderLayer`` inside a model being trained runs fused except while a hook is on, so
on measured steps its output is rounded differently (about 1e-7); ``activations=False`` avoids it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.functional.kernel import MASKED_AT
from hdi_monitor.models._parametrize import preserved_parametrizations
from hdi_monitor.models.base import (
    Adapter,
    AdapterMismatch,
    AttentionLayer,
    HookHandle,
    OutputHook,
    TokenSelect,
    full_weight,
)
from hdi_monitor.models.logits import LogitForm
from hdi_monitor.models.tensor_parallel import tensor_parallel_of

__all__ = ["ADAPTER", "MHALayer", "hold_fastpath_off", "mha_head_outputs", "mha_heads", "unnest_self_attention"]

_MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)

_fastpath_lock = threading.Lock()
_fastpath_holds = 0
_fastpath_saved: bool | None = None


def _hold_fastpath_off() -> None:
    global _fastpath_holds, _fastpath_saved
    with _fastpath_lock:
        if _fastpath_holds == 0:
            _fastpath_saved = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _fastpath_holds += 1


def _release_fastpath() -> None:
    global _fastpath_holds, _fastpath_saved
    with _fastpath_lock:
        _fastpath_holds -= 1
        if _fastpath_holds == 0 and _fastpath_saved is not None:
            torch.backends.mha.set_fastpath_enabled(_fastpath_saved)
            _fastpath_saved = None


def hold_fastpath_off() -> HookHandle:
    """Switch the MHA fast path (``torch.backends.mha``) off until the handle's ``remove()`` (nested
    holds count; the flag comes back as it was). For analysis tools that edit an MHA's output
    (`hdi_monitor.ablation`), never for the monitor of a training run (see the module's docstring)."""
    _hold_fastpath_off()
    return HookHandle(on_remove=_release_fastpath)


def unnest_self_attention(mha: nn.MultiheadAttention, call: dict[str, Any]) -> tuple[dict[str, Any], Tensor | None]:
    """A call whose query is a nested tensor (``nn.TransformerEncoder`` in eval mode turns a padded
    batch into one before its layers run) as the same call on the padded ``(B, T, E)`` batch with
    the padding as ``key_padding_mask``, and the ``(B, T)`` keep mask of its real tokens; any other
    call as it is, and None.

    Raises:
        ValueError: a nested call that is not self-attention (``query is key is value``) or not
            ``batch_first``: not a layout ``nn.TransformerEncoder`` makes.
    """
    query = call.get("query")
    if not isinstance(query, Tensor) or not query.is_nested:
        return call, None
    nested: Tensor = query
    if call.get("key") is not nested or call.get("value") is not nested or not mha.batch_first:
        raise ValueError(
            "nn.MultiheadAttention was called with nested tensors other than batch-first self-attention; "
            "its head outputs cannot be read"
        )
    lengths = torch.tensor([t.shape[0] for t in nested.unbind()], device=nested.device)  # sizes: host metadata
    padded = nested.to_padded_tensor(0.0)
    keep = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
    return {**call, "query": padded, "key": padded, "value": padded, "key_padding_mask": ~keep}, keep


def _qkv_weights(mha: nn.MultiheadAttention) -> tuple[Tensor, Tensor, Tensor]:
    """Gathered ``(E, E)``, ``(E, kdim)``, ``(E, vdim)`` input-projection weights. A parametrized
    weight (``spectral_norm`` on ``in_proj_weight``, say) is the one the next forward computes, and
    the read leaves the parametrization's state as it was (this runs inside the training forward)."""
    with preserved_parametrizations(mha):
        if mha._qkv_same_embed_dim:
            w = full_weight(mha.in_proj_weight)
            e = mha.embed_dim
            return w[:e], w[e : 2 * e], w[2 * e :]
        return full_weight(mha.q_proj_weight), full_weight(mha.k_proj_weight), full_weight(mha.v_proj_weight)


def _qkv_biases(mha: nn.MultiheadAttention) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if mha.in_proj_bias is None:
        return None, None, None
    with preserved_parametrizations(mha):
        b = full_weight(mha.in_proj_bias)
    e = mha.embed_dim
    return b[:e], b[e : 2 * e], b[2 * e :]


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = masked out) or a float mask as an additive float mask."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _keep_from_padding(key_padding_mask: Tensor) -> Tensor:
    """``key_padding_mask`` (True, or a float entry at or below `MASKED_AT` = padding) as a bool keep
    mask (True = real token)."""
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    return ~(key_padding_mask <= MASKED_AT)  # -inf included; NaN counts as real (and shows as NaN)


def mha_heads(
    mha: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The per-head ``q``, ``k`` (and ``v``) and the mask that ``nn.MultiheadAttention`` gives its kernel.

    Takes the module's forward arguments (``batch_first`` or not, batched or not) and follows
    ``F.multi_head_attention_forward``: ``in_proj`` (packed or separate), ``bias_k``/``bias_v``,
    ``add_zero_attn``, bool (True = not allowed) or float ``attn_mask`` (2-D or ``(B H, L, S)``) and
    ``key_padding_mask``.

    Returns:
        ``q`` ``(B, H, L, d)``, ``k`` ``(B, H, S, d)``, ``v`` ``(B, H, S, d)`` (None without ``value``),
        in float32 at least, and an additive float mask broadcastable to ``(B, H, L, S)`` (``-inf`` =
        not allowed) or None.
    """
    heads, e = mha.num_heads, mha.embed_dim
    if query.dim() == 2:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        value = None if value is None else value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
        value = None if value is None else value.transpose(0, 1)
    # now (B, L, E), (B, S, kdim), (B, S, vdim)
    dtype = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    wq, wk, wv = (w.to(dtype) for w in _qkv_weights(mha))
    bq, bk, bv = (None if b is None else b.to(dtype) for b in _qkv_biases(mha))
    q = F.linear(query.to(dtype), wq, bq)
    k = F.linear(key.to(dtype), wk, bk)
    v = None if value is None else F.linear(value.to(dtype), wv, bv)
    b = q.shape[0]
    if mha.bias_k is not None and mha.bias_v is not None:
        k = torch.cat([k, mha.bias_k.detach().to(dtype).expand(b, 1, e)], dim=1)
        v = None if v is None else torch.cat([v, mha.bias_v.detach().to(dtype).expand(b, 1, e)], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    q, k = (rearrange(t, "b s (h d) -> b h s d", h=heads) for t in (q, k))
    v = None if v is None else rearrange(v, "b s (h d) -> b h s d", h=heads)
    if mha.add_zero_attn:
        zeros = k.new_zeros((b, heads, 1, k.shape[-1]))
        k = torch.cat([k, zeros], dim=2)
        v = None if v is None else torch.cat([v, zeros], dim=2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    mask: Tensor | None = None
    if attn_mask is not None:
        mask = _additive(attn_mask, dtype)
        mask = rearrange(mask, "(b h) l s -> b h l s", h=heads) if mask.dim() == 3 else mask[None, None]
    if key_padding_mask is not None:
        pad = _additive(key_padding_mask, dtype)[:, None, None, :]
        mask = pad if mask is None else mask + pad
    return q, k, v, mask


def mha_head_outputs(
    mha: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,  # noqa: ARG001 - accepted for signature parity with the module
) -> Tensor:
    """Recompute the concatenated per-head outputs of an ``nn.MultiheadAttention`` call.

    Takes the module's forward arguments (same layouts: ``batch_first`` or not, batched or not) and
    returns ``o`` laid out like the module's ``attn_output`` but before ``out_proj``:
    ``o[..., h*d:(h+1)*d]`` is head ``h``. Follows ``F.multi_head_attention_forward`` (see
    `mha_heads`) without dropout. ``is_causal`` is only a hint: ``nn.MultiheadAttention`` requires the
    causal ``attn_mask`` with it, and that mask is what is applied. Computed in float32 at least.
    """
    q, k, v, mask = mha_heads(mha, query, key, value, key_padding_mask, attn_mask)
    assert v is not None  # value was given
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o = rearrange(o, "b h l d -> b l (h d)")
    if query.dim() == 2:
        return o[0]
    return o if mha.batch_first else o.transpose(0, 1)


class MHALayer(AttentionLayer):
    """An ``nn.MultiheadAttention``; its output hook recomputes head outputs from the forward inputs.

    `attach_output_hook` hooks the MHA's own forward (``select`` is for tensor-parallel layers, which
    ``nn.MultiheadAttention`` never is: unused). ``o`` is recomputed from the call's inputs (see
    `mha_head_outputs`). For self-attention calls (``query is key``) with a ``key_padding_mask``,
    ``keep_mask = ~key_padding_mask`` (float masks: entries that are not -inf), laid out like
    ``o.shape[:-1]``; otherwise None (for cross-attention the padding mask describes the keys, not the
    query tokens).
    """

    def _output_pre_hook(self, fn: OutputHook, select: TokenSelect | None) -> tuple[nn.Module, Callable[..., None]]:
        """The MHA itself, and a pre-hook that recomputes ``o`` from its call (see the class)."""
        mha = self.module
        assert isinstance(mha, nn.MultiheadAttention)

        def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
            call = dict(zip(_MHA_ARGS, args, strict=False))
            call.update(kwargs)
            call, _ = unnest_self_attention(mha, call)
            query, key, value = call["query"], call["key"], call["value"]
            kpm = call.get("key_padding_mask")
            with torch.no_grad():
                o = mha_head_outputs(
                    mha,
                    query,
                    key,
                    value,
                    key_padding_mask=kpm,
                    attn_mask=call.get("attn_mask"),
                    is_causal=bool(call.get("is_causal", False)),
                )
                keep = None
                if kpm is not None and query is key:
                    keep = _keep_from_padding(kpm)
                    if query.dim() == 3 and not mha.batch_first:
                        keep = keep.transpose(0, 1)
            fn(o, keep)

        return mha, pre_hook


def _match(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention)


def _build(name: str, module: nn.Module) -> AttentionLayer:
    if tensor_parallel_of(module, name) is not None:
        raise AdapterMismatch(
            f"{name}: {type(module).__name__} is split by tensor parallelism, and its fused in_proj_weight has "
            "no known row split; not measured"
        )
    assert isinstance(module, nn.MultiheadAttention)
    mha = module

    def q() -> Tensor:
        return _qkv_weights(mha)[0]

    def k() -> Tensor:
        return _qkv_weights(mha)[1]

    def v() -> Tensor:
        return _qkv_weights(mha)[2]

    return MHALayer(
        name,
        mha,
        family="torch_mha",
        num_heads=mha.num_heads,
        num_kv_heads=mha.num_heads,
        head_dim=mha.head_dim,
        model_dim=mha.embed_dim,
        weights={"query": q, "key": k, "value": v, "output": lambda: mha.out_proj.weight},
        mask_key=None,
        # F.multi_head_attention_forward: no position rotation, scale 1/sqrt(head_dim), no QK-norm
        logit_form=LogitForm(
            rotary=False,
            scale=mha.head_dim**-0.5,
            notes=("bias_k (an extra learned key) left out of the logit bound",) if mha.bias_k is not None else (),
        ),
    )


ADAPTER = Adapter(
    family="torch_mha",
    classes="nn.MultiheadAttention (also inside nn.TransformerEncoderLayer / nn.TransformerDecoderLayer)",
    match=_match,
    build=_build,
)
