"""Weight-only statistics of each head's bilinear form ``W_Q,h W_K,g(h)^T``.

A head's attention logit between a query input ``x`` and a key input ``y`` (both in ``R^D``) is,
biases left out, ``scale * x^T W_Q,h W_K,g(h)^T y`` with ``W`` in the ``D x d_k`` convention of
`hdi_monitor.functional.diversity` (``x @ W_h`` is the head's query) and ``g(h)`` the key/value
head that query head ``h`` attends with (grouped-query attention shares one key head between
``H / H_kv`` query heads). Two statistics are read from the weights alone, so they work where the
attention kernel cannot be reached (fused kernels, tensor parallelism, ZeRO-3, compiled models):

* `logit_bound`: the largest logit a unit-norm query input and a unit-norm key input can give,
  ``scale * sigma_max(W_Q,h W_K,g(h)^T)`` (DESIGN.md rule 9). For rotary models the rotation
  between query and key depends on their offset, so the bound that holds at every offset is used:
  ``scale * sigma_max(W_Q,h) sigma_max(W_K,g(h))``. `qk_norm_logit_bound` gives the bound of a layer
  that normalises each query and key (QK-norm) before the product: there the norms' gains bound
  the logit whatever the input.
* `update_entropy`: the spectral entropy (nats) of the first-order change of the bilinear form
  between two weight readings, ``Delta = dW_Q W_K^T + W_Q dW_K^T`` (DESIGN.md rule 10): low when
  the update concentrates on a few directions.

`gram_factor` reduces a head's ``D x d_k`` weights to a ``d_k x d_k`` factor with the same Gram
matrix, on which `logit_bound` gives the same value: a caller can keep the factor of one
projection's heads (``d_k / D`` of the memory) until the other projection is read.

Pure functions of tensors, batched over leading dimensions, on the weights' own device; never in
half precision (inputs are upcast to float32, `update_entropy` computes in float64).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from einops import repeat
from torch import Tensor

__all__ = ["KVMap", "gram_factor", "logit_bound", "qk_norm_logit_bound", "update_entropy"]

KVMap = Literal["block", "modulo"]
"""How query heads share key heads: ``g(h) = h // (H / H_kv)`` (``"block"``) or ``h % H_kv`` (``"modulo"``)."""


def _check_pair(w_q: Tensor, w_k: Tensor, names: tuple[str, str] = ("w_q", "w_k")) -> None:
    for name, w in zip(names, (w_q, w_k), strict=True):
        if not isinstance(w, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.ndim < 3:
            raise ValueError(f"{name} must have shape (..., heads, D, d_k), got {tuple(w.shape)}")
        if w.is_complex() or not w.is_floating_point():
            raise TypeError(f"{name} must be a real floating-point tensor, got {w.dtype}")
        if 0 in w.shape[-3:]:
            raise ValueError(f"{name} must hold at least one head of non-zero size, got {tuple(w.shape)}")
    q, k = names
    if w_q.shape[-1] != w_k.shape[-1]:  # the input widths may differ (cross-attention with kdim != D)
        raise ValueError(
            f"{q} and {k} must have the same head width d_k, got {tuple(w_q.shape[-2:])} and {tuple(w_k.shape[-2:])}"
        )
    if w_q.shape[:-3] != w_k.shape[:-3]:
        raise ValueError(
            f"{q} and {k} must have the same leading dimensions, got {tuple(w_q.shape)} and {tuple(w_k.shape)}"
        )
    heads, kv_heads = w_q.shape[-3], w_k.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"the key heads ({kv_heads}) must divide the query heads ({heads})")
    if w_q.device != w_k.device:
        raise ValueError(f"{q} and {k} must be on the same device, got {w_q.device} and {w_k.device}")


