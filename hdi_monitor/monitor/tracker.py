"""Framework-free measurement driver.

`HDITracker` decides when to measure, attaches head-output hooks only for a measured step,
accumulates activation statistics, computes the per-layer report, feeds the early-warning
detector, and writes to sinks. The Lightning callback (`hdi_monitor.integrations.lightning`) and the other
integrations are thin shells over it.

Two ways to drive it:

* **Plain PyTorch loop** (the tracker counts optimizer steps itself)::

      tracker = HDITracker(model, every_n_steps=100, writer=SummaryWriter("runs/x"))
      for batch in loader:
          with tracker.capture(batch):      # hooks on only if this step is measured
              loss = model(**batch).loss
          loss.backward()
          tracker.step()                    # finish the measurement, advance the step
          optimizer.step(); optimizer.zero_grad()

* **Explicit** (what the callbacks do): ``begin(step, batch)`` before the forward pass,
  ``stop_capture()`` before backward, ``finish()`` any time after backward.

``finish()`` may come before or after the optimizer step: the head-output accumulators combine
each captured head output with the output projection ``W_O`` as it is in the forward pass, at
capture time, so ``finish()`` reads no weight (it sums the accumulators over the ranks and makes
one device-to-host transfer for every layer's statistics). The callbacks finish before the
optimizer step, where backward is known to be done.

A measured step ``s`` reports the weights that produced step ``s``'s forward pass (measured in
``begin``, before the optimizer changes them) and the activations of that forward pass, so the HDI
point at ``s`` sits beside the training loss of step ``s``.

Size: about 750 lines, because `HDITracker` is the one stateful driver of a measurement
(schedule, hooks, the agreement of ranks before and after every collective, publishing, state for
resume), and splitting it would spread one state machine over several files. What is not that
state machine lives beside it: layer revalidation in `hdi_monitor.monitor._layers`, warnings in
`hdi_monitor.monitor._warnings`, the dashboards in `hdi_monitor.monitor.dashboard`, the settings in
`hdi_monitor.monitor.config`.
"""

from __future__ import annotations

import base64
import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.functional._numerics import no_autocast
from hdi_monitor.functional.covariance import (
    HeadCovarianceAccumulator,
    compute_results,
)
from hdi_monitor.functional.diversity import pairwise_principal_angles
from hdi_monitor.models import AttentionLayer, find_attention_layers
from hdi_monitor.models.base import Projection
from hdi_monitor.models.hooks import (
    CallCounts,
    attach_output_hooks,
    call_model,
    eval_mode,
    iter_batches,
    output_accumulator,
)
from hdi_monitor.models.sharding import is_fsdp1_module
from hdi_monitor.models.tensor_parallel import sync_data_parallel
from hdi_monitor.monitor import gaps, ranks, resume
from hdi_monitor.monitor._layers import describe_change, heads_text, naming_hint, signature, submodule
from hdi_monitor.monitor._warnings import summarize_events, warn
from hdi_monitor.monitor.config import (
    ACTIVATION_COLLAPSE_DELTA,
    ACTIVATION_MIN_DELTA,
    DetectorArg,
    MonitorConfig,
    resolve_detectors,
)
from hdi_monitor.monitor.dashboard import Dashboard
from hdi_monitor.monitor.detector import DiversityEvent, DiversityWarning
from hdi_monitor.monitor.sinks import Sink, TensorBoardSink
from hdi_monitor.report import DiversityReport, compute_report, weight_groups

__all__ = [
    "HDITracker",
    "Measurement",
    "MonitorConfig",
    "MonitoringWarning",
    "ACTIVATION_MIN_DELTA",
    "ACTIVATION_COLLAPSE_DELTA",
]


@dataclass
class Measurement:
    """One measured step: the report, the scalars written, and the events raised."""

    step: int
    report: DiversityReport
    scalars: dict[str, float]
    events: list[DiversityEvent] = field(default_factory=list)


@dataclass
class _Pending:
    step: int
    report: DiversityReport
    accumulators: list[HeadCovarianceAccumulator | None]
    forward_expected: bool = True  # False for weight-only measurements (step() without capture())
    counts: CallCounts = field(default_factory=CallCounts)  # module / head-output hook calls per layer


