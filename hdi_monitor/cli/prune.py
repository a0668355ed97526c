"""``hdi-monitor prune MODEL --inputs FILE --fraction F``: what removing heads costs.

Loads MODEL as ``hdi-monitor report`` does (a Hugging Face folder, a Lightning checkpoint with
``--module``, or a state_dict with ``--config``) and the inputs the same way (a ``.txt`` file, one
example per line, tokenized in batches of 16 lines; or a ``.pt`` file of batches). The batches are
split into a ranking set (the first ``1 - --holdout`` of them) and a held-out set (the rest). Heads
are ranked on the ranking set (``--rank``, repeatable: ``diversity``, ``importance``, ``combined``,
``random``), the first 10%, 20%, ... up to ``--fraction`` of them are zero-ablated, and the fidelity
of the held-out mean-pooled embeddings is measured (see ``hdi_monitor.ablation.fidelity``). Writes
``DIR/results.json``, ``DIR/results.md`` (the table, also printed) and ``DIR/fidelity.png``. Where
the family can be pruned, the JSON also holds the parameter count and forward time of the model
pruned by the first ranking at ``--fraction``, and the largest difference between its outputs and the
ablated model's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

from hdi_monitor.cli._common import CLIError, add_model_arguments, finite_json, no_link, prepare_out_dir

HELP = "rank heads (diversity, importance, random), ablate a fraction and measure the fidelity on held-out inputs"

RANKINGS = ("diversity", "importance", "combined", "random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, path_metavar="MODEL")
    parser.add_argument(
        "--inputs", metavar="FILE", required=True, help="a .txt file (one example per line) or a .pt file of batches"
    )
    parser.add_argument(
        "--fraction", type=float, required=True, metavar="F", help="largest fraction of heads to remove, in (0, 1)"
    )
    parser.add_argument(
        "--rank",
        action="append",
        choices=RANKINGS,
        metavar="RANKING",
        help=f"ranking(s) to compare, repeatable: {', '.join(RANKINGS)} (default: diversity, importance, random)",
    )
    parser.add_argument(
        "--out", metavar="DIR", required=True, help="folder for results.json, results.md and fidelity.png"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --out folder (files of the same names are replaced)",
    )
    parser.add_argument(
        "--holdout", type=float, default=0.5, metavar="P", help="share of the batches held out (default: 0.5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random ranking (default: 0)")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="allow full unpickling of MODEL/--inputs (trusted files only)"
    )


def fractions_up_to(fraction: float) -> list[float]:
    """``0.1, 0.2, ...`` below ``fraction``, then ``fraction`` itself."""
    steps = [round(0.1 * i, 10) for i in range(1, 10) if 0.1 * i < fraction - 1e-9]
    return steps + [fraction]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one row per fraction, cosine and neighbours kept per ranking."""
    names = list(dict.fromkeys(r["ranking"] for r in rows))
    fracs = sorted({r["fraction"] for r in rows})
    by = {(r["ranking"], r["fraction"]): r for r in rows}
    head = "| removed | " + " | ".join(f"{n} cosine | {n} NN kept" for n in names) + " |"
    sep = "|---:|" + "---:|---:|" * len(names)
    lines = [head, sep]
    for f in fracs:
        any_row = next(by[(n, f)] for n in names if (n, f) in by)
        cells = []
        for n in names:
            r = by.get((n, f))
            if r is None:
                cells += ["", ""]
                continue
            cos = f"{r['cosine']:.4f}" + (f" ± {r['cosine_std']:.4f}" if "cosine_std" in r else "")
            kept = f"{r['neighbours_kept']:.3f}" + (
                f" ± {r['neighbours_kept_std']:.3f}" if "neighbours_kept_std" in r else ""
            )
            cells += [cos, kept]
        lines.append(f"| {f:.0%} ({any_row['removed']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str, reference: tuple[float, str] | None = None) -> None:
    """Fidelity and neighbours kept against the fraction removed, one line per ranking (± std band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    names = list(dict.fromkeys(r["ranking"] for r in rows))
    for n in names:
        sel = sorted((r for r in rows if r["ranking"] == n), key=lambda r: r["fraction"])
        x = [0.0] + [r["fraction"] for r in sel]
        for ax, key in zip(axes, ("cosine", "neighbours_kept"), strict=True):
            y = [1.0] + [r[key] for r in sel]
            (line,) = ax.plot(x, y, marker="o", ms=3, label=n)
            if f"{key}_std" in sel[0]:
                s = [0.0] + [r[f"{key}_std"] for r in sel]
                ax.fill_between(
                    x,
                    [a - b for a, b in zip(y, s, strict=True)],
                    [a + b for a, b in zip(y, s, strict=True)],
                    color=line.get_color(),
                    alpha=0.2,
                )
    for ax, label in zip(axes, ("mean cosine, full vs ablated", "nearest neighbour unchanged"), strict=True):
        ax.set_xlabel("fraction of heads removed")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if reference is not None:
            ax.axvline(reference[0], color="grey", ls="--", lw=1, label=reference[1])
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _split(batches: list[Any], holdout: float) -> tuple[list[Any], list[Any]]:
    n_hold = round(len(batches) * holdout)
    n_hold = min(max(n_hold, 1), len(batches) - 1)
    return batches[: len(batches) - n_hold], batches[len(batches) - n_hold :]


def run(args: argparse.Namespace) -> int:
    if not (isinstance(args.fraction, float) and 0.0 < args.fraction < 1.0 and math.isfinite(args.fraction)):
        raise CLIError(f"--fraction must be in (0, 1), got {args.fraction}")
    if not 0.0 < args.holdout < 1.0:
        raise CLIError(f"--holdout must be in (0, 1), got {args.holdout}")
    out = prepare_out_dir(args.out, args.force)  # before any work: not after a long sweep
    import torch

    from hdi_monitor.ablation import (
        combined_ranking,
        count_parameters,
        head_importance,
        head_similarity,
        importance_ranking,
        prune_heads,
        random_ranking,
        redundancy_ranking,
        select_heads,
    )
    from hdi_monitor.ablation.fidelity import (
        embed,
        pair_contrastive_loss,
        sweep,
        time_forward,
    )
    from hdi_monitor.cli._load import load_inputs, load_model
    from hdi_monitor.cli.report import find_layers
    from hdi_monitor.models.hooks import iter_batches

    rankings_wanted = list(dict.fromkeys(args.rank or ["diversity", "importance", "random"]))
    model, tokenizer, _ = load_model(args)
    model.eval()
    batches = list(iter_batches(load_inputs(args.inputs, model, tokenizer, args.allow_pickle)))
    if len(batches) < 2:
        raise CLIError(
            f"--inputs {args.inputs!r} gives {len(batches)} batch; at least 2 are needed (a ranking and a held-out set; "
            "a .txt file needs more than 16 lines)"
        )
    ranking_set, heldout = _split(batches, args.holdout)
    layers = find_layers(model, args)
    counts = {lay.name: lay.num_heads for lay in layers}
    total = sum(counts.values())
    if total - len(counts) < 1:
        raise CLIError(f"{args.path!r}: its attention layers have one head each; there is nothing to remove")
    try:
        check = embed(model, batches)  # every batch once, before the sweep: the outputs must be finite
    except ValueError as err:
        raise CLIError(f"{args.path!r}: {err}") from err
    if not bool(torch.isfinite(check).all()):
        bad = int((~torch.isfinite(check)).any(dim=-1).sum())
        raise CLIError(
            f"{args.path!r}: the model's outputs on --inputs are not finite (NaN or inf in {bad} of {check.shape[0]} "
            "embeddings) before any head is removed, so no fidelity can be measured; check the weights (a diverged "
            "or wrongly converted checkpoint?)"
        )
    del check
    orders: dict[str, Any] = {}
    need_div = {"diversity", "combined"} & set(rankings_wanted)
    need_imp = {"importance", "combined"} & set(rankings_wanted)
    if need_div:
        sim = head_similarity(model, inputs=ranking_set, layers=layers)
        orders["diversity"] = redundancy_ranking(sim)
    if need_imp:
        try:
            imp = head_importance(model, ranking_set, pair_contrastive_loss, layers=layers)
        except ValueError as err:
            raise CLIError(f"--rank importance: {err}") from err
        orders["importance"] = importance_ranking(imp)
    if "combined" in rankings_wanted:
        orders["combined"] = combined_ranking(orders["diversity"], orders["importance"])
    if "random" in rankings_wanted:
        orders["random"] = random_ranking(counts, seed=args.seed)
    orders = {n: orders[n] for n in rankings_wanted}
    fractions = fractions_up_to(args.fraction)
    rows = sweep(model, heldout, orders, fractions, layers=layers)

    first = rankings_wanted[0]
    k = min(round(args.fraction * total), total - len(counts))
    chosen = select_heads(orders[first], k, counts)
    pruned_info: dict[str, Any] = {"ranking": first, "fraction": args.fraction, "removed": k}
    try:
        pruned = prune_heads(copy.deepcopy(model), chosen)
    except ValueError as err:
        pruned_info["error"] = str(err)
    else:
        from hdi_monitor.ablation import ablate_heads
        from hdi_monitor.ablation.fidelity import mean_pooled

        with torch.no_grad():
            with ablate_heads(model, chosen, layers=layers):
                ref = torch.cat([mean_pooled(model, b) for b in heldout])
            got = torch.cat([mean_pooled(pruned, b) for b in heldout])
        pruned_info.update(
            parameters_full=count_parameters(model),
            parameters_pruned=count_parameters(pruned),
            forward_seconds_full=time_forward(model, heldout, repeats=2),
            forward_seconds_pruned=time_forward(pruned, heldout, repeats=2),
            max_abs_diff_vs_ablated=float((got - ref).abs().max()),
        )
    result = {
        "model": str(args.path),
        "inputs": str(args.inputs),
        "heads": total,
        "layers": counts,
        "ranking_batches": len(ranking_set),
        "heldout_batches": len(heldout),
        "heldout_sentences": sum(_rows(b) for b in heldout),
        "rankings": {n: [[name, h] for name, h in o] for n, o in orders.items()},
        "rows": rows,
        "pruned": pruned_info,
    }
    out.mkdir(parents=True, exist_ok=True)
    # NaN (an ablation that broke the outputs) is written as null: the file stays valid JSON
    no_link(out / "results.json").write_text(
        json.dumps(finite_json(result), indent=1, allow_nan=False), encoding="utf-8"
    )
    table = format_table(rows)
    no_link(out / "results.md").write_text(table + "\n", encoding="utf-8")
    plot(rows, no_link(out / "fidelity.png"), title=f"Heads removed from {Path(args.path).name}")
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'fidelity.png'}")
    return 0


def _rows(batch: Any) -> int:
    import torch

    if isinstance(batch, dict):
        v = next(iter(batch.values()))
        return int(v.shape[0]) if isinstance(v, torch.Tensor) else 0
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    return 0
