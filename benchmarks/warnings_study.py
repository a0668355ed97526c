"""What the early warnings are worth on real training runs, held out and against the field's baselines.

Small causal byte-level language models are trained on real English text (the docstrings of the
Python standard library, which ship with Python, or ``--corpus FILE``) on the CPU, several seeds
per configuration, with the monitor's `HDITracker` measuring every few steps (HDI, effective heads,
kernel statistics, update entropy) and the study reading each head's weight-only logit bound
(`hdi_monitor.functional.bilinear.logit_bound`; QK-norm heads: `qk_norm_logit_bound` from the norms'
gains). Beside every measurement the held-out loss is computed on fixed held-out batches; the
training loss, gradient norm and update norm are recorded at every step.

**Configurations.** A few of the first study's (``baseline``: 4 heads of width 16, lr 1e-2,
constant after `LR_WARMUP` steps of warmup; ``wide_heads``: 2 heads of width 32;
``shuffled``: the baseline on shuffled bytes) and the small-scale instability proxy of Wortsman et
al. 2023: a learning-rate sweep (`SWEEP_LRS`) with and without QK-norm (a LayerNorm without bias on
each head's queries and keys), AdamW with beta2 0.95, `PROXY_WARMUP` steps of linear warmup then
cosine decay to 10%, no weight decay, no z-loss.

**Outcomes.** A held-out **spike** (the held-out loss rises ``SPIKE_REL`` above its best so far,
or the run diverges) within ``--window`` measurements after an event; a held-out **plateau** (the
held-out loss improves by less than ``PLATEAU_REL`` over the window) for saturation; for
redundancy, whether ablating the flagged heads costs less held-out loss than ablating random heads
of the same layers. Events and outcomes count from measurement `SCORE_FROM` on (after the learning
rate warmup), for every signal and baseline alike; a window running past the end of a run is left
out.

**Candidate signals** (`SIGNALS`): the HDI detector's saturation and collapse on the HDI and the
effective-heads series, the kernel detector's entropy collapse and logit blow-up, the logit bound
(threshold or growth rule: the kernel detector's blow-up rule fed the largest bound of each layer)
and the update entropy (the kernel detector's collapse rule fed each layer's mean update entropy),
and redundancy. Every setting is replayed offline over the recorded series (``replay_check``: the
replay with the runs' settings gives exactly the live events).

**Held-out scoring.** Every setting is chosen on tuning folds and scored on the others: two-fold by
seed (tune on one half of the seeds, score on the other, and the reverse) and leave one
configuration out. Precision and recall are pooled over the held-out predictions (each run is
scored once per scheme), with percentile bootstrap intervals over runs (`BOOTSTRAP` resamples of a
private generator). Baselines on the same runs, outcomes and folds: random timing and time-matched;
a configuration prior (the best rule on the learning rate alone, chosen on the tuning folds);
training-loss spike detectors with their published defaults (OLMo-core: a value above the mean plus
6 standard deviations of the last 128; llm.c: a z-score above 3 over the last 128; ZClip: an EMA
z-score above 2.5, alpha 0.97); the llm.c z-score on the gradient norm and on the update norm;
persistence (the run has already spiked); for plateaus, a power-law extrapolation of the recent
held-out losses and "the loss already improved less than the plateau threshold over the last
window". A signal is on by default (``defaults_on``) only if the lower end of its interval is above
the best baseline's precision in both schemes.

**Also measured.** ``added_information``: the held-out AUC of a logistic regression predicting a
spike within the window (and by run) from the loss and gradient baselines alone and with the head
signals added. ``saturation_use``: at each held-out saturation event and at as many random times,
the rank correlation of the heads' importance (held-out loss when ablated) and diversity rankings
with the end's, and the overlap of the 30%-pruned sets. ``redundancy``: the ablation cost of the
flagged heads against random heads of the same layers. ``chosen_on_all_runs``: the settings to ship
as defaults, chosen on all runs (labelled so: their in-sample figures are not evidence).

Runs are trained ``--jobs`` at a time (default 2), one CPU thread each; the results do not depend
on ``--jobs``. Progress lines (run i/n, elapsed time) go to stderr.

Run: ``python benchmarks/warnings_study.py --seeds 0 1 2 3 --out benchmarks/results --docs
docs/early-warnings.md`` (``--quick``: two seeds, three configurations, few steps, under two
minutes). Writes ``warnings_study.json`` (the scores), ``warnings_study_runs.json.gz`` (every run's
recorded series, which ``--rescore`` scores again without training), ``warnings_study.md`` and
``warnings_study.png`` into ``--out``; with ``--docs PAGE`` replaces the generated block of that page
(between its ``<!-- warnings-study:begin ... -->`` and ``<!-- warnings-study:end -->`` lines).
"""

from __future__ import annotations

import argparse
import bisect
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
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from hdi_monitor.ablation import ablate_heads
from hdi_monitor.functional.bilinear import logit_bound, qk_norm_logit_bound
from hdi_monitor.monitor.detector import ACTIVATION_COLLAPSE_DELTA, ACTIVATION_MIN_DELTA, SaturationDetector
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
SPIKE_REL = 0.05  # a held-out loss 5% above its best so far is a spike
RANDOM_ABLATIONS = 5
SERIES_FILE = "warnings_study_runs.json.gz"
META_FILE = "warnings_study_meta.json"  # the command and run settings, written before the scoring
LR_WARMUP = 100  # steps of linear learning-rate warmup (the proxy's: PROXY_WARMUP)
PROXY_WARMUP = 300
COSINE_FLOOR = 0.1  # the cosine schedule decays to this fraction of the peak rate
WARMUP_MEASUREMENTS = 10  # the runs' live detector warmup (measurements)
SCORE_FROM = 10  # events and outcomes count from this measurement on (every signal and baseline)
#: The detector settings the runs use live (pinned: the recorded runs stay reproducible, and
#: `replay_check` true, whatever defaults the library ships).
RUN_HDI: dict[str, Any] = {"patience": 10, "min_delta": 0.002, "collapse_delta": 0.05, "redundancy_threshold": 0.9}
RUN_KERNEL: dict[str, Any] = {
    "entropy_fraction": 0.5,
    "logit_threshold": 50.0,
    "logit_growth": 4.0,
    "patience": 10,
    "min_logit": 10.0,
}
MIN_SCORED = 10  # plateau signals: a setting is chosen among those with this many scored events on the tuning runs
MIN_FLAGGED_RUNS = 2  # spike signals: ... among those that flag this many tuning runs
BOOTSTRAP = 1000  # bootstrap resamples over runs
BOOTSTRAP_SEED = 12345
PRUNE_FRACTION = 0.3
RANK_EVERY = 15  # head rankings (importance, diversity) every this many measurements, and at the last
SEQ_LEN = 64
BATCH = 16
EVAL_BATCHES = 4
VOCAB = 128  # ASCII bytes
PROJECTIONS = ("query", "key", "value", "output")
#: Published defaults of the loss-spike detectors used as baselines.
OLMO_WINDOW, OLMO_STDS = 128, 6.0  # OLMo-core's stability monitor: value > mean + 6 std of the last 128
LLMC_WINDOW, LLMC_Z = 128, 3.0  # llm.c's outlier detector: z-score over the last 128 above 3
ZCLIP_ALPHA, ZCLIP_Z, ZCLIP_WARMUP = 0.97, 2.5, 25  # ZClip: EMA z-score above 2.5, alpha 0.97
#: The candidate warning signals and the outcome each suggests.
SIGNALS = {
    "saturation/hdi": "plateau",
    "saturation/effective_heads": "plateau",
    "collapse/hdi": "spike",
    "collapse/effective_heads": "spike",
    "entropy_collapse": "spike",
    "logit_blowup": "spike",
    "logit_bound": "spike",
    "update_entropy": "spike",
    "redundancy": "ablation",
}
SPIKE_BASELINES = ("random_timing", "time_matched", "config_prior", "olmo_loss", "llmc_loss_z", "zclip_loss",
                   "grad_norm_z", "update_norm_z", "persistence")  # fmt: skip
PLATEAU_BASELINES = ("random_timing", "time_matched", "config_prior", "persistence", "power_law")
#: The learning rates of the instability proxy (with and without QK-norm each).
SWEEP_LRS = (6e-3, 1.5e-2, 4e-2, 1e-1, 2e-1)


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
    beta2: float = 0.999
    schedule: str = "constant"  # "constant" after warmup, or "cosine" decay to COSINE_FLOOR
    warmup: int = LR_WARMUP  # steps of linear learning-rate warmup


def _lr_name(lr: float) -> str:
    return f"{lr:g}"