class HDITracker:
    """Measure head diversity every ``config.every_n_steps`` optimizer steps.

    Args:
        model: the model to watch (any ``nn.Module``; attention layers are found by discovery).
        config: what to measure and how often (see `MonitorConfig`); default ``MonitorConfig()``.
        writer: a ``SummaryWriter``; shorthand for ``sinks=[TensorBoardSink(writer)]``.
        sinks: where results go (see `hdi_monitor.monitor.sinks`).
        detector: early-warning detector for the HDI series: a `SaturationDetector` (used as
            given: its events and state are the tracker's), ``"default"`` (``SaturationDetector()``)
            or None (the default here: no HDI early warnings; the callbacks default to
            ``"default"``).
        activation_detector: early-warning detector for the effective-heads series (thresholds in
            heads) and for redundant head pairs by output correlation; ``"default"`` derives it
            from ``detector`` (see `resolve_detectors`), None (the default here) turns it off.
        fsdp_root: for FSDP1 (``FullyShardedDataParallel``) models, the root FSDP module, when
            ``model`` is not that root itself (it defaults to ``model`` when ``model`` is an FSDP1
            module). Weights are then read one FSDP unit at a time (see
            `full_weights`). The Lightning callback sets it to
            ``trainer.strategy.model``. Can also be set later through the attribute.
        **fields: `MonitorConfig` fields, applied over ``config``:
            ``HDITracker(model, every_n_steps=50)`` is ``HDITracker(model, MonitorConfig(every_n_steps=50))``.

    Raises:
        TypeError: an unknown keyword (the message names the valid fields), or a wrong type.
        ValueError: a bad setting (checked by `MonitorConfig`).
    """

    def __init__(
        self,
        model: nn.Module,
        config: MonitorConfig | None = None,
        *,
        writer: Any = None,
        sinks: Sequence[Sink] = (),
        detector: DetectorArg = None,
        activation_detector: DetectorArg = None,
        fsdp_root: nn.Module | None = None,
        **fields: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if fsdp_root is not None and not isinstance(fsdp_root, nn.Module):
            raise TypeError(f"fsdp_root must be a torch.nn.Module or None, got {type(fsdp_root).__name__}")
        config = MonitorConfig.build(config, fields, owner="HDITracker")
        detectors = resolve_detectors(detector, activation_detector, activations=config.activations)
        if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Sequence):
            raise TypeError(f"sinks must be a sequence of sinks, got {type(sinks).__name__}")
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise TypeError(
                    f"every sink needs log_scalars, log_images, log_histograms, log_text, log_layout and flush; "
                    f"got {type(sink).__name__}"
                )
        self.model = model
        self.config = config
        self.every_n_steps = config.every_n_steps
        self.projections: tuple[Projection, ...] = config.projections
        self.weighting = config.weighting
        self.layer_filter = config.layers
        self.spec = config.spec
        self.log_images_every_n_steps = config.image_every_n_steps
        self.activations = config.activations  # turned off by the torch.compile fallback
        self.max_tokens = config.max_tokens
        self.seed = config.seed
        # private RNG for the token subsample: the global generators are never drawn from
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.sinks: list[Sink] = list(sinks)
        if writer is not None:
            self.sinks.append(TensorBoardSink(writer))
        self.detector, self.activation_detector = detectors
        self.on_saturation = config.on_saturation
        self.strict = config.strict
        if fsdp_root is None and is_fsdp1_module(model):
            fsdp_root = model
        self.fsdp_root: nn.Module | None = fsdp_root

        self.history: list[dict[str, float]] = []
        self.events: list[DiversityEvent] = []
        self.last_measurement: Measurement | None = None
        self.last_token_counts: list[int] = []  # tokens per layer in the last measurement (after sync)
        self.stop_requested = False
        self.disabled = False
        self._layers: list[AttentionLayer] | None = None
        self._signatures: list[tuple[Any, ...]] = []  # per layer: (path, module, parameter shapes)
        self._notes: list[str] = []  # MonitoringWarning lines of the measurement under way (one warning)
        self._invalid_seen: set[tuple[str, str]] = set()  # (layer, projection) already warned about
        self._failed_sinks: set[int] = set()  # id() of sinks that failed once (warned once)
        self._gap_seen: tuple[set[str], set[str]] = (set(), set())  # layers told: hook never fired / < 2 tokens
        self._delivery = gaps.SinkDelivery()  # sinks that have the layout and levels text
        self._pending: _Pending | None = None
        self._scheduled: int | None = None  # step of the measurement under way (set even if it failed)
        self._handles: list[Any] = []
        self._last_step = -1
        self._step = 0  # own step counter for step()/capture()
        self.dashboard = Dashboard(  # layout, summary scalars, pictures
            loss_tag=config.loss_tag,
            max_image_layers=config.max_image_layers,
            max_histogram_layers=config.max_histogram_layers,
        )

    # ------------------------------------------------------------------ public driving API
    @property
    def layers(self) -> list[AttentionLayer]:
        """The attention layers being watched (found on first use, see `setup`)."""
        if self._layers is None:
            self.setup()
        assert self._layers is not None
        return self._layers

    def setup(self) -> list[AttentionLayer]:
        """Find the attention layers now; call before training (the integrations do).

        Raises:
            ValueError: no attention layer was found, or the ``layers`` filter matches none; the
                message names the model's modules and says how to pass ``layers`` or ``spec``.
            TypeError: ``layers`` or ``spec`` has the wrong type.
        """
        try:
            found = find_attention_layers(self.model, spec=self.spec, layers=self.layer_filter)
        except ValueError as err:
            raise ValueError(
                f"hdi-monitor cannot watch {type(self.model).__name__}: {err}{naming_hint(self.model)}"
            ) from err
        self._set_layers(found)
        ranks.check_ranks_agree(self._fingerprint(found))  # one small collective: all ranks watch the same
        return found

    def _fingerprint(self, layers: list[AttentionLayer]) -> dict[str, str]:
        c = self.config
        return ranks.fingerprint(
            layers,
            every_n_steps=self.every_n_steps,
            log_images_every_n_steps=self.log_images_every_n_steps,
            projections=self.projections,
            weighting=self.weighting,
            activations=self.activations,
            max_tokens=c.max_tokens,
        )

    def _set_layers(self, layers: list[AttentionLayer]) -> None:
        paths = {id(m): n for n, m in self.model.named_modules()}
        self._layers = layers
        self._signatures = [signature(la.module, paths.get(id(la.module))) for la in layers]

    def _revalidate(self) -> list[AttentionLayer]:
        """Check, cheaply, that every watched layer is still the module in the model with the same
        parameter shapes; if not, rediscover once and note what changed (one MonitoringWarning)."""
        layers = self.layers
        stale = [
            la
            for la, sig in zip(layers, self._signatures, strict=True)
            if sig[0] is None or signature(submodule(self.model, sig[0]), sig[0]) != sig
        ]
        if not stale:
            return layers
        try:
            found = find_attention_layers(self.model, spec=self.spec, layers=self.layer_filter)
        except ValueError as err:
            names = ", ".join(la.name for la in stale)
            raise ValueError(f"attention layer(s) {names} changed and the model no longer matches: {err}") from err
        new = {la.name: la for la in found}
        old = {la.name: la for la in layers}
        for la in stale:
            self._notes.append(describe_change(la, new.get(la.name)))
        for name in new.keys() - old.keys():
            self._notes.append(f"{name}: new attention layer, measured from now on ({heads_text(new[name])})")
        self._set_layers(found)
        return found

    @property
    def current_step(self) -> int:
        """The step counter used by `capture` and `step`."""
        return self._step

    def should_measure(self, step: int) -> bool:
        """True if ``step`` is a measured step not measured before (so resumed runs never repeat)."""
        return not self.disabled and step % self.every_n_steps == 0 and step > self._last_step

    def begin(self, step: int, batch: Any = None) -> bool:
        """Start (or, for further micro-batches of the same step, continue) a measurement.

        Measures the weights now, before the optimizer step, and attaches head-output hooks when
        ``activations`` is on. Returns True if step ``step`` is being measured.
        """
        if self._scheduled == step:
            # a further micro-batch of the step under way; a step whose measurement failed (a hook
            # error, say) is never restarted: it stays skipped until finish()
            if self._pending is None:
                return False
            with self._guard("capturing head outputs"):
                self._attach(batch)
            return True
        if not self.should_measure(step):
            return False
        self._scheduled = step
        return self._start(step, batch)

    @property
    def measuring(self) -> bool:
        """True between `begin` of a measured step and `finish`, even if this rank's
        measurement failed (so that every rank still takes part in `finish`)."""
        return self._scheduled is not None or self._pending is not None

    def _start(self, step: int, batch: Any) -> bool:
        self.stop_capture()
        self._pending = None  # an unfinished earlier measurement (e.g. after an exception) is dropped
        self._notes = []
        if self._layers is None:
            self.setup()  # a model the monitor cannot watch fails here, before its first step
        with self._guard("measuring weights"), no_autocast():
            layers = self._revalidate()
            report = compute_report(
                layers,
                projections=self.config.projections,
                weighting=self.weighting,
                fsdp_root=self.fsdp_root,
            )
            accs: list[HeadCovarianceAccumulator | None] = [None] * len(layers)
            if self.activations:
                accs = [output_accumulator(la, max_tokens=self.max_tokens, generator=self.generator) for la in layers]
            self._pending = _Pending(step=step, report=report, accumulators=accs)
            self._attach(batch)
            return True
        return False

    def stop_capture(self) -> None:
        """Remove every hook (idempotent). Call before backward so recomputed forwards are not counted."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def finish(self) -> Measurement | None:
        """Finish the pending measurement: compute, warn, write to the sinks. None if nothing was pending.

        Under ``torch.distributed`` this is a collective: call it on every rank at the same steps.
        The ranks first agree that all of them hold the measurement (one tiny ``all_reduce``);
        then, with activations, every accumulator is summed over the ranks.
        """
        self.stop_capture()
        if not self.measuring:
            return None  # not a measured step: no collective, no host sync
        pending, self._pending = self._pending, None
        self._scheduled = None
        if not _all_ranks_agree(pending is not None) or pending is None:
            # some rank failed earlier in this measurement: every rank drops it, so none waits
            # in a collective that the others never reach
            return None
        # Phase 1 runs every collective (accumulator sums, FSDP gathers) in the same order on every
        # rank; a local failure is recorded, not raised, so the ranks stay in step. Then the ranks
        # agree, and phase 2 (scalars, detector, sinks: no collective) runs only if all succeeded.
        errors: list[Exception] = []
        with no_autocast():
            self._gather_statistics(pending, errors)
            pictures = self._pictures(pending, errors)
        if not _all_ranks_agree(not errors):
            self._skip(errors[0] if errors else None, "computing the measurement")
            return None
        with self._guard("writing the measurement"):
            return self._publish(pending, pictures)
        return None

    @contextlib.contextmanager
    def capture(self, batch: Any = None) -> Iterator[bool]:
        """Context manager around the forward pass of the current step (plain loops).

        Yields True if this step is measured. Hooks are removed on exit, also on exceptions.
        """
        measured = self.begin(self._step, batch)
        try:
            yield measured
        finally:
            self.stop_capture()

    def step(self) -> Measurement | None:
        """Call once per optimizer step in a plain loop, after ``backward()``.

        Finishes the current step's measurement and advances the step counter. Returns the
        measurement of the step just finished, if any. With `capture`, the weights and ``W_O``
        were read in the forward pass, so ``step()`` may come before or after
        ``optimizer.step()``. Without `capture` the step is measured from the weights only, read
        here: call it before ``optimizer.step()`` so they are the weights of this step's forward.
        """
        if self._scheduled != self._step:
            self.begin(self._step)  # weights-only measurement when capture() was not used
            if self._pending is not None:
                self._pending.forward_expected = False
        result = self.finish()
        self._step += 1
        return result

    def measure(self, inputs: Any = None, *, step: int | None = None) -> Measurement | None:
        """Measure now, whatever the schedule; with ``inputs`` (a batch or an iterable of batches)
        and ``activations`` on, run them through the model to collect head-output statistics."""
        step = self._step if step is None else step
        self._scheduled = step
        if self._start(step, None) and inputs is not None and self.activations:
            # like head_diversity(inputs=...): eval mode (no dropout), restored afterwards
            with self._guard("running inputs through the model"), torch.no_grad(), eval_mode(self.model):
                for batch in iter_batches(inputs):
                    self.stop_capture()
                    self._attach(batch)
                    call_model(self.model, batch)
        return self.finish()

    def close(self) -> None:
        """Remove hooks and drop any unfinished measurement; flush the sinks."""
        self.stop_capture()
        self._pending = None
        self._scheduled = None
        for sink in self.sinks:
            with self._guard("flushing a sink"):
                sink.flush()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """History, last measured step, detector state and the subsample generator's state (plain
        Python types: JSON-ready, and loadable with ``torch.load(..., weights_only=True)``)."""
        return {
            "generator": base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii"),
            "settings": resume.settings(self.every_n_steps, self.projections),
            "history": [dict(h) for h in self.history],
            "last_step": self._last_step,
            "step": self._step,
            "events": [e.to_dict() for e in self.events],
            "detector": self.detector.state_dict() if self.detector is not None else None,
            "activation_detector": (
                self.activation_detector.state_dict() if self.activation_detector is not None else None
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        now = resume.settings(self.every_n_steps, self.projections)
        self.history, changed = resume.reconcile(state.get("settings"), now, state.get("history", []))
        if changed:
            warn(changed, MonitoringWarning, rank_zero_only=True)
        self._last_step = int(state.get("last_step", -1))
        self._step = int(state.get("step", 0))
        self.events = [DiversityEvent.from_dict(e) for e in state.get("events", [])]
        if self.detector is not None and state.get("detector") is not None:
            self.detector.load_state_dict(state["detector"])
        if self.activation_detector is not None and state.get("activation_detector") is not None:
            self.activation_detector.load_state_dict(state["activation_detector"])
        if state.get("generator") is not None:
            raw = base64.b64decode(state["generator"])
            self.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            self.stop_capture()
            self._pending = None
            if self.strict:
                raise
            warn(
                f"hdi-monitor: error while {what}; training goes on, this measurement is skipped "
                f"({type(err).__name__}: {err}). Pass strict=True to raise instead.",
                MonitoringWarning,
            )

    def _attach(self, batch: Any) -> None:
        pending = self._pending
        if pending is not None and self.activations:
            self._handles += attach_output_hooks(
                self.layers, pending.accumulators, batch, on_error=self._hook_failed, counts=pending.counts
            )

    def _hook_failed(self, err: Exception) -> None:
        """A head-output hook raised inside the forward pass: drop this measurement (in ``finish``
        every rank then agrees to drop it) and let the forward pass go on; hooks stay attached until
        ``stop_capture`` (removing them inside a hook would change the dict being iterated)."""
        if self.strict:
            raise err
        if self._pending is None:
            return  # already dropped (and warned) by an earlier hook of this forward pass
        self._pending = None
        warn(
            f"hdi-monitor: error while capturing head outputs; training goes on, this measurement is skipped "
            f"({type(err).__name__}: {err}). Pass strict=True to raise instead.",
            MonitoringWarning,
        )

    def _gather_statistics(self, pending: _Pending, errors: list[Exception]) -> None:
        """Sum the accumulators over the ranks, then compute every layer's head-output statistics
        with one device-to-host transfer for all of them (no weight is read: the accumulators took
        ``W_O`` at capture time)."""
        self.last_token_counts = []
        if not self.activations:
            return
        pairs = [
            (acc, entry)
            for acc, entry in zip(pending.accumulators, pending.report.layers, strict=True)
            if acc is not None
        ]
        accs = [acc for acc, _ in pairs]
        sync_data_parallel(accs, self.layers)  # collectives first (layer check + two sums), data-parallel ranks
        results: list[Any] = [None] * len(accs)
        try:
            results = compute_results(accs, min_tokens=2)  # caches every token count on the host
        except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
            errors.append(err)
        self.last_token_counts = [acc.num_tokens for acc in accs]
        for (_, entry), result in zip(pairs, results, strict=True):
            if result is None:
                continue
            entry.covariance = result.covariance
            entry.correlation = result.correlation
            entry.effective_heads = result.effective_heads
            entry.mean_correlation = result.mean_correlation
            entry.variance_ratio = result.variance_ratio
            entry.num_tokens = result.num_tokens
        # token counts are all-rank totals here, so every rank takes the same decision
        if pending.forward_expected and 0 in self.last_token_counts and _is_compiled(self.model):
            self._compile_fallback()
        elif pending.forward_expected:  # an F.linear output projection, or < 2 real tokens: said once per layer
            outs = {la.name: type(la.output_module).__name__ for la in self.layers}
            self._notes += gaps.silent_hook_notes(pending.counts.silent_layers(), outs, self._gap_seen[0])
            counts = {e.name: n for (_, e), n in zip(pairs, self.last_token_counts, strict=True)}
            self._notes += gaps.few_token_notes(counts, pending.counts.output_calls, self._gap_seen[1])

    def _publish(self, pending: _Pending, pictures: tuple[dict[str, Tensor], dict[str, Tensor]]) -> Measurement:
        """Scalars, early warnings, sinks and history for a finished measurement (rank-local)."""
        report, step = pending.report, pending.step
        scalars = self._scalars(report)
        events = self._detect(step, report)
        detecting = self.detector is not None or (self.activation_detector is not None and self.activations)
        self.dashboard.summary_scalars(scalars, report, events, projections=self.projections, detecting=detecting)
        measurement = Measurement(step=step, report=report, scalars=scalars, events=events)
        # results first, so that no sink can lose them; then the warnings; then the sinks, each alone
        self.history.append({"step": float(step), **scalars})
        self.events.extend(events)
        self.last_measurement = measurement
        self._last_step = max(self._last_step, step)
        self._note_invalidheads_text(report)
        notes, self._notes = self._notes, []
        if notes:
            lines = "\n  ".join(notes)
            warn(
                f"hdi-monitor step {step}: {len(notes)} change(s) in the watched layers:\n  {lines}",
                MonitoringWarning,
                rank_zero_only=True,
            )
        self._dispatch(step, events)
        self._write(measurement, *pictures)
        return measurement

    def _note_invalidheads_text(self, report: DiversityReport) -> None:
        """One note the first time a layer and projection has dead (all-zero) or non-finite heads."""
        for layer in report.layers:
            for projection in self.projections:
                bad = layer.invalid_heads.get(projection) or []
                if bad and (layer.name, projection) not in self._invalid_seen:
                    self._invalid_seen.add((layer.name, projection))
                    total = layer.num_kv_heads if projection in ("key", "value") else layer.num_heads
                    valid = total - len(bad)
                    self._notes.append(
                        f"{layer.name} ({projection}): head(s) {bad} are dead (all zero) or non-finite; "
                        f"its HDI is over the {valid} valid head(s) of {total} "
                        f"(scalar invalid_heads/{projection}/{layer.name})"
                    )

    def _skip(self, err: Exception | None, what: str) -> None:
        """Drop a measurement that failed on this rank (``err``: warn, or raise when strict) or on
        another rank (None: that rank warns; this one drops it quietly, as when ``begin`` failed)."""
        if err is None:
            return
        if self.strict:
            raise err
        reason = f"{type(err).__name__}: {err}"
        warn(
            f"hdi-monitor: error while {what}; training goes on, this measurement is skipped ({reason}). "
            "Pass strict=True to raise instead.",
            MonitoringWarning,
        )

    def _compile_fallback(self) -> None:
        """Hooks did not run inside a torch.compile'd forward: warn once, go on with weights only."""
        missed = [la.name for la, n in zip(self.layers, self.last_token_counts, strict=False) if n == 0]
        shown = ", ".join(missed[:3]) + (", ..." if len(missed) > 3 else "")
        self.activations = False
        warn(
            f"hdi-monitor: the model runs under torch.compile and the head-output hooks of {len(missed)} "
            f"layer(s) ({shown}) did not run inside the compiled forward (Dynamo does not see hooks attached "
            "after compilation). Activation statistics (covariance, effective heads) are off from now on; the "
            "weight-based HDI is unaffected. Pass activations=False to silence this warning.",
            MonitoringWarning,
            rank_zero_only=True,
        )

    def _scalars(self, report: DiversityReport) -> dict[str, float]:
        scalars: dict[str, float] = {}
        for projection in self.projections:
            chance, cap = [], []
            for layer in report.layers:
                # on every measured step, so a dead or NaN head is never silent (0 when none)
                scalars[f"invalid_heads/{projection}/{layer.name}"] = float(
                    len(layer.invalid_heads.get(projection) or [])
                )
                value = layer.hdi.get(projection)
                if value is not None and math.isfinite(value):
                    scalars[f"hdi/{projection}/{layer.name}"] = value
                    chance.append(layer.chance_hdi[projection])
                    if (top := layer.max_hdi.get(projection)) is not None:
                        cap.append(top)
            mean = report.mean_hdi(projection)
            if mean is not None and math.isfinite(mean):
                scalars[f"hdi/{projection}/mean"] = mean
            if chance:
                scalars[f"hdi_chance/{projection}"] = float(sum(chance) / len(chance))
            if cap:
                scalars[f"hdi_max/{projection}"] = float(sum(cap) / len(cap))
        if self.activations:
            eff, corr = [], []
            for layer in report.layers:
                if (heads := layer.effective_heads) is not None and math.isfinite(heads):
                    scalars[f"effective_heads/{layer.name}"] = float(heads)
                    eff.append(float(heads))
                if (r := layer.mean_correlation) is not None and math.isfinite(r):
                    scalars[f"head_correlation/{layer.name}"] = float(r)
                    corr.append(float(r))
            if eff:
                scalars["effective_heads/mean"] = sum(eff) / len(eff)
            if corr:
                scalars["head_correlation/mean"] = sum(corr) / len(corr)
        return scalars

    def _detect(self, step: int, report: DiversityReport) -> list[DiversityEvent]:
        events: list[DiversityEvent] = []
        if self.detector is not None:
            for projection in self.projections:
                chances = []
                for layer in report.layers:
                    value = layer.hdi.get(projection)
                    if value is None:
                        continue
                    chance = layer.chance_hdi[projection]
                    chances.append(chance)
                    events += self.detector.update(
                        step, layer.name, projection, value, chance=chance, pairwise=layer.overlap.get(projection)
                    )
                mean = report.mean_hdi(projection)
                if mean is not None and chances:
                    events += self.detector.update(step, "mean", projection, mean, chance=sum(chances) / len(chances))
        if self.activation_detector is not None and self.activations:
            for layer in report.layers:
                if layer.effective_heads is None:
                    continue
                events += self.activation_detector.update(
                    step,
                    layer.name,
                    "activations",
                    layer.effective_heads,
                    metric="effective_heads",
                    pairwise=layer.correlation,
                )
        return events

    def _pictures(self, pending: _Pending, errors: list[Exception]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Angle histograms on image steps (a collective under FSDP); the images are drawn in
        `_write`, from the history that includes this step."""
        if not self._image_step(pending.step):
            return {}, {}
        return {}, self.dashboard.histograms(self._angles(errors))

    def _image_step(self, step: int) -> bool:
        return bool(self.log_images_every_n_steps) and step % self.log_images_every_n_steps == 0

    def _angles(self, errors: list[Exception]) -> dict[str, dict[str, Tensor]]:
        """Principal angles (degrees) of every head pair i < j, per projection and layer (in
        depth order); batched over the layers of one shape by `weight_groups` (the traversal of
        `compute_report`: sharded layers gathered one at a time, in the same order on every rank).
        Local failures go to ``errors`` (the gathers still run, so the ranks stay in step)."""
        values: dict[str, dict[str, Tensor]] = {p: {} for p in self.projections}
        for projection, members, weights in weight_groups(self.layers, self.projections, fsdp_root=self.fsdp_root):
            if errors or weights.shape[1] < 2:
                continue
            try:
                angles = pairwise_principal_angles(weights)  # (L, H, H, d)
                h = angles.shape[1]
                i, j = torch.triu_indices(h, h, offset=1, device=angles.device)
                picked = torch.rad2deg(angles[:, i, j].flatten(1)).float().cpu()
                for index, row in zip(members, picked, strict=True):
                    values[projection][self.layers[index].name] = row[~torch.isnan(row)]
            except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
                errors.append(err)
            del weights  # a gathered layer is freed before the next one
        order = [layer.name for layer in self.layers]
        return {p: {n: vs[n] for n in order if n in vs} for p, vs in values.items()}

    def _write(self, m: Measurement, images: dict[str, Any], histograms: dict[str, Tensor]) -> None:
        """Write to every sink, each guarded alone: a failing sink loses only its own write."""
        if not self.sinks:
            return
        layout = levels = None
        if self._delivery.pending(self.sinks):  # until every sink has it (a failed write is retried)
            names: dict[str, list[str]] = {
                p: [la.name for la in m.report.layers if la.hdi.get(p) is not None] for p in self.projections
            }
            layout = self.dashboard.layout(names, activations=self.activations)
            levels = self.dashboard.levels_text(m.report, self.projections)
            self.dashboard.layout_written = True
        if self._image_step(m.step):
            with self._guard("drawing the dashboard images"):  # a failure costs the images only
                images = {
                    **images,
                    **self.dashboard.images(
                        m.report, self.history, step=m.step, projections=self.projections, activations=self.activations
                    ),
                }
        first_error: Exception | None = None
        for sink in self.sinks:
            try:
                if layout is not None and self._delivery.needs(sink):
                    sink.log_layout(layout)
                    if levels is not None:
                        sink.log_text("hdi_levels", levels, m.step)
                    self._delivery.done(sink)
                sink.log_scalars(m.scalars, m.step)
                if images:
                    sink.log_images(images, m.step)
                if histograms:
                    sink.log_histograms(histograms, m.step)
                for event in m.events:
                    sink.log_text(f"diversity_events/{event.kind}", event.message, m.step)
                sink.flush()
            except Exception as err:  # noqa: BLE001 - one sink's failure must not cost the others
                first_error = first_error or err
                if id(sink) not in self._failed_sinks and not self.strict:
                    self._failed_sinks.add(id(sink))
                    warn(
                        f"hdi-monitor: sink {type(sink).__name__} failed at step {m.step} ({type(err).__name__}: {err}); "
                        "its write is skipped, the other sinks, history and events are kept. Later failures of "
                        "this sink are not reported again.",
                        MonitoringWarning,
                    )
        if first_error is not None and self.strict:
            raise first_error

    def _dispatch(self, step: int, events: list[DiversityEvent]) -> None:
        """The events of one measured step: a callable gets each one; otherwise at most one
        DiversityWarning (the one message, or a summary) and the stop flag."""
        if not events:
            return
        if callable(self.on_saturation):
            for event in events:
                self.on_saturation(event)
            return
        if self.on_saturation == "stop" and any(e.kind in ("saturation", "collapse") for e in events):
            self.stop_requested = True
        message = events[0].message if len(events) == 1 else summarize_events(step, events)
        warn(message, DiversityWarning, rank_zero_only=True)


def _is_compiled(model: nn.Module) -> bool:
    """True if ``model`` or a submodule runs through torch.compile: a ``torch.compile(m)`` wrapper
    (``OptimizedModule``), an in-place ``m.compile()``, or Lightning's compiled LightningModule."""
    if getattr(model, "_compiler_ctx", None):
        return True
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without Dynamo
        return False
    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    )


def _all_ranks_agree(flag: bool) -> bool:
    """Logical AND of ``flag`` over all ranks (a collective); ``flag`` itself when not distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return flag
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