def _expand_kv(w_k: Tensor, heads: int, kv_map: KVMap) -> Tensor:
    """``(..., H_kv, D, d)`` key heads repeated to one per query head, ``(..., H, D, d)``."""
    group = heads // w_k.shape[-3]
    if group == 1:
        return w_k
    if kv_map == "block":  # query head h uses key head h // group
        return repeat(w_k, "... g m d -> ... (g r) m d", r=group)
    if kv_map == "modulo":  # query head h uses key head h % H_kv
        return repeat(w_k, "... g m d -> ... (r g) m d", r=group)
    raise ValueError(f"kv_map must be 'block' or 'modulo', got {kv_map!r}")


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 or None (1 / sqrt(d_k)), got {scale!r}")
    return float(scale)


def _upcast(w: Tensor, minimum: torch.dtype) -> Tensor:
    if w.dtype in (torch.float16, torch.bfloat16) or torch.finfo(w.dtype).bits < torch.finfo(minimum).bits:
        return w.to(minimum)
    return w


def _finite_heads(*heads: Tensor) -> tuple[list[Tensor], Tensor]:
    """The ``(..., H, D, d)`` inputs with every non-finite head zeroed (an SVD of a non-finite matrix
    raises), and the ``(..., H)`` mask of heads that were finite in all of them."""
    ok = torch.stack([torch.isfinite(h).flatten(-2).all(-1) for h in heads]).all(0)
    zero = torch.zeros((), dtype=heads[0].dtype, device=heads[0].device)
    return [torch.where(ok[..., None, None], h, zero) for h in heads], ok


def _nan_where(values: Tensor, ok: Tensor) -> Tensor:
    return torch.where(ok, values, torch.full_like(values, float("nan")))