CONFIGS = (
    Config("baseline", "D=64, 2 layers, 4 heads of width 16, lr 1e-2 constant"),
    Config("wide_heads", "D=64, 2 heads of width 32 (too few wide heads)", heads=2),
    Config("shuffled", "baseline on shuffled tokens (no structure)", shuffled=True),
) + tuple(
    Config(f"lr{_lr_name(lr)}{'_qk_norm' if qk else ''}",
           f"proxy: lr {lr:g}{' with QK-norm' if qk else ''}, beta2 0.95, cosine", lr=lr, qk_norm=qk,
           beta2=0.95, schedule="cosine", warmup=PROXY_WARMUP)
    for lr in SWEEP_LRS for qk in (False, True)
)  # fmt: skip
QUICK_CONFIGS = ("baseline", f"lr{_lr_name(SWEEP_LRS[-1])}", f"lr{_lr_name(SWEEP_LRS[-1])}_qk_norm")


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
        self.normed = qk_norm  # LayerNorm without bias: the logit bound from its gains holds whatever the input
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim, bias=False) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(self.head_dim, bias=False) if qk_norm else nn.Identity()

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
    train_loss: list[float] = field(default_factory=list)  # training loss at each measured step
    lr: float = 0.0  # the configuration's peak learning rate
    step_loss: list[float] = field(default_factory=list)  # training loss at every step
    grad_norm: list[float] = field(default_factory=list)  # gradient norm (all parameters) at every step
    update_norm: list[float] = field(default_factory=list)  # norm of the optimizer's update at every step
    hdi: dict[str, list[float]] = field(default_factory=dict)  # projection -> model-mean HDI series
    #: "<layer>/<projection>" (layer "mean" included) -> HDI series, as the detector was fed them
    hdi_series: dict[str, list[float | None]] = field(default_factory=dict)
    chance_series: dict[str, float] = field(default_factory=dict)  # same keys -> chance level
    #: "<layer>/<statistic>" (entropy, uniform, max_logit) -> series, as the kernel detector was fed them
    kernel: dict[str, list[float | None]] = field(default_factory=dict)
    effective_heads: list[float] = field(default_factory=list)  # mean over layers
    #: layer -> effective-heads series, as the activation detector was fed them
    effective_series: dict[str, list[float | None]] = field(default_factory=dict)
    #: layer -> largest logit bound over the layer's heads, per measurement
    logit_bound: dict[str, list[float | None]] = field(default_factory=dict)
    logit_bound_rule: str = ""
    #: layer -> mean update entropy over the layer's heads, per measurement (None on the first)
    update_entropy: dict[str, list[float | None]] = field(default_factory=dict)
    #: head rankings: {"index": measurement index, "importance": [...], "redundancy": [...]} (all heads)
    rankings: list[dict[str, Any]] = field(default_factory=list)
    chance: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    ablations: list[dict[str, Any]] = field(default_factory=list)
    diverged_at: int | None = None
    seconds: float = 0.0


def layer_logit_bounds(model: TinyLM) -> tuple[dict[str, float], str]:
    """The largest logit bound over each attention layer's heads, from the weights: without QK-norm
    ``sigma_max(W_Q,h W_K,h^T) / sqrt(d_k)`` (`logit_bound`, unit-norm query and key inputs); with
    QK-norm (LayerNorm without bias over each head's ``d_k`` channels: the normalised vector has
    norm at most ``sqrt(d_k)``), ``scale * d_k * max_i |g_q,i g_k,i|`` from the norms' gains
    (`qk_norm_logit_bound`), a bound whatever the input."""
    out: dict[str, float] = {}
    rule = "bilinear"
    for i, block in enumerate(cast(Sequence[Block], model.blocks)):
        a = block.attn
        h, d = a.num_heads, a.head_dim
        if a.normed:
            rule = "qk_norm"
            gq = cast(nn.LayerNorm, a.q_norm).weight.detach().expand(h, d)
            gk = cast(nn.LayerNorm, a.k_norm).weight.detach().expand(h, d)
            r = math.sqrt(d)
            bound = qk_norm_logit_bound(gq, gk, radius_q=r, radius_k=r, scale=1 / math.sqrt(d))
        else:
            w_q = rearrange(a.q_proj.weight.detach(), "(h d) D -> h D d", h=h)
            w_k = rearrange(a.k_proj.weight.detach(), "(h d) D -> h D d", h=h)
            bound = logit_bound(w_q, w_k)
        finite = bound[torch.isfinite(bound)]
        out[f"blocks.{i}.attn"] = float(finite.max()) if finite.numel() else math.nan
    return out, rule


def head_rankings(model: nn.Module, report: Any, held: Tensor, heads: dict[str, int]) -> dict[str, list[float]]:
    """Every head's importance (the held-out loss increase when it alone is zero-ablated, on the
    first held-out batch) and redundancy (its mean absolute weight overlap with the other
    heads of its layer, mean over the projections; diversity ranks the other way), in layer order."""
    sub = held[:BATCH]
    base = held_out_loss(model, sub)
    importance: list[float] = []
    redundancy: list[float] = []
    for la in report.layers:
        for h in range(heads[la.name]):
            with ablate_heads(model, {la.name: [h]}):
                importance.append(held_out_loss(model, sub) - base)
        rows = []
        for projection in PROJECTIONS:
            m = la.overlap.get(projection)
            if m is None:
                continue
            m = m.double().abs().clone()
            m.fill_diagonal_(float("nan"))
            rows.append(torch.nanmean(m, dim=1))
        red = torch.stack(rows).nanmean(0) if rows else torch.full((heads[la.name],), math.nan)
        redundancy += [float(x) for x in red.tolist()]
    return {"importance": importance, "redundancy": redundancy}


def lr_factor(cfg: Config, step: int, steps: int) -> float:
    """The learning-rate multiplier at ``step``: linear warmup over the configuration's warmup steps, then constant
    or cosine decay to `COSINE_FLOOR` at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup) / max(1, steps - cfg.warmup))
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


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
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s, steps))
    detector = SaturationDetector(warmup_steps=WARMUP_MEASUREMENTS * every, **RUN_HDI)
    tracker = HDITracker(
        model,
        every_n_steps=every,
        log_images_every_n_steps=0,
        max_tokens=512,
        detector=detector,
        activation_detector="default",
        kernel_stats=True,
        update_entropy=True,
        kernel_detector=KernelDetector(warmup_steps=WARMUP_MEASUREMENTS * every, **RUN_KERNEL),
        on_saturation=lambda event: None,  # the study collects events; no warnings
        seed=seed,
    )
    heads = {layer.name: layer.num_heads for layer in tracker.setup()}
    ablate_gen = torch.Generator().manual_seed(2000 + seed)
    run = Run(cfg.name, seed, lr=cfg.lr)
    start = time.perf_counter()
    for step in range(steps):
        batch = windows(train, BATCH, data_gen)
        with tracker.capture(batch[:, :-1]):
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        run.step_loss.append(value)
        if not math.isfinite(value):
            run.diverged_at = step
            run.grad_norm.append(math.nan)
            run.update_norm.append(math.nan)
            break
        loss.backward()
        grads = [p.grad.detach().reshape(-1) for p in params if p.grad is not None]
        run.grad_norm.append(float(torch.cat(grads).norm()))
        measurement = tracker.step()  # before optimizer.step(): the weights of this forward
        if measurement is not None:
            base = held_out_loss(model, held)
            i = len(run.steps)
            run.steps.append(step)
            run.held_out.append(base)
            run.train_loss.append(value)
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
                for stat, val in (
                    ("entropy", la.mean_attention_entropy),
                    ("uniform", la.mean_attention_entropy_uniform),
                    ("max_logit", la.max_attention_logit_max),
                ):
                    run.kernel.setdefault(f"{la.name}/{stat}", []).append(val)
                run.effective_series.setdefault(la.name, []).append(la.effective_heads)
                ue = la.update_entropy
                ue_mean = (
                    None if ue is None or not bool(torch.isfinite(ue).any()) else float(ue[torch.isfinite(ue)].mean())
                )
                run.update_entropy.setdefault(la.name, []).append(ue_mean)
            bounds, run.logit_bound_rule = layer_logit_bounds(model)
            for name, b in bounds.items():
                run.logit_bound.setdefault(name, []).append(b if math.isfinite(b) else None)
            for projection in PROJECTIONS:
                run.hdi_series.setdefault(f"mean/{projection}", []).append(report.mean_hdi(projection))
                run.chance_series[f"mean/{projection}"] = run.chance[projection]
            effs = [la.effective_heads for la in report.layers if la.effective_heads is not None]
            run.effective_heads.append(statistics.fmean(effs) if effs else float("nan"))
            if math.isfinite(base) and (i % RANK_EVERY == 0 or step + every >= steps):
                run.rankings.append({"index": i, **head_rankings(model, report, held, heads)})
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
        before = torch.cat([p.detach().reshape(-1) for p in params])
        opt.step()
        run.update_norm.append(float((torch.cat([p.detach().reshape(-1) for p in params]) - before).norm()))
        schedule.step()
    tracker.close()
    run.seconds = time.perf_counter() - start
    return run


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


# ------------------------------------------------------------------------------------ replays
Fires = list[list[int]]  # per run (in the study's run order): sorted measurement indices where a detector fired


def _union(events: dict[int, None], i: int) -> None:
    events.setdefault(i, None)


def replay_hdi_fires(runs: Sequence[Run], *, every: int, warmup: int, metric: str, kind: str, **settings: Any) -> Fires:
    """The runs' HDI (``metric="hdi"``: every layer, the mean, every projection) or effective-heads
    series fed again to a fresh `SaturationDetector` with ``settings``; the measurement indices
    where an event of ``kind`` fired (any series)."""
    out: Fires = []
    for run in runs:
        det = SaturationDetector(warmup_steps=warmup * every, **settings)
        hits: dict[int, None] = {}
        for i, step in enumerate(run.steps):
            if metric == "hdi":
                for key, values in run.hdi_series.items():
                    layer, projection = key.rsplit("/", 1)
                    for event in det.update(
                        step, layer, cast(Projection, projection), values[i], chance=run.chance_series.get(key)
                    ):
                        if event.kind == kind:
                            _union(hits, i)
            else:
                for layer, values in run.effective_series.items():
                    for event in det.update(step, layer, "activations", values[i], metric="effective_heads"):
                        if event.kind == kind:
                            _union(hits, i)
        out.append(sorted(hits))
    return out


def replay_kernel_fires(
    runs: Sequence[Run], *, every: int, warmup: int, source: str, kind: str, **settings: Any
) -> Fires:
    """A fresh `KernelDetector` with ``settings`` fed each layer's series of ``source``:
    ``"kernel"`` (mean attention entropy, uniform level, largest logit: the live feed),
    ``"logit_bound"`` (the layer's largest logit bound as its logit: the blow-up rule on the bound)
    or ``"update_entropy"`` (the layer's mean update entropy as its entropy: the collapse rule on
    it); the measurement indices where an event of ``kind`` fired (any layer)."""
    out: Fires = []
    for run in runs:
        det = KernelDetector(warmup_steps=warmup * every, **{**RUN_KERNEL, **settings})
        hits: dict[int, None] = {}
        layers = sorted({key.rsplit("/", 1)[0] for key in run.kernel})
        for i, step in enumerate(run.steps):
            for layer in layers:
                if source == "kernel":
                    feed = {s: run.kernel[f"{layer}/{k}"][i] for s, k in
                            (("entropy", "entropy"), ("uniform", "uniform"), ("max_logit", "max_logit"))}  # fmt: skip
                elif source == "logit_bound":
                    feed = {"max_logit": run.logit_bound.get(layer, [None] * len(run.steps))[i]}
                else:
                    feed = {"entropy": run.update_entropy.get(layer, [None] * len(run.steps))[i]}
                for event in det.update(step, layer, **feed):
                    if event.kind == kind:
                        _union(hits, i)
        out.append(sorted(hits))
    return out


def live_redundancy(runs: Sequence[Run]) -> list[list[dict[str, Any]]]:
    """The redundancy ablations of each run (the live events at the runs' threshold)."""
    return [list(run.ablations) for run in runs]


#: Each signal's replayed settings (warmup in measurements). The logit-bound and update-entropy
#: rules are the kernel detector's blow-up and collapse rules fed those series.
def signal_grid(signal: str) -> list[dict[str, Any]]:
    """The settings replayed for ``signal``."""
    if signal == "saturation/hdi":
        return [{"patience": p, "min_delta": d, "warmup_measurements": w}
                for p in (3, 5, 10, 20) for d in (0.001, 0.002, 0.005, 0.01) for w in (10, 20)]  # fmt: skip
    if signal == "saturation/effective_heads":
        return [{"patience": p, "min_delta": d, "warmup_measurements": w}
                for p in (3, 5, 10, 20) for d in (0.01, 0.05, 0.1, 0.2) for w in (10, 20)]  # fmt: skip
    if signal == "collapse/hdi":
        return [{"collapse_delta": c, "warmup_measurements": w} for c in (0.01, 0.02, 0.05, 0.1, 0.2) for w in (10, 20)]
    if signal == "collapse/effective_heads":
        return [{"collapse_delta": c, "warmup_measurements": w} for c in (0.25, 0.5, 1.0, 2.0) for w in (10, 20)]
    if signal == "entropy_collapse":
        return [{"entropy_fraction": f, "warmup_measurements": w}
                for f in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7) for w in (10, 20)]  # fmt: skip
    if signal == "logit_blowup":
        return [{"logit_threshold": t, "logit_growth": g, "warmup_measurements": w}
                for t in (20.0, 50.0, 100.0, 200.0, 500.0, 1000.0) for g in (4.0, 10.0, 100.0) for w in (10, 20)]  # fmt: skip
    if signal == "logit_bound":
        return [{"logit_threshold": t, "logit_growth": g, "warmup_measurements": w}
                for t in (2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1e9) for g in (1.5, 2.0, 4.0, 1e9) for w in (10, 20)
                if t < 1e9 or g < 1e9]  # fmt: skip
    if signal == "update_entropy":
        return [{"entropy_fraction": f, "warmup_measurements": w}
                for f in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95) for w in (10, 20)]  # fmt: skip
    raise KeyError(signal)


