"""Coverage sweep: attention discovery on every model class of the installed transformers (not in CI).

For each model type of ``transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES`` the sweep
builds the base model from its default config shrunk to a tiny one (width 32, 4 heads, 2 key/value
heads, 2 layers, applied to sub-configs too), on CPU, each model time-boxed, and records:

* expected: the attention modules, i.e. the innermost modules whose class name says attention
  (``...Attention``, ``...Attn``) and that hold parameters;
* found: how many of them a measured layer covers (the layer is the module, inside it or around it);
* skipped: the attention-like modules discovery named as not measured (refused layouts and others);
* check: one forward pass on generic inputs (token ids, or pixels for vision models) with the
  attention kernels captured (``tests/kernel_capture.py``): ``ok`` when every measured layer's
  per-head q/k/v at position 0 and its head outputs reproduce what the model fed its kernel.

A model "works" when all its expected modules are found, none is skipped and the check is ``ok``
or could not run. It is "loud" when something is not measured but said so (skipped, or an error
naming the module); "SILENT" when a module is neither found nor named, or the check fails without
a warning: the goal is none.

Run: ``PYTHONPATH=. python benchmarks/coverage.py [--limit N] [--only TYPE ...]``; writes
``benchmarks/results/coverage.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import transformers  # noqa: E402
from kernel_capture import run_and_check, zero_biases  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES  # noqa: E402

from hdi_monitor.models import discover_attention  # noqa: E402

transformers.logging.set_verbosity_error()

_SMALL = {
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "dim": 32,
    "embed_dim": 32,
    "n_embed": 32,
    "d_embed": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "d_ff": 64,
    "n_inner": 64,
    "hidden_dim": 64,
    "head_dim": 8,
    "d_kv": 8,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "embedding_size": 32,
    "projection_dim": 16,
    "text_embed_dim": 32,
    "vision_embed_dim": 32,
    "rotary_dim": 4,
    "num_key_value_attention_heads": 2,
}
#: Per-stage head counts (Swin-style tuples): every stage gets 4 heads (the stage widths 32 * 2^i split evenly).
_STAGE_HEADS = ("num_heads", "num_attention_heads")
#: Model types whose attention gives value H heads and key H_kv heads and so only runs with H_kv = H (their
#: original fused projection): shrunk with num_key_value_heads = num_attention_heads, not 2.
_KV_EQUALS_HEADS = frozenset(
    {
        "nemotron3_5_transcribe_asr_audio",
        "nemotron3_5_transcribe_word_timestamp",
        "nemotron3_diarization_audio",
    }
)

_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "hybrid_sliding"})
_ATTENTION_CLASS = re.compile(r"(Attention|Attn)$")


def shrink(cfg, depth: int = 0):
    """Set the width/depth attributes the config has to tiny values, sub-configs included."""
    for key, value in _SMALL.items():
        if isinstance(getattr(cfg, key, None), int) and not isinstance(getattr(cfg, key), bool):
            with contextlib.suppress(Exception):
                setattr(cfg, key, value)
    for key in ("head_dim", "num_key_value_heads"):  # None defaults that some models do not derive themselves
        if key in vars(cfg) and getattr(cfg, key) is None:
            with contextlib.suppress(Exception):
                setattr(cfg, key, _SMALL[key])
    for key in _STAGE_HEADS:
        stages = getattr(cfg, key, None)
        if isinstance(stages, (list, tuple)) and stages and all(isinstance(v, int) for v in stages):
            with contextlib.suppress(Exception):
                setattr(cfg, key, type(stages)([4] * len(stages)))
    per_layer, heads = getattr(cfg, "num_key_value_heads_per_layer", None), getattr(cfg, "num_attention_heads", None)
    if isinstance(per_layer, list) and isinstance(heads, int):  # computed at init from the unshrunk head count
        cfg.num_key_value_heads_per_layer = [min(v, heads) for v in per_layer]
    if getattr(cfg, "model_type", None) in _KV_EQUALS_HEADS and isinstance(
        getattr(cfg, "num_attention_heads", None), int
    ):
        cfg.num_key_value_heads = cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and isinstance(getattr(cfg, "num_hidden_layers", None), int):
        # hybrids whose first attention layer comes later (Qwen3-Next: every 4th): keep layers up to it
        first = next((i for i, t in enumerate(types) if t in _ATTENTION_LAYER_TYPES), None)
        if first is not None and cfg.num_hidden_layers <= first < 8:
            cfg.num_hidden_layers = first + 1
    if hasattr(cfg, "first_k_dense_replace"):
        cfg.first_k_dense_replace = 1
    if depth < 3:
        for name in list(vars(cfg)):
            sub = getattr(cfg, name, None)
            if isinstance(sub, transformers.PretrainedConfig):
                shrink(sub, depth + 1)
    return cfg


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_box(seconds: int):
    def fire(*_):
        raise Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def expected_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Innermost modules whose class name says attention and that hold parameters."""
    cands = [
        (n, m)
        for n, m in model.named_modules()
        if _ATTENTION_CLASS.search(type(m).__name__) and next(m.parameters(), None) is not None
    ]
    names = [n for n, _ in cands]
    return [(n, m) for n, m in cands if not any(o != n and o.startswith(n + ".") for o in names)]


