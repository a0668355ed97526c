"""`KernelDetector`: early warnings from the kernel statistics (entropy collapse, logit blow-up).

Pure Python, like `hdi_monitor.monitor.detector.SaturationDetector`, with plain-Python state.
"""

from __future__ import annotations

from typing import Any

from hdi_monitor._validation import check_index, check_int, check_real
from hdi_monitor.events import DiversityEvent
from hdi_monitor.evidence import backed
from hdi_monitor.monitor.detector import MAX_KEPT_EVENTS, _check_warmup, _evidence, _measurement, _warming

__all__ = ["KernelDetector"]


_KERNEL_STATE_VERSION = 1


def _advice_and_evidence(signal: str, advice: str) -> str:
    """The end of a ``signal`` event's message: ``"; {advice}"`` only where the warnings study backs
    acting on the signal, then what the study measured for it, in parentheses, and a full stop."""
    return (f"; {advice}" if backed(signal) else "") + f" ({_evidence(signal)})."


class KernelDetector:
    """Early warnings from the kernel statistics: entropy collapse and logit blow-up.

    Fed one layer's kernel statistics per measured step (the mean attention entropy over heads,
    its uniform level and the largest attention logit over heads); returns the new events. Pure
    Python, like `SaturationDetector`, with plain-Python state.

    * **entropy_collapse**: after warmup, the layer's mean attention entropy falls below
      ``entropy_fraction`` times its best (highest) value so far (attention-entropy collapse,
      which precedes loss spikes at high learning rates without QK-norm: Zhai et al. 2023).
    * **logit_blowup**: after warmup, the layer's maximum attention logit exceeds
      ``logit_threshold``, or is at least ``min_logit`` and ``logit_growth`` times the value
      ``patience`` measurements earlier (which must be positive) (Wortsman et al. 2023; what
      qk-clip guards against).

    Each fires once per layer (a run that collapses has been told). The defaults are the settings
    the warnings study chose on all its runs (``benchmarks/results/warnings_study.json``,
    ``chosen_on_all_runs``): ``entropy_fraction=0.05``, ``logit_threshold=1000``, the growth rule
    effectively off (``logit_growth=100``), a warm-up of 10 measurements. Held out, neither kind beat
    the study's best baseline (the spike rate at the same point of training in other runs), so
    neither warns by default (`hdi_monitor.evidence.DEFAULTS_ON`); the events are recorded and drawn.

    Args:
        warmup_measurements: the first this many measurements of each layer are ignored entirely
            (the warm-up follows the measuring cadence).
        warmup_steps: instead, ignore the measurements at training steps below this (None: count
            measurements).
        entropy_fraction: in ``(0, 1)``: entropy collapse below this fraction of the best.
        logit_threshold: a maximum logit above this is a blow-up.
        logit_growth: ``> 1``: growth by this factor within the window is a blow-up.
        patience: the window, in measurements, over which growth is judged.
        min_logit: growth only counts once the maximum logit is at least this.
    """

    def __init__(
        self,
        *,
        warmup_measurements: int = 10,
        warmup_steps: int | None = None,
        entropy_fraction: float = 0.05,
        logit_threshold: float = 1000.0,
        logit_growth: float = 100.0,
        patience: int = 10,
        min_logit: float = 10.0,
    ) -> None:
        self.warmup_measurements, self.warmup_steps = _check_warmup(warmup_measurements, warmup_steps)
        self._seen: dict[str, int] = {}  # layer -> measurements fed, warm-up included
        self.entropy_fraction = check_real(
            "entropy_fraction", entropy_fraction, low=0.0, high=1.0, low_open=True, high_open=True
        )
        self.logit_threshold = check_real("logit_threshold", logit_threshold)
        self.logit_growth = check_real("logit_growth", logit_growth, low=1.0, low_open=True)
        self.patience = check_int("patience", check_index("patience", patience))
        self.min_logit = check_real("min_logit", min_logit)
        self._best: dict[str, float] = {}  # layer -> best mean entropy after warmup
        self._logits: dict[str, list[float]] = {}  # layer -> last patience + 1 maximum logits
        self._fired: set[tuple[str, str]] = set()  # (layer, kind) already reported
        self._last_step: dict[str, int] = {}
        self._events: list[DiversityEvent] = []

    @property
    def events(self) -> tuple[DiversityEvent, ...]:
        """The events issued so far (the last `MAX_KEPT_EVENTS`)."""
        return tuple(self._events)

    def best_entropy(self, layer: str) -> float | None:
        """The highest mean entropy of ``layer`` after warmup, or None."""
        return self._best.get(layer)

    def reset(self) -> None:
        """Forget every series and event."""
        self._best.clear()
        self._logits.clear()
        self._fired.clear()
        self._last_step.clear()
        self._seen.clear()
        self._events.clear()

    def update(
        self,
        step: int,
        layer: str,
        *,
        entropy: float | None = None,
        uniform: float | None = None,
        max_logit: float | None = None,
    ) -> list[DiversityEvent]:
        """Feed one layer's kernel statistics of one measured step; return the new events.

        Args:
            step: training step; must increase per layer.
            layer: the layer's tag name.
            entropy: mean attention entropy over heads (nats); None/NaN: missing.
            uniform: its uniform-attention level (mean ``ln(n_keys)``), quoted in the message.
            max_logit: the largest attention logit over heads; None/NaN: missing.

        Returns:
            New events, entropy collapse first.
        """
        step = check_int("step", check_index("step", step), low=0)
        if not isinstance(layer, str) or not layer:
            raise TypeError(f"layer must be a non-empty str, got {layer!r}")
        last = self._last_step.get(layer)
        if last is not None and step <= last:
            raise ValueError(f"step {step} for {layer!r} is not after the previous measurement at step {last}")
        self._last_step[layer] = step
        self._seen[layer] = seen = self._seen.get(layer, 0) + 1
        if _warming(step, seen, self.warmup_measurements, self.warmup_steps):
            return []
        ent, ref, top = _measurement(entropy), _measurement(uniform), _measurement(max_logit)
        events: list[DiversityEvent] = []
        if ent is not None:
            best = self._best.get(layer)
            if best is None or ent > best:
                best = self._best[layer] = ent
            if (layer, "entropy_collapse") not in self._fired and ent < self.entropy_fraction * best:
                self._fired.add((layer, "entropy_collapse"))
                ref_text = "" if ref is None else f"; uniform attention would have {ref:.3f}"
                message = (
                    f"Attention entropy of '{layer}' fell to {ent:.3f} nats at step {step}, below "
                    f"{self.entropy_fraction:.3g} of its best {best:.3f}{ref_text}: the heads attend to ever fewer "
                    "keys (entropy collapse, reported to precede loss spikes at high learning rates)"
                    + _advice_and_evidence(
                        "entropy_collapse", "consider QK-norm, a lower learning rate or a longer warmup"
                    )
                )
                events.append(
                    DiversityEvent(
                        "entropy_collapse", layer, "kernel", "attention_entropy", step, ent, best, ref, (), message
                    )
                )
        if top is not None:
            window = self._logits.setdefault(layer, [])
            window.append(top)
            del window[: -(self.patience + 1)]
            if (layer, "logit_blowup") not in self._fired:
                why = None
                if top > self.logit_threshold:
                    why = f"above the {self.logit_threshold:.3g} threshold"
                elif (
                    len(window) == self.patience + 1
                    and window[0] > 0
                    and top >= self.min_logit
                    and top >= self.logit_growth * window[0]
                ):
                    why = (
                        f"{top / window[0]:.1f} times its value {window[0]:.3f} {self.patience} measurements "
                        f"earlier (growth threshold {self.logit_growth:.3g})"
                    )
                if why is not None:
                    self._fired.add((layer, "logit_blowup"))
                    message = (
                        f"Maximum attention logit of '{layer}' is {top:.3f} at step {step}, {why}: the attention "
                        "kernel is sharpening (logit growth is reported to precede loss spikes and divergence)"
                        + _advice_and_evidence(
                            "logit_blowup", "consider QK-norm, qk-clip, a lower learning rate or more weight decay"
                        )
                    )
                    events.append(
                        DiversityEvent(
                            "logit_blowup", layer, "kernel", "max_attention_logit", step, top, None, None, (), message
                        )
                    )
        self._events.extend(events)
        del self._events[:-MAX_KEPT_EVENTS]
        return events

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (loadable with ``torch.load(..., weights_only=True)``)."""
        return {
            "version": _KERNEL_STATE_VERSION,
            "best": dict(self._best),
            "logits": {k: list(v) for k, v in self._logits.items()},
            "fired": sorted([layer, kind] for layer, kind in self._fired),
            "last_step": dict(self._last_step),
            "seen": dict(self._seen),
            "events": [e.to_dict() for e in self._events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (the constructor's settings are kept)."""
        if not isinstance(state, dict) or state.get("version") != _KERNEL_STATE_VERSION:
            raise ValueError("state must be a KernelDetector.state_dict()")
        try:
            self._best = {str(k): float(v) for k, v in state["best"].items()}
            self._logits = {str(k): [float(x) for x in v][-(self.patience + 1) :] for k, v in state["logits"].items()}
            self._fired = {(str(a), str(b)) for a, b in state["fired"]}
            self._last_step = {str(k): int(v) for k, v in state["last_step"].items()}
            self._seen = {str(k): int(v) for k, v in state.get("seen", {}).items()}
            self._events = [DiversityEvent.from_dict(e) for e in state["events"]][-MAX_KEPT_EVENTS:]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed KernelDetector state: {err!r}") from err
