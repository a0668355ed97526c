"""Reading a parametrized weight without changing the module: `preserved_parametrizations`.

``torch.nn.utils.parametrizations.spectral_norm`` runs one power-iteration step, updating its
``_u`` / ``_v`` buffers in place, every time ``module.weight`` is read in training mode. A monitor
that reads weights (at setup, on each measured step, in the read-only ``head_diversity``) would
then change training. Inside `preserved_parametrizations` a read computes exactly the weight the
module's next forward pass computes (same mode, same buffers), and every buffer of every
parametrization that the read changed in place is put back afterwards, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["parametrization_buffers", "preserved_parametrizations"]


def parametrization_buffers(*modules: nn.Module | None) -> list[Tensor]:
    """Every buffer held by a parametrization (``module.parametrizations.<name>[i]``) under
    ``modules`` (each module and its descendants), each once."""
    seen: set[int] = set()
    out: list[Tensor] = []
    for root in modules:
        if root is None:
            continue
        for m in root.modules():
            if not parametrize.is_parametrized(m):
                continue
            holder: Any = m.parametrizations
            for plist in holder.values():
                for p in plist:  # the parametrization modules, not `original`
                    for b in p.buffers():
                        if id(b) not in seen:
                            seen.add(id(b))
                            out.append(b)
    return out


@contextlib.contextmanager
def preserved_parametrizations(*modules: nn.Module | None) -> Iterator[None]:
    """Leave every parametrization buffer under ``modules`` as it was on entry.

    Buffers are snapshotted on entry (a copy of each; parametrization buffers are small: spectral
    norm's two vectors). On exit a buffer whose version counter moved (an in-place update, the only
    way a parametrization changes its state during a read) is copied back; untouched buffers are
    not written, so nothing autograd saved is invalidated. No host synchronisation.
    """
    buffers = parametrization_buffers(*modules)
    if not buffers:
        yield
        return
    saved = [(b, b._version, b.detach().clone()) for b in buffers]
    try:
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, version, copy in saved:
                if b._version != version:
                    b.copy_(copy)
