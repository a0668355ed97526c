"""Tensor parallelism and DeepSpeed ZeRO-3: head counts and weights read whole.

The multi-process runs are ``tests/scripts/tp_engines.py``'s scenarios on the session's persistent gloo
ranks (2, or 4 for a 2 x 2 mesh; ``tests/helpers/pool.py``), on CPU. The
reference is independent of the sharding code: ``head_diversity()`` of the same model built unsharded in
this process from the same seed. The head-count rules are also tested directly on
`tp_head_counts`, against counts worked out by hand.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from hdi_monitor import head_diversity
from hdi_monitor.exceptions import AdapterMismatch
from hdi_monitor.models.tensor_parallel import tp_head_counts

SCRIPT = Path(__file__).parents[1] / "scripts" / "tp_engines.py"
TIMEOUT_S = 400


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


te = _load("tp_engines", SCRIPT)


def launch(pool, engine: str, out: Path) -> dict[int, dict]:
    """Run ``engine`` (`tp_engines.scenario`) on the ranks of ``pool``, the session's persistent gloo group
    (``tests/helpers/pool.py``); each rank's result. A deadlock fails by the pool's timeout."""
    out.mkdir(parents=True, exist_ok=True)
    pool.run(SCRIPT, "scenario", engine, str(out), timeout_s=TIMEOUT_S)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(pool.world)}


def reference(model) -> dict[str, dict[str, float]]:
    return {r.name: dict(r.hdi) for r in head_diversity(model).layers}


def assert_same_hdi(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, hdis in want.items():
        for proj in te.PROJECTIONS:
            assert got[name][proj] == pytest.approx(hdis[proj], abs=1e-5), (name, proj)


# ------------------------------------------------------------------------------- head-count rules


def test_tp_counts_from_head_dim_and_full_width() -> None:
    # 4 heads of width 8 (32 features), 2-way TP: the attribute may be 4 (global) or 2 (local)
    assert tp_head_counts("L", inner=32, tp=2, num_heads=2, heads_from="a.n", head_dim=8, dim_from="a.d")[:2] == (4, 8)
    assert tp_head_counts("L", inner=32, tp=2, num_heads=4, heads_from="a.n", head_dim=8, dim_from="a.d")[:2] == (4, 8)
    note = tp_head_counts("L", inner=32, tp=2, num_heads=2, heads_from="a.n", head_dim=8, dim_from="a.d")[2]
    assert "this rank's count" in note
    with pytest.raises(AdapterMismatch, match=r"^L: 2-way .*a\.n = 3 is neither"):
        tp_head_counts("L", inner=32, tp=2, num_heads=3, heads_from="a.n", head_dim=8, dim_from="a.d")


def test_tp_counts_undecidable_or_uneven_are_refused() -> None:
    with pytest.raises(AdapterMismatch, match="could count all heads"):
        tp_head_counts("L", inner=32, tp=2, num_heads=2, heads_from="a.n", head_dim=None, dim_from="")
    # 3 local heads (not a multiple of tp) can only be this rank's: 6 heads of width 4
    assert tp_head_counts("L", inner=24, tp=2, num_heads=3, heads_from="a.n", head_dim=None, dim_from="")[:2] == (6, 4)
    with pytest.raises(AdapterMismatch, match="do not split evenly"):
        tp_head_counts("L", inner=24, tp=2, num_heads=None, heads_from="", head_dim=8, dim_from="a.d")


# ------------------------------------------------------------------------------- multi-process runs


@pytest.mark.slow
def test_plain_module_tp_with_num_heads_divided(tmp_path: Path, gloo2) -> None:
    ranks = launch(gloo2, "plain_tp", tmp_path)
    want = reference(te.build_plain())
    for r, res in ranks.items():
        assert res["skipped"] == {}, r
        for lay in res["layers"].values():
            assert (lay["num_heads"], lay["num_kv_heads"], lay["head_dim"], lay["tp"]) == (4, 2, 8, 2)
            assert any("n_heads = 2 is this rank's count" in n for n in lay["notes"])
        assert_same_hdi(res["hdi"], want)
    refused = ranks[0]["refused"]
    assert "layers.0.attention" in refused["no_head_dim"] and "no head_dim tells which" in refused["no_head_dim"]
    assert "n_heads = 3 is neither" in refused["odd:layers.1.attention"]
    # an unnamed mesh: the out-projection's Shard(1) tells TP; a dimension named "dp" that splits o by
    # columns contradicts its name and is refused, naming the layer
    assert ranks[0]["meshes"]["unnamed"] == [[4, 8, 2], [4, 8, 2]]
    assert "layers.0.attention" in ranks[0]["meshes"]["named_dp"]
    assert "named data-parallel" in ranks[0]["meshes"]["named_dp"]
    # fused [q|k|v] rows: plain row blocks are refused, transformers' strided packing reads right
    fused = ranks[0]["fused"]
    assert set(fused["skipped"]) == {"plain"} and "Shard(0)" in fused["skipped"]["plain"]
    want_fused = reference(te.build_fused())
    assert set(fused["hdi"]) == {"strided"}
    assert "plain" in fused["spec_error"] and "Shard(0)" in fused["spec_error"]  # an AttentionSpec too
    for proj in te.PROJECTIONS:
        assert fused["hdi"]["strided"][proj] == pytest.approx(want_fused["strided"][proj], abs=1e-5)


@pytest.mark.slow
def test_transformers_tp_plan_auto(tmp_path: Path, gloo2) -> None:
    ranks = launch(gloo2, "hf_tp", tmp_path)
    want = reference(te.build_llama())
    for res in ranks.values():
        assert res["mesh_dim_names"] == ["tp"] and res["q_placements"] == ["S(0)"]
        assert res["skipped"] == {}
        for lay in res["layers"].values():
            assert (lay["num_heads"], lay["num_kv_heads"], lay["head_dim"], lay["tp"]) == (4, 2, 8, 2)
        assert_same_hdi(res["hdi"], want)
    stats = head_diversity(te.build_llama(), inputs={"input_ids": te.hf_tokens()})
    for res in ranks.values():
        for lay in stats.layers:
            got = res["activations"][lay.name]
            assert got["num_tokens"] == lay.num_tokens == 16
            assert got["effective_heads"] == pytest.approx(lay.effective_heads, abs=1e-5)
            torch.testing.assert_close(torch.tensor(got["covariance"]), lay.covariance.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_deepspeed_zero3(tmp_path: Path, gloo2) -> None:
    pytest.importorskip("deepspeed")
    ranks = launch(gloo2, "zero3", tmp_path)
    want = reference(te.build_plain())
    for res in ranks.values():
        assert res["partitioned_shapes"] == [[0]]  # really partitioned outside the forward pass
        assert res["skipped"] == {}
        for lay in res["layers"].values():
            assert (lay["num_heads"], lay["num_kv_heads"], lay["head_dim"]) == (4, 2, 8)
        assert_same_hdi(res["hdi"], want)


# ------------------------------------------------------------------- activations and training under TP


@pytest.fixture(scope="module")
def single_track() -> dict:
    """One process, the unsharded model, the whole global batch at each step (the reference)."""
    return te.track(te.build_plain(), 0, 1)


def assert_same_statistics(got_steps: list, want_steps: list) -> None:
    # step 0 is measured on the initial weights in both runs (later steps follow differently rounded updates)
    got, want = got_steps[0], want_steps[0]
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name]["num_tokens"] == ref["num_tokens"] == te.GLOBAL_BATCH * te.SEQ  # each token once
        assert got[name]["effective_heads"] == pytest.approx(ref["effective_heads"], abs=1e-5)
        cov_got, cov_want = torch.tensor(got[name]["covariance"]), torch.tensor(ref["covariance"])
        torch.testing.assert_close(cov_got, cov_want, rtol=1e-5, atol=1e-7)
        for proj in te.PROJECTIONS:
            assert got[name]["hdi"][proj] == pytest.approx(ref["hdi"][proj], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["plain_tp_track", "fsdp_tp_track", "zero3_track"])
def test_tracker_under_tp_equals_one_process(engine: str, tmp_path: Path, single_track: dict, request) -> None:
    if engine.startswith("zero3"):
        pytest.importorskip("deepspeed")
    pool = request.getfixturevalue("gloo4" if te.WORLD.get(engine, te.WORLD_SIZE) == 4 else "gloo2")
    ranks = launch(pool, engine, tmp_path)
    for res in ranks.values():
        assert_same_statistics(res["with"]["steps"], single_track["steps"])
        # the monitor never changes training: same losses and weights, bit for bit
        assert res["with"]["losses"] == res["without"]["losses"]
        assert res["with"]["weights"] == res["without"]["weights"]
    if engine == "fsdp_tp_track":
        assert ranks[0]["placements"] == ["S(0)", "S(1)"]  # a 2-D DTensor: FSDP on "dp", TP on "tp"
    elif engine == "plain_tp_track":
        assert ranks[0]["with"]["losses"] == pytest.approx(single_track["losses"], abs=1e-5)


@pytest.mark.slow
def test_tp_gather_is_bounded_by_max_tokens_and_equals_one_process(tmp_path: Path, gloo2) -> None:
    ranks = launch(gloo2, "plain_tp_subsample", tmp_path)
    want = te.track(te.build_plain(), 0, 1, max_tokens=te.SUBSAMPLE)["steps"]
    assert te.SUBSAMPLE < te.GLOBAL_BATCH * te.SEQ
    for res in ranks.values():
        # one gather per layer per step, each of at most max_tokens rows (not the batch's tokens)
        assert res["gathered_rows"] and max(res["gathered_rows"]) == te.SUBSAMPLE
        for got_step, want_step in zip(res["steps"], want, strict=True):
            for name, ref in want_step.items():
                assert got_step[name]["num_tokens"] == ref["num_tokens"] == te.SUBSAMPLE
                assert got_step[name]["effective_heads"] == pytest.approx(ref["effective_heads"], abs=1e-5)
                cov = torch.tensor(got_step[name]["covariance"])
                assert torch.allclose(cov, torch.tensor(ref["covariance"]), rtol=1e-5, atol=1e-7)


LIGHTNING = Path(__file__).parents[1] / "scripts" / "tp_lightning.py"


def launch_lightning(pool, out: Path, *extra: str) -> dict[int, dict]:
    """``tp_lightning.py``'s ``main`` on the ranks of ``pool`` (Lightning joins their group, as under torchrun)."""
    pool.run(LIGHTNING, "main", ["--out", str(out), *extra], timeout_s=TIMEOUT_S)
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def _unprefixed(steps: list) -> list:
    return [{name.removeprefix("lm."): v for name, v in step.items()} for step in steps]


