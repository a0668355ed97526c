"""Persistent gloo process groups for the multi-process tests: ``world`` ranks, started once per session.

A fresh group of interpreters per multi-process test paid an interpreter start and the imports of torch,
Lightning and transformers on every rank, each time (most of a launch on 2 cores); the scenarios themselves
take seconds. A `RankPool` starts its ranks once, joins them in one gloo default process group, and then
runs scenarios on request: the same importable function on every rank, found by file path and name, so the
scripts in ``tests/scripts/`` stay runnable on their own.

Each scenario starts from what a fresh rank would hold: the default torch generator reseeded with the seed a
new interpreter starts from, the environment, working directory and warning filters restored after the
previous scenario, Dynamo's caches reset and the Hugging Face / accelerate singletons cleared. The ranks see
the environment a launcher such as torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so Lightning, accelerate and DeepSpeed join the existing group instead of starting
processes of their own. A scenario that raises on any rank, a rank that dies and a call that does not finish
in time fail the test with every rank's output, and the pool is torn down (its group may be out of step);
the next call starts a fresh one. Every rank of a scenario must pass the same collectives, as in any run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any


class ScenarioFailed(AssertionError):
    """A scenario raised on a rank, a rank died, or the scenario did not finish in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_script(path: str | Path):
    """Import the script at ``path`` as the module named by its stem (registered in ``sys.modules``, as
    dataclasses and pickling need), with its folder on ``sys.path`` as when it runs as a script."""
    path = Path(path).resolve()
    name = path.stem
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "") or "").resolve() == path:
        return module
    import importlib.util

    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class RankPool:
    """``world`` processes in one gloo group that run scenario functions on request (see the module docstring).

    ``run(script, function, *args, **kwargs)`` calls ``function(*args, **kwargs)`` of the script at ``script`` on
    every rank at once and returns each rank's return value (rank order); ranks find their own rank with
    ``torch.distributed.get_rank()``. Each rank's output goes to ``log_dir/rank{R}.log``.
    """

    def __init__(self, world: int, log_dir: Path, *, pg_timeout_s: float = 60.0, start_timeout_s: float = 300.0):
        self.world = world
        self.log_dir = Path(log_dir)
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.starts = 0

    # ------------------------------------------------------------------------------------------ lifecycle

    def _logs(self) -> list[Path]:
        return [self.log_dir / f"rank{r}.log" for r in range(self.world)]

    def _start(self) -> None:
        if self._procs:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank, log in enumerate(self._logs()):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, self.world, port, child, str(log), self.pg_timeout_s),
                name=f"gloo-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.starts += 1
        self._collect("start", [0] * self.world, self.start_timeout_s)

    def kill(self) -> None:
        """End every rank at once (a failed or stuck scenario); the next call starts a fresh pool."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Let every rank pass a last barrier and exit; kill what does not within 30 s."""
        if not self._procs:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 30
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    # ------------------------------------------------------------------------------------------- running

    def run(self, script: str | Path, function: str, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        """``function(*args, **kwargs)`` of ``script`` on every rank; each rank's return value, in rank order."""
        self._start()
        marks = [log.stat().st_size if log.exists() else 0 for log in self._logs()]
        for conn in self._conns:
            conn.send((str(script), function, args, kwargs))
        return self._collect(f"{Path(script).name}:{function}{args or ''}", marks, timeout_s)

    def _collect(self, what: str, marks: list[int], timeout_s: float) -> list[Any]:
        """Each rank's reply; on an error, a death or the deadline: kill the pool and fail with the logs."""
        results: list[Any] = [None] * self.world
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout_s
        while pending:
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or proc.sentinel in ready:
                    try:
                        kind, value = conn.recv() if conn.poll() else ("error", None)
                    except (EOFError, OSError):
                        kind, value = "error", None
                    if kind == "error" and value is None:
                        proc.join(5)
                        value = f"rank {r} ended (exit code {proc.exitcode}) without a reply"
                    pending.discard(r)
                    if kind == "ok":
                        results[r] = value
                    else:
                        errors[r] = value
            if errors:  # the other ranks may wait in a collective: give them a moment to fail too
                deadline = min(deadline, time.monotonic() + 5)
        if not errors and not pending:
            return results
        self.kill()
        lines = [f"{what} failed on {self.world} gloo ranks (the pool is restarted for the next scenario)"]
        if pending and not errors:
            lines[0] = f"{what} did not finish in {timeout_s:.0f} s on ranks {sorted(pending)} (deadlock?)"
        for r, message in sorted(errors.items()):
            lines.append(f"--- rank {r}:\n{message}")
        for r, (log, mark) in enumerate(zip(self._logs(), marks, strict=True)):
            if log.exists():
                with open(log, "rb") as f:
                    f.seek(mark)
                    tail = f.read().decode(errors="replace")[-4000:]
                lines.append(f"--- rank {r} output:\n{tail}")
        raise ScenarioFailed("\n".join(lines))


# -------------------------------------------------------------------------------------------- the ranks


def _serve(rank: int, world: int, port: int, conn: Connection, log_path: str, pg_timeout_s: float) -> None:
    """One rank: join the group, then run each scenario the pool sends until it sends ``None``."""
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - this process's stdout and stderr until it ends
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fresh_seed = torch.initial_seed()  # what the default generator starts from in a new interpreter
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ok", os.getpid()))
    cwd = os.getcwd()
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool's process is gone
            os._exit(1)
        if message is None:
            dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # no gloo teardown: it aborted a rank now and then at destruction (tests/scripts/gloo_exit.py)
        script, function, args, kwargs = message
        print(f"=== {Path(script).name}:{function}{args}", flush=True)
        env = dict(os.environ)
        try:
            torch.manual_seed(fresh_seed)
            with warnings.catch_warnings():
                result = getattr(load_script(script), function)(*args, **kwargs)
            dist.barrier()  # every rank is done with the scenario's collectives before any reply
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        _reset(env, cwd)
        conn.send(("ok", result))


def _reset(env: dict[str, str], cwd: str) -> None:
    """Undo what a scenario leaves in the process that a fresh rank would not have."""
    import gc

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.reset()
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    gc.collect()