#: The parameter each signal's threshold curve varies (the others at the all-runs choice).
CURVE_PARAMETER = {
    "saturation/hdi": "min_delta",
    "saturation/effective_heads": "min_delta",
    "collapse/hdi": "collapse_delta",
    "collapse/effective_heads": "collapse_delta",
    "entropy_collapse": "entropy_fraction",
    "logit_blowup": "logit_threshold",
    "logit_bound": "logit_threshold",
    "update_entropy": "entropy_fraction",
}


def signal_fires(runs: Sequence[Run], signal: str, setting: dict[str, Any], *, every: int) -> Fires:
    """Replay ``signal`` at ``setting`` over ``runs``."""
    s = dict(setting)
    warm = s.pop("warmup_measurements")
    if signal in ("saturation/hdi", "collapse/hdi"):
        base = {k: RUN_HDI[k] for k in ("patience", "min_delta", "collapse_delta", "redundancy_threshold")}
        return replay_hdi_fires(runs, every=every, warmup=warm, metric="hdi", kind=signal.split("/")[0],
                                **{**base, **s})  # fmt: skip
    if signal in ("saturation/effective_heads", "collapse/effective_heads"):
        base = {"patience": RUN_HDI["patience"], "min_delta": ACTIVATION_MIN_DELTA,
                "collapse_delta": ACTIVATION_COLLAPSE_DELTA, "redundancy_threshold": RUN_HDI["redundancy_threshold"]}  # fmt: skip
        return replay_hdi_fires(runs, every=every, warmup=warm, metric="effective_heads", kind=signal.split("/")[0],
                                **{**base, **s})  # fmt: skip
    if signal in ("entropy_collapse", "logit_blowup"):
        if signal == "logit_blowup":
            s["min_logit"] = min(RUN_KERNEL["min_logit"], s["logit_threshold"] / 2)
        return replay_kernel_fires(runs, every=every, warmup=warm, source="kernel", kind=signal, **s)
    if signal == "logit_bound":
        return replay_kernel_fires(runs, every=every, warmup=warm, source="logit_bound", kind="logit_blowup",
                                   min_logit=0.0, **s)  # fmt: skip
    if signal == "update_entropy":
        return replay_kernel_fires(runs, every=every, warmup=warm, source="update_entropy",
                                   kind="entropy_collapse", **s)  # fmt: skip
    raise KeyError(signal)


def replay_check(runs: Sequence[Run], *, every: int) -> bool:
    """True when replaying the recorded series with the settings the runs used gives exactly the
    measured steps of the live HDI saturation/collapse (both metrics) and kernel events."""
    live_settings = {
        "saturation/hdi": {"patience": RUN_HDI["patience"], "min_delta": RUN_HDI["min_delta"]},
        "collapse/hdi": {"collapse_delta": RUN_HDI["collapse_delta"]},
        "saturation/effective_heads": {"patience": RUN_HDI["patience"], "min_delta": ACTIVATION_MIN_DELTA},
        "collapse/effective_heads": {"collapse_delta": ACTIVATION_COLLAPSE_DELTA},
        "entropy_collapse": {"entropy_fraction": RUN_KERNEL["entropy_fraction"]},
        "logit_blowup": {"logit_threshold": RUN_KERNEL["logit_threshold"], "logit_growth": RUN_KERNEL["logit_growth"]},
    }
    for signal, setting in live_settings.items():
        s = dict(setting)
        if signal == "logit_blowup":
            fires = replay_kernel_fires(
                runs, every=every, warmup=WARMUP_MEASUREMENTS, source="kernel", kind=signal, **s
            )
        else:
            fires = signal_fires(runs, signal, {**s, "warmup_measurements": WARMUP_MEASUREMENTS}, every=every)
        kind = signal.split("/")[0]
        metric = signal.split("/")[1] if "/" in signal else None
        for run, got in zip(runs, fires, strict=True):
            index = {s_: i for i, s_ in enumerate(run.steps)}
            live = sorted({index[e["step"]] for e in run.events
                           if e["kind"] == kind and (metric is None or e["metric"] == metric)})  # fmt: skip
            if live != got:
                return False
    return True


# ----------------------------------------------------------------------------- baseline detectors
def olmo_spikes(values: Sequence[float], *, window: int = OLMO_WINDOW, stds: float = OLMO_STDS) -> list[int]:
    """OLMo-core's stability rule: indices ``t`` whose value exceeds the mean plus ``stds`` sample
    standard deviations of the ``window`` values before it (only once ``window`` values are there;
    a non-finite value fires; non-finite values are left out of the history)."""
    out: list[int] = []
    hist: list[float] = []
    for t, x in enumerate(values):
        if not math.isfinite(x):
            out.append(t)
            continue
        if len(hist) >= window:
            recent = hist[-window:]
            if x > statistics.fmean(recent) + stds * statistics.stdev(recent):
                out.append(t)
        hist.append(x)
    return out


def zscore_spikes(values: Sequence[float], *, window: int = LLMC_WINDOW, z: float = LLMC_Z) -> list[int]:
    """llm.c's outlier rule: indices whose z-score against the ``window`` values before it (their
    mean and population standard deviation) exceeds ``z`` (once ``window`` values are there; a
    non-finite value fires)."""
    return [t for t, s in enumerate(zscores(values, window=window)) if not math.isfinite(s) or s > z]


def zscores(values: Sequence[float], *, window: int = LLMC_WINDOW) -> list[float]:
    """The llm.c z-score of each value against the ``window`` finite values before it (0.0 until
    ``window`` are there or where they do not vary; inf for a non-finite value)."""
    out: list[float] = []
    hist: list[float] = []
    for x in values:
        if not math.isfinite(x):
            out.append(math.inf)
            continue
        score = 0.0
        if len(hist) >= window:
            recent = hist[-window:]
            sd = statistics.pstdev(recent)
            score = (x - statistics.fmean(recent)) / sd if sd > 0 else 0.0
        out.append(score)
        hist.append(x)
    return out


def ema_zscores(
    values: Sequence[float], *, alpha: float = ZCLIP_ALPHA, z: float = ZCLIP_Z, warmup: int = ZCLIP_WARMUP
) -> list[float]:
    """ZClip's z-score: the mean and variance are initialised from the first ``warmup`` values, then
    each value's z-score is taken against the current EMA mean and standard deviation, and the EMAs
    are updated (``mu <- alpha mu + (1 - alpha) x``, ``var <- alpha var + (1 - alpha) (x - mu)^2``
    with the new ``mu``) with the value clipped to ``mu + z sd`` when it spikes (as ZClip updates
    with the clipped norm). 0.0 during warmup; inf for a non-finite value (the EMAs skip it)."""
    out: list[float] = []
    first: list[float] = []
    mu = var = 0.0
    for x in values:
        if not math.isfinite(x):
            out.append(math.inf)
            continue
        if len(first) < warmup:
            first.append(x)
            out.append(0.0)
            if len(first) == warmup:
                mu, var = statistics.fmean(first), statistics.pvariance(first)
            continue
        sd = math.sqrt(var)
        score = (x - mu) / sd if sd > 0 else 0.0
        out.append(score)
        kept = min(x, mu + z * sd) if score > z else x
        mu = alpha * mu + (1 - alpha) * kept
        var = alpha * var + (1 - alpha) * (kept - mu) ** 2
    return out


