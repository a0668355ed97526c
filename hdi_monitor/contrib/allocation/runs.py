"""A sweep read from the TensorBoard records of runs trained with the monitor (``allocate --runs``).

Each run folder holds the event files of one training run that `HDITracker` (or the Lightning /
Hugging Face callbacks) wrote to. From them:

* the split ``(H, d_k)``: the table of watched attention layers in the monitor's ``hdi_levels``
  text (`hdi_monitor.monitor._dashboard.SHAPES_HEADER`), written once per run; every layer must have
  the same split;
* the held-out loss: the last value (highest step) of the scalar tag the user names (``--metric``);
* ``N``: given (``tokens``), or the run's hyperparameter ``tokens_key`` from Lightning's
  ``hparams.yaml`` or TensorBoard's hparams plugin;
* the measured head correlation: the last ``head_correlation/mean`` scalar, where it was logged;
* for the record, the last ``hdi/key/mean`` and ``effective_heads/mean``.

Every problem is a `SweepError` (a ``ValueError``) with a one-line message naming the run.
TensorBoard (``tensorboard``) is imported only here, when runs are read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdi_monitor.contrib.allocation.sweep import AllocationRun
from hdi_monitor.monitor._dashboard import SHAPES_HEADER as _SHAPES_HEADER

__all__ = ["LoggedRun", "SweepError", "check_sweep", "find_run_dirs", "read_logged_run", "read_logged_sweep"]


class SweepError(ValueError):
    """Runs that cannot be read, or that do not form a sweep; the message is one line."""


@dataclass(frozen=True)
class LoggedRun:
    """One run read from its event files: its split, ``N``, the metric's final value and what the
    monitor measured at its last measured step (None where not logged)."""

    path: str
    num_heads: int
    head_dim: int
    n_train: float
    loss: float
    metric_step: int
    correlation: float | None = None
    key_hdi: float | None = None
    effective_heads: float | None = None

    @property
    def total_dim(self) -> int:
        """``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    def to_allocation_run(self, *, use_correlation: bool = True) -> AllocationRun:
        """The `AllocationRun` the law is fitted to (with the measured correlation if asked)."""
        corr = self.correlation if use_correlation else None
        return AllocationRun(self.num_heads, self.head_dim, self.n_train, self.loss, corr)


def _has_events(path: Path) -> bool:
    return any(p.is_file() and "tfevents" in p.name for p in path.iterdir())


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """The run folders named: a folder with event files is a run; one without them stands for its
    subfolders that have some (e.g. a sweep root holding one folder per run)."""
    out: list[Path] = []
    for value in paths:
        p = Path(value)
        if not p.is_dir():
            raise SweepError(f"--runs {str(value)!r} is not a folder")
        if _has_events(p):
            out.append(p)
            continue
        subs = sorted(q for q in p.rglob("*") if q.is_dir() and _has_events(q))
        if not subs:
            raise SweepError(f"--runs {str(value)!r} holds no TensorBoard event files (events.out.tfevents.*)")
        out.extend(subs)
    if len({str(p.resolve()) for p in out}) != len(out):
        raise SweepError("the same run folder is named twice in --runs")
    return out


def _accumulator(path: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 1, "histograms": 1})
    acc.Reload()
    return acc


def _last_scalar(acc: Any, tag: str) -> tuple[int, float] | None:
    if tag not in acc.Tags().get("scalars", []):
        return None
    events = acc.Scalars(tag)
    if not events:
        return None
    last = max(events, key=lambda e: (e.step, e.wall_time))
    return int(last.step), float(last.value)


def _split(acc: Any, where: str) -> tuple[int, int]:
    tag = "hdi_levels/text_summary"
    if tag not in acc.Tags().get("tensors", []):
        raise SweepError(
            f"{where}: no 'hdi_levels' text: the run was not logged by hdi-monitor's TensorBoard sink (or no step "
            "was measured), so its split (H, d_k) is unknown"
        )
    splits: set[tuple[int, int]] = set()
    for event in acc.Tensors(tag):
        text = event.tensor_proto.string_val[0].decode("utf-8", "replace")
        lines = text.splitlines()
        if _SHAPES_HEADER not in lines:
            raise SweepError(
                f"{where}: the 'hdi_levels' text has no table of layer shapes (written by hdi-monitor before "
                "this version); the split (H, d_k) is unknown"
            )
        for line in lines[lines.index(_SHAPES_HEADER) + 2 :]:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 5 or not line.startswith("|"):
                break
            try:
                splits.add((int(cells[1]), int(cells[3])))
            except ValueError:
                raise SweepError(f"{where}: unreadable row {line!r} in the table of layer shapes") from None
    if not splits:
        raise SweepError(f"{where}: the table of layer shapes in 'hdi_levels' lists no layer")
    if len(splits) > 1:
        shown = ", ".join(f"H={h} x d_k={d}" for h, d in sorted(splits))
        raise SweepError(f"{where}: its attention layers have different splits ({shown}); the law needs one per run")
    return next(iter(splits))


