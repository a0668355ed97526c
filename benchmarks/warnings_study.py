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
* the **baseline precision** of a detector that fires at random measured steps at the same rate:
  the exact expectation, the outcome's frequency over every measured step the detector could have
  fired at (after warmup), weighted by each run's number of events;
* the **median lead** in steps from the event to the outcome, and the **recall**: the fraction of
  outcomes (plateau or spike onsets) that an event of the kind preceded within the window;
* for redundancy events: the held-out loss increase when the flagged heads (the second head of each
  redundant pair) are zero-ablated at that step, against the same number of random heads of the
  same layers (``RANDOM_ABLATIONS`` draws of a private generator).

Configurations: (a) ``baseline``; (b) ``narrow_heads``: too many narrow heads for the width;
(c) ``wide_heads``: too few wide ones; (d) ``high_lr``: a high learning rate without QK-norm;
(e) ``high_lr_qk_norm``: the same with QK-norm (LayerNorm on each head's queries and keys);
(f) ``shuffled``: the baseline on shuffled tokens (the same bytes, no structure).

The detector's thresholds are used as the library ships them; ``warmup_steps`` and the window are
scaled to the run (the defaults assume about ten measurements of warmup: ``warmup_steps=1000`` at
one measurement every 100 steps). A grid of ``patience`` and ``min_delta`` is replayed offline on
the recorded HDI series (`SaturationDetector` fed the same values the tracker fed it) to choose the
defaults.

Run: ``python benchmarks/warnings_study.py --seeds 0 1 2 3 4 --out benchmarks/results``
(``--quick``: one seed, few steps, under two minutes). Writes ``warnings_study.json`` and
``warnings_study.png`` into ``--out``, and with ``--docs PAGE`` replaces the generated block of that
page (between its ``<!-- warnings-study:begin -->`` and ``<!-- warnings-study:end -->`` lines).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.ablation import ablate_heads
from hdi_monitor.monitor.detector import SaturationDetector
from hdi_monitor.monitor.tracker import HDITracker

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
    lr: float = 3e-3
    qk_norm: bool = False
    shuffled: bool = False


CONFIGS = (
    Config("baseline", "D=64, 4 heads of width 16, lr 3e-3"),
    Config("narrow_heads", "D=64, 32 heads of width 2 (too many narrow heads)", heads=32),
    Config("wide_heads", "D=64, 2 heads of width 32 (too few wide heads)", heads=2),
    Config("high_lr", "baseline at lr 3e-2, no QK-norm", lr=3e-2),
    Config("high_lr_qk_norm", "baseline at lr 3e-2 with QK-norm", lr=3e-2, qk_norm=True),
    Config("shuffled", "baseline on shuffled tokens (no structure)", shuffled=True),
)


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
    hdi: dict[str, list[float]] = field(default_factory=dict)  # "mean/<projection>" -> series
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
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = 10 * every  # ten measurements, as the shipped default (1000 steps at every 100)
    detector = SaturationDetector(warmup_steps=warmup)
    tracker = HDITracker(
        model,
        every_n_steps=every,
        log_images_every_n_steps=0,
        max_tokens=512,
        detector=detector,
        activation_detector="default",
        kernel_stats=True,
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
    lead in steps (outcome step minus event step) when it does."""
    if outcome == "plateau":
        for j in range(i, min(i + window, len(run.held_out) - 1) + 1):
            state = plateau_at(run, j, window)
            if state is None:
                return (None, None) if j == i else (False, None)
            if state:
                return True, run.steps[j] - run.steps[i]
        return False, None
    for j in spike_onsets(run):
        if i < j <= i + window:
            return True, run.steps[j] - run.steps[i]
    if i + window >= len(run.held_out) and run.diverged_at is None:
        return None, None
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


def score(runs: Sequence[Run], kind: str, metric: str, *, window: int, warmup_index: int) -> dict[str, Any]:
    """Fired, precision, baseline precision, median lead and recall of one event kind and metric
    (the ``mean`` series and every layer pooled; one event per measured step counted)."""
    outcome = OUTCOME.get(kind, "spike")
    hits = scored = fired = 0
    leads: list[int] = []
    base_num = base_den = 0.0
    onsets_total = onsets_caught = 0
    for run in runs:
        index = {s: i for i, s in enumerate(run.steps)}
        event_idx = sorted({index[e["step"]] for e in run.events if e["kind"] == kind and e["metric"] == metric})
        fired += len(event_idx)
        for i in event_idx:
            ok, lead = outcome_after(run, i, outcome, window)
            if ok is None:
                continue
            scored += 1
            hits += int(ok)
            if ok and lead is not None:
                leads.append(lead)
        # a detector firing at random measured steps after warmup, as often as this one did here
        eligible = [outcome_after(run, i, outcome, window)[0] for i in range(warmup_index, len(run.steps))]
        eligible = [e for e in eligible if e is not None]
        if eligible and event_idx:
            base_num += len(event_idx) * sum(eligible) / len(eligible)
            base_den += len(event_idx)
        for u in outcome_onsets(run, outcome, window):
            if u < warmup_index:
                continue
            onsets_total += 1
            onsets_caught += int(any(u - window <= i <= u for i in event_idx))
    return {
        "fired": fired,
        "scored": scored,
        "precision": hits / scored if scored else None,
        "baseline_precision": base_num / base_den if base_den else None,
        "median_lead_steps": statistics.median(leads) if leads else None,
        "outcomes": onsets_total,
        "recall": onsets_caught / onsets_total if onsets_total else None,
    }


def replay_grid(runs: Sequence[Run], *, window: int, every: int, warmup: int) -> list[dict[str, Any]]:
    """Saturation/collapse of the model-mean key HDI, replayed offline with other detector settings."""
    rows = []
    for patience in (3, 5, 10):
        for min_delta in (0.001, 0.002, 0.005):
            replayed = []
            for run in runs:
                det = SaturationDetector(patience=patience, min_delta=min_delta, warmup_steps=warmup)
                copy = Run(run.config, run.seed, run.steps, run.held_out, diverged_at=run.diverged_at)
                for s, v in zip(run.steps, run.hdi.get("key", []), strict=False):
                    for event in det.update(s, "mean", "key", v, chance=run.chance.get("key")):
                        copy.events.append({"kind": event.kind, "metric": "hdi", "step": s})
                replayed.append(copy)
            sat = score(replayed, "saturation", "hdi", window=window, warmup_index=warmup // every)
            rows.append(
                {"patience": patience, "min_delta": min_delta, **{f"saturation_{k}": v for k, v in sat.items()}}
            )
    return rows


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
    }
    kinds = sorted(expected | {(e["kind"], e["metric"]) for run in runs for e in run.events})
    per_kind: dict[str, Any] = {}
    for kind, metric in kinds:
        row = score(runs, kind, metric, window=window, warmup_index=warmup // every)
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


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Measured by `{results['command']}` ({results['runs']} runs, {results['seconds']:.0f} s on "
        f"{results['machine']}); window {results['window_steps']} steps, detector warmup "
        f"{results['warmup_steps']} steps. Precision: events followed by their outcome within the window; "
        "baseline: a detector firing at random measured steps at the same rate.",
        "",
        "| event (metric) | fired | precision | random baseline | median lead (steps) | recall | flagged-head ablation (loss +) | random-head ablation (loss +) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in results["overall"].items():
        abl = row.get("ablation_loss_increase", {}).get("mean")
        rnd = row.get("random_ablation_loss_increase", {}).get("mean")
        lines.append(
            f"| {key} | {row['fired']} | {fmt(row['precision'])} | {fmt(row['baseline_precision'])} | "
            f"{fmt(row['median_lead_steps'], 0)} | {fmt(row['recall'])} | {fmt(abl, 4)} | {fmt(rnd, 4)} |"
        )
    lines += [
        "",
        "| configuration | final held-out loss | diverged | key HDI (final) | key chance | events |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["configurations"].items():
        lines.append(
            f"| {name} | {fmt(row['final_held_out'], 3)} | {row['diverged']} of {row['seeds']} | "
            f"{fmt(row['final_key_hdi'], 3)} | {fmt(row['key_chance'], 3)} | {row['events']} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.config for r in runs))
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 5.2), squeeze=False, sharex=True)
    marks = {"saturation": "v", "collapse": "x", "redundancy": "o"}
    for col, name in enumerate(names):
        for run in (r for r in runs if r.config == name):
            axes[0][col].plot(run.steps, run.held_out, lw=0.8)
            axes[1][col].plot(run.steps, run.hdi.get("key", []), lw=0.8)
            for e in run.events:
                if e["layer"] == "mean" or e["kind"] == "redundancy":
                    i = run.steps.index(e["step"])
                    axes[1][col].plot(e["step"], run.hdi["key"][i], marks.get(e["kind"], "."), ms=4, color="k")
        axes[0][col].set_title(name, fontsize=9)
        axes[1][col].axhline(
            statistics.fmean(r.chance.get("key", math.nan) for r in runs if r.config == name), ls=":", c="grey"
        )
    axes[0][0].set_ylabel("held-out loss")
    axes[1][0].set_ylabel("key HDI (mean; markers: events)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 1500; quick 60)")
    parser.add_argument("--every", type=int, default=None, help="measure every N steps (default 10; quick 3)")
    parser.add_argument("--window", type=int, default=10, help="outcome window, in measurements")
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS], choices=[c.name for c in CONFIGS])
    parser.add_argument("--docs", type=Path, default=None, help="a page whose generated block to replace")
    args = parser.parse_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    steps = args.steps or (60 if args.quick else 1500)
    every = args.every or (3 if args.quick else 10)
    window = 3 if args.quick else args.window
    if steps < 2 * every or every < 1 or window < 1:
        parser.error("need --steps >= 2 * --every >= 2 and --window >= 1")
    docs = file_documents(args.corpus) if args.corpus else stdlib_documents()
    streams = split_tokens(docs, seed=0)
    log(f"corpus: {len(docs)} documents, {len(streams[0])} train / {len(streams[1])} held-out bytes")
    start = time.perf_counter()
    runs: list[Run] = []
    for cfg in (c for c in CONFIGS if c.name in args.configs):
        for seed in seeds:
            run = train_run(cfg, seed, streams, steps=steps, every=every)
            runs.append(run)
            log(f"{cfg.name} seed {seed}: held-out {run.held_out[-1] if run.held_out else math.nan:.3f}, "
                f"{len(run.events)} events, {run.seconds:.1f} s")  # fmt: skip
    seconds = time.perf_counter() - start
    warmup = 10 * every
    configurations = {}
    for cfg in (c for c in CONFIGS if c.name in args.configs):
        rs = [r for r in runs if r.config == cfg.name]
        finals = [r.held_out[-1] for r in rs if r.held_out and math.isfinite(r.held_out[-1])]
        keys = [r.hdi["key"][-1] for r in rs if r.hdi.get("key")]
        configurations[cfg.name] = {
            **asdict(cfg),
            "seeds": len(rs),
            "diverged": sum(r.diverged_at is not None for r in rs),
            "final_held_out": statistics.fmean(finals) if finals else None,
            "final_key_hdi": statistics.fmean(keys) if keys else None,
            "key_chance": statistics.fmean(r.chance["key"] for r in rs if "key" in r.chance) if rs else None,
            "events": sum(len(r.events) for r in rs),
            "per_kind": summarize(rs, window=window, every=every, warmup=warmup),
        }
    results = {
        "command": "python benchmarks/warnings_study.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": seeds,
        "steps": steps,
        "every_n_steps": every,
        "window_measurements": window,
        "window_steps": window * every,
        "warmup_steps": warmup,
        "plateau_rel": PLATEAU_REL,
        "spike_rel": SPIKE_REL,
        "corpus": str(args.corpus) if args.corpus else "stdlib docstrings",
        "machine": f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}",
        "runs": len(runs),
        "seconds": seconds,
        "configurations": configurations,
        "overall": summarize(runs, window=window, every=every, warmup=warmup),
        "detector_grid": replay_grid(runs, window=window, every=every, warmup=warmup),
        "series": [asdict(r) for r in runs],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warnings_study.json").write_text(json.dumps(finite(results), indent=1, allow_nan=False))
    plot(runs, args.out / "warnings_study.png")
    table = markdown(results)
    (args.out / "warnings_study.md").write_text(table)
    if args.docs is not None:
        replace_block(args.docs, table)
    print(table)
    log(f"done in {seconds:.0f} s; wrote {args.out / 'warnings_study.json'}")
    return 0


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