def ema_spikes(values: Sequence[float], **kwargs: Any) -> list[int]:
    """Indices whose ZClip EMA z-score exceeds ``ZCLIP_Z`` (or is non-finite)."""
    z = kwargs.get("z", ZCLIP_Z)
    return [t for t, s in enumerate(ema_zscores(values, **kwargs)) if not math.isfinite(s) or s > z]


def steps_to_measurements(run: Run, fired_steps: Sequence[int]) -> list[int]:
    """Training steps mapped to the latest measurement at or before each (what was known when the
    detector fired), deduplicated."""
    out = {bisect.bisect_right(run.steps, s) - 1 for s in fired_steps}
    return sorted(i for i in out if i >= 0)


def power_law_plateau(held: Sequence[float], i: int, window: int, steps: Sequence[int]) -> bool:
    """Whether a power law ``L(t) = b t^-c`` fitted (least squares in log-log) to the held-out losses
    of the last ``2 * window`` measurements up to ``i`` predicts a relative improvement below
    `PLATEAU_REL` over the next ``window`` measurements (False with fewer than 3 usable points)."""
    lo = max(0, i - 2 * window + 1)
    pts = [(steps[j], held[j]) for j in range(lo, i + 1) if steps[j] > 0 and math.isfinite(held[j]) and held[j] > 0]
    if len(pts) < 3:
        return False
    x = np.log([p[0] for p in pts])
    y = np.log([p[1] for p in pts])
    slope = float(np.polyfit(x, y, 1)[0])
    c = max(0.0, -slope)  # a fit that rises predicts no improvement
    t_now, t_next = steps[i], steps[i] + (steps[i] - steps[lo]) / max(1, i - lo) * window
    return 1 - (t_next / t_now) ** (-c) < PLATEAU_REL


def baseline_fires(runs: Sequence[Run], name: str, outcome: str, window: int) -> Fires:
    """Measurement indices where a fixed baseline detector fires in each run (those without a
    setting to tune; `config_prior` is `prior_fires`)."""
    out: Fires = []
    for run in runs:
        n = len(run.steps)
        if name == "olmo_loss":
            fired = steps_to_measurements(run, olmo_spikes(run.step_loss))
        elif name == "llmc_loss_z":
            fired = steps_to_measurements(run, zscore_spikes(run.step_loss))
        elif name == "zclip_loss":
            fired = steps_to_measurements(run, ema_spikes(run.step_loss))
        elif name == "grad_norm_z":
            fired = steps_to_measurements(run, zscore_spikes(run.grad_norm))
        elif name == "update_norm_z":
            fired = steps_to_measurements(run, zscore_spikes(run.update_norm))
        elif name == "persistence" and outcome == "spike":
            onsets = spike_onsets(run)
            fired = list(range(onsets[0], n)) if onsets else []
        elif name == "persistence":  # the loss already improved less than the plateau threshold
            fired = [i for i in range(window, n) if _flat_before(run.held_out, i, window)]
        elif name == "power_law":
            fired = [i for i in range(n) if power_law_plateau(run.held_out, i, window, run.steps)]
        else:
            raise KeyError(name)
        out.append(fired)
    return out


def _flat_before(held: Sequence[float], i: int, window: int) -> bool:
    before, now = held[i - window], held[i]
    if not (math.isfinite(before) and math.isfinite(now)) or before <= 0:
        return False
    return (before - now) / before < PLATEAU_REL


def prior_fires(runs: Sequence[Run], rule: tuple[str, float]) -> Fires:
    """The configuration prior: fire at every measurement of the runs whose learning rate is at
    least (``">="``) or at most (``"<="``) the rule's rate."""
    op, rate = rule
    return [list(range(len(r.steps))) if (r.lr >= rate if op == ">=" else r.lr <= rate) else [] for r in runs]


# ------------------------------------------------------------------------------------ scoring
#: Columns of a per-run score row.
HITS, SCORED, FIRED, ONSETS, CAUGHT, RAND_NUM, RAND_DEN, MATCH_NUM, MATCH_DEN = range(9)


class Scorer:
    """Scores detector firings on the study's runs: per-run rows of hits, scored events, outcome
    onsets caught, and the random-timing and time-matched expectations for the same events."""

    def __init__(self, runs: Sequence[Run], *, window: int) -> None:
        self.runs, self.window = list(runs), window
        self.states: dict[str, list[list[bool | None]]] = {}
        self.onsets: dict[str, list[list[int]]] = {}
        self.matched: dict[str, list[np.ndarray]] = {}
        _STATES.clear()
        for outcome in ("spike", "plateau"):
            self.states[outcome] = [outcome_states(r, outcome, window) for r in self.runs]
            self.onsets[outcome] = [
                [u for u in outcome_onsets(r, outcome, window) if u >= SCORE_FROM] for r in self.runs
            ]
            self.matched[outcome] = self._matched(outcome)

    def _matched(self, outcome: str) -> list[np.ndarray]:
        """Per run and measured index: the outcome rate at that index in the other seeds of the same
        configuration (NaN where none decides)."""
        out = []
        for r, run in enumerate(self.runs):
            n = len(run.steps)
            num, den = np.zeros(n), np.zeros(n)
            for q, other in enumerate(self.runs):
                if q == r or other.config != run.config:
                    continue
                st = self.states[outcome][q]
                for i in range(min(n, len(st))):
                    if st[i] is not None:
                        num[i] += bool(st[i])
                        den[i] += 1
            with np.errstate(invalid="ignore", divide="ignore"):
                out.append(np.where(den > 0, num / np.maximum(den, 1), np.nan))
        return out

    def rows(self, fires: Fires, outcome: str) -> np.ndarray:
        """``(runs, 9)`` per-run counts of ``fires`` judged against ``outcome``."""
        out = np.zeros((len(self.runs), 9))
        for r, idx in enumerate(fires):
            states = self.states[outcome][r]
            events = [i for i in idx if i >= SCORE_FROM]
            row = out[r]
            row[FIRED] = len(events)
            for i in events:
                if states[i] is None:
                    continue
                row[SCORED] += 1
                row[HITS] += bool(states[i])
                m = self.matched[outcome][r][i]
                if math.isfinite(m):
                    row[MATCH_NUM] += m
                    row[MATCH_DEN] += 1
            eligible = [bool(s) for s in states[SCORE_FROM:] if s is not None]
            if eligible and row[SCORED]:
                row[RAND_NUM] = row[SCORED] * sum(eligible) / len(eligible)
                row[RAND_DEN] = row[SCORED]
            onsets = self.onsets[outcome][r]
            row[ONSETS] = len(onsets)
            for u in onsets:
                # a plateau onset at u is a claim about what follows u: an event at u precedes it;
                # a spike onset at u has happened: only earlier events caught it
                last = u if outcome == "plateau" else u - 1
                row[CAUGHT] += any(u - self.window <= i <= last for i in events)
        return out


def ratio(rows: np.ndarray, num: int, den: int) -> float | None:
    d = float(rows[:, den].sum())
    return float(rows[:, num].sum()) / d if d > 0 else None