@pytest.mark.slow
def test_lightning_model_parallel_tp2(tmp_path: Path, single_track: dict, gloo2) -> None:
    ranks = launch_lightning(gloo2, tmp_path / "with")
    plain = launch_lightning(gloo2, tmp_path / "without", "--no-monitor")
    assert set(ranks) == set(plain) == {0, 1}
    for r, res in ranks.items():
        assert res["mesh_dim_names"] == ["data_parallel", "tensor_parallel"]
        assert len(res["steps"]) == te.TRACK_STEPS
        assert_same_statistics(_unprefixed(res["steps"]), single_track["steps"])
        assert res["losses"] == plain[r]["losses"] and res["weights"] == plain[r]["weights"]
    # logged once, by rank 0: one metrics file, each measured step once, the one-process values
    (metrics,) = (tmp_path / "with" / "logs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.read_text().splitlines()) if r.get("hdi/key/lm.layers.0.attention")]
    assert [int(r["step"]) for r in rows] == list(range(te.TRACK_STEPS))
    want = single_track["steps"][0]["layers.0.attention"]["hdi"]["key"]
    assert float(rows[0]["hdi/key/lm.layers.0.attention"]) == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_lightning_fsdp2_plus_tp_2x2(tmp_path: Path, single_track: dict, gloo4) -> None:
    ranks = launch_lightning(gloo4, tmp_path, "--dp", "2")
    assert set(ranks) == {0, 1, 2, 3}
    for res in ranks.values():
        assert_same_statistics(_unprefixed(res["steps"]), single_track["steps"])


@pytest.mark.slow
def test_hf_trainer_with_zero3(tmp_path: Path, gloo2) -> None:
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    script = Path(__file__).parents[1] / "scripts" / "hf_zero3.py"
    hz = _load("hf_zero3", script)
    gloo2.run(script, "scenario", str(tmp_path), timeout_s=TIMEOUT_S)
    # the reference: the one-shot API on the unsharded model, same weights, the step's whole global batch
    want = head_diversity(te.build_llama(), inputs={"input_ids": hz.samples()})
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["zero_stage"] == 3 and res["q_shape"] == [0]  # partitioned outside the forward pass
        assert res["step"] == 1
        for lay in want.layers:
            got = res["layers"][lay.name]
            assert got["num_tokens"] == lay.num_tokens == hz.SAMPLES * hz.SEQ
            assert got["effective_heads"] == pytest.approx(lay.effective_heads, abs=1e-5)
            torch.testing.assert_close(torch.tensor(got["covariance"]), lay.covariance.float(), rtol=1e-5, atol=1e-7)
            for proj in te.PROJECTIONS:
                assert got["hdi"][proj] == pytest.approx(lay.hdi[proj], abs=1e-5)


def test_megatron_core_attention_is_refused_out_loud() -> None:
    from torch import nn

    from hdi_monitor.models import discover_attention

    class SelfAttention(nn.Module):  # stands in for megatron.core.transformer.attention.SelfAttention
        def __init__(self) -> None:
            super().__init__()
            self.linear_qkv = nn.Linear(16, 48)
            self.linear_proj = nn.Linear(16, 16)

    SelfAttention.__module__ = "megatron.core.transformer.attention"
    model = nn.Sequential(SelfAttention())
    with pytest.raises(ValueError, match=r"(?s)0 \(SelfAttention\).*Megatron-core keeps its tensor-parallel shards"):
        discover_attention(model)


@pytest.mark.slow
def test_pipeline_stages_are_refused_at_setup_on_every_rank(tmp_path: Path, gloo2) -> None:
    ranks = launch(gloo2, "stage_mismatch", tmp_path)
    assert set(ranks) == {0, 1}
    for res in ranks.values():
        for activations in ("True", "False"):
            error = res["errors"][activations]
            assert "layers (names and shapes) differs: rank 0: layers.0.attention" in error
            assert "rank 1: layers.1.attention" in error
            assert "Pipeline parallelism (each stage holding different layers) is not supported" in error


@pytest.mark.slow
def test_a_hand_made_data_parallel_group_beside_a_1d_tp_mesh_is_refused_at_setup(
    gloo2, tmp_path: Path, single_track: dict
) -> None:
    """Issue 30 item 10: the refusal came from ``tracker.step()`` after the first measured forward and
    backward (with ``strict=False``: it ended the loop). It comes now when the first measured step's
    capture begins, before any forward pass, on both ranks, saying what to do; a weights-only tracker
    sums nothing and measures; the advice (the TP mesh sliced from a 2-D (dp, tp) mesh) is measured,
    each token once (summed over "dp"), equal to one process over the global batch."""
    ranks = launch(gloo2, "tp_beside_dp", tmp_path)
    want_weights = reference(te.build_plain())
    for res in ranks.values():
        refused = res["hand_made"]
        assert refused["reached"] == "capture" and refused["forwards"] == 0  # nothing of the step ran
        assert refused["error"].startswith(
            "hdi-monitor: a 1-way tensor-parallel mesh of 1 rank(s) in a world of 2: the data-parallel replicas are "
            "not on the mesh (a data-parallel group made beside it cannot be known)"
        )
        assert 'init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))["tp"]' in refused["error"]
        assert_same_hdi(res["weights_only"], want_weights)
        assert_same_statistics(res["sliced"]["steps"], single_track["steps"])
