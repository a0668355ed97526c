"""What the early warnings are worth on real training runs.

Small causal byte-level language models are trained on real English text (the docstrings of the
Python standard library, which ship with Python, or ``--corpus FILE``) on the CPU, in six
configurations, several seeds each, with the monitor's `HDITracker` measuring every few steps, its
default detectors turned on and the kernel statistics (``kernel_stats=True``: entropy collapse and
logit blow-up events) measured. Beside every measurement the held-out loss is computed on fixed
held-out batches (documents never seen in training). The script then asks of every event kind:

* how often it fired;
* its **precision**: the fraction of its events followed, within ``--window`` measurements, by the
  outcome it suggests: a held-out **plateau** after a saturation event (the held-out loss improves
  by less than ``PLATEAU_REL`` over the following window), a held-out **spike** (the loss rises
  ``SPIKE_REL`` above its best so far) or divergence (non-finite loss) after a collapse event;
* two baselines: a detector that fires at random measured steps after warmup as often (the
  outcome's frequency over every measured step it could have fired at, weighted by each run's
  number of scored events), and a **time-matched** one (the outcome rate at the same measured
  steps in the other seeds of the same configuration: what knowing only when in training to fire
  gets);
* the **median lead** in steps from the event to the outcome, and the **recall**: the fraction of
  outcomes (plateau or spike onsets) that an event of the kind preceded within the window;
* for the spike kinds, which fire once per series, the same **by run**: of the runs in which the
  kind fired, the fraction that spiked after its first event, against the fraction of all runs that
  spiked after warmup; the runs that never spiked among those flagged; the runs flagged before any
  spike;
* for redundancy events: the held-out loss increase when the flagged heads (the second head of each
  redundant pair) are zero-ablated at that step, against the same number of random heads of the
  same layers (``RANDOM_ABLATIONS`` draws of a private generator).

An outcome window that runs past the end of a run is left out of every score (events and baselines
alike).

Configurations (D=64, 2 layers, byte-level, 64-token windows, batch 16; AdamW without weight
decay, ``LR_WARMUP`` steps of linear learning-rate warmup, then constant): (a) ``baseline`` (4
heads, lr 1e-2); (b) ``narrow_heads``: 32 heads of width 2; (c) ``wide_heads``: 2 heads of width
32; (d) ``high_lr``: lr 6e-2 without QK-norm, which trains unstably (held-out spikes; the largest
attention logit grows by orders of magnitude); (e) ``high_lr_qk_norm``: the same with QK-norm (LayerNorm on each
head's queries and keys), which trains smoothly; (f) ``shuffled``: the baseline on shuffled bytes
(the same bytes, no structure).

The runs use the detectors with the defaults from before this study (``RUN_HDI``, ``RUN_KERNEL``,
pinned here), with ``warmup_steps`` scaled to ``WARMUP_MEASUREMENTS`` measurements (the old
``warmup_steps=1000`` is ten measurements at one per 100 steps). Every detector setting is then
replayed offline over the recorded series (each layer and the model mean, fed to a fresh
`SaturationDetector` or `KernelDetector` exactly as the tracker fed them; ``replay_check`` in the
results says the replay with the used settings gives exactly the live events) and scored the same
way: ``patience`` x ``min_delta`` x warmup for saturation, ``collapse_delta`` x warmup for HDI
collapse, ``entropy_fraction`` and ``logit_threshold`` x ``logit_growth`` at ``KERNEL_WARMUPS``
for the kernel events. ``chosen`` names, per event kind, the setting with the largest lift of
precision over its baseline if it exceeds ``MIN_LIFT`` (None otherwise; see `choose`).

Runs are trained ``--jobs`` at a time (default 2), one CPU thread each; the results do not depend
on ``--jobs``.

Run: ``python benchmarks/warnings_study.py --seeds 0 1 2 3 4 --out benchmarks/results --docs
docs/early-warnings.md --readme README.md`` (``--quick``: one seed, few steps, under two minutes).
Writes ``warnings_study.json`` (the scores), ``warnings_study_runs.json.gz`` (every run's recorded
series, which ``--rescore`` scores again without training), ``warnings_study.md`` and
``warnings_study.png`` into ``--out``; with
``--docs PAGE`` replaces the generated block of that page (between its ``<!-- warnings-study:begin
-->`` and ``<!-- warnings-study:end -->`` lines) with the tables and the plot (copied to ``img/``
beside the page), and with ``--readme FILE`` the same block of that file with the event and settings
tables.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.ablation import ablate_heads
from hdi_monitor.monitor.detector import SaturationDetector
from hdi_monitor.monitor.kernel_detector import KernelDetector
from hdi_monitor.monitor.tracker import HDITracker
from hdi_monitor.report import Projection

#: Modules whose docstrings make the default corpus (they ship with every Python).
MODULES = (
    "argparse", "asyncio", "calendar", "collections", "configparser", "csv", "datetime", "decimal",
    "difflib", "email.message", "fractions", "functools", "gettext", "gzip", "heapq", "http.client",
    "inspect", "ipaddress", "json", "logging", "mailbox", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "tokenize", "typing", "unittest", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip
PLATEAU_REL = 0.01  # a held-out improvement of less than 1% over the window is a plateau
SPIKE_REL = 0.10  # a held-out loss 10% above its best so far is a spike
RANDOM_ABLATIONS = 5
SERIES_FILE = "warnings_study_runs.json.gz"
LR_WARMUP = 100  # steps of linear learning-rate warmup, then constant (AdamW, no weight decay)
WARMUP_MEASUREMENTS = 10  # the runs' detector warmup: the old default (1000 steps at one measurement per 100)
#: The detector settings the runs use: the library's defaults before this study set them (0.1's
#: saturation detector, the first kernel-detector guesses), pinned here so that the recorded runs
#: stay reproducible (and `replay_check` true) whatever defaults the library ships.
RUN_HDI: dict[str, Any] = {"patience": 10, "min_delta": 0.002, "collapse_delta": 0.05, "redundancy_threshold": 0.9}
RUN_KERNEL: dict[str, Any] = {
    "entropy_fraction": 0.5,
    "logit_threshold": 50.0,
    "logit_growth": 4.0,
    "patience": 10,
    "min_logit": 10.0,
}
KERNEL_WARMUPS = (10, 20)  # measurements of warmup at which the kernel settings are replayed
MIN_LIFT = 0.02  # a setting is chosen only if its precision beats its baseline by more than this
MIN_SCORED = 10  # saturation settings are chosen only among those with this many scored events
MIN_FLAGGED_RUNS = 3  # ... and a spike kind's setting only among those that flag this many runs
SEQ_LEN = 64
BATCH = 16
EVAL_BATCHES = 8
VOCAB = 128  # ASCII bytes
PROJECTIONS = ("query", "key", "value", "output")
#: Which outcome each event kind suggests.
OUTCOME = {
    "saturation": "plateau",
    "collapse": "spike",
    "entropy_collapse": "spike",
    "logit_blowup": "spike",
    "redundancy": "ablation",
}


@dataclass(frozen=True)
class Config:
    """One training configuration of the study."""

    name: str
    description: str
    dim: int = 64
    heads: int = 4
    layers: int = 2
    lr: float = 1e-2
    qk_norm: bool = False
    shuffled: bool = False


CONFIGS = (
    Config("baseline", "D=64, 2 layers, 4 heads of width 16, lr 1e-2"),
    Config("narrow_heads", "D=64, 32 heads of width 2 (too many narrow heads)", heads=32),
    Config("wide_heads", "D=64, 2 heads of width 32 (too few wide heads)", heads=2),
    Config("high_lr", "baseline at lr 6e-2, no QK-norm (unstable)", lr=6e-2),
    Config("high_lr_qk_norm", "baseline at lr 6e-2 with QK-norm", lr=6e-2, qk_norm=True),
    Config("shuffled", "baseline on shuffled tokens (no structure)", shuffled=True),
)


def _one_thread() -> None:
    torch.set_num_threads(1)  # each worker process trains one run on one core


def log(msg: str) -> None:
    print(f"[warnings-study] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- data
def stdlib_documents() -> list[str]:
    """Distinct ASCII docstrings of `MODULES` and their public members, in a fixed order."""
    seen: set[str] = set()
    docs: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [obj for key, obj in sorted(vars(mod).items()) if not key.startswith("_")]
        for obj in objs:
            members = [obj]
            if inspect.isclass(obj):
                members += [m for key, m in sorted(vars(obj).items()) if not key.startswith("_")]
            for m in members:
                doc = inspect.getdoc(m) if callable(m) or inspect.ismodule(m) else None
                if doc and doc not in seen and doc.isascii() and len(doc) >= 80:
                    seen.add(doc)
                    docs.append(doc)
    return docs


def file_documents(path: Path) -> list[str]:
    """Blank-line separated paragraphs of a text file, ASCII only."""
    text = path.read_text(encoding="utf-8", errors="ignore").encode("ascii", "ignore").decode("ascii")
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80]


def split_tokens(docs: list[str], seed: int) -> tuple[Tensor, Tensor]:
    """Train and held-out byte streams: documents shuffled by a private generator, 10% held out."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(docs), generator=g).tolist()
    cut = max(1, len(docs) // 10)
    held, train = [docs[i] for i in order[:cut]], [docs[i] for i in order[cut:]]

    def encode(parts: list[str]) -> Tensor:
        return torch.tensor(list("\n\n".join(parts).encode("ascii")), dtype=torch.long)

    return encode(train), encode(held)


def windows(stream: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` random windows of ``SEQ_LEN + 1`` bytes."""
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (count,), generator=generator)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])


# --------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections (optional QK-norm)."""

    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (
            rearrange(p(x), "b t (h d) -> b h t d", h=self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.o_proj(rearrange(o, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Byte-level causal transformer with learned positions and a tied read-out."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads, cfg.qk_norm) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: nn.Module, held: Tensor) -> float:
    """Mean loss over the fixed held-out batches (eval mode, restored after)."""
    was = model.training
    model.eval()
    try:
        losses = [lm_loss(model, held[i : i + BATCH]) for i in range(0, len(held), BATCH)]
        return float(torch.stack(losses).mean())
    finally:
        model.train(was)


# ------------------------------------------------------------------------------------ one run
@dataclass
class Run:
    """What one (configuration, seed) run recorded."""

    config: str
    seed: int
    steps: list[int] = field(default_factory=list)  # measured steps
    held_out: list[float] = field(default_factory=list)  # held-out loss at each measured step
    train_loss: list[float] = field(default_factory=list)
    hdi: dict[str, list[float]] = field(default_factory=dict)  # projection -> model-mean HDI series
    #: "<layer>/<projection>" (layer "mean" included) -> HDI series, as the detector was fed them
    hdi_series: dict[str, list[float | None]] = field(default_factory=dict)
    chance_series: dict[str, float] = field(default_factory=dict)  # same keys -> chance level
    #: "<layer>/<statistic>" (entropy, uniform, max_logit) -> series, as the kernel detector was fed them
    kernel: dict[str, list[float | None]] = field(default_factory=dict)
    effective_heads: list[float] = field(default_factory=list)  # mean over layers
    chance: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    ablations: list[dict[str, Any]] = field(default_factory=list)
    diverged_at: int | None = None
    seconds: float = 0.0


def redundancy_ablation(
    model: nn.Module, event: Any, held: Tensor, base: float, layers: dict[str, int], generator: torch.Generator
) -> dict[str, Any] | None:
    """Held-out loss increase when the flagged heads of a redundancy event are ablated, and when
    the same number of random heads of the same layer are."""
    if event.layer not in layers:
        return None
    flagged = sorted({j for _, j, _ in event.pairs})
    if not flagged:
        return None
    with ablate_heads(model, {event.layer: flagged}):
        flagged_loss = held_out_loss(model, held)
    total = layers[event.layer]
    randoms: list[float] = []
    for _ in range(RANDOM_ABLATIONS):
        pick = torch.randperm(total, generator=generator)[: len(flagged)].tolist()
        with ablate_heads(model, {event.layer: pick}):
            randoms.append(held_out_loss(model, held) - base)
    return {
        "step": event.step,
        "layer": event.layer,
        "projection": event.projection,
        "heads": flagged,
        "loss_increase": flagged_loss - base,
        "random_loss_increase": statistics.fmean(randoms),
        "random_draws": randoms,
    }


def train_run(cfg: Config, seed: int, streams: tuple[Tensor, Tensor], *, steps: int, every: int) -> Run:
    """Train one model, measuring every ``every`` steps; returns what was recorded."""
    train, held_stream = streams
    torch.manual_seed(seed)  # the study's own runs: seeding the global generator is the point here
    data_gen = torch.Generator().manual_seed(1000 + seed)
    if cfg.shuffled:
        train = train[torch.randperm(len(train), generator=data_gen)]
        held_stream = held_stream[torch.randperm(len(held_stream), generator=data_gen)]
    held = windows(held_stream, EVAL_BATCHES * BATCH, torch.Generator().manual_seed(7))
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / LR_WARMUP))
    detector = SaturationDetector(warmup_steps=WARMUP_MEASUREMENTS * every, **RUN_HDI)
    tracker = HDITracker(
        model,
        every_n_steps=every,
        log_images_every_n_steps=0,
        max_tokens=512,
        detector=detector,
        activation_detector="default",
        kernel_stats=True,
        kernel_detector=KernelDetector(warmup_steps=WARMUP_MEASUREMENTS * every, **RUN_KERNEL),
        on_saturation=lambda event: None,  # the study collects events; no warnings
        seed=seed,
    )
    heads = {layer.name: layer.num_heads for layer in tracker.setup()}
    ablate_gen = torch.Generator().manual_seed(2000 + seed)
    run = Run(cfg.name, seed)
    start = time.perf_counter()
    for step in range(steps):
        batch = windows(train, BATCH, data_gen)
        with tracker.capture(batch[:, :-1]):
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):
            run.diverged_at = step
            break
        loss.backward()
        measurement = tracker.step()  # before optimizer.step(): the weights of this forward
        if measurement is not None:
            base = held_out_loss(model, held)
            run.steps.append(step)
            run.held_out.append(base)
            run.train_loss.append(float(loss.detach()))
            report = measurement.report
            for projection in PROJECTIONS:
                mean = report.mean_hdi(projection)
                run.hdi.setdefault(projection, []).append(float("nan") if mean is None else mean)
                run.chance[projection] = statistics.fmean(la.chance_hdi[projection] for la in report.layers)
            for la in report.layers:
                for projection in PROJECTIONS:
                    key = f"{la.name}/{projection}"
                    run.hdi_series.setdefault(key, []).append(la.hdi.get(projection))
                    run.chance_series[key] = la.chance_hdi[projection]
                for stat, value in (
                    ("entropy", la.mean_attention_entropy),
                    ("uniform", la.mean_attention_entropy_uniform),
                    ("max_logit", la.max_attention_logit_max),
                ):
                    run.kernel.setdefault(f"{la.name}/{stat}", []).append(value)
            for projection in PROJECTIONS:
                run.hdi_series.setdefault(f"mean/{projection}", []).append(report.mean_hdi(projection))
                run.chance_series[f"mean/{projection}"] = run.chance[projection]
            effs = [la.effective_heads for la in report.layers if la.effective_heads is not None]
            run.effective_heads.append(statistics.fmean(effs) if effs else float("nan"))
            for event in measurement.events:
                run.events.append({"kind": event.kind, "metric": event.metric, "layer": event.layer,
                                   "projection": event.projection, "step": event.step})  # fmt: skip
                if event.kind == "redundancy" and math.isfinite(base):
                    row = redundancy_ablation(model, event, held, base, heads, ablate_gen)
                    if row is not None:
                        run.ablations.append(row)
            if not math.isfinite(base):
                run.diverged_at = step
                break
        opt.step()
        schedule.step()
    tracker.close()
    run.seconds = time.perf_counter() - start
    return run


# ------------------------------------------------------------------------------------ scoring
def spike_onsets(run: Run) -> list[int]:
    """Indices (into ``run.steps``) where the held-out loss first rises ``SPIKE_REL`` above its best
    so far (again after having come back below), or becomes non-finite."""
    onsets, best, inside = [], math.inf, False
    for i, value in enumerate(run.held_out):
        spiking = not math.isfinite(value) or value > (1 + SPIKE_REL) * best
        if spiking and not inside:
            onsets.append(i)
        inside = spiking
        if math.isfinite(value):
            best = min(best, value)
    if run.diverged_at is not None and (not onsets or onsets[-1] != len(run.held_out) - 1):
        onsets.append(len(run.held_out) - 1)  # divergence between two measurements
    return onsets


def plateau_at(run: Run, i: int, window: int) -> bool | None:
    """True if the held-out loss improves by less than ``PLATEAU_REL`` over the ``window``
    measurements after index ``i``; None where the window runs past the end of the run."""
    if i + window >= len(run.held_out):
        return None
    now = run.held_out[i]
    later = [v for v in run.held_out[i + 1 : i + window + 1] if math.isfinite(v)]
    if not math.isfinite(now) or not later:
        return False
    return (now - min(later)) / now < PLATEAU_REL


def outcome_after(run: Run, i: int, outcome: str, window: int) -> tuple[bool | None, int | None]:
    """Whether ``outcome`` follows measurement index ``i`` within ``window`` measurements, and the
    lead in steps (outcome step minus event step) when it does; None when the measurements needed
    to decide run past the end of the run (for both outcomes alike, hit or miss; a divergence ends
    the run and decides)."""
    if outcome == "plateau":
        if i + 2 * window >= len(run.held_out):  # plateau_at(j) looks ``window`` past j <= i + window
            return None, None
        for j in range(i, i + window + 1):
            if plateau_at(run, j, window):
                return True, run.steps[j] - run.steps[i]
        return False, None
    if i + window >= len(run.held_out) and run.diverged_at is None:
        return None, None
    for j in spike_onsets(run):
        if i < j <= i + window:
            return True, run.steps[j] - run.steps[i]
    return False, None


def outcome_onsets(run: Run, outcome: str, window: int) -> list[int]:
    if outcome == "spike":
        return spike_onsets(run)
    onsets, before = [], False
    for i in range(len(run.held_out)):
        state = bool(plateau_at(run, i, window))
        if state and not before:
            onsets.append(i)
        before = state
    return onsets


#: Outcome states per (run's held-out list, outcome, window), shared by the many replays of one scoring.
_STATES: dict[tuple[int, str, int], list[bool | None]] = {}


def outcome_states(run: Run, outcome: str, window: int) -> list[bool | None]:
    """`outcome_after` at every measured index of ``run`` (cached: replayed copies share the list)."""
    key = (id(run.held_out), outcome, window)
    if key not in _STATES:
        _STATES[key] = [outcome_after(run, i, outcome, window)[0] for i in range(len(run.steps))]
    return _STATES[key]


def score(runs: Sequence[Run], kind: str, metric: str, *, window: int, warmup_index: int) -> dict[str, Any]:
    """Fired, precision, baselines, median lead and recall of one event kind and metric (the
    ``mean`` series and every layer pooled; one event per measured step counted: ``fired`` is the
    number of measured steps with an event).

    Two baselines: ``baseline_precision``, a detector firing at random measured steps after warmup
    as often as this one was scored in each run; ``matched_baseline_precision``, the outcome rate at
    the same measured steps in the other seeds of the same configuration (a detector that knows
    only when in training to fire)."""
    outcome = OUTCOME.get(kind, "spike")
    hits = scored = fired = 0
    leads: list[int] = []
    base_num = base_den = matched_num = matched_den = 0.0
    onsets_total = onsets_caught = 0
    for run in runs:
        index = {s: i for i, s in enumerate(run.steps)}
        event_idx = sorted({index[e["step"]] for e in run.events if e["kind"] == kind and e["metric"] == metric})
        fired += len(event_idx)
        states = outcome_states(run, outcome, window)
        scored_here = 0
        for i in event_idx:
            ok = states[i]
            if ok is None:
                continue
            scored_here += 1
            hits += int(ok)
            lead = outcome_after(run, i, outcome, window)[1]
            if ok and lead is not None:
                leads.append(lead)
            others = [
                bool(o[i]) for o in (outcome_states(r, outcome, window) for r in runs
                                     if r.config == run.config and r is not run) if i < len(o) and o[i] is not None
            ]  # fmt: skip
            if others:
                matched_num += sum(others) / len(others)
                matched_den += 1
        scored += scored_here
        eligible = [e for e in states[warmup_index:] if e is not None]
        if eligible and scored_here:
            base_num += scored_here * sum(eligible) / len(eligible)
            base_den += scored_here
        for u in outcome_onsets(run, outcome, window):
            if u < warmup_index:
                continue
            onsets_total += 1
            # a plateau onset at u is a claim about what follows u: an event at u precedes it;
            # a spike onset at u has happened: only earlier events caught it
            last = u if outcome == "plateau" else u - 1
            onsets_caught += int(any(u - window <= i <= last for i in event_idx))
    return {
        "fired": fired,
        "scored": scored,
        "precision": hits / scored if scored else None,
        "baseline_precision": base_num / base_den if base_den else None,
        "matched_baseline_precision": matched_num / matched_den if matched_den else None,
        "median_lead_steps": statistics.median(leads) if leads else None,
        "outcomes": onsets_total,
        "recall": onsets_caught / onsets_total if onsets_total else None,
    }


def run_level(runs: Sequence[Run], kind: str, metric: str, *, warmup_index: int) -> dict[str, Any]:
    """The same events judged per run rather than within a window: does a run in which the kind
    fired go on to spike (a spike onset after the first event), against the fraction of all runs
    that spike after warmup (a detector that flags runs at random), and how far ahead? Also: how
    many of the runs that never spiked it flagged, and how many runs it flagged before any spike."""
    flagged = spiked_after = spiked = caught = healthy_flagged = early = 0
    leads: list[int] = []
    for run in runs:
        index = {s: i for i, s in enumerate(run.steps)}
        events = sorted(index[e["step"]] for e in run.events if e["kind"] == kind and e["metric"] == metric)
        every_onset = spike_onsets(run)
        onsets = [u for u in every_onset if u >= warmup_index]
        spiked += bool(onsets)
        if events:
            flagged += 1
            healthy_flagged += not onsets
            early += bool(onsets) and events[0] < every_onset[0]
            later = [u for u in onsets if u > events[0]]
            if later:
                spiked_after += 1
                leads.append(run.steps[later[0]] - run.steps[events[0]])
        if onsets and events and events[0] < onsets[0]:
            caught += 1
    return {
        "runs": len(runs),
        "runs_flagged": flagged,
        "spiking_runs": spiked,
        "healthy_runs_flagged": healthy_flagged,
        "flagged_before_any_spike": early,
        "precision": spiked_after / flagged if flagged else None,
        "baseline_precision": spiked / len(runs) if runs else None,
        "recall": caught / spiked if spiked else None,
        "median_lead_steps": statistics.median(leads) if leads else None,
    }


def replay_hdi(
    runs: Sequence[Run], *, every: int, warmup: int, patience: int, min_delta: float, collapse_delta: float
) -> list[Run]:
    """The runs' HDI series (every layer and the mean, every projection) fed again to a fresh
    `SaturationDetector` with other settings; the copies hold only the replayed events."""
    replayed = []
    for run in runs:
        det = SaturationDetector(
            patience=patience, min_delta=min_delta, warmup_steps=warmup * every, collapse_delta=collapse_delta
        )
        copy = Run(run.config, run.seed, run.steps, run.held_out, diverged_at=run.diverged_at)
        for i, step in enumerate(run.steps):
            for key, values in run.hdi_series.items():
                layer, projection = key.rsplit("/", 1)
                for event in det.update(
                    step, layer, cast(Projection, projection), values[i], chance=run.chance_series.get(key)
                ):
                    copy.events.append({"kind": event.kind, "metric": "hdi", "layer": layer, "step": step})
        replayed.append(copy)
    return replayed


def replay_kernel(runs: Sequence[Run], *, every: int, warmup: int, **settings: Any) -> list[Run]:
    """The runs' kernel series (each layer's mean entropy, uniform level, largest logit) fed again
    to a fresh `KernelDetector` with other settings."""
    replayed = []
    for run in runs:
        det = KernelDetector(warmup_steps=warmup * every, **{**RUN_KERNEL, **settings})
        copy = Run(run.config, run.seed, run.steps, run.held_out, diverged_at=run.diverged_at)
        layers = sorted({key.rsplit("/", 1)[0] for key in run.kernel})
        for i, step in enumerate(run.steps):
            for layer in layers:
                ent, uni, top = (run.kernel[f"{layer}/{stat}"][i] for stat in ("entropy", "uniform", "max_logit"))
                for event in det.update(step, layer, entropy=ent, uniform=uni, max_logit=top):
                    copy.events.append({"kind": event.kind, "metric": event.metric, "layer": layer, "step": step})
        replayed.append(copy)
    return replayed


def replay_grids(runs: Sequence[Run], *, window: int, every: int, warmup: int) -> dict[str, list[dict[str, Any]]]:
    """Each detector setting replayed offline over the recorded series and scored like the live
    events: saturation over ``patience`` x ``min_delta`` x warmup; HDI collapse over ``collapse_delta`` x
    warmup (in measurements); entropy collapse over ``entropy_fraction``; logit blow-up over
    ``logit_threshold`` x ``logit_growth``."""
    shipped = SimpleNamespace(**RUN_HDI)
    grids: dict[str, list[dict[str, Any]]] = {
        "saturation": [],
        "collapse": [],
        "entropy_collapse": [],
        "logit_blowup": [],
    }
    for patience in (3, 5, 10, 20):
        for min_delta in (0.001, 0.002, 0.005, 0.01):
            for warm in (5, 10, 20):
                replayed = replay_hdi(runs, every=every, warmup=warm, patience=patience, min_delta=min_delta,
                                      collapse_delta=shipped.collapse_delta)  # fmt: skip
                row = score(replayed, "saturation", "hdi", window=window, warmup_index=warm)
                grids["saturation"].append(
                    {"patience": patience, "min_delta": min_delta, "warmup_measurements": warm, **row}
                )
    for collapse_delta in (0.02, 0.05, 0.1, 0.2):
        for warm in (5, 10, 20):
            replayed = replay_hdi(runs, every=every, warmup=warm, patience=shipped.patience,
                                  min_delta=shipped.min_delta, collapse_delta=collapse_delta)  # fmt: skip
            row = score(replayed, "collapse", "hdi", window=window, warmup_index=warm)
            row["run_level"] = run_level(replayed, "collapse", "hdi", warmup_index=warm)
            grids["collapse"].append({"collapse_delta": collapse_delta, "warmup_measurements": warm, **row})
    for warm in KERNEL_WARMUPS:  # the kernel detector takes the HDI detector's warmup: replay both
        for fraction in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7):
            replayed = replay_kernel(runs, every=every, warmup=warm, entropy_fraction=fraction)
            row = score(replayed, "entropy_collapse", "attention_entropy", window=window, warmup_index=warm)
            row["run_level"] = run_level(replayed, "entropy_collapse", "attention_entropy", warmup_index=warm)
            grids["entropy_collapse"].append({"entropy_fraction": fraction, "warmup_measurements": warm, **row})
        for threshold in (20.0, 50.0, 100.0, 200.0, 500.0, 1000.0):
            for growth in (4.0, 10.0, 100.0):
                replayed = replay_kernel(runs, every=every, warmup=warm, logit_threshold=threshold,
                                         logit_growth=growth, min_logit=min(RUN_KERNEL["min_logit"], threshold / 2))  # fmt: skip
                row = score(replayed, "logit_blowup", "max_attention_logit", window=window, warmup_index=warm)
                row["run_level"] = run_level(replayed, "logit_blowup", "max_attention_logit", warmup_index=warm)
                grids["logit_blowup"].append(
                    {"logit_threshold": threshold, "logit_growth": growth, "warmup_measurements": warm, **row}
                )
    return grids


def choose_all(grids: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any] | None]:
    """`choose` per kind. The library has one warmup for every detector, so saturation (the kind
    judged on most events) sets it, and the other kinds are chosen among settings replayed at it."""
    chosen: dict[str, dict[str, Any] | None] = {"saturation": choose(grids["saturation"])}  # sets the warmup
    sat = chosen["saturation"]
    warm = sat["warmup_measurements"] if sat is not None else WARMUP_MEASUREMENTS
    for kind in ("collapse", "entropy_collapse", "logit_blowup"):
        chosen[kind] = choose([r for r in grids[kind] if r["warmup_measurements"] == warm])
    return chosen


def replay_check(runs: Sequence[Run], *, every: int) -> bool:
    """True when replaying the recorded series with the settings the runs used gives exactly the
    HDI saturation/collapse and kernel events the tracker issued (the replays are faithful)."""
    shipped = SimpleNamespace(**RUN_HDI)
    hdi = replay_hdi(runs, every=every, warmup=WARMUP_MEASUREMENTS, patience=shipped.patience,
                     min_delta=shipped.min_delta, collapse_delta=shipped.collapse_delta)  # fmt: skip
    ker = replay_kernel(runs, every=every, warmup=WARMUP_MEASUREMENTS)

    def key(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e["kind"], e["layer"], e["step"])

    for run, a, b in zip(runs, hdi, ker, strict=True):
        live = sorted(key(e) for e in run.events if e["kind"] != "redundancy" and e["metric"] != "effective_heads")
        if live != sorted(key(e) for e in a.events + b.events):
            return False
    return True


def used_settings() -> dict[str, dict[str, float]]:
    """The detector settings the runs used (the library's defaults, warmup in measurements)."""
    sat, ker = SimpleNamespace(**RUN_HDI), SimpleNamespace(**RUN_KERNEL)
    return {
        "saturation": {
            "patience": sat.patience,
            "min_delta": sat.min_delta,
            "warmup_measurements": WARMUP_MEASUREMENTS,
        },
        "collapse": {"collapse_delta": sat.collapse_delta, "warmup_measurements": WARMUP_MEASUREMENTS},
        "entropy_collapse": {"entropy_fraction": ker.entropy_fraction, "warmup_measurements": WARMUP_MEASUREMENTS},
        "logit_blowup": {
            "logit_threshold": ker.logit_threshold,
            "logit_growth": ker.logit_growth,
            "warmup_measurements": WARMUP_MEASUREMENTS,
        },
    }


def choose(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The setting with the largest lift of precision over its baseline, if that lift exceeds
    ``MIN_LIFT``; None otherwise. Saturation (re-armed, many events per run) is judged within the
    window against the stricter of the random and the time-matched baselines, among settings with
    at least ``MIN_SCORED`` scored events; the spike kinds (each fires once per series: the run has
    been told) by run (``run_level``) against flagging runs at random, among settings that flag at
    least ``MIN_FLAGGED_RUNS`` runs. Ties: the setting that flags more (recall, then events)."""

    def lift(r: dict[str, Any]) -> float | None:
        judged = r.get("run_level", r)
        if judged["precision"] is None or judged["baseline_precision"] is None:
            return None
        reference = judged["baseline_precision"]
        if "run_level" not in r and r.get("matched_baseline_precision") is not None:
            reference = max(reference, r["matched_baseline_precision"])
        return float(judged["precision"] - reference)

    def enough(r: dict[str, Any]) -> bool:
        if "run_level" in r:
            return bool(r["run_level"]["runs_flagged"] >= MIN_FLAGGED_RUNS)
        return bool(r["scored"] >= MIN_SCORED)

    ok = [(gain, r) for r in rows if enough(r) and (gain := lift(r)) is not None]
    if not ok:
        return None
    gain, best = max(ok, key=lambda t: (t[0], t[1].get("run_level", t[1])["recall"] or 0.0, t[1]["fired"]))
    return best if gain > MIN_LIFT else None


def ablation_summary(runs: Sequence[Run]) -> dict[str, Any]:
    """Mean and spread over seeds of the per-seed mean loss increase (flagged and random heads)."""
    flagged, random_ = [], []
    for run in runs:
        if run.ablations:
            flagged.append(statistics.fmean(a["loss_increase"] for a in run.ablations))
            random_.append(statistics.fmean(a["random_loss_increase"] for a in run.ablations))

    def spread(xs: list[float]) -> dict[str, float | None]:
        return {
            "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "seeds": len(xs),
        }

    return {"ablation_loss_increase": spread(flagged), "random_ablation_loss_increase": spread(random_)}


def redundancy_precision(runs: Sequence[Run]) -> dict[str, Any]:
    """Precision of redundancy events: the fraction whose flagged heads cost less held-out loss to
    ablate than the mean of the random draws; baseline: the same for each random draw against the
    mean of the other draws (a detector that flags random heads)."""
    rows = [a for r in runs for a in r.ablations]
    if not rows:
        return {"precision": None, "baseline_precision": None}
    hits = sum(a["loss_increase"] <= a["random_loss_increase"] for a in rows)
    base = []
    for a in rows:
        draws = a["random_draws"]
        for k, d in enumerate(draws):
            others = draws[:k] + draws[k + 1 :]
            if others:
                base.append(d <= statistics.fmean(others))
    return {
        "precision": hits / len(rows),
        "baseline_precision": statistics.fmean(base) if base else None,
        "scored": len(rows),
        "median_lead_steps": None,
        "recall": None,
    }


def summarize(runs: Sequence[Run], *, window: int, every: int, warmup: int) -> dict[str, Any]:
    expected = {
        (kind, metric) for kind in ("saturation", "collapse", "redundancy") for metric in ("hdi", "effective_heads")
    } | {("entropy_collapse", "attention_entropy"), ("logit_blowup", "max_attention_logit")}
    kinds = sorted(expected | {(e["kind"], e["metric"]) for run in runs for e in run.events})
    per_kind: dict[str, Any] = {}
    for kind, metric in kinds:
        row = score(runs, kind, metric, window=window, warmup_index=warmup // every)
        if OUTCOME.get(kind) == "spike":
            row["run_level"] = run_level(runs, kind, metric, warmup_index=warmup // every)
        if kind == "redundancy":
            subset = [
                Run(r.config, r.seed, ablations=[a for a in r.ablations if (a["projection"] == "activations") == (metric == "effective_heads")])
                for r in runs
            ]  # fmt: skip
            row.update(ablation_summary(subset))
            row.update(redundancy_precision(subset))
        per_kind[f"{kind}/{metric}"] = row
    return per_kind


# ------------------------------------------------------------------------------------- output
def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


SHIPPED = {
    "saturation": ("patience", "min_delta", "warmup_measurements"),
    "collapse": ("collapse_delta", "warmup_measurements"),
    "entropy_collapse": ("entropy_fraction", "warmup_measurements"),
    "logit_blowup": ("logit_threshold", "logit_growth", "warmup_measurements"),
}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Measured by `{results['command']}` ({results['runs']} runs of {results['steps']} steps, "
        f"{results['seconds'] / 60:.0f} min on {results['machine']}); one measurement every "
        f"{results['every_n_steps']} steps, outcome window {results['window_steps']} steps, detector warmup "
        f"{results['warmup_steps']} steps. Fired: measured steps with an event. Precision: the fraction of "
        "them followed by their outcome within the window (saturation: a held-out plateau; collapse, entropy "
        "collapse, logit blow-up: a held-out spike or divergence). Random baseline: a detector firing at "
        "random measured steps as often; time-matched: the outcome rate at the same steps in the other seeds "
        "of the same configuration.",
        "",
        "| event (metric) | fired | precision | random baseline | time-matched baseline | median lead (steps) | recall | flagged-head ablation (loss +) | random-head ablation (loss +) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in results["overall"].items():
        abl = row.get("ablation_loss_increase", {}).get("mean")
        rnd = row.get("random_ablation_loss_increase", {}).get("mean")
        abl_sd = row.get("ablation_loss_increase", {}).get("std")
        rnd_sd = row.get("random_ablation_loss_increase", {}).get("std")
        lines.append(
            f"| {key} | {row['fired']} | {fmt(row['precision'])} | {fmt(row['baseline_precision'])} | "
            f"{fmt(row.get('matched_baseline_precision'))} | "
            f"{fmt(row['median_lead_steps'], 0)} | {fmt(row['recall'])} | {fmt(abl, 4)}"
            f"{'' if abl_sd is None else ' ± ' + fmt(abl_sd, 4)} | {fmt(rnd, 4)}"
            f"{'' if rnd_sd is None else ' ± ' + fmt(rnd_sd, 4)} |"
        )
    lines += [
        "",
        "The spike kinds judged by run: of the runs in which the kind fired, the fraction that spiked "
        "after its first event, against the fraction of all runs that spiked after warmup (flagging runs "
        "at random); the runs that never spiked among those flagged; the spiking runs flagged before any "
        "spike; recall: the spiking runs flagged before their first spike after warmup.",
        "",
        "| event (metric) | runs flagged | precision | random baseline | never-spiking runs flagged | flagged before any spike | recall | median lead (steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in results["overall"].items():
        if "run_level" in row:
            lines.append(f"| {key} | {_run_cells(row['run_level'])} |")
    lines += [
        "",
        "Detector settings replayed over the recorded series (every layer and the model mean): the "
        "setting the runs used and the one with the largest lift of precision over its baseline, if "
        f"that lift exceeds {results['min_lift']}: saturation within the window against the stricter of "
        f"the random and time-matched baselines, among settings with at least {results['min_scored']} "
        f"scored events; the spike kinds by run, among settings that flag at least "
        f"{results['min_flagged_runs']} runs, at the warmup chosen for saturation (the runs' own when none "
        "is), since the library has one warmup for all detectors. The full grid is in the results file.",
        "",
        "| event | setting | in window: fired, precision (random; time-matched) | by run: runs flagged | precision | random baseline | never-spiking runs flagged | flagged before any spike | recall | median lead (steps) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, names in SHIPPED.items():
        rows = results["detector_grid"][kind]
        used = results["used_settings"][kind]
        shown = [("runs (old default)", next((r for r in rows if all(r[n] == used[n] for n in names)), None)),
                 ("best lift", results["chosen"][kind])]  # fmt: skip
        for label, row in shown:
            if row is None:
                lines.append(
                    f"| {kind} | {label}: none beats its baseline by more than {results['min_lift']} | |{' |' * 7}"
                )
                continue
            setting = ", ".join(f"{n}={row[n]:g}" for n in names)
            window = (
                f"{row['fired']}, {fmt(row['precision'])} ({fmt(row['baseline_precision'])}; "
                f"{fmt(row.get('matched_baseline_precision'))})"
            )
            by_run = _run_cells(row["run_level"]) if "run_level" in row else " | ".join("-" * 7)
            lines.append(f"| {kind} | {label}: {setting} | {window} | {by_run} |")
    lines += [
        "",
        "Per configuration: spike onsets after warmup and the runs they fell in; seed means of the final values.",
        "",
        "| configuration | final held-out loss | spike onsets | diverged | key HDI (final) | key chance | "
        "attention entropy (final; uniform) | max logit (final) | events |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["configurations"].items():
        lines.append(
            f"| {name} | {fmt(row['final_held_out'], 3)} | {row['spike_onsets']} in {row['spiking_runs']} "
            f"run{'' if row['spiking_runs'] == 1 else 's'} | "
            f"{row['diverged']} of "
            f"{row['seeds']} | {fmt(row['final_key_hdi'], 3)} | {fmt(row['key_chance'], 3)} | "
            f"{fmt(row['final_entropy'])}; {fmt(row['final_uniform'])} | {fmt(row['final_max_logit'], 1)} | "
            f"{row['events']} |"
        )
    return "\n".join(lines) + "\n"


def _run_cells(rl: dict[str, Any]) -> str:
    """The by-run cells of a table row."""
    return (
        f"{rl['runs_flagged']} of {rl['runs']} | {fmt(rl['precision'])} | {fmt(rl['baseline_precision'])} | "
        f"{rl['healthy_runs_flagged']} of {rl['runs'] - rl['spiking_runs']} | "
        f"{rl['flagged_before_any_spike']} of {rl['spiking_runs']} | {fmt(rl['recall'])} | "
        f"{fmt(rl['median_lead_steps'], 0)}"
    )


def layer_final(run: Run, stat: str, reduce: Any) -> float | None:
    """``reduce`` over the layers of the last measured value of a kernel statistic."""
    values = [v[-1] for k, v in run.kernel.items() if k.endswith(f"/{stat}") and v and v[-1] is not None]
    return reduce(values) if values else None


def _max_logit(run: Run, i: int) -> float:
    """The largest attention logit over the layers at measurement ``i`` (NaN if none)."""
    values = [v for k, series in run.kernel.items() if k.endswith("/max_logit") and (v := series[i]) is not None]
    return max(values, default=math.nan)


def plot(runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.config for r in runs))
    fig, axes = plt.subplots(3, len(names), figsize=(3.2 * len(names), 7.4), squeeze=False, sharex=True)
    marks = {"saturation": "v", "collapse": "x", "redundancy": "o", "entropy_collapse": "s", "logit_blowup": "^"}
    for col, name in enumerate(names):
        for run in (r for r in runs if r.config == name):
            (line,) = axes[0][col].plot(run.steps, run.held_out, lw=0.8)
            for i in spike_onsets(run):
                axes[0][col].plot(run.steps[i], run.held_out[i] if math.isfinite(run.held_out[i]) else 0, "*",
                                  ms=6, color=line.get_color())  # fmt: skip
            axes[1][col].plot(run.steps, run.hdi.get("key", []), lw=0.8, color=line.get_color())
            logits = [_max_logit(run, i) for i in range(len(run.steps))]
            axes[2][col].plot(run.steps, logits, lw=0.8, color=line.get_color())
            for e in run.events:
                i = run.steps.index(e["step"])
                if e["layer"] == "mean" and e["metric"] == "hdi":
                    axes[1][col].plot(e["step"], run.hdi["key"][i], marks.get(e["kind"], "."), ms=4, color="k")
                elif e["kind"] in ("entropy_collapse", "logit_blowup"):
                    axes[2][col].plot(e["step"], logits[i], marks[e["kind"]], ms=4, color="k")
        axes[0][col].set_title(name, fontsize=9)
        axes[1][col].axhline(
            statistics.fmean(r.chance.get("key", math.nan) for r in runs if r.config == name), ls=":", c="grey"
        )
        axes[2][col].set_yscale("log")  # a non-positive largest logit is left out
        finite = [v for r in runs if r.config == name for s, v in zip(r.steps, r.held_out, strict=True)
                  if s >= LR_WARMUP and math.isfinite(v)]  # fmt: skip
        if finite:  # the first steps' loss (about ln 128 and above) would flatten everything after
            axes[0][col].set_ylim(min(finite) - 0.1, min(max(finite), 2 * min(finite)) + 0.1)
        axes[2][col].set_xlabel("step")
    axes[0][0].set_ylabel("held-out loss (*: spike onsets)")
    axes[1][0].set_ylabel("key HDI, model mean\n(v saturation, x collapse)")
    axes[2][0].set_ylabel("max attention logit\n(s entropy collapse, ^ blow-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def replace_block(page: Path, text: str) -> None:
    begin, end = "<!-- warnings-study:begin -->", "<!-- warnings-study:end -->"
    body = page.read_text()
    if begin not in body or end not in body:
        raise SystemExit(f"{page} has no {begin} ... {end} block")
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{begin}\n{text}{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--corpus", type=Path, default=None, help="a text file (default: stdlib docstrings)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="one seed, few steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 2000; quick 60)")
    parser.add_argument("--every", type=int, default=None, help="measure every N steps (default 10; quick 3)")
    parser.add_argument(
        "--window", type=int, default=None, help="outcome window, in measurements (default 10; quick 3)"
    )
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS], choices=[c.name for c in CONFIGS])
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once, one CPU thread each (default 2)")
    parser.add_argument(
        "--docs", type=Path, default=None, help="a docs page whose generated block to replace (the plot goes to img/)"
    )
    parser.add_argument(
        "--readme", type=Path, default=None, help="a page whose generated block gets the event and settings tables"
    )
    parser.add_argument(
        "--rescore", action="store_true",
        help="train nothing: score again the runs recorded in --out/warnings_study.json (with this version's scoring)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    command = "python benchmarks/warnings_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.rescore:
        recorded = json.loads((args.out / "warnings_study.json").read_text())
        with gzip.open(args.out / SERIES_FILE, "rt") as f:
            runs = [Run(**row) for row in json.load(f)]
        meta = {k: recorded[k] for k in ("command", "seeds", "steps", "every_n_steps", "corpus", "machine", "seconds")}
        window = args.window or recorded["window_measurements"]
        meta["rescored_by"] = command
    else:
        seeds = args.seeds[:1] if args.quick else args.seeds
        steps = args.steps or (60 if args.quick else 2000)
        every = args.every or (3 if args.quick else 10)
        window = args.window or (3 if args.quick else 10)
        if steps < 2 * every or every < 1 or window < 1 or args.jobs < 1:
            parser.error("need --steps >= 2 * --every >= 2, --window >= 1 and --jobs >= 1")
        start = time.perf_counter()
        runs = train_all(args, seeds, steps=steps, every=every)
        meta = {
            "command": command,
            "seeds": seeds,
            "steps": steps,
            "every_n_steps": every,
            "corpus": str(args.corpus) if args.corpus else "stdlib docstrings",
            "machine": f"{args.jobs} worker processes of one thread each, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "seconds": time.perf_counter() - start,
        }  # fmt: skip
    results = score_runs(runs, meta, window=window)
    args.out.mkdir(parents=True, exist_ok=True)
    series = results.pop("series")
    (args.out / "warnings_study.json").write_text(json.dumps(finite(results), indent=1, allow_nan=False))
    data = json.dumps(finite(series), allow_nan=False, separators=(",", ":")).encode()
    # every run's recorded series, for --rescore; mtime 0: the same runs give the same bytes
    (args.out / SERIES_FILE).write_bytes(gzip.compress(data, mtime=0))
    plot(runs, args.out / "warnings_study.png")
    table = markdown(results)
    (args.out / "warnings_study.md").write_text(table)
    if args.docs is not None:
        image = args.docs.parent / "img" / "warnings_study.png"
        image.parent.mkdir(exist_ok=True)
        shutil.copyfile(args.out / "warnings_study.png", image)
        replace_block(args.docs, f"{table}\n![What the study's runs recorded](img/warnings_study.png)\n")
    if args.readme is not None:
        parts = table.split("\n\n")  # measured by, events, by run (text, table), settings (text, table), configs
        replace_block(args.readme, "\n\n".join(parts[:2] + parts[4:6]) + "\n")
    print(table)
    log(f"done; wrote {args.out / 'warnings_study.json'}")
    return 0


def train_all(args: argparse.Namespace, seeds: list[int], *, steps: int, every: int) -> list[Run]:
    """Every (configuration, seed) run, ``--jobs`` at a time, in job order."""
    docs = file_documents(args.corpus) if args.corpus else stdlib_documents()
    streams = split_tokens(docs, seed=0)
    log(f"corpus: {len(docs)} documents, {len(streams[0])} train / {len(streams[1])} held-out bytes")
    jobs = [(cfg, seed) for cfg in CONFIGS if cfg.name in args.configs for seed in seeds]
    runs: list[Run] = []
    with ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=mp.get_context("spawn"), initializer=_one_thread
    ) as pool:
        futures = [pool.submit(train_run, cfg, seed, streams, steps=steps, every=every) for cfg, seed in jobs]
        for future in futures:  # in job order: the results file does not depend on --jobs
            run = future.result()
            runs.append(run)
            log(f"{run.config} seed {run.seed}: held-out {run.held_out[-1] if run.held_out else math.nan:.3f}, "
                f"{len(run.events)} events, {run.seconds:.1f} s")  # fmt: skip
    return runs


def score_runs(runs: list[Run], meta: dict[str, Any], *, window: int) -> dict[str, Any]:
    """The results file's contents: ``meta`` (command, seeds, steps, ...), per configuration and
    overall scores, the replayed detector grids, and every run's series."""
    _STATES.clear()
    every = meta["every_n_steps"]
    warmup = WARMUP_MEASUREMENTS * every
    by_name = {c.name: c for c in CONFIGS}
    configurations = {}
    for name in dict.fromkeys(r.config for r in runs):
        rs = [r for r in runs if r.config == name]
        finals = [r.held_out[-1] for r in rs if r.held_out and math.isfinite(r.held_out[-1])]
        keys = [r.hdi["key"][-1] for r in rs if r.hdi.get("key")]
        configurations[name] = {
            **asdict(by_name[name]),
            "seeds": len(rs),
            "diverged": sum(r.diverged_at is not None for r in rs),
            "final_held_out": _mean(finals),
            "final_key_hdi": _mean(keys),
            "key_chance": _mean([r.chance.get("key") for r in rs]),
            "events": sum(len(r.events) for r in rs),
            "spike_onsets": sum(u >= WARMUP_MEASUREMENTS for r in rs for u in spike_onsets(r)),
            "spiking_runs": sum(any(u >= WARMUP_MEASUREMENTS for u in spike_onsets(r)) for r in rs),
            "final_entropy": _mean([layer_final(r, "entropy", statistics.fmean) for r in rs]),
            "final_uniform": _mean([layer_final(r, "uniform", statistics.fmean) for r in rs]),
            "final_max_logit": _mean([layer_final(r, "max_logit", max) for r in rs]),
            "per_kind": summarize(rs, window=window, every=every, warmup=warmup),
        }
    grids = replay_grids(runs, window=window, every=every, warmup=WARMUP_MEASUREMENTS)
    return {
        **meta,
        "window_measurements": window,
        "window_steps": window * every,
        "warmup_steps": warmup,
        "plateau_rel": PLATEAU_REL,
        "spike_rel": SPIKE_REL,
        "min_scored": MIN_SCORED,
        "min_flagged_runs": MIN_FLAGGED_RUNS,
        "min_lift": MIN_LIFT,
        "used_settings": used_settings(),
        "runs": len(runs),
        "configurations": configurations,
        "overall": summarize(runs, window=window, every=every, warmup=warmup),
        "detector_grid": grids,
        "chosen": choose_all(grids),
        "replay_check": replay_check(runs, every=every),
        "series": [asdict(r) for r in runs],
    }


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(kept) if kept else None


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