def bootstrap_interval(num: np.ndarray, den: np.ndarray, *, resamples: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                       level: float = 0.95) -> list[float] | None:  # fmt: skip
    """Percentile bootstrap interval over runs of the pooled ratio ``sum(num) / sum(den)``: runs drawn
    with replacement (a private numpy generator seeded ``seed``), resamples with ``sum(den) = 0``
    left out; None when fewer than 2 runs have ``den > 0``."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if int((den > 0).sum()) < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(resamples, len(num)))
    n, d = num[idx].sum(1), den[idx].sum(1)
    keep = d > 0
    values = n[keep] / d[keep]
    tail = (1 - level) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def summary(rows: np.ndarray) -> dict[str, Any]:
    """Precision, its interval, recall, events and runs flagged of pooled per-run rows."""
    return {
        "precision": ratio(rows, HITS, SCORED),
        "interval": bootstrap_interval(rows[:, HITS], rows[:, SCORED]),
        "recall": ratio(rows, CAUGHT, ONSETS),
        "events": int(rows[:, SCORED].sum()),
        "fired": int(rows[:, FIRED].sum()),
        "runs_flagged": int((rows[:, FIRED] > 0).sum()),
        "outcome_onsets": int(rows[:, ONSETS].sum()),
    }


def choose_rows(candidates: Sequence[tuple[Any, np.ndarray]], tune: Sequence[int], outcome: str) -> Any:
    """The candidate (setting, per-run rows) with the largest lift of precision over random timing on
    the tuning runs, among those with enough evidence there (plateau: `MIN_SCORED` scored events;
    spike: `MIN_FLAGGED_RUNS` flagged runs); ties: recall, then events. Without any candidate with
    enough evidence, the one with the most scored events."""

    def key(item: tuple[Any, np.ndarray]) -> tuple[float, ...]:
        rows = item[1][list(tune)]
        enough = (
            rows[:, SCORED].sum() >= MIN_SCORED
            if outcome == "plateau"
            else (rows[:, FIRED] > 0).sum() >= MIN_FLAGGED_RUNS
        )
        p, base = ratio(rows, HITS, SCORED), ratio(rows, RAND_NUM, RAND_DEN)
        lift = -math.inf if p is None else p - (base or 0.0)
        return (float(enough), lift if enough else float(rows[:, SCORED].sum()), ratio(rows, CAUGHT, ONSETS) or 0.0,
                float(rows[:, SCORED].sum()))  # fmt: skip

    return max(candidates, key=key)[0]


def choose_prior(scorer: Scorer, tune: Sequence[int], outcome: str) -> tuple[str, float]:
    """The configuration prior's rule (learning rate at least or at most a rate) with the best
    precision on the tuning runs, among rules that flag `MIN_FLAGGED_RUNS` tuning runs (ties: more
    runs flagged)."""
    rates = sorted({scorer.runs[r].lr for r in tune})
    best: tuple[tuple[float, float], tuple[str, float]] | None = None
    for op in (">=", "<="):
        for rate in rates:
            rows = scorer.rows(prior_fires(scorer.runs, (op, rate)), outcome)[list(tune)]
            flagged = float((rows[:, FIRED] > 0).sum())
            p = ratio(rows, HITS, SCORED)
            if p is None or flagged < min(MIN_FLAGGED_RUNS, len(tune)):
                continue
            if best is None or (p, flagged) > best[0]:
                best = ((p, flagged), (op, rate))
    return best[1] if best is not None else (">=", 0.0)


def make_folds(runs: Sequence[Run]) -> dict[str, list[dict[str, Any]]]:
    """The held-out schemes: two-fold by seed (first half of the seeds against the second, both
    directions) and leave one configuration out; each split names its tuning and test seeds or
    configurations and holds the run indices."""
    seeds = sorted({r.seed for r in runs})
    configs = list(dict.fromkeys(r.config for r in runs))
    half = [seeds[: len(seeds) // 2], seeds[len(seeds) // 2 :]]
    by_seed = []
    for a, b in ((0, 1), (1, 0)):
        by_seed.append({"tune_seeds": half[a], "test_seeds": half[b],
                        "tune": [i for i, r in enumerate(runs) if r.seed in half[a]],
                        "test": [i for i, r in enumerate(runs) if r.seed in half[b]]})  # fmt: skip
    loco = [{"test_configuration": c, "tune": [i for i, r in enumerate(runs) if r.config != c],
             "test": [i for i, r in enumerate(runs) if r.config == c]} for c in configs]  # fmt: skip
    return {"two_fold_by_seed": by_seed, "leave_one_configuration_out": loco}


def held_out(
    scorer: Scorer, splits: Sequence[dict[str, Any]], candidates: Sequence[tuple[Any, np.ndarray]], outcome: str
) -> tuple[np.ndarray, list[Any]]:
    """Per-run rows where each split's test runs are scored with the candidate chosen on its tuning
    runs (each run is in one test fold), and the choices."""
    pooled = np.zeros((len(scorer.runs), 9))
    chosen = []
    by_setting = {json.dumps(c[0], sort_keys=True): c[1] for c in candidates}
    for split in splits:
        if not split["tune"] or not split["test"]:
            continue
        pick = choose_rows(candidates, split["tune"], outcome)
        chosen.append(pick)
        rows = by_setting[json.dumps(pick, sort_keys=True)]
        pooled[split["test"]] = rows[split["test"]]
    return pooled, chosen


def held_out_prior(scorer: Scorer, splits: Sequence[dict[str, Any]], outcome: str) -> tuple[np.ndarray, list[Any]]:
    pooled = np.zeros((len(scorer.runs), 9))
    rules = []
    for split in splits:
        if not split["tune"] or not split["test"]:
            continue
        rule = choose_prior(scorer, split["tune"], outcome)
        rules.append(list(rule))
        pooled[split["test"]] = scorer.rows(prior_fires(scorer.runs, rule), outcome)[split["test"]]
    return pooled, rules


def redundancy_rows(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run: (events whose flagged heads cost no more than the mean of the random draws, events),
    the random-heads baseline (each draw against the mean of the other draws: hits, draws), and the
    summed cost difference (flagged minus random-mean) with the event count."""
    sig, base, diff = np.zeros((len(runs), 9)), np.zeros((len(runs), 9)), np.zeros((len(runs), 2))
    for r, run in enumerate(runs):
        for a in run.ablations:
            sig[r, SCORED] += 1
            sig[r, FIRED] += 1
            sig[r, HITS] += a["loss_increase"] <= a["random_loss_increase"]
            diff[r] += (a["loss_increase"] - a["random_loss_increase"], 1)
            draws = a["random_draws"]
            for k, d in enumerate(draws):
                others = draws[:k] + draws[k + 1 :]
                if others:
                    base[r, SCORED] += 1
                    base[r, HITS] += d <= statistics.fmean(others)
    return sig, base, diff


def score_signals(runs: Sequence[Run], *, window: int, every: int) -> dict[str, Any]:
    """Every signal and baseline, held out under both schemes; the settings chosen on all runs;
    the threshold curves."""
    scorer = Scorer(runs, window=window)
    folds = make_folds(runs)
    fixed: dict[tuple[str, str], np.ndarray] = {}
    for outcome, names in (("spike", SPIKE_BASELINES), ("plateau", PLATEAU_BASELINES)):
        for name in names:
            if name not in ("random_timing", "time_matched", "config_prior"):
                fixed[(outcome, name)] = scorer.rows(baseline_fires(runs, name, outcome, window), outcome)
    schemes: dict[str, dict[str, Any]] = {s: {} for s in folds}
    chosen_all: dict[str, Any] = {}
    curves: dict[str, list[list[float | None]]] = {}
    everyone = list(range(len(runs)))
    for signal, outcome in SIGNALS.items():
        if outcome == "ablation":
            sig, base, _ = redundancy_rows(runs)
            for scheme in folds:  # nothing is tuned: the live events at the runs' threshold are held out as they are
                row = summary(sig)
                row.update(outcome="ablation cheaper than random heads of the same layers", recall=None,
                           baselines={"random_heads": ratio(base, HITS, SCORED)})  # fmt: skip
                schemes[scheme][signal] = row
            continue
        t0 = time.perf_counter()
        candidates = [(s, scorer.rows(signal_fires(runs, signal, s, every=every), outcome))
                      for s in signal_grid(signal)]  # fmt: skip
        log(f"scored {signal}: {len(candidates)} settings in {time.perf_counter() - t0:.0f} s")
        for scheme, splits in folds.items():
            rows, picks = held_out(scorer, splits, candidates, outcome)
            row = summary(rows)
            row["outcome"] = f"held-out {outcome} within {window} measurements"
            baselines: dict[str, float | None] = {
                "random_timing": ratio(rows, RAND_NUM, RAND_DEN),
                "time_matched": ratio(rows, MATCH_NUM, MATCH_DEN),
            }
            prior_rows, rules = held_out_prior(scorer, splits, outcome)
            baselines["config_prior"] = ratio(prior_rows, HITS, SCORED)
            for name in SPIKE_BASELINES if outcome == "spike" else PLATEAU_BASELINES:
                if (outcome, name) in fixed:
                    baselines[name] = ratio(fixed[(outcome, name)], HITS, SCORED)
            row["baselines"] = baselines
            row["baseline_recall"] = {name: ratio(fixed[(outcome, name)], CAUGHT, ONSETS)
                                      for name in baselines if (outcome, name) in fixed}  # fmt: skip
            row["settings_chosen_on_tuning_folds"] = picks
            row["config_prior_rules"] = rules
            schemes[scheme][signal] = row
        pick = choose_rows(candidates, everyone, outcome)
        rows = dict((json.dumps(c[0], sort_keys=True), c[1]) for c in candidates)[json.dumps(pick, sort_keys=True)]
        chosen_all[signal] = {"setting": pick, "in_sample": summary(rows)}
        param = CURVE_PARAMETER[signal]
        curve = []
        for s, r in candidates:
            if all(s[k] == pick[k] for k in s if k != param):
                curve.append([float(s[param]), ratio(r, HITS, SCORED), ratio(r, CAUGHT, ONSETS)])
        curves[signal] = sorted(curve, key=lambda c: cast(float, c[0]))
    for scheme in schemes:
        for row in schemes[scheme].values():
            known = {k: v for k, v in row["baselines"].items() if v is not None}
            best = max(known, key=lambda k: known[k]) if known else None
            row["best_baseline"] = best
            row["best_baseline_precision"] = known[best] if best is not None else None
            row["beats_best_baseline"] = bool(
                row["interval"] is not None and best is not None and row["interval"][0] > known[best]
            )
    for scheme in schemes:
        for signal in schemes[scheme]:
            schemes[scheme][signal]["default_on"] = all(schemes[s][signal]["beats_best_baseline"] for s in schemes)
    return {"folds": folds, "schemes": schemes, "chosen_on_all_runs": chosen_all, "curves": curves,
            "fixed_baselines": {f"{o}/{n}": summary(r) for (o, n), r in fixed.items()}}  # fmt: skip


# ------------------------------------------------------------------------ added information
BASE_FEATURES = ("loss_llmc_z", "loss_zclip_z", "grad_norm_z", "update_norm_z", "log_grad_norm", "log_update_norm",
                 "train_loss_over_best", "held_out_over_best", "already_spiked")  # fmt: skip
HEAD_FEATURES = ("key_hdi", "effective_heads", "entropy_over_uniform", "log_max_logit", "log_max_logit_growth",
                 "log_logit_bound", "log_logit_bound_growth", "update_entropy")  # fmt: skip


def _log(x: float | None) -> float:
    return math.log(x) if x is not None and math.isfinite(x) and x > 0 else math.nan