def _hparams(acc: Any, path: Path) -> dict[str, Any]:
    """Lightning's ``hparams.yaml`` beside the event files, else TensorBoard's hparams plugin."""
    out: dict[str, Any] = {}
    yml = path / "hparams.yaml"
    if yml.is_file():
        import yaml

        try:
            loaded = yaml.safe_load(yml.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SweepError(f"{path}: hparams.yaml is not valid YAML ({type(err).__name__})") from None
        if isinstance(loaded, dict):
            out.update({str(k): v for k, v in loaded.items()})
    if not out:
        try:
            content = acc.PluginTagToContent("hparams")
        except KeyError:
            content = {}
        from tensorboard.plugins.hparams import plugin_data_pb2

        for raw in content.values():
            data = plugin_data_pb2.HParamsPluginData.FromString(raw)
            if data.HasField("session_start_info"):
                for k, v in data.session_start_info.hparams.items():
                    kind = v.WhichOneof("kind")
                    out[k] = getattr(v, kind) if kind else None
    return out


def read_logged_run(
    path: str | Path, metric: str, *, tokens: float | None = None, tokens_key: str = "train_tokens"
) -> LoggedRun:
    """Read one run folder (see the module docstring). ``tokens`` wins over the run's hyperparameter."""
    p = Path(path)
    where = f"run {str(p)!r}"
    acc = _accumulator(p)
    found = _last_scalar(acc, metric)
    if found is None:
        tags = sorted(t for t in acc.Tags().get("scalars", []) if "/" not in t or "loss" in t)
        shown = ", ".join(tags[:12]) + (" ..." if len(tags) > 12 else "")
        raise SweepError(f"{where}: no scalar {metric!r} (--metric); its scalars include: {shown or 'none'}")
    step, loss = found
    if not (math.isfinite(loss) and loss > 0):
        raise SweepError(f"{where}: the last {metric!r} (step {step}) is {loss}; the law needs a finite loss > 0")
    num_heads, head_dim = _split(acc, where)
    if tokens is None:
        hp = _hparams(acc, p)
        value = hp.get(tokens_key)
        if value is None:
            raise SweepError(
                f"{where}: N unknown: pass --tokens N, or log the hyperparameter {tokens_key!r} (--tokens-key)"
            )
        try:
            tokens = float(value)
        except (TypeError, ValueError):
            raise SweepError(f"{where}: hyperparameter {tokens_key!r} is {value!r}, not a number") from None
    if not (math.isfinite(tokens) and tokens >= 1):
        raise SweepError(f"{where}: N = {tokens}; it must be a finite number >= 1")

    def last(tag: str) -> float | None:
        got = _last_scalar(acc, tag)
        return None if got is None or not math.isfinite(got[1]) else got[1]

    corr = last("head_correlation/mean")
    if corr is not None and num_heads > 1 and corr + (1 - corr) / num_heads <= 0:
        corr = None  # not a valid ensemble factor: leave rho to the fit
    return LoggedRun(
        path=str(p),
        num_heads=num_heads,
        head_dim=head_dim,
        n_train=float(tokens),
        loss=loss,
        metric_step=step,
        correlation=None if num_heads == 1 else corr,
        key_hdi=last("hdi/key/mean"),
        effective_heads=last("effective_heads/mean"),
    )


def check_sweep(runs: Sequence[LoggedRun]) -> None:
    """Refuse runs that do not form a sweep: one split only, or one head width only."""
    splits = {(r.num_heads, r.head_dim) for r in runs}
    if len(splits) == 1:
        h, d = next(iter(splits))
        raise SweepError(
            f"all {len(runs)} runs have the same split H={h} x d_k={d}: not a sweep; the law needs runs at"
            " two or more splits (H, d_k) of a width"
        )
    widths = {r.head_dim for r in runs}
    if len(widths) == 1:
        raise SweepError(
            f"every run has head width d_k={next(iter(widths))} (only H differs): the law's head-width terms"
            " need runs at two or more head widths d_k"
        )


def read_logged_sweep(
    paths: Sequence[str | Path], metric: str, *, tokens: float | None = None, tokens_key: str = "train_tokens"
) -> list[LoggedRun]:
    """Read every run folder (`find_run_dirs`), then `check_sweep`."""
    runs = [read_logged_run(p, metric, tokens=tokens, tokens_key=tokens_key) for p in find_run_dirs(paths)]
    check_sweep(runs)
    return runs