def generic_batch(model: nn.Module, cfg) -> dict | None:
    main = getattr(model, "main_input_name", "input_ids")
    g = torch.Generator().manual_seed(0)
    if main == "input_ids":
        vocab = int(
            getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 100) or 100
        )
        ids = torch.randint(5, max(6, min(vocab, 100)), (2, 7), generator=g)
        batch = {"input_ids": ids}
        if getattr(cfg, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = ids[:, :5]
        return batch
    if main == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        chans = getattr(cfg, "num_channels", 3)
        if not isinstance(size, int) or size > 512:
            return None
        return {"pixel_values": torch.randn(2, chans, size, size, generator=g)}
    return None


def prepare_check(model_type: str, model: nn.Module, batch: dict) -> str:
    """Per-model adjustments that make the position-0 check valid (rotary phase 0 at token 0); returns
    the note saying what was changed. Only the check's inputs change, never the extraction."""
    if model_type == "paligemma":  # PaliGemma numbers positions from 1: pass them from 0
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None].expand(batch["input_ids"].shape[0], -1)
        return "check with position_ids from 0 (PaliGemma counts from 1, so token 0 is rotated)"
    if model_type.startswith("mlcd"):  # MLCD's class token has a learned rotary angle
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("class_pos_emb"):
                    p.zero_()
        return (
            "check with class_pos_emb = 0 (MLCD's class token has a learned rotary angle at token 0); 'gated': its "
            "head outputs are sequence-first (T, B, H d), so the hooked o is not the kernel's (B, T) layout"
        )
    return ""


#: Layers whose key/value check compares against the wrong stream, per model type:
#: (layer-name regex, projections, why the extraction is still exact).
_EXPLAINED = {
    "t5gemma2": (
        re.compile(r"decoder\.layers\.\d+\.self_attn"),
        ("key", "value"),
        "decoder merged attention feeds its kernel [k_proj(decoder); k_proj(encoder)] (same for v): one "
        "k_proj/v_proj for both; the position-0 check reads k_proj's last input (the encoder's), so only "
        "its query and output are checked there",
    ),
}


def _explained(model_type: str, layer: str, problem: str) -> bool:
    rule = _EXPLAINED.get(model_type)
    if rule is None or not rule[0].fullmatch(layer):
        return False
    return all(part.split(":")[0].strip() in rule[1] for part in problem.split(";"))


@dataclass
class Row:
    model_type: str
    cls: str
    status: str  # works / loud / SILENT / no attention / build failed
    found: int = 0
    expected: int = 0
    skipped: int = 0
    families: str = ""
    check: str = ""
    note: str = ""


def _covered(name: str, layer_names: list[str]) -> bool:
    return any(name == n or name.startswith(n + ".") or n.startswith(name + ".") for n in layer_names)


