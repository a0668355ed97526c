"""The update entropy of a measured step (DESIGN.md rule 10; opt-in): each head's spectral entropy of
the first-order change of its bilinear form since the previous measured step.

It needs the query and key weights themselves at two measured steps, so `UpdateEntropy` keeps a
CPU copy of every watched layer's query and key heads (in the weights' own dtype) from one
measured step to the next, taken from the step's one weight read (`hdi_monitor.report.compute_report`'s
``tap``); the math is `hdi_monitor.functional.bilinear.update_entropy` (float64, on the CPU).
Memory: the size of the layers' ``W_Q`` and ``W_K`` in host memory, for as long as the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from hdi_monitor.functional.bilinear import update_entropy
from hdi_monitor.models import AttentionLayer

__all__ = ["UpdateEntropy"]


class UpdateEntropy:
    """The previous measured step's query and key heads of each layer, and this step's tap.

    Use: ``tap = ue.tap(layers)``, pass it to ``compute_report(..., tap=tap)``, then
    ``ue.finish(layers)`` gives ``{layer name: (H,) float64}`` for the layers measured at both steps
    (with the same shapes) and keeps this step's weights for the next one.
    """

    def __init__(self) -> None:
        self.previous: dict[str, tuple[Tensor, Tensor]] = {}
        self._now: dict[tuple[str, str], Tensor] = {}
        self._layers: Sequence[AttentionLayer] = ()

    def tap(self, layers: Sequence[AttentionLayer]) -> Callable[[str, list[int], Tensor], None]:
        """The ``tap`` for this step's `compute_report` (copies the query and key groups to the CPU)."""
        self._layers, self._now = layers, {}

        def take(projection: str, indices: list[int], weights: Tensor) -> None:
            if projection in ("query", "key"):
                host = weights.detach().to("cpu", copy=True)
                for j, i in enumerate(indices):
                    self._now[(layers[i].name, projection)] = host[j]

        return take

    def finish(self) -> dict[str, Tensor]:
        """This step's update entropy per layer (see the class docstring); keeps this step's weights."""
        out: dict[str, Tensor] = {}
        current: dict[str, tuple[Tensor, Tensor]] = {}
        for layer in self._layers:
            q, k = self._now.get((layer.name, "query")), self._now.get((layer.name, "key"))
            if q is None or k is None:
                continue
            current[layer.name] = (q, k)
            before = self.previous.get(layer.name)
            if before is not None and before[0].shape == q.shape and before[1].shape == k.shape:
                out[layer.name] = update_entropy(before[0], before[1], q, k, kv_map=layer.kv_map)
        self.previous, self._now = current, {}
        return out