def gram_factor(w: Tensor) -> Tensor:
    """A square factor of each head with the same Gram matrix: ``R^T R = W^T W``.

    `logit_bound` depends on the heads only through ``W_Q^T W_Q``, ``W_K^T W_K`` and the
    singular values of ``W_Q W_K^T``, which equal those of ``R_Q R_K^T`` (``W = U R`` with
    orthonormal ``U``); so ``logit_bound(gram_factor(w_q), gram_factor(w_k))`` is
    ``logit_bound(w_q, w_k)``, also when the query and key heads read inputs of different widths.

    Args:
        w: ``(..., D, d_k)`` heads (any ``D``).

    Returns:
        ``(..., d_k, d_k)`` upper-triangular factors (a QR's ``R``; heads with ``D < d_k`` are
        padded with zero rows first), in float32 (float64 for float64 weights), on the weights'
        device; NaN for a head holding NaN or inf.
    """
    if not isinstance(w, Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.ndim < 2 or 0 in w.shape[-2:]:
        raise ValueError(f"w must have shape (..., D, d_k) with D, d_k > 0, got {tuple(w.shape)}")
    if w.is_complex() or not w.is_floating_point():
        raise TypeError(f"w must be a real floating-point tensor, got {w.dtype}")
    x = _upcast(w.detach(), torch.float32)
    rows, d = x.shape[-2:]
    if rows < d:
        x = torch.cat([x, x.new_zeros((*x.shape[:-2], d - rows, d))], dim=-2)
    (x,), ok = _finite_heads(x)
    r = torch.linalg.qr(x, mode="r").R
    return torch.where(ok[..., None, None], r, torch.full_like(r, float("nan")))


def logit_bound(
    w_q: Tensor,
    w_k: Tensor,
    *,
    rotary: bool = False,
    kv_map: KVMap = "block",
    scale: float | None = None,
) -> Tensor:
    """The largest attention logit each query head can give for unit-norm inputs.

    Args:
        w_q: ``(..., H, D, d_k)`` query heads (``x @ w_q[h]`` is head ``h``'s query).
        w_k: ``(..., H_kv, D_k, d_k)`` key heads; ``H_kv`` divides ``H``; ``D_k`` may differ from
            ``D`` (a cross-attention whose keys read another width).
        rotary: the layer rotates queries and keys by their positions (rotary embeddings): the
            bound ``sigma_max(W_Q,h) sigma_max(W_K,g(h))``, which holds at every offset, replaces the
            bilinear one.
        kv_map: which key head each query head uses (see `KVMap`).
        scale: the logit's scale; None is ``1 / sqrt(d_k)``.

    Returns:
        ``(..., H)``: ``scale * sigma_max(W_Q,h W_K,g(h)^T)`` (``rotary=False``) or ``scale *
        sigma_max(W_Q,h) sigma_max(W_K,g(h))`` (``rotary=True``), in float32 (float64 for float64
        weights), on the weights' device. For any query input ``x`` and key input ``y`` the head's
        logit, biases left out, is at most the bound times ``|x| |y|``. NaN for a head holding NaN
        or inf.
    """
    _check_pair(w_q, w_k)
    if not isinstance(rotary, bool):
        raise TypeError(f"rotary must be True or False, got {rotary!r}")
    factor = _scale(scale, w_q.shape[-1])
    dtype = torch.float64 if torch.float64 in (w_q.dtype, w_k.dtype) else torch.float32
    q = _upcast(w_q.detach(), dtype).to(dtype)
    k = _expand_kv(_upcast(w_k.detach(), dtype).to(dtype), q.shape[-3], kv_map)
    (q, k), ok = _finite_heads(q, k)
    if rotary:
        bound = torch.linalg.matrix_norm(q, ord=2) * torch.linalg.matrix_norm(k, ord=2)
    else:
        # sigma_max(Q K^T) = sigma_max(R_q R_k^T) with Q = U_q R_q, K = U_k R_k: a small (d x d) norm per head
        r_q = torch.linalg.qr(q, mode="r").R
        r_k = torch.linalg.qr(k, mode="r").R
        bound = torch.linalg.matrix_norm(r_q @ r_k.mT, ord=2)
    return _nan_where(factor * bound, ok)


def qk_norm_logit_bound(
    gain_q: Tensor,
    gain_k: Tensor,
    *,
    radius_q: float,
    radius_k: float,
    rotary: bool = False,
    kv_map: KVMap = "block",
    scale: float,
) -> Tensor:
    """The largest logit of heads whose queries and keys are normalised before the product (QK-norm).

    A QK-norm layer feeds its kernel ``q = g_q * u`` and ``k = g_k * v`` (elementwise gains) with
    ``|u| <= radius_q`` and ``|v| <= radius_k`` whatever the input: an RMSNorm or LayerNorm over a
    head's ``d_k`` channels gives ``|u| = sqrt(d_k)`` (``radius = sqrt(d_k)``); one over all ``H d_k``
    channels of the projection gives ``|u_h| <= sqrt(H d_k)``. Biases of the norms are left out.

    Args:
        gain_q: ``(..., H, d_k)`` query gains per head.
        gain_k: ``(..., H_kv, d_k)`` key gains per head; ``H_kv`` divides ``H``.
        radius_q, radius_k: the largest norm of a normalised query / key of one head.
        rotary: positions rotate the normalised queries and keys after the norm (Qwen3, OLMo2):
            then the coordinates no longer pair up and the bound is ``max|g_q| max|g_k|``.
        kv_map: which key head each query head uses (see `KVMap`).
        scale: the logit's scale (``1 / sqrt(d_k)`` for most models).

    Returns:
        ``(..., H)``: ``scale * radius_q * radius_k * max_i |g_q,i g_k,i|`` (``rotary=False``: the
        coordinates pair up) or ``scale * radius_q * radius_k * max|g_q| * max|g_k|``; float32 at
        least, on the gains' device. The logit never exceeds it, whatever the input norms.
    """
    for name, g in (("gain_q", gain_q), ("gain_k", gain_k)):
        if not isinstance(g, Tensor) or not g.is_floating_point() or g.ndim < 2:
            raise TypeError(f"{name} must be a real floating-point tensor of shape (..., heads, d_k)")
    if gain_q.shape[-1] != gain_k.shape[-1] or gain_q.shape[-2] % gain_k.shape[-2]:
        raise ValueError(
            f"gain_q {tuple(gain_q.shape)} and gain_k {tuple(gain_k.shape)} must share d_k, key heads dividing query heads"
        )
    for name, value in (("radius_q", radius_q), ("radius_k", radius_k), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    dtype = torch.float64 if torch.float64 in (gain_q.dtype, gain_k.dtype) else torch.float32
    gq, gk = _upcast(gain_q.detach(), dtype).to(dtype).abs(), _upcast(gain_k.detach(), dtype).to(dtype).abs()
    gk = _expand_kv(gk[..., None], gq.shape[-2], kv_map)[..., 0]  # (..., H, d_k)
    top = gq.amax(-1) * gk.amax(-1) if rotary else (gq * gk).amax(-1)
    return float(scale) * float(radius_q) * float(radius_k) * top


def update_entropy(
    w_q_before: Tensor,
    w_k_before: Tensor,
    w_q_after: Tensor,
    w_k_after: Tensor,
    *,
    kv_map: KVMap = "block",
) -> Tensor:
    """Spectral entropy of each head's first-order update of its bilinear form.

    With ``W`` the earlier weights and ``dW`` the change to the later ones, ``Delta_h = dW_Q,h
    W_K,g^T + W_Q,h dW_K,g^T`` (``D x D``, rank at most ``2 d_k``); with ``s_i`` its singular values
    and ``p_i = s_i^2 / sum_j s_j^2``, the entropy is ``-sum_i p_i ln p_i`` nats: 0 when the update
    is one direction, ``ln(2 d_k)`` at most.

    Args:
        w_q_before, w_q_after: ``(..., H, D, d_k)`` query heads at two readings.
        w_k_before, w_k_after: ``(..., H_kv, D_k, d_k)`` key heads at the same readings (``D_k``
            may differ from ``D``).
        kv_map: which key head each query head uses (see `KVMap`).

    Returns:
        ``(..., H)`` float64 on the weights' device; NaN for a head whose bilinear form did not
        change (``Delta = 0``: no update to describe) or that holds NaN or inf.
    """
    _check_pair(w_q_before, w_k_before, ("w_q_before", "w_k_before"))
    _check_pair(w_q_after, w_k_after, ("w_q_after", "w_k_after"))
    if w_q_before.shape != w_q_after.shape or w_k_before.shape != w_k_after.shape:
        raise ValueError(
            "the weights before and after must have the same shapes, got "
            f"{tuple(w_q_before.shape)}/{tuple(w_q_after.shape)} (query) and "
            f"{tuple(w_k_before.shape)}/{tuple(w_k_after.shape)} (key)"
        )
    if w_q_before.device != w_q_after.device:
        raise ValueError(f"the weights must be on one device, got {w_q_before.device} and {w_q_after.device}")
    heads = w_q_before.shape[-3]
    q0, q1 = (w.detach().to(torch.float64) for w in (w_q_before, w_q_after))
    k0, k1 = (_expand_kv(w.detach().to(torch.float64), heads, kv_map) for w in (w_k_before, w_k_after))
    (q0, q1, k0, k1), ok = _finite_heads(q0, q1, k0, k1)
    dq, dk = q1 - q0, k1 - k0
    # Delta = [dQ | Q] [K | dK]^T = A B^T; its singular values are those of R_A R_B^T (QR of A and B)
    r_a = torch.linalg.qr(torch.cat([dq, q0], dim=-1), mode="r").R
    r_b = torch.linalg.qr(torch.cat([k0, dk], dim=-1), mode="r").R
    s2 = torch.linalg.svdvals(r_a @ r_b.mT).square()
    total = s2.sum(-1, keepdim=True)
    p = s2 / total
    terms = torch.where(p > 0, -p * torch.log(p), torch.zeros_like(p))
    return _nan_where(terms.sum(-1), ok & (total[..., 0] > 0))
