"""Gaps a measurement could leave in silence, named (or retried) instead.

Pure helpers for the tracker, each tested on its own:

* `silent_hook_notes`: a layer whose attention module ran while its head-output hook never fired
  (its forward calls ``F.linear(x, self.out_proj.weight)``, or never calls the output module):
  0 tokens every measured step. Said once per layer, naming the layer and why.
* `few_token_notes`: a layer that saw fewer than 2 real tokens in a measured step has no
  activation statistics (a covariance needs two). Said once per layer.
* `SinkDelivery`: the one-off writes (the Custom Scalars layout, the levels text) are marked done
  per sink only when that sink's write succeeded, so one failed write at the first measured step
  is retried at the next one instead of being lost for the whole run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["SinkDelivery", "few_token_notes", "silent_hook_notes"]


def silent_hook_notes(
    silent: Sequence[str], output_modules: Mapping[str, str], seen: set[str], *, where: str = "head-output"
) -> list[str]:
    """One line per layer in ``silent`` not in ``seen`` (then added to it).

    Args:
        silent: layers whose attention module ran while their head-output hook never fired.
        output_modules: layer name -> the class name of the hooked output module (for the message).
        seen: layers already reported (updated in place).
        where: what kind of hook it is (for the message).
    """
    out = []
    for name in silent:
        if name in seen:
            continue
        seen.add(name)
        module = output_modules.get(name, "its output module")
        out.append(
            f"{name}: the attention module ran but its {where} hook on {module} never fired, so this layer has "
            "no activation statistics (0 tokens). Its forward calls the output projection's weight directly "
            f"(e.g. F.linear(x, self.out_proj.weight)) instead of calling {module}, or does not call it at all. "
            "Call the submodule (self.out_proj(x)), or point AttentionSpec(output_module=...) at a submodule that "
            "receives the concatenated head outputs; activations=False turns activation statistics off. "
            "(Said once per layer.)"
        )
    return out


def few_token_notes(
    token_counts: Mapping[str, int], fired: Mapping[str, int], seen: set[str], *, min_tokens: int = 2
) -> list[str]:
    """One line per layer whose head-output hook fired but which kept fewer than ``min_tokens``
    tokens (after masks and subsampling; all ranks together), once per layer (``seen`` is updated).

    Args:
        token_counts: layer name -> tokens accumulated in the measured step.
        fired: layer name -> how often its head-output hook ran in the step.
        seen: layers already reported (updated in place).
        min_tokens: the fewest tokens a covariance is computed from.
    """
    out = []
    for name, n in token_counts.items():
        if n >= min_tokens or fired.get(name, 0) == 0 or name in seen:
            continue
        seen.add(name)
        out.append(
            f"{name}: only {n} real token(s) in this measured step (at least {min_tokens} are needed for a "
            "covariance), so it has no activation statistics this step; check the batch's token mask (all "
            "padding?) or measure on longer inputs. (Said once per layer.)"
        )
    return out


class SinkDelivery:
    """Which sinks have received a one-off write (the dashboard layout and the levels text).

    ``pending(sinks)`` lists the sinks that still need it; ``done(sink)`` marks one after its write
    succeeded. A sink whose first write failed stays pending and gets it again at the next
    measured step.
    """

    def __init__(self) -> None:
        self._done: set[int] = set()

    def pending(self, sinks: Sequence[object]) -> list[object]:
        return [s for s in sinks if id(s) not in self._done]

    def needs(self, sink: object) -> bool:
        return id(sink) not in self._done

    def done(self, sink: object) -> None:
        self._done.add(id(sink))
