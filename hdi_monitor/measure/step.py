"""`MeasuredStep`: everything between the start and the end of one measured step.

A measured step reads the weights once (`hdi_monitor.report.compute_report`: the HDI, its levels,
the logit bound; principal angles on image steps), attaches the capture for the step's forward
passes (head-output hooks feeding one covariance accumulator per layer, the kernel capture; a side
forward for compiled parts of the model), takes the hooks off before backward, and at `finish`
runs the collectives in a fixed order on every rank (the ranks agree they all hold the
measurement; the data-parallel sum of every accumulator in one packed collective; the ranks agree
they all computed it), then returns a frozen `hdi_monitor.measure.measurement.Measurement`.

Its own failure state: an error while reading the weights raises from `start` (the caller applies
its error policy); an error inside a hook goes to the caller's ``on_error`` and drops the step (the
forward pass goes on, and every rank still reaches `finish`, where they agree to drop it). A hook
that Dynamo traces (the model runs inside a torch.compile region the monitor was not given) takes
the step's capture off at trace time (`hdi_monitor.models.base.TraceSignal`): the step keeps its
weight read, has no activation or kernel statistics, and says why once; later steps do not hook
the training forward (`ModelWatch.compiled_outside`).

`hdi_monitor.head_diversity`, `hdi_monitor.HDITracker` and ``hdi-monitor report`` all measure
through this class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from hdi_monitor.functional._numerics import no_autocast
from hdi_monitor.measure.accumulators import sync_accumulators
from hdi_monitor.measure.capture import CallCounts, attach_capture, output_accumulator
from hdi_monitor.measure.compiled import (
    capture_side_forward,
    compiled_outside_message,
    intercept,
    never_fired_message,
)
from hdi_monitor.measure.covariance import HeadCovarianceAccumulator, compute_results
from hdi_monitor.measure.kernel import KernelStatsAccumulator, KernelStatsCapture, compute_kernel_results
from hdi_monitor.measure.measurement import Measurement
from hdi_monitor.measure.watch import ModelWatch
from hdi_monitor.models.base import TraceSignal
from hdi_monitor.models.hooks import call_model, eval_mode, iter_batches
from hdi_monitor.models.kernel_capture import NOT_RUN
from hdi_monitor.models.tensor_parallel import check_same_layers
from hdi_monitor.report import ACTIVATIONS, AngleWork, DiversityReport, LayerDiversity, Progress, compute_report

__all__ = ["MeasuredStep", "StepFailed"]

ErrorHandler = Callable[[Exception], None]


class StepFailed(Exception):
    """A measured step that failed on this rank (``error``) or on another one (``error`` None) and
    is dropped on every rank."""

    def __init__(self, error: Exception | None, what: str) -> None:
        super().__init__(what if error is None else f"{what}: {error}")
        self.error = error
        self.what = what


class MeasuredStep:
    """One measured step (see the module docstring). Made by `start`.

    Attributes:
        step: the optimizer step measured.
        image: True if this step's pictures are drawn (principal angles are computed from the weights).
        forward_expected: False for a weights-only measurement (no forward pass runs).
        dropped: True once something failed on this rank (the weight read, a hook): the step is
            skipped (side forwards too), on every rank (they agree in `finish`).
        error: what failed while reading the weights (handed to ``on_error`` already), or None.
        blind: True when the training forward was not hooked (a hook was traced by Dynamo, or an
            earlier step found that it would be): no activation or kernel statistics this step.
        notes: what this step noticed so far (layers that changed).
    """

    def __init__(
        self,
        watch: ModelWatch,
        step: int,
        report: DiversityReport | None,
        *,
        image: bool,
        angle_work: list[AngleWork],
        on_error: ErrorHandler,
        notes: list[str],
    ) -> None:
        self.watch = watch
        self.step = step
        self.image = image
        self.report = report
        self.forward_expected = True
        self.dropped = report is None
        self.error: Exception | None = None
        self.blind = False
        self.notes = notes
        self._angle_work = angle_work
        self._on_error = on_error
        self._handles: list[Any] = []
        self._traced = False  # Dynamo traced a hook of this step (its capture came off at trace time)
        self._hooked = False  # a capture was attached for a forward pass
        self._nothing_ran = False  # ... and no watched layer ran while it was on (set in finish)
        self.signal = TraceSignal(self._on_traced, on_error=self._failed)
        self.counts = CallCounts()
        config, layers = watch.config, watch.layers
        self.accumulators: list[HeadCovarianceAccumulator | None] = [None] * len(layers)
        self.kernel: KernelStatsCapture | None = None
        self.kernel_accumulators: list[KernelStatsAccumulator] = []
        self.kernel_off: dict[str, str] = {}  # layer -> why it is not captured
        if report is None:
            return  # a failed step: nothing to capture
        if watch.activations:
            self.accumulators = [
                output_accumulator(
                    la,
                    max_tokens=config.max_tokens,
                    calls=watch.calls.get(la.name, 1),  # the budget shared by the calls seen last time
                    generator=watch.generator,
                )
                for la in layers
            ]
        if config.kernel_stats:
            self._start_kernel()

    @classmethod
    def start(
        cls,
        watch: ModelWatch,
        step: int,
        *,
        image: bool,
        on_error: ErrorHandler,
        angles: bool | None = None,
        progress: Progress | None = None,
    ) -> MeasuredStep:
        """Read the weights (the one read of this step) and set up the accumulators.

        Args:
            watch: the model's watch.
            step: the step measured.
            image: the step's pictures are drawn.
            angles: also compute the principal angles from this read (on the CPU: left for the
                picture worker); default ``image``.
            on_error: receives an exception raised inside a hook (the forward pass goes on).
            progress: called with the number of layers measured after each group of weights (see
                `hdi_monitor.report.compute_report`).

        A failure to read the weights is handed to ``on_error`` as a `StepFailed` (the caller's
        error policy: it may raise) and gives a dropped step, which still takes part in `finish` (the other ranks wait
        there).
        """
        try:
            return cls._read(watch, step, image=image, on_error=on_error, angles=angles, progress=progress)
        except Exception as err:  # noqa: BLE001 - this rank's step is dropped; the ranks agree in finish()
            failed = cls(watch, step, None, image=image, angle_work=[], on_error=on_error, notes=[])
            failed.error = err
            on_error(StepFailed(err, "measuring weights"))
            return failed

    @classmethod
    def _read(
        cls,
        watch: ModelWatch,
        step: int,
        *,
        image: bool,
        on_error: ErrorHandler,
        angles: bool | None,
        progress: Progress | None,
    ) -> MeasuredStep:
        with no_autocast():
            layers, notes = watch.revalidate()
            work: list[AngleWork] = []
            updates = watch.updates
            report = compute_report(
                layers,
                projections=watch.config.projections,
                weighting=watch.config.weighting,
                fsdp_root=watch.fsdp_root,
                sharded=watch.sharded,
                skipped=watch.skipped,
                progress=progress,
                angles=work if (image if angles is None else angles) else False,
                tap=updates.tap(layers) if updates is not None else None,
            )
            if updates is not None:
                entropy = updates.finish()
                report = dataclasses.replace(
                    report,
                    layers=[dataclasses.replace(la, update_entropy=entropy.get(la.name)) for la in report.layers],
                )
        return cls(watch, step, report, image=image, angle_work=work, on_error=on_error, notes=notes)

    def _start_kernel(self) -> None:
        """The kernel-statistics capture of this step: one accumulator per watched layer, in layer
        order on every rank (the sync visits them in this order), drawing the query subsample from
        the watch's generator. Layers it cannot measure are noted with the reason."""
        watch, off = self.watch, self.kernel_off
        layers, units = watch.layers, watch.units
        for la in layers:
            if getattr(la, "tensor_parallel", None) is not None:
                off[la.name] = "kernel statistics are not taken under tensor parallelism yet"
            elif any(not u.interceptable and u.contains(la.name) for u in units):
                off[la.name] = "the model was compiled whole by Lightning (no eager call to intercept)"
            elif units and not any(u.contains(la.name) for u in units):
                off[la.name] = (
                    "part of the model is compiled and this layer lies outside the compiled parts: wrapping the "
                    "attention functions for its forward would change the compiled graph's guards"
                )
        max_tokens = watch.config.max_tokens
        # every layer has an accumulator (the sync is the same on every rank); only the others are watched
        accs = [KernelStatsAccumulator(la.num_heads, max_tokens=max_tokens, generator=watch.generator) for la in layers]
        watched = [la for la in layers if la.name not in off]
        capture = KernelStatsCapture(
            watched, max_tokens=max_tokens, generator=watch.generator, on_error=self._failed, signal=self.signal
        )
        capture.accumulators.update({la.name: acc for la, acc in zip(layers, accs, strict=True) if la.name not in off})
        self.kernel, self.kernel_accumulators = capture, accs

    # ------------------------------------------------------------------ capture
    def attach(self, batch: Any) -> None:
        """Hooks for one forward pass (a further micro-batch of the step calls it again): plain
        hooks on the layers outside compiled parts; for each compiled part, an eager interception
        that runs a side forward with its layers' hooks on (see `hdi_monitor.measure.compiled`).
        Nothing once a hook was traced by Dynamo, at this step or an earlier one (`blind`)."""
        if self._traced or self.watch.compiled_outside:
            self.blind = True
            return
        self._attach(batch)

    def _attach(self, batch: Any) -> None:
        kernel = self.kernel
        if self.dropped or not (self.watch.activations or kernel is not None):
            return
        self.stop_capture()
        self._hooked = True
        layers, units, accs, counts = self.watch.layers, self.watch.units, self.accumulators, self.counts
        # the compiled unit (index into units) each layer lies in, or None
        unit_of = [next((k for k, u in enumerate(units) if u.contains(la.name)), None) for la in layers]
        plain = [i for i, k in enumerate(unit_of) if k is None]
        # the kernel capture is never put around a compiled call
        watched = kernel if not units and len(self.kernel_off) < len(layers) else None
        if plain:
            self._handles += attach_capture(
                [layers[i] for i in plain],
                [accs[i] for i in plain],
                batch,
                kernel=watched,
                on_error=self._failed,
                counts=counts,
                signal=self.signal,
            )
        for k in dict.fromkeys(u for u in unit_of if u is not None):
            members = [i for i, u in enumerate(unit_of) if u == k]
            # the side forward is eager: the kernel capture is safe there
            attach = partial(
                attach_capture,
                [layers[i] for i in members],
                [accs[i] for i in members],
                kernel=kernel,
                on_error=self._failed,
                counts=counts,
                signal=self.signal,
            )
            on_call = partial(capture_side_forward, units[k], attach, batch, self._failed, dropped=self._is_dropped)
            self._handles += [intercept(units[k], on_call, self.signal)]

    def run(self, inputs: Any, progress: Progress | None = None, *, call: nn.Module | None = None) -> int:
        """Run ``inputs`` (a batch or an iterable of batches, see
        `hdi_monitor.models.hooks.iter_batches`) through the model for this step: eagerly (a
        compiled root's original module), in eval mode (each module's flag restored after), under
        no_grad, the capture attached for each batch. Returns the number of batches; ``progress``
        is called with 1 after each; ``call``: the module to pass them to instead (a submodule that
        holds the watched layers)."""
        model = call if call is not None else self.watch.eager_model()
        seen = 0
        with torch.no_grad(), eval_mode(model):
            try:
                for batch in iter_batches(inputs):
                    self._attach(batch)  # an eager pass: hooked even where the training forward is not
                    call_model(model, batch)
                    seen += 1
                    if progress is not None:
                        progress(1)
            finally:
                self.stop_capture()
        return seen

    def _is_dropped(self) -> bool:
        return self.dropped

    def _any_layer_ran(self) -> bool:
        """Some watched layer ran while the capture was on (its module's call was counted, or the
        kernel capture saw its forward)."""
        if self.watch.activations and (
            any(self.counts.module_calls.values()) or any(self.counts.output_calls.values())
        ):
            return True
        kernel = self.kernel
        if kernel is None:
            return False
        if not kernel.accumulators:
            return True  # no layer's kernel is watched: nothing to tell from
        reasons = dict(kernel.unreachable)
        return any(reasons.get(name) != NOT_RUN for name in kernel.accumulators)

    def _on_traced(self) -> bool:
        """Dynamo is tracing a hook of this step (called at trace time, see `TraceSignal`): the model
        runs inside a torch.compile region the monitor was not given. Take every hook off now, so
        that Dynamo, tracing again, sees the model without them; the step has no activation or
        kernel statistics (what some hooks saw eagerly before would be partial), and the training
        forward is not hooked from now on. True the first time (Dynamo restarts its trace)."""
        if self._traced:
            return False  # the hook is itself the frame compiled: let it compile into a no-op
        self._traced = self.blind = True
        self.watch.compiled_outside = True
        self.stop_capture()
        return True

    def _failed(self, err: Exception) -> None:
        """A hook raised inside the forward pass: drop this step (every rank then agrees to drop
        it in `finish`) and let the forward pass go on; the hooks stay attached until
        `stop_capture` (removing them inside a hook would change the dict being iterated)."""
        if self.dropped:
            return  # already dropped (and reported) by an earlier hook of this forward pass
        self.dropped = True
        self._on_error(err)

    def stop_capture(self) -> None:
        """Remove every hook (idempotent). Call before backward so recomputed forwards are not counted."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    # ------------------------------------------------------------------ finish
    def finish(self) -> Measurement:
        """Run the collectives and return the step's record.

        Phase 1 runs every collective (the data-parallel sums) in the same order on every rank; a
        local failure is recorded, not raised, so the ranks stay in step. Then the ranks agree, and
        the record is made only if all of them succeeded.

        Raises:
            StepFailed: this rank or another one failed (every rank raises it; ``error`` is this
                rank's own exception not handed out yet, None when it was, or when another rank failed).
        """
        self.stop_capture()
        if not self.watch.agree(not self.dropped) or self.report is None:
            raise StepFailed(None, "measuring")  # a rank dropped it: every rank does, so none waits
        self._nothing_ran = self._hooked and not self.blind and not self._any_layer_ran()
        errors: list[Exception] = []
        with no_autocast():
            outputs = self._gather_outputs(errors) if self.watch.activations else None
            kernel = self._gather_kernel(errors) if self.kernel is not None else None
        if not self.watch.agree(not errors):
            raise StepFailed(errors[0] if errors else None, "computing the measurement")
        layers = list(self.report.layers)
        counts: dict[str, int] = {}
        if outputs is not None:
            counts = {la.name: n for la, (n, _) in zip(layers, outputs, strict=True) if n is not None}
            layers = [
                la if res is None else _with_outputs(la, res) for la, (_, res) in zip(layers, outputs, strict=True)
            ]
        if kernel is not None:
            layers = [la if res is None else _with_kernel(la, res) for la, res in zip(layers, kernel, strict=True)]
        if self.forward_expected and self.watch.activations and not self.blind:
            # each layer's calls this step: the next measured step shares max_tokens between them
            self.watch.calls = {n: c for n, c in self.counts.output_calls.items() if c > 0}
        kernel_stats = self.kernel is not None
        if self.blind and self.forward_expected and self.watch.once("compiled outside", ""):
            self.notes.append(compiled_outside_message(self.step, kernel_stats))
        if self._nothing_ran and self.forward_expected and self.watch.once("never fired", ""):
            what = " or ".join(
                ["activation statistics"] * self.watch.activations + ["kernel statistics"] * kernel_stats
            )
            self.notes.append(never_fired_message(self.step, what))
        return Measurement(
            step=self.step,
            report=dataclasses.replace(self.report, layers=layers),
            image_step=self.image,
            activations=self.watch.activations and not self.blind,  # a blind step measured no head output
            notes=tuple(self.notes),
            token_counts=counts,
            calls=dict(self.watch.calls),
            angle_work=tuple(self._angle_work),
        )

    def _gather_outputs(self, errors: list[Exception]) -> list[tuple[int | None, Any]]:
        """Head-output statistics: the accumulators summed over the data-parallel ranks (the
        layer check, then one packed collective), then every layer's results with one
        device-to-host transfer; ``(tokens, result)`` per layer (None where not measured)."""
        layers = self.watch.layers
        accs = [acc for acc in self.accumulators if acc is not None]
        reduce, group = self.watch.data_parallel
        if reduce:
            check_same_layers(layers, group)
            sync_accumulators(accs, group)  # collective: every rank, every layer, in order
        if self.blind:  # the training forward was not hooked: nothing measured, nothing partial
            return [(None, None)] * len(self.accumulators)
        results: list[Any] = [None] * len(accs)
        try:
            results = compute_results(accs, min_tokens=2)  # caches every token count on the host
        except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
            errors.append(err)
        found = iter(zip(accs, results, strict=True))
        out: list[tuple[int | None, Any]] = []
        for acc in self.accumulators:
            if acc is None:
                out.append((None, None))
            else:
                done, result = next(found)
                out.append((done.num_tokens, result))
        if self.forward_expected:
            self._output_notes([n for n, _ in out])
        return out

    def _output_notes(self, tokens: list[int | None]) -> None:
        """No hook fired at all while the capture was on (said once), an output projection whose
        hook never fired (``F.linear`` on its weight) or a layer with fewer than 2 real tokens: said
        once per layer."""
        watch, calls = self.watch, self.counts.output_calls
        if self._nothing_ran:
            return  # said once in finish
        for name in self.counts.silent_layers():
            if watch.once("silent hook", name):
                module = next((type(la.output_module).__name__ for la in watch.layers if la.name == name), "")
                self.notes.append(
                    f"{name}: the attention module ran but its head-output hook on {module or 'its output module'} "
                    "never fired, so this layer has no activation statistics (0 tokens). Its forward calls the output "
                    f"projection's weight directly (e.g. F.linear(x, self.out_proj.weight)) instead of calling "
                    f"{module or 'it'}, or does not call it at all. Call the submodule (self.out_proj(x)), or point "
                    "AttentionSpec(output_module=...) at a submodule that receives the concatenated head outputs; "
                    "activations=False turns activation statistics off. (Said once per layer.)"
                )
        for la, n in zip(watch.layers, tokens, strict=True):
            if n is not None and n < 2 and calls.get(la.name, 0) > 0 and watch.once("few tokens", la.name):
                self.notes.append(
                    f"{la.name}: only {n} real token(s) in this measured step (at least 2 are needed for a "
                    "covariance), so it has no activation statistics this step; check the batch's token mask (all "
                    "padding?) or measure on longer inputs. (Said once per layer.)"
                )

    def _gather_kernel(self, errors: list[Exception]) -> list[Any] | None:
        """Kernel statistics: the per-layer accumulators summed over the data-parallel ranks (the
        same group and layer order as the head-output sums, right after them), then one host
        transfer for every layer; layers not measured get None and a note (once per layer)."""
        layers, accs, capture = self.watch.layers, self.kernel_accumulators, self.kernel
        assert capture is not None
        reduce, group = self.watch.data_parallel
        if reduce:
            sync_accumulators(accs, group)  # collective: every rank, every layer, in order
        if not self.forward_expected or self.blind:
            return None  # no forward pass ran, or it was not hooked (said once in finish)
        try:
            results = compute_kernel_results(accs)
        except Exception as err:  # noqa: BLE001 - recorded; the ranks agree in finish()
            errors.append(err)
            return None
        off = dict(capture.unreachable)
        if self._nothing_ran:  # said once in finish, not once per layer
            off = {name: why for name, why in off.items() if why != NOT_RUN}
        off.update(self.kernel_off)
        for name, why in off.items():
            if self.watch.once("kernel", name):
                self.notes.append(f"{name}: kernel statistics not measured ({why}); said once per layer")
        # never partial: a layer with a refused call reports nothing
        return [None if la.name in off else res for la, res in zip(layers, results, strict=True)]


#: Record field -> result field, for the head-output and the kernel statistics of a step.
_OUTPUT_FIELDS = {
    "covariance": "covariance",
    "correlation": "correlation",
    "effective_heads": "effective_heads",
    "mean_correlation": "mean_correlation",
    "variance_ratio": "variance_ratio",
    "num_tokens": "num_tokens",
}
_KERNEL_FIELDS = {
    "attention_entropy": "entropy",
    "attention_entropy_uniform": "uniform_entropy",
    "max_attention_logit": "max_logit",
    "kernel_queries": "num_queries",
}


def _with_outputs(layer: LayerDiversity, result: Any) -> LayerDiversity:
    """A new record of ``layer`` with one step's head-output statistics."""
    return dataclasses.replace(
        layer,
        **{f: getattr(result, r) for f, r in _OUTPUT_FIELDS.items()},
        invalid_heads={**layer.invalid_heads, ACTIVATIONS: list(result.invalid_heads)},
        nonfinite_heads=tuple(result.nonfinite_heads),
    )


def _with_kernel(layer: LayerDiversity, result: Any) -> LayerDiversity:
    """A new record of ``layer`` with one step's kernel statistics."""
    return dataclasses.replace(layer, **{f: getattr(result, r) for f, r in _KERNEL_FIELDS.items()})
