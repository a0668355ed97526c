"""Small numeric guards shared by the measurement code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["no_autocast", "ieee_float32_matmul"]


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Turn autocast off (CPU and CUDA) so that measurements never run in bf16/fp16.

    Monitoring code runs inside the user's forward pass (hooks) or next to it, often under
    ``torch.autocast``; every measurement upcasts explicitly and must not be downcast again.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def _fp32_backends() -> list[object]:
    """The matmul backends with a per-backend ``fp32_precision`` flag (torch >= 2.9), else []."""
    out = []
    for name in ("cuda", "mkldnn"):
        backend = getattr(getattr(torch.backends, name, None), "matmul", None)
        if backend is not None and isinstance(getattr(backend, "fp32_precision", None), str):
            out.append(backend)
    return out


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Float32 matmuls in full IEEE float32 inside the block: no TF32 (CUDA), no bf16 (oneDNN, CPU).

    Training code often allows reduced-precision float32 matmuls
    (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cuda.matmul.allow_tf32``); a
    measurement must not inherit them. The flags are set to ``"ieee"`` for the block and restored
    exactly on exit (also on exceptions), so the training sees its own settings again. Torch before
    2.9 has only the global flag, which is saved and restored the same way.
    """
    backends = _fp32_backends()
    if backends:
        saved = [b.fp32_precision for b in backends]  # type: ignore[attr-defined]
        try:
            for b in backends:
                b.fp32_precision = "ieee"  # type: ignore[attr-defined]
            yield
        finally:
            for b, value in zip(backends, saved, strict=True):
                b.fp32_precision = value  # type: ignore[attr-defined]
        return
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
