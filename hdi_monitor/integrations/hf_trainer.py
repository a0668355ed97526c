"""``HDITrainerCallback``: head-diversity monitoring for the Hugging Face ``transformers.Trainer``.

A thin shell over `HDITracker`, like the Lightning callback. It needs ``transformers``: from a
checkout, ``pip install -e '.[hf]'``.

```python
from hdi_monitor import HDITrainerCallback

args = TrainingArguments("out", report_to="tensorboard", logging_steps=100)
trainer = Trainer(model, args, train_dataset=ds, callbacks=[HDITrainerCallback(every_n_steps=100)])
```

**Step axis.** The Trainer logs the loss of its ``k``-th optimizer update (``k = 1, 2, ...``) at
``state.global_step == k``: the step counter is incremented after ``optimizer.step()`` and before
``on_log``. The callback uses the same axis: the point at step ``k`` reports the weights that
produced update ``k``'s forward passes (measured in ``on_step_begin``, where
``state.global_step == k - 1``) and the head outputs of those forward passes, so every HDI point sits
on the same x as the loss it belongs to. Steps ``k`` with ``k % every_n_steps == 0`` are measured;
with ``every_n_steps == logging_steps`` each HDI point lands on a logged loss point. With
``measure_at_start`` (default) the initial weights are also measured, weights only, at step 0
(``on_train_begin``; the Trainer logs no loss there).

**Gradient accumulation.** Only optimizer updates are counted; the head outputs of every
micro-batch of a measured update are captured. Capture is switched on by a forward pre-hook on the
model and off by a forward hook when the model's forward returns, so a forward recomputed during
backward (gradient checkpointing) is not counted twice, and evaluation passes between updates are
not captured. All hooks come off in ``on_train_end`` (or with `HDITrainerCallback.close`
after a training run that raised).

**torch.compile.** With ``TrainingArguments(torch_compile=True)`` the Trainer (through accelerate)
trains ``torch.compile(model)`` while callbacks get the uncompiled ``model``. No hook is then ever
put inside the compiled region: the callback keeps no hook on the model, finds the compiled wrapper
the Trainer calls (``trainer.model_wrapped``), and on measured updates only a forward pre-hook on
that wrapper (outside the compiled code) runs, before each micro-batch's compiled call, a **side
forward** of the uncompiled ``model`` on the same batch: no grad, eval mode (no dropout), every
random generator restored, with the head-output hooks on only meanwhile
(`hdi_monitor.measure.compiled`). The compiled graph, its guards and the training are those of
the run without the callback (same graph and graph-break counts, bit-identical weights). The cost
is one extra eager forward, without backward, per micro-batch of a measured update; the head
outputs are those of that eval-mode forward (without dropout), which is what `head_diversity`
with ``inputs=`` reports for the same weights and batch. A model compiled before it was handed to
the Trainer (``Trainer(torch.compile(model))``) is treated the same way. If the Trainer compiles
but its wrapper cannot be found, activation statistics are turned off with a `MonitoringWarning`
and the weight-based HDI is still measured.

**Where it writes.** To ``writer`` if given. Otherwise, with ``report_to="tensorboard"``, to the
Trainer's own TensorBoard writer (that of its ``TensorBoardCallback``), so the loss and the HDI are
one run in TensorBoard. Without a TensorBoard callback, to a new ``SummaryWriter`` in ``log_dir``,
which defaults to ``args.logging_dir`` where the installed transformers has it (4.x), else
``$TENSORBOARD_LOGGING_DIR``, else ``<output_dir>/runs/<date>_<host>_hdi``. Only the main process
writes; under ``torch.distributed`` every process measures (activation statistics are summed across
processes).

**Resume.** The callback is a transformers ``ExportableState`` (like ``EarlyStoppingCallback``):
each checkpoint's ``trainer_state.json`` holds its history, events, early-warning detector and
random-generator state, and ``trainer.train(resume_from_checkpoint=...)`` restores them, so the
resumed run measures, warns and subsamples exactly like an uninterrupted one. The restore happens
in ``on_train_begin`` on the callback instance you passed (its settings are kept), whether or not
``TrainingArguments.restore_callback_states_from_checkpoint`` is set. With that flag set the
Trainer rebuilds the callback from the JSON-ready part of its arguments (a configured ``spec``,
``detector`` or a callable ``on_event`` are then lost: leave the flag off to keep them). A
checkpoint never decides where files go: it holds no path, and the rebuilt callback writes where
the one you passed would (its ``writer`` or ``log_dir``); a ``log_dir`` written into
``trainer_state.json``, or any saved attribute other than the monitor's state, is ignored with a
`MonitoringWarning`. A new ``trainer.train()`` without a checkpoint starts afresh.

**Checks.** Every argument is checked in ``__init__``; a model without a recognised attention
layer, or a ``layers`` filter that matches none, raises in ``on_train_begin``, before the first
step.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import socket
import sys
from collections.abc import Mapping
from datetime import datetime
from types import FrameType
from typing import Any

from torch import nn

from hdi_monitor._validation import check_bool
from hdi_monitor.config import DEFAULTS
from hdi_monitor.exceptions import MonitoringWarning
from hdi_monitor.integrations._settings import MonitorSettings
from hdi_monitor.measure.compiled import called_through, compiled_units
from hdi_monitor.monitor._warnings import warn
from hdi_monitor.monitor.tracker import HDITracker

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as _err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "HDITrainerCallback needs the transformers package, which is not installed: from a checkout of "
        "hdi-monitor, pip install -e '.[hf]' (or pip install transformers accelerate)"
    ) from _err

__all__ = ["HDITrainerCallback"]


def _default_log_dir(args: Any) -> str:
    logging_dir = getattr(args, "logging_dir", None)  # TrainingArguments.logging_dir (transformers 4.x)
    if logging_dir:
        return str(logging_dir)
    env = os.getenv("TENSORBOARD_LOGGING_DIR")
    if env:
        return os.path.expanduser(env)
    stamp = datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(str(args.output_dir), "runs", f"{stamp}_{socket.gethostname()}_hdi")


def _trainer_tensorboard_writer(args: Any) -> Any:
    """The ``SummaryWriter`` of the running Trainer's ``TensorBoardCallback`` (``report_to=
    "tensorboard"``), or None when it has none.

    A ``TrainerCallback`` is not given the Trainer; the callback list is found on the caller's
    stack (``CallbackHandler.call_event``, which is calling ``on_train_begin``). The Trainer's
    callbacks run in order and its ``TensorBoardCallback`` comes before user callbacks, so its writer
    exists; if it has none yet, one is made in the directory it would use and handed to it, so both
    callbacks write one event stream."""
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import CallbackHandler

    handler = _caller_self(CallbackHandler, depth=8)  # on_train_begin <- call_event <- handler <- Trainer
    if handler is None:
        return None
    board = next((cb for cb in handler.callbacks if isinstance(cb, TensorBoardCallback)), None)
    if board is None:
        return None
    if board.tb_writer is None:
        from transformers.integrations.integration_utils import default_logdir

        if board.logging_dir is None:
            board.logging_dir = os.path.join(str(args.output_dir), default_logdir())
        board._init_summary_writer(args)
    return board.tb_writer


def _caller_self(cls: type, *, depth: int) -> Any:
    """The ``self`` of the nearest caller (within ``depth`` frames above this function's caller)
    that is a ``cls``: transformers hands callbacks no Trainer, so the integration finds the one
    calling it on the stack."""
    frame: FrameType | None = sys._getframe(2)
    try:
        for _ in range(depth):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, cls):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def _trainer_compiled_wrapper(model: nn.Module) -> nn.Module | None:
    """The ``torch.compile`` wrapper the running Trainer calls ``model`` through
    (``trainer.model_wrapped``, made by accelerate's ``prepare`` under ``torch_compile=True``), or
    None when it calls no compiled wrapper of ``model`` or cannot be found.

    Like `_trainer_tensorboard_writer`, the Trainer is found on the caller's stack (it is calling
    ``on_train_begin`` through its ``CallbackHandler``); a callback is not given it."""
    from torch._dynamo.eval_frame import OptimizedModule
    from transformers import Trainer

    trainer = _caller_self(Trainer, depth=12)  # on_train_begin <- call_event <- handler <- _inner_training_loop
    wrapped = getattr(trainer, "model_wrapped", None)
    if isinstance(wrapped, OptimizedModule) and any(m is model for m in wrapped.modules()):
        return wrapped
    return None


def _replaced_by_restore() -> HDITrainerCallback | None:
    """The callback that transformers' ``Trainer._load_callback_state`` is replacing, when it is
    the caller building a new one from ``trainer_state.json`` (``type(callback)(**saved_args)``,
    under ``restore_callback_states_from_checkpoint``); else None. Found on the caller's stack,
    like `_trainer_tensorboard_writer`: the constructor is not told."""
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(2)
    found = None
    for _ in range(6):  # __init__ <- (a subclass's __init__ ...) <- Trainer._load_callback_state
        if frame is None:
            break
        if frame.f_code.co_name == "_load_callback_state" and isinstance(frame.f_locals.get("self"), Trainer):
            candidate = frame.f_locals.get("callback")
            found = candidate if isinstance(candidate, HDITrainerCallback) else None
            break
        frame = frame.f_back
    del frame
    return found


def _json_ready(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


class HDITrainerCallback(MonitorSettings, TrainerCallback, ExportableState):
    """Measure attention-head diversity every ``every_n_steps`` optimizer updates of a ``Trainer``.

    Updates ``k`` with ``k % every_n_steps == 0`` are measured (``k = state.global_step`` after the
    update, the step the Trainer logs that update's loss at).

    Settings: every argument of `hdi_monitor.integrations._settings.MonitorSettings` (the
    `MonitorConfig` fields, ``detector``, ``activation_detector`` and ``state_key``), named in the
    signature, with the defaults of `hdi_monitor.config.DEFAULTS`. Each ``trainer.train()`` gets
    untouched copies of the detectors. Besides them:

    Args:
        measure_at_start: also measure the initial weights at step 0 (weights only).
        writer: a ``SummaryWriter`` to write to; by default the Trainer's TensorBoard writer.
        log_dir: where to create a ``SummaryWriter`` when ``writer`` is None and the Trainer has
            no TensorBoard callback (see the module doc). Never saved in a checkpoint, and never
            read from one.

    With ``on_event="stop"``, ``control.should_training_stop`` is set at the first event of a
    signal in ``warn_on``. The defaults are those of `MonitorConfig`; a finished one is passed with
    `HDITrainerCallback.from_config`.

    Raises:
        TypeError: a wrong type.
        ValueError: a bad setting.
    """

    def __init__(
        self,
        every_n_steps: int = DEFAULTS.every_n_steps,
        *,
        measure_at_start: bool = True,
        writer: Any = None,
        log_dir: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(every_n_steps, **settings)
        detector, activation_detector = self.detector, self.activation_detector
        check_bool("measure_at_start", measure_at_start)
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir must be a path or None, got {type(log_dir).__name__}")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}")
        if writer is not None and log_dir is not None:
            raise ValueError("give writer or log_dir, not both")
        # what the Trainer's callback restore rebuilds the callback from (the JSON-ready part); no
        # path: a checkpoint never decides where files go
        self._args: dict[str, Any] = {
            **self.config.to_dict(),
            "detector": detector,  # kept when JSON-ready ("default", None), see state()
            "activation_detector": activation_detector,
            "measure_at_start": measure_at_start,
        }
        self.activations = self.config.activations
        self.measure_at_start = measure_at_start
        self._ignored: list[str] = []  # what a checkpoint tried to set and was not taken (said at train begin)
        replaced = _replaced_by_restore()
        if replaced is not None:  # rebuilt by the Trainer from trainer_state.json: write where the user's would
            if log_dir is not None:
                self._ignored.append(f"log_dir={os.fspath(log_dir)!r}")
            writer, log_dir = replaced.writer, replaced.log_dir
        self.writer: Any = writer
        self.log_dir: str | None = None if log_dir is None else os.fspath(log_dir)
        self.tracker: HDITracker | None = None
        self._own_writer: Any = None
        self._root_handles: list[Any] = []
        self._outer: Any = None  # handle of called_through(model, the Trainer's compiled wrapper)
        self._compiled_root = False  # the model's forward runs compiled: no hook on it, side forwards
        self._measuring: int | None = None  # the step whose forward passes are being captured
        self._restored_state: dict[str, Any] | None = None  # from a checkpoint, applied in on_train_begin
        # the Trainer's restore next sets each saved attribute: only the monitor's state is taken
        self.__dict__["_from_checkpoint"] = replaced is not None

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_from_checkpoint") and name != "_restored_state":
            self._ignored.append(name)  # transformers' restore setting a saved attribute other than the state
            return
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ checkpoint state
    def state(self) -> dict[str, Any]:
        """transformers ``ExportableState``: the JSON-ready constructor arguments and the tracker's
        state (history, events, detectors, generator), saved in each checkpoint's ``trainer_state.json``."""
        tracker_state = self.tracker.state_dict() if self.tracker is not None else self._restored_state
        args = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in self._args.items()}
        args = {k: v for k, v in args.items() if _json_ready(v)}
        return {"args": args, "attributes": {"_restored_state": tracker_state}}

    # ------------------------------------------------------------------ results
    def _restored_state_dict(self) -> dict[str, Any]:
        return dict(self._restored_state or {})

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError("HDITrainerCallback: the Trainer passed no model to on_train_begin")
        self.__dict__["_from_checkpoint"] = False  # the restore is over
        if self._ignored:
            warn(
                f"hdi-monitor: the checkpoint's trainer_state.json sets HDITrainerCallback {self._ignored}; a "
                "checkpoint restores the monitor's state only, never where files go or other attributes: ignored",
                MonitoringWarning,
                rank_zero_only=True,
            )
            self._ignored = []
        self.close()  # a second trainer.train() starts clean
        config = self.config
        if not any(unit.path == "" for unit in compiled_units(model)):
            wrapper = _trainer_compiled_wrapper(model)
            if wrapper is not None:  # torch_compile=True: the Trainer calls torch.compile(model)
                self._outer = called_through(model, wrapper)
        # the model's whole forward is compiled (by the Trainer, or before it got the model)
        self._compiled_root = any(unit.path == "" for unit in compiled_units(model))
        if not self._compiled_root and getattr(args, "torch_compile", False) and config.activations:
            config = dataclasses.replace(config, activations=False)
            warn(
                "hdi-monitor: TrainingArguments.torch_compile is set but the Trainer's compiled model was not "
                "found, so head outputs cannot be taken without hooking the compiled graph. Activation "
                "statistics (covariance, effective heads) are off; the weight-based HDI is measured. Pass "
                "activations=False to silence this warning.",
                MonitoringWarning,
                rank_zero_only=True,
            )
        tracker = HDITracker(
            model,
            config,
            detector=copy.deepcopy(self.detector),  # untouched copies: runs never share detector state
            activation_detector=copy.deepcopy(self.activation_detector),
        )
        tracker.setup()  # raises now, before the first step, if the model cannot be watched
        restored = self._checkpoint_state(state)
        if restored is not None:
            tracker.load_state_dict(restored)
        self._restored_state = None
        writer = self.writer
        if writer is None and self.log_dir is None and state.is_world_process_zero:
            writer = _trainer_tensorboard_writer(args)  # one run with the Trainer's loss
        if writer is None and state.is_world_process_zero:
            from torch.utils.tensorboard import SummaryWriter

            self._own_writer = writer = SummaryWriter(log_dir=self.log_dir or _default_log_dir(args))
        if writer is not None and state.is_world_process_zero:
            from hdi_monitor.monitor.sinks import TensorBoardSink

            tracker.sinks.append(TensorBoardSink(writer))
        self.tracker = tracker
        if tracker.activations and not self._compiled_root:
            self._root_handles = [
                model.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
                model.register_forward_hook(self._forward_ends, always_call=True),
            ]
        if self.measure_at_start and state.global_step == 0:
            self.tracker.measure(step=0)  # initial weights; no forward pass has run yet
        self._check_stop(control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is None:
            return
        step = state.global_step + 1  # where the Trainer will log this update's loss
        if self.tracker.begin(step):  # measures the weights; hooks follow the model's forwards
            if self._compiled_root:
                # the tracker's pre-hook on the compiled wrapper (not inside it) stays until finish():
                # a side forward before each micro-batch's compiled call
                return
            self.tracker.stop_capture()
            self._measuring = step if self.activations else None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # backward is done for every micro-batch (W_O was read at capture time): finish here
        self._finish(control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(control)  # no-op unless no optimizer step happened
        max_steps = getattr(state, "max_steps", 0) or 0
        if self.tracker is not None and max_steps and state.global_step >= max_steps:
            # the last step: draw and write its pictures now, while the Trainer's TensorBoard writer is
            # still open (its callback closes it in on_train_end, which may come before ours)
            self.tracker.close()

    def _finish(self, control: Any) -> None:
        if self.tracker is None:
            return
        self._measuring = None
        if self.tracker.finish() is not None:
            self._check_stop(control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and drop an unfinished measurement; close a writer this callback made."""
        self._measuring = None
        handles, self._root_handles = self._root_handles, []
        for handle in handles:
            handle.remove()
        if self.tracker is not None:
            self.tracker.close()
        if self._outer is not None:
            self._outer.remove()
            self._outer = None
        self._compiled_root = False
        if self._own_writer is not None:
            self._own_writer.close()
            self._own_writer = None

    # ------------------------------------------------------------------ internals
    def _checkpoint_state(self, state: Any) -> dict[str, Any] | None:
        """The tracker state to resume from: set by the Trainer's own callback restore, or read from
        the resumed ``trainer_state.json`` (``state.stateful_callbacks``); None for a fresh run."""
        if self._restored_state is not None:
            return self._restored_state
        if not getattr(state, "global_step", 0):
            return None  # not resuming: on_train_begin of a fresh run sees global_step 0
        stored = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        entries = stored if isinstance(stored, list) else [stored] if stored else []
        entries = [e for e in entries if isinstance(e, Mapping) and (e.get("attributes") or {}).get("_restored_state")]
        if not entries:
            return None
        mine = self.state()["args"]
        entry = next((e for e in entries if e.get("args") == mine), entries[0])
        return dict(entry["attributes"]["_restored_state"])

    def _forward_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._measuring is None or self.tracker is None or not module.training:
            return
        batch = kwargs if kwargs else (args[0] if len(args) == 1 and isinstance(args[0], Mapping) else None)
        self.tracker.begin(self._measuring, batch)

    def _forward_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.tracker is not None:
            self.tracker.stop_capture()

    def _check_stop(self, control: Any) -> None:
        if self.config.on_event == "stop" and self.tracker is not None and self.tracker.stop_requested:
            control.should_training_stop = True


def _merged_signature() -> inspect.Signature:
    """The settings of `MonitorSettings` and the callback's own arguments, as one signature (what
    ``help()`` and ``inspect.signature`` show)."""
    own = inspect.signature(HDITrainerCallback.__init__).parameters
    base = inspect.signature(MonitorSettings.__init__).parameters
    extra = [p for name, p in own.items() if name not in ("self", "every_n_steps", "settings")]
    return inspect.Signature([*base.values(), *extra])


HDITrainerCallback.__init__.__signature__ = _merged_signature()  # type: ignore[attr-defined]