def run_features(run: Run) -> np.ndarray:
    """``(measurements, base + head features)``: at each measurement, the loss and gradient baselines'
    statistics over the steps since the previous measurement (largest z-scores, norms, the losses
    against their best so far, whether the run already spiked) and the head signals (model-mean key
    HDI, effective heads, the lowest attention entropy over uniform, the largest attention logit and
    logit bound and their growth over 5 measurements, the lowest update entropy)."""
    n = len(run.steps)
    zl, el = zscores(run.step_loss), ema_zscores(run.step_loss)
    zg, zu = zscores(run.grad_norm), zscores(run.update_norm)
    onsets = spike_onsets(run)
    first = onsets[0] if onsets else n
    out = np.full((n, len(BASE_FEATURES) + len(HEAD_FEATURES)), np.nan)
    best_train = best_held = math.inf
    layers = sorted(run.logit_bound)
    logits = [_max_logit(run, i) for i in range(n)]
    bounds = [
        max((v for la in layers if (v := run.logit_bound[la][i]) is not None), default=math.nan) for i in range(n)
    ]
    for i, step in enumerate(run.steps):
        lo = run.steps[i - 1] + 1 if i else 0
        span = slice(lo, step + 1)

        def top(values: list[float], span: slice = span) -> float:
            part = [min(v, 50.0) for v in values[span]]
            return max(part) if part else math.nan

        for v in run.step_loss[span]:
            if math.isfinite(v):
                best_train = min(best_train, v)
        held = run.held_out[i]
        best_held = min(best_held, held) if math.isfinite(held) else best_held
        train = run.step_loss[step] if step < len(run.step_loss) else math.nan
        ents = [e / u for la in layers if (e := run.kernel[f"{la}/entropy"][i]) is not None
                and (u := run.kernel[f"{la}/uniform"][i]) is not None and u > 0]  # fmt: skip
        ues = [v for la in layers if (v := run.update_entropy.get(la, [None] * n)[i]) is not None]
        back = max(0, i - 5)
        out[i] = [
            top(zl), top(el), top(zg), top(zu),
            _log(run.grad_norm[step] if step < len(run.grad_norm) else None),
            _log(run.update_norm[step] if step < len(run.update_norm) else None),
            train / best_train if math.isfinite(train) and math.isfinite(best_train) else math.nan,
            held / best_held if math.isfinite(held) and math.isfinite(best_held) else math.nan,
            float(i > first),
            run.hdi.get("key", [math.nan] * n)[i], run.effective_heads[i] if i < len(run.effective_heads) else math.nan,
            min(ents) if ents else math.nan, _log(logits[i]), _log(logits[i]) - _log(logits[back]),
            _log(bounds[i]), _log(bounds[i]) - _log(bounds[back]), min(ues) if ues else math.nan,
        ]  # fmt: skip
    return np.clip(out, -1e6, 1e6)


def fit_logistic(x: np.ndarray, y: np.ndarray, *, l2: float = 1e-2) -> np.ndarray:
    """Weights (bias last) of an L2-regularised logistic regression (mean log-loss plus ``l2`` times
    the squared weights, bias free), by L-BFGS (`scipy.optimize.minimize`)."""
    from scipy.optimize import minimize

    a = np.hstack([x, np.ones((len(x), 1))])

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = a @ w
        p = 1 / (1 + np.exp(-np.clip(z, -50, 50)))
        value = float(np.mean(np.logaddexp(0, z) - y * z) + l2 * np.sum(w[:-1] ** 2))
        grad = a.T @ (p - y) / len(y)
        grad[:-1] += 2 * l2 * w[:-1]
        return value, grad

    return np.asarray(minimize(loss, np.zeros(a.shape[1]), jac=True, method="L-BFGS-B").x)


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (the Mann-Whitney statistic, ties half); None without both classes."""
    from scipy.stats import rankdata

    pos, n = int(labels.sum()), len(labels)
    if pos == 0 or pos == n:
        return None
    ranks = rankdata(scores)
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * (n - pos)))


def bootstrap_auc(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[float] | None:
    """Percentile interval of the pooled AUC, runs (``(scores, labels)`` parts) drawn with replacement."""
    if len(parts) < 2:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    values = []
    for _ in range(BOOTSTRAP):
        pick = rng.integers(0, len(parts), len(parts))
        s = np.concatenate([parts[k][0] for k in pick])
        lab = np.concatenate([parts[k][1] for k in pick])
        v = auc(s, lab)
        if v is not None:
            values.append(v)
    if not values:
        return None
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def added_information(runs: Sequence[Run], folds: dict[str, Any], *, window: int) -> dict[str, Any]:
    """Held-out AUC (two-fold by seed) of predicting a held-out spike from the loss and gradient
    baselines alone and with the head signals added: within the window at every measurement from
    `SCORE_FROM` on, and by run (features: the largest value of each over measurements `SCORE_FROM`
    to `SCORE_FROM` + window; label: a spike onset after that)."""
    feats = [run_features(r) for r in runs]
    states = [outcome_states(r, "spike", window) for r in runs]
    nb = len(BASE_FEATURES)
    window_data, run_data = [], []
    for r, run in enumerate(runs):
        keep = [i for i in range(SCORE_FROM, len(run.steps)) if states[r][i] is not None]
        window_data.append((feats[r][keep], np.array([float(bool(states[r][i])) for i in keep])))
        k0 = SCORE_FROM + window
        if len(run.steps) > k0:
            with np.errstate(all="ignore"):
                x = np.nanmax(feats[r][SCORE_FROM : k0 + 1], axis=0, keepdims=True)
            run_data.append((r, x, np.array([float(any(u > k0 for u in spike_onsets(run)))])))
        else:
            run_data.append((r, np.zeros((0, feats[r].shape[1])), np.zeros(0)))

    def evaluate(data: list[tuple[np.ndarray, np.ndarray]], columns: int) -> dict[str, Any]:
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for split in folds["two_fold_by_seed"]:
            tx = np.vstack([data[r][0][:, :columns] for r in split["tune"]])
            ty = np.concatenate([data[r][1] for r in split["tune"]])
            if len(ty) == 0 or ty.min() == ty.max():
                continue
            with np.errstate(all="ignore"):
                mu, sd = np.nanmean(tx, axis=0), np.nanstd(tx, axis=0)
            mu, sd = np.nan_to_num(mu), np.where(np.isfinite(sd) & (sd > 0), sd, 1.0)

            def norm(x: np.ndarray, mu: np.ndarray = mu, sd: np.ndarray = sd) -> np.ndarray:
                return np.nan_to_num((x[:, :columns] - mu) / sd)

            w = fit_logistic(norm(tx), ty)
            for r in split["test"]:
                x, y = data[r]
                if len(y):
                    parts.append((np.hstack([norm(x), np.ones((len(x), 1))]) @ w, y))
        if not parts:
            return {"auc": None, "interval": None, "measurements": 0, "positives": 0}
        s, lab = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        return {
            "auc": auc(s, lab),
            "interval": bootstrap_auc(parts),
            "measurements": len(lab),
            "positives": int(lab.sum()),
        }

    total = nb + len(HEAD_FEATURES)
    by_run = [(x, y) for _, x, y in run_data]
    return {
        "outcome": f"held-out spike onset within the next {window} measurements (from measurement {SCORE_FROM} on); "
        "logistic regression fitted on the tuning seeds, scored on the others (two-fold by seed)",
        "without_head_signals": evaluate(window_data, nb),
        "with_head_signals": evaluate(window_data, total),
        "base_features": list(BASE_FEATURES),
        "head_features": list(HEAD_FEATURES),
        "by_run": {
            "outcome": f"the run spikes after measurement {SCORE_FROM + window} (features: the largest value of each "
            f"over measurements {SCORE_FROM} to {SCORE_FROM + window})",
            "without_head_signals": evaluate(by_run, nb),
            "with_head_signals": evaluate(by_run, total),
        },
    }


# --------------------------------------------------------------------------- saturation's use
def _pruned(values: Sequence[float], k: int, *, highest: bool) -> set[int]:
    order = sorted(range(len(values)), key=lambda h: (values[h], h), reverse=highest)
    return set(order[:k])


def compare_rankings(now: dict[str, Any], end: dict[str, Any]) -> dict[str, float] | None:
    """Rank correlation (`scipy.stats.spearmanr`) of the heads' importance and diversity rankings at
    a time with those at the end, and the overlap (shared fraction) of the heads a
    `PRUNE_FRACTION` pruning would remove (the least important; the most redundant)."""
    from scipy.stats import spearmanr

    out: dict[str, float] = {}
    for name, highest in (("importance", False), ("redundancy", True)):
        a, b = np.array(now[name], dtype=float), np.array(end[name], dtype=float)
        if len(a) != len(b) or len(a) < 3 or not (np.isfinite(a).all() and np.isfinite(b).all()):
            return None
        rho = spearmanr(a, b).statistic
        label = "importance" if name == "importance" else "diversity"
        out[f"{label}_rank_correlation"] = float(rho) if math.isfinite(rho) else math.nan
        k = max(1, round(PRUNE_FRACTION * len(a)))
        out[f"{label}_pruned_overlap"] = (
            len(_pruned(a.tolist(), k, highest=highest) & _pruned(b.tolist(), k, highest=highest)) / k
        )
    return out


def saturation_use(runs: Sequence[Run], fires: Fires) -> dict[str, Any]:
    """At each held-out saturation event (``fires``) and at as many random measured times of the same
    runs (a private generator), how close the head rankings and pruned sets are to the end's."""
    rng = np.random.default_rng(BOOTSTRAP_SEED + 1)
    metrics = ("importance_rank_correlation", "importance_pruned_overlap", "diversity_rank_correlation",
               "diversity_pruned_overlap")  # fmt: skip
    sums = {kind: np.zeros((len(runs), len(metrics) + 1)) for kind in ("event", "random")}
    for r, run in enumerate(runs):
        if run.diverged_at is not None or not run.rankings or run.rankings[-1]["index"] != len(run.steps) - 1:
            continue
        end = run.rankings[-1]
        known = [x["index"] for x in run.rankings[:-1]]
        if not known:
            continue
        events = [i for i in fires[r] if SCORE_FROM <= i < end["index"]]
        pool = list(range(max(SCORE_FROM, known[0]), end["index"]))
        randoms = [int(x) for x in rng.choice(pool, size=len(events), replace=True)] if pool and events else []
        for kind, times in (("event", events), ("random", randoms)):
            for i in times:
                ranking = run.rankings[bisect.bisect_right(known, i) - 1]
                row = compare_rankings(ranking, end)
                if row is None or not all(math.isfinite(row[m]) for m in metrics):
                    continue
                sums[kind][r] += [row[m] for m in metrics] + [1]
    out: dict[str, Any] = {
        "times": {kind: int(s[:, -1].sum()) for kind, s in sums.items()},
        "pruned_fraction": PRUNE_FRACTION,
        "ranking": "importance: held-out loss increase when the head alone is ablated; diversity: the negative of "
        "the head's mean absolute weight overlap with the other heads of its layer; the ranking in force at a time "
        f"is the latest one taken (every {RANK_EVERY} measurements)",
        "pruned_then_trained": "not run: the study's budget (60 minutes on 2 cores) does not hold a second training "
        "per event; only the rankings and pruned sets are compared",
    }
    for j, m in enumerate(metrics):
        out[m] = {
            kind: {
                "mean": ratio(np.stack([s[:, j], s[:, -1]], 1), 0, 1),
                "interval": bootstrap_interval(s[:, j], s[:, -1]),
            }
            for kind, s in sums.items()
        }
    return out


