"""The route of one measurement on the training thread: which package files it visits, call by call.

A Lightning fit of the demo model with ``HDIMonitor(every_n_steps=1, log_images_every_n_steps=1)``
on 3 steps; ``sys.setprofile`` on the training thread records every call into an ``hdi_monitor``
file during step 1 (from the callbacks' ``on_train_batch_start`` to ``on_train_batch_end``: the
weight read, the capture, the collectives, the publisher, the scalar writes and the queueing of the
pictures; drawing happens on the worker thread, not counted). It prints:

* every package file visited with its number of calls (the user's model file left out);
* the measurement's route: the files of the calls that are handed the step's record (a
  `Measurement`, its `DiversityReport` or a `LayerDiversity` among their arguments), apart from the
  computations that make or read the values (the weight read, the capture, the math, the argument
  checks);
* the calls from ``monitor/tracker.py`` into another package file (how the measurement leaves the
  tracker).

Run: ``python benchmarks/route.py [--out benchmarks/results/route.md]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import warnings
from pathlib import Path


def trace() -> list[tuple[str, str]]:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    import hdi_monitor
    from hdi_monitor import HDIMonitor
    from hdi_monitor.contrib.demo import CharDataModule, CharLM
    from hdi_monitor.measure.measurement import Measurement
    from hdi_monitor.report import DiversityReport, LayerDiversity

    root = os.path.dirname(hdi_monitor.__file__)
    calls: list[tuple[str, str, str, bool]] = []  # (file, function, calling file, handed the record)
    active = {"on": False}
    records = (Measurement, DiversityReport, LayerDiversity)

    def profile(frame, event, arg):  # noqa: ANN001
        if event != "call" or not active["on"] or not frame.f_code.co_filename.startswith(root):
            return
        code = frame.f_code
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        handed = any(isinstance(frame.f_locals.get(n), records) for n in names if n != "self")
        where = os.path.relpath(caller, root) if caller.startswith(root) else ""
        calls.append((os.path.relpath(code.co_filename, root), code.co_name, where, handed))

    class Probe(L.Callback):  # listed before the monitor: on at its batch start, off after its batch end
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            active["on"] = trainer.global_step == 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if trainer.global_step >= 2:
                active["on"] = False

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            max_steps=3,
            callbacks=[Probe(), HDIMonitor(every_n_steps=1, log_images_every_n_steps=1)],
            logger=TensorBoardLogger(tmp),
            enable_progress_bar=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            enable_model_summary=False,
        )
        sys.setprofile(profile)
        try:
            trainer.fit(CharLM(d_model=32, num_heads=4, num_layers=2), datamodule=CharDataModule())
        finally:
            sys.setprofile(None)
    return [c for c in calls if not c[0].startswith("contrib/")]  # the demo model is the user's code


def report(calls: list[tuple[str, str, str, bool]]) -> str:
    files = collections.Counter(f for f, _, _, _ in calls)
    route = sorted({f for f, _, _, handed in calls if handed} | {"monitor/tracker.py", "integrations/lightning.py"})
    leaves = sorted(set(files) - set(route))
    exits = [f"{f}:{fn}" for f, fn, caller, _ in calls if caller == "monitor/tracker.py" and f != caller]
    lines = [
        f"One measured image step, Lightning hook to queued pictures: {len(calls)} calls into {len(files)} "
        "package files.",
        "",
        f"The measurement's route ({len(route)} files: the hooks, the tracker, and every file a call hands "
        "the record to): " + ", ".join(route) + ".",
        "",
        f"The computations on the way ({len(leaves)} files: the weight read, the capture, the math, the "
        "argument checks): " + ", ".join(leaves) + ".",
        "",
        f"Calls from monitor/tracker.py into another file ({len(exits)}): " + ", ".join(exits) + ".",
        "",
        "| file | calls |",
        "|---|---:|",
    ]
    lines += [f"| {f} | {n} |" for f, n in files.most_common()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = parser.parse_args(argv)
    text = report(trace())
    print(text)
    if args.out is not None:
        args.out.write_text(f"Measured by `python benchmarks/route.py --out {args.out}`.\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
