"""Small numeric guards shared by the measurement code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["no_autocast"]


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