def sweep_one(model_type: str, seconds: int) -> Row:
    mapped = MODEL_MAPPING_NAMES[model_type]
    cls_name: str = mapped if isinstance(mapped, str) else mapped[0]
    row = Row(model_type, cls_name, "build failed")
    try:
        with time_box(seconds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = shrink(CONFIG_MAPPING[model_type]())
            torch.manual_seed(0)
            model = getattr(transformers, cls_name)(cfg).eval()
    except Exception as exc:  # noqa: BLE001 - a sweep records every failure
        row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}" if str(exc) else type(exc).__name__
        return row
    expected = expected_modules(model)
    row.expected = len(expected)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = discover_attention(model)
    except ValueError as exc:
        row.status = "no attention" if not expected else "loud"
        lines = str(exc).splitlines()
        row.note = (lines[1].strip() if len(lines) > 1 else lines[0])[:140]
        return row
    except Exception as exc:  # noqa: BLE001
        row.status = "SILENT" if expected else "no attention"
        row.note = f"crash {type(exc).__name__}: {str(exc)[:90]}"
        return row
    names = [lay.name for lay in found.layers]
    skipped_names = [s.name for s in found.skipped]
    row.found = sum(_covered(n, names) for n, _ in expected)
    row.skipped = len(found.skipped)
    row.families = ",".join(sorted({lay.family for lay in found.layers}))
    silent = [n for n, _ in expected if not _covered(n, names) and not _covered(n, skipped_names)]
    batch = generic_batch(model, cfg)
    if batch is None:
        row.check = "no generic input"
    else:
        try:
            zero_biases(model)
            prepared = prepare_check(model_type, model, batch)
            with time_box(seconds), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = run_and_check(model, found.layers, lambda: model(**batch))
            explained = [k for k, v in result.items() if _explained(model_type, k, v)]
            result = {k: "ok" if k in explained else v for k, v in result.items()}
            bad = {k: v for k, v in result.items() if not v.startswith("ok") and v != "no kernel call"}
            calls = sum(v.startswith("ok") for v in result.values())
            gated = any(v == "ok (gated head outputs)" for v in result.values())
            row.check = (
                ("ok, gated" if gated else "ok") if not bad and calls else ("no kernel call" if not bad else "FAIL")
            )
            if explained and not bad:
                row.check += " (explained)"
                row.note = _EXPLAINED[model_type][2]
            elif prepared and not bad:
                row.note = prepared
            if bad:
                row.note = "; ".join(f"{k}: {v}" for k, v in list(bad.items())[:1])[:120]
        except Exception as exc:  # noqa: BLE001 - the model's own forward failed on generic inputs
            row.check = "forward failed"
            row.note = row.note or f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}" if str(exc) else ""
    if not expected and not found.layers:
        row.status = "no attention"
    elif silent or row.check == "FAIL":
        row.status = "SILENT"
        if silent:
            row.note = f"not found, not named: {silent[:2]}"
    elif found.skipped or row.found < row.expected:
        row.status = "loud"
        row.note = row.note or (found.skipped[0].reason[:110] if found.skipped else "")
    else:
        row.status = "works"
    del caught
    return row


def write(rows: list[Row], path: str, elapsed: float) -> str:
    with_attn = [r for r in rows if r.status in ("works", "loud", "SILENT")]
    works = sum(r.status == "works" for r in with_attn)
    loud = sum(r.status == "loud" for r in with_attn)
    silent = sum(r.status == "SILENT" for r in with_attn)
    checked = sum(r.check.startswith("ok") for r in with_attn)
    lines = [
        "# Attention discovery coverage",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU; "
        f"{len(rows)} model types of `MODEL_MAPPING_NAMES`, each built from its default config shrunk to width 32 "
        f"(`benchmarks/coverage.py`, {elapsed:.0f} s).",
        "",
        f"- built with attention: **{len(with_attn)}**; work with no spec: **{works}** "
        f"({100 * works / max(1, len(with_attn)):.1f}%); not measured but named (refused/skipped, loud): {loud}; "
        f"silent (found nothing, said nothing, or wrong): **{silent}**",
        f"- extraction checked against the model's own attention kernel (position 0): {checked} models ok",
        f"- not built from a tiny config: {sum(r.status == 'build failed' for r in rows)}; "
        f"no attention modules: {sum(r.status == 'no attention' for r in rows)}",
        "",
        "| model type | class | status | found/expected | skipped | families | check | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.status != "SILENT", r.status != "loud", r.model_type)):
        if r.status in ("build failed", "no attention"):
            continue
        note = r.note.replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r.model_type} | {r.cls} | {r.status} | {r.found}/{r.expected} | {r.skipped} | "
            f"{r.families} | {r.check} | {note} |"
        )
    lines += ["", "Not built from a tiny default config, or without attention modules:", ""]
    lines.append(
        ", ".join(
            f"{r.model_type} ({'no attention' if r.status == 'no attention' else 'build'})"
            for r in sorted(rows, key=lambda r: r.model_type)
            if r.status in ("build failed", "no attention")
        )
    )
    text = "\n".join(lines) + "\n"
    with open(path, "w") as fh:
        fh.write(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="only the first N model types")
    parser.add_argument("--only", nargs="*", default=None, help="only these model types")
    parser.add_argument("--seconds", type=int, default=20, help="time box per model (build, and forward)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "coverage.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    types = sorted(MODEL_MAPPING_NAMES)
    if args.only:
        types = [t for t in types if t in args.only]
    if args.limit:
        types = types[: args.limit]
    start = time.time()
    rows = []
    for i, t in enumerate(types):
        rows.append(sweep_one(t, args.seconds))
        r = rows[-1]
        print(f"[{i + 1}/{len(types)}] {t}: {r.status} {r.found}/{r.expected} {r.check} {r.note[:80]}", flush=True)
    print(write(rows, args.out, time.time() - start).split("| model type")[0])


if __name__ == "__main__":
    main()