def layer_final(run: Run, stat: str, reduce: Any) -> float | None:
    """``reduce`` over the layers of the last measured value of a kernel statistic."""
    values = [v[-1] for k, v in run.kernel.items() if k.endswith(f"/{stat}") and v and v[-1] is not None]
    return reduce(values) if values else None


def _max_logit(run: Run, i: int) -> float:
    """The largest attention logit over the layers at measurement ``i`` (NaN if none)."""
    values = [v for k, series in run.kernel.items() if k.endswith("/max_logit") and (v := series[i]) is not None]
    return max(values, default=math.nan)


# ------------------------------------------------------------------------------------- output
def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else "-"
    return str(value)


def _interval(iv: Sequence[float] | None, digits: int = 2) -> str:
    return "" if iv is None else f" [{iv[0]:.{digits}f}, {iv[1]:.{digits}f}]"


def headline_table(results: dict[str, Any]) -> list[str]:
    """The one table the page opens with: held out (two-fold by seed), against the best baseline."""
    lines = [
        "| signal | outcome | held-out precision [95% interval] | recall | best baseline (precision) | default on? |",
        "|---|---|---|---:|---|---|",
    ]
    for signal, row in results["out_of_sample"].items():
        best = row["best_baseline"]
        lines.append(
            f"| {signal} | {row['outcome']} | {fmt(row['precision'])}{_interval(row['interval'])} "
            f"({row['events']} events, {row['runs_flagged']} runs) | {fmt(row['recall'])} | "
            f"{best or '-'} ({fmt(row['best_baseline_precision'])}) | {'yes' if row['default_on'] else 'no'} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown, opening with the one table of what the warnings are worth."""
    ai = results["added_information"]
    lines = headline_table(results) + [
        "",
        f"Measured by `{results['command']}` ({results['runs']} runs of {results['steps']} steps, "
        f"{results['seconds'] / 60:.0f} min on {results['machine']}); one measurement every "
        f"{results['every_n_steps']} steps, outcome window {results['window_measurements']} measurements, events and "
        f"outcomes counted from measurement {SCORE_FROM} on. Held out: every setting was chosen on one half of the "
        f"seeds ({', '.join(str(f['tune_seeds']) for f in results['folds']['two_fold_by_seed'])}) and scored on the "
        "other, both ways; the interval is a 95% percentile bootstrap over runs "
        f"({BOOTSTRAP} resamples). A signal is on by default only if the interval's lower end is above the best "
        "baseline's precision on the same runs, in this scheme and leaving one configuration out. Default on: "
        f"{', '.join(results['defaults_on']) or 'none'}.",
        "",
        "Leaving one configuration out (tuned on the other configurations, scored on it):",
        "",
        "| signal | held-out precision [95% interval] | recall | best baseline (precision) | beats it? |",
        "|---|---|---:|---|---|",
    ]
    for signal, row in results["leave_one_configuration_out"].items():
        lines.append(
            f"| {signal} | {fmt(row['precision'])}{_interval(row['interval'])} ({row['events']} events) | "
            f"{fmt(row['recall'])} | {row['best_baseline'] or '-'} ({fmt(row['best_baseline_precision'])}) | "
            f"{'yes' if row['beats_best_baseline'] else 'no'} |"
        )
    names = list(dict.fromkeys(n for row in results["out_of_sample"].values() for n in row["baselines"]))
    lines += [
        "",
        "Every baseline's held-out precision on the same runs and outcomes (two-fold by seed; random timing and "
        "time-matched fire as often as the signal, at the same runs' measured steps).",
        "",
        "| signal | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for signal, row in results["out_of_sample"].items():
        lines.append(f"| {signal} | " + " | ".join(fmt(row["baselines"].get(n)) for n in names) + " |")
    wo, wi = ai["without_head_signals"], ai["with_head_signals"]
    bw, bi = ai["by_run"]["without_head_signals"], ai["by_run"]["with_head_signals"]
    lines += [
        "",
        f"Does head information add anything? Held-out AUC of predicting a spike ({ai['outcome']}): loss and gradient "
        f"baselines alone {fmt(wo['auc'])}{_interval(wo['interval'])}, with the head signals added "
        f"{fmt(wi['auc'])}{_interval(wi['interval'])} ({wo['measurements']} measurements, {wo['positives']} before "
        f"a spike). By run ({ai['by_run']['outcome']}): {fmt(bw['auc'])}{_interval(bw['interval'])} against "
        f"{fmt(bi['auc'])}{_interval(bi['interval'])}.",
    ]
    su = results["saturation_use"]
    lines += [
        "",
        f"What saturation is for: at {su['times']['event']} held-out saturation events and {su['times']['random']} "
        "random times, how close the heads' rankings and 30%-pruned sets are to the end's (mean [95% interval over "
        f"runs]). {su['ranking']}. Pruned, then trained on: {su['pruned_then_trained']}.",
        "",
        "| measure | at saturation events | at random times |",
        "|---|---|---|",
    ]
    for m in ("importance_rank_correlation", "importance_pruned_overlap", "diversity_rank_correlation",
              "diversity_pruned_overlap"):  # fmt: skip
        ev, rn = su[m]["event"], su[m]["random"]
        lines.append(f"| {m.replace('_', ' ')} | {fmt(ev['mean'])}{_interval(ev['interval'])} | "
                     f"{fmt(rn['mean'])}{_interval(rn['interval'])} |")  # fmt: skip
    red = results["redundancy"]
    lines += [
        "",
        f"Redundancy: ablating the heads a redundancy event flags costs {fmt(red['flagged_loss_increase'], 4)} held-out "
        f"loss against {fmt(red['random_loss_increase'], 4)} for random heads of the same layers (difference "
        f"{fmt(red['difference'], 4)}{_interval(red['difference_interval'], 4)}, "
        f"{red['events']} events).",
        "",
        "Settings to ship, **chosen on all runs** (in-sample: these figures are not evidence; the held-out ones above "
        "are):",
        "",
        "| signal | setting | in-sample precision | recall |",
        "|---|---|---:|---:|",
    ]
    for signal, setting in results["chosen_on_all_runs"].items():
        ins = results["chosen_on_all_runs_in_sample"].get(signal, {})
        text = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in setting.items())
        lines.append(f"| {signal} | {text} | {fmt(ins.get('precision'))} | {fmt(ins.get('recall'))} |")
    lines += [
        "",
        "Per configuration (seed means): spike onsets after warmup and the runs they fell in.",
        "",
        "| configuration | final held-out loss | spike onsets | diverged | max attention logit (final) | "
        "logit bound (final) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results["configurations"].items():
        lines.append(
            f"| {name} | {fmt(row['final_held_out'], 3)} | {row['spike_onsets']} in {row['spiking_runs']} of "
            f"{row['seeds']} | {row['diverged']} | {fmt(row['final_max_logit'], 1)} | {fmt(row['final_logit_bound'], 1)} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[Run], path: Path) -> None:
    """Held-out loss (spike onsets starred), the largest attention logit and the largest logit bound
    of every run, one column per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.config for r in runs))
    fig, axes = plt.subplots(3, len(names), figsize=(2.2 * len(names), 6.0), squeeze=False, sharex=True)
    for col, name in enumerate(names):
        for run in (r for r in runs if r.config == name):
            (line,) = axes[0][col].plot(run.steps, run.held_out, lw=0.8)
            for i in spike_onsets(run):
                axes[0][col].plot(run.steps[i], run.held_out[i] if math.isfinite(run.held_out[i]) else 0, "*",
                                  ms=6, color=line.get_color())  # fmt: skip
            axes[1][col].plot(run.steps, [_max_logit(run, i) for i in range(len(run.steps))], lw=0.8,
                              color=line.get_color())  # fmt: skip
            bounds = [max((v for s in run.logit_bound.values() if (v := s[i]) is not None), default=math.nan)
                      for i in range(len(run.steps))]  # fmt: skip
            axes[2][col].plot(run.steps, bounds, lw=0.8, color=line.get_color())
        axes[0][col].set_title(name, fontsize=7)
        for row in (1, 2):
            axes[row][col].set_yscale("log")
        finite = [v for r in runs if r.config == name for s, v in zip(r.steps, r.held_out, strict=True)
                  if s >= LR_WARMUP and math.isfinite(v)]  # fmt: skip
        if finite:  # the first steps' loss would flatten everything after
            axes[0][col].set_ylim(min(finite) - 0.1, min(max(finite), 2 * min(finite)) + 0.1)
        axes[2][col].set_xlabel("step")
    axes[0][0].set_ylabel("held-out loss (*: spikes)")
    axes[1][0].set_ylabel("max attention logit")
    axes[2][0].set_ylabel("logit bound (weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=60)
    plt.close(fig)


BEGIN, END = "<!-- warnings-study:begin", "<!-- warnings-study:end -->"


def replace_block(page: Path, text: str) -> None:
    """Replace what lies between the page's begin line (``<!-- warnings-study:begin ... -->``, kept as
    it is) and its end line with ``text``."""
    body = page.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} block")
    head, rest = body.split(BEGIN, 1)
    marker, rest = rest.split("\n", 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}{marker}\n{text}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--corpus", type=Path, default=None, help="a text file (default: stdlib docstrings)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="two seeds, three configurations, few steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 1500; quick 45)")
    parser.add_argument("--every", type=int, default=None, help="measure every N steps (default 10; quick 3)")
    parser.add_argument(
        "--window", type=int, default=None, help="outcome window, in measurements (default 10; quick 3)"
    )
    parser.add_argument("--configs", nargs="+", default=None, choices=[c.name for c in CONFIGS])
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once, one CPU thread each (default 2)")
    parser.add_argument(
        "--docs", type=Path, default=None, help="a docs page whose generated block to replace (the plot goes to img/)"
    )
    parser.add_argument(
        "--rescore", action="store_true",
        help="train nothing: score again the runs recorded in --out (with this version's scoring)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    command = "python benchmarks/warnings_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.rescore:
        recorded = json.loads((args.out / META_FILE).read_text())
        with gzip.open(args.out / SERIES_FILE, "rt") as f:
            runs = [Run(**row) for row in json.load(f)]
        meta = {k: recorded[k] for k in ("command", "seeds", "steps", "every_n_steps", "corpus", "machine", "seconds")}
        meta["window_measurements"] = window = args.window or recorded["window_measurements"]
        meta["rescored_by"] = command
    else:
        seeds = args.seeds[:2] if args.quick else args.seeds
        configs = args.configs or (list(QUICK_CONFIGS) if args.quick else [c.name for c in CONFIGS])
        steps = args.steps or (45 if args.quick else 1500)
        every = args.every or (3 if args.quick else 10)
        window = args.window or (3 if args.quick else 10)
        if steps < 2 * every or every < 1 or window < 1 or args.jobs < 1 or len(seeds) < 2 or len(configs) < 2:
            parser.error(
                "need --steps >= 2 * --every >= 2, --window >= 1, --jobs >= 1, two seeds and two configurations"
            )
        start = time.perf_counter()
        runs = train_all(args, seeds, configs, steps=steps, every=every)
        meta = {
            "command": command,
            "seeds": seeds,
            "steps": steps,
            "every_n_steps": every,
            "corpus": str(args.corpus) if args.corpus else "stdlib docstrings",
            "machine": f"{args.jobs} worker processes of one thread each, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "seconds": time.perf_counter() - start,
            "window_measurements": window,
        }  # fmt: skip
        # the runs and their metadata first: a scoring that fails can be redone with --rescore
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / META_FILE).write_text(json.dumps(meta, indent=1))
        write_series(args.out, runs)
    results = score_runs(runs, meta, window=window)
    args.out.mkdir(parents=True, exist_ok=True)
    results.pop("series")
    (args.out / "warnings_study.json").write_text(json.dumps(finite(results), indent=1, allow_nan=False))
    plot(runs, args.out / "warnings_study.png")
    table = markdown(finite(results))
    (args.out / "warnings_study.md").write_text(table)
    if args.docs is not None:
        image = args.docs.parent / "img" / "warnings_study.png"
        image.parent.mkdir(exist_ok=True)
        shutil.copyfile(args.out / "warnings_study.png", image)
        replace_block(args.docs, f"{table}\n![What the study's runs recorded](img/warnings_study.png)\n")
    print(table)
    log(f"done; wrote {args.out / 'warnings_study.json'}")
    return 0


def write_series(out: Path, runs: Sequence[Run]) -> None:
    """Every run's recorded series, for --rescore; mtime 0: the same runs give the same bytes."""
    data = json.dumps(finite([asdict(r) for r in runs]), allow_nan=False, separators=(",", ":")).encode()
    (out / SERIES_FILE).write_bytes(gzip.compress(data, mtime=0))


def train_all(args: argparse.Namespace, seeds: list[int], configs: list[str], *, steps: int, every: int) -> list[Run]:
    """Every (configuration, seed) run, ``--jobs`` at a time, in job order (progress logged as runs end)."""
    docs = file_documents(args.corpus) if args.corpus else stdlib_documents()
    streams = split_tokens(docs, seed=0)
    log(f"corpus: {len(docs)} documents, {len(streams[0])} train / {len(streams[1])} held-out bytes")
    jobs = [(cfg, seed) for cfg in CONFIGS if cfg.name in configs for seed in seeds]
    start = time.perf_counter()
    with ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=mp.get_context("spawn"), initializer=_one_thread
    ) as pool:
        futures = [pool.submit(train_run, cfg, seed, streams, steps=steps, every=every) for cfg, seed in jobs]
        log(f"{len(jobs)} runs of {steps} steps, {args.jobs} at a time; worker pids: "
            f"{' '.join(str(p) for p in getattr(pool, '_processes', {}) or {})}")  # fmt: skip
        for done, future in enumerate(as_completed(futures), 1):
            run = future.result()
            elapsed = time.perf_counter() - start
            log(f"run {done}/{len(jobs)} {run.config} seed {run.seed}: held-out "
                f"{run.held_out[-1] if run.held_out else math.nan:.3f}, {len(run.events)} events, {run.seconds:.0f} s; "
                f"elapsed {elapsed / 60:.1f} min, about {elapsed / done * (len(jobs) - done) / 60:.0f} min left")  # fmt: skip
        return [f.result() for f in futures]  # in job order: the results file does not depend on --jobs


def score_runs(runs: list[Run], meta: dict[str, Any], *, window: int) -> dict[str, Any]:
    """The results file's contents: ``meta`` (command, seeds, steps, ...), the held-out scores of
    every signal against every baseline, the added information, saturation's use, the redundancy
    ablations, the settings chosen on all runs, per-configuration summaries and every run's series."""
    t0 = time.perf_counter()
    every = meta["every_n_steps"]
    by_name = {c.name: c for c in CONFIGS}
    configurations = {}
    for name in dict.fromkeys(r.config for r in runs):
        rs = [r for r in runs if r.config == name]
        finals = [r.held_out[-1] for r in rs if r.held_out and math.isfinite(r.held_out[-1])]
        configurations[name] = {
            **asdict(by_name[name]),
            "seeds": len(rs),
            "diverged": sum(r.diverged_at is not None for r in rs),
            "final_held_out": _mean(finals),
            "events": sum(len(r.events) for r in rs),
            "spike_onsets": sum(u >= SCORE_FROM for r in rs for u in spike_onsets(r)),
            "spiking_runs": sum(any(u >= SCORE_FROM for u in spike_onsets(r)) for r in rs),
            "final_max_logit": _mean([layer_final(r, "max_logit", max) for r in rs]),
            "final_logit_bound": _mean(
                [max((v[-1] for v in r.logit_bound.values() if v and v[-1] is not None), default=None) for r in rs]
            ),  # fmt: skip
        }
    scored = score_signals(runs, window=window, every=every)
    folds = scored["folds"]
    main_scheme = scored["schemes"]["two_fold_by_seed"]
    keys = ("outcome", "precision", "interval", "recall", "baselines", "best_baseline", "best_baseline_precision",
            "default_on", "events", "runs_flagged")  # fmt: skip
    out_of_sample = {s: {k: row[k] for k in keys} for s, row in main_scheme.items()}
    loco = {s: {k: row[k] for k in (*keys, "beats_best_baseline")} for s, row in
            scored["schemes"]["leave_one_configuration_out"].items()}  # fmt: skip
    details = {scheme: {s: {k: v for k, v in row.items() if k not in keys} for s, row in rows.items()}
               for scheme, rows in scored["schemes"].items()}  # fmt: skip
    # saturation's use: the held-out saturation events (settings chosen on the other seeds)
    sat_fires: Fires = [[] for _ in runs]
    for split, pick in zip(
        folds["two_fold_by_seed"],
        details["two_fold_by_seed"]["saturation/hdi"]["settings_chosen_on_tuning_folds"],
        strict=True,
    ):
        fires = signal_fires(runs, "saturation/hdi", pick, every=every)
        for r in split["test"]:
            sat_fires[r] = fires[r]
    _, _, diff = redundancy_rows(runs)
    flagged = [a["loss_increase"] for r in runs for a in r.ablations]
    randoms = [a["random_loss_increase"] for r in runs for a in r.ablations]
    chosen = {s: dict(v["setting"]) for s, v in scored["chosen_on_all_runs"].items()}
    chosen["redundancy"] = {"redundancy_threshold": RUN_HDI["redundancy_threshold"]}
    results = {
        **meta,
        "window_measurements": window,
        "window_steps": window * every,
        "score_from_measurement": SCORE_FROM,
        "plateau_rel": PLATEAU_REL,
        "spike_rel": SPIKE_REL,
        "bootstrap": {"resamples": BOOTSTRAP, "seed": BOOTSTRAP_SEED, "level": 0.95, "method": "percentile, over runs"},
        "runs": len(runs),
        "folds": {
            "two_fold_by_seed": [
                {"tune_seeds": f["tune_seeds"], "test_seeds": f["test_seeds"]} for f in folds["two_fold_by_seed"]
            ],
            "leave_one_configuration_out": [
                {"test_configuration": f["test_configuration"]} for f in folds["leave_one_configuration_out"]
            ],
        },  # fmt: skip
        "out_of_sample": out_of_sample,
        "leave_one_configuration_out": loco,
        "out_of_sample_details": details,
        "defaults_on": [s for s, row in out_of_sample.items() if row["default_on"]],
        "added_information": added_information(runs, folds, window=window),
        "chosen_on_all_runs": chosen,
        "chosen_on_all_runs_in_sample": {s: v["in_sample"] for s, v in scored["chosen_on_all_runs"].items()},
        "chosen_on_all_runs_note": "settings to ship as detector defaults, chosen on all runs: their in-sample "
        "figures are not evidence (see out_of_sample)",
        "curves": scored["curves"],
        "curves_note": "[threshold, precision, recall] on all runs, the curve's parameter varied and the others at "
        "the all-runs choice (in-sample)",
        "saturation_use": saturation_use(runs, sat_fires),
        "redundancy": {
            "events": len(flagged),
            "flagged_loss_increase": _mean(flagged),
            "random_loss_increase": _mean(randoms),
            "difference": ratio(diff, 0, 1),
            "difference_interval": bootstrap_interval(diff[:, 0], diff[:, 1]),
        },
        "fixed_baselines": scored["fixed_baselines"],
        "configurations": configurations,
        "replay_check": replay_check(runs, every=every),
        "scoring_seconds": 0.0,
        "series": [asdict(r) for r in runs],
    }
    results["scoring_seconds"] = time.perf_counter() - t0
    return results


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
    if isinstance(value, np.floating):
        return finite(float(value))
    if isinstance(value, np.integer):
        return int(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
