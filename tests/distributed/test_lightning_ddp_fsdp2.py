"""HDIMonitor under DDP and FSDP2 (ModelParallelStrategy + fully_shard): 2-rank CPU runs over gloo.

``strategy="ddp"`` inside pytest re-runs the pytest command in the child rank, so every
distributed run is ``tests/scripts/dist_monitor.py``'s ``main`` on the two ranks of the session's
persistent gloo group (the ``gloo2`` fixture, ``tests/helpers/pool.py``: Lightning joins the group the
ranks already hold, as under torchrun); the tests read back its event files, per-rank JSON summaries
and the measurements rank 0 saved. A run that deadlocks fails by the pool's timeout (and every
collective has a 60 s timeout in the group).

References are independent of the monitor's distributed code: ``head_diversity()`` of the
unsharded model built with the same seed (lr=0, so the weights never change), the script run in
this process with one device over the whole global batch, and ``head_diversity(inputs=...)`` of
that global batch.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_events, scalar_series

from hdi_monitor import head_diversity

SCRIPT = Path(__file__).parents[1] / "scripts" / "dist_monitor.py"
TIMEOUT_S = 180
STEPS, EVERY, GLOBAL_BATCH = 5, 2, 4
MEASURED = [0, 2, 4]
LAYERS = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
ARGS = ["--steps", str(STEPS), "--every", str(EVERY), "--global-batch", str(GLOBAL_BATCH)]


def load_module(name: str, path: Path):
    """Import a script by path (registered in sys.modules, as dataclasses need)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


dm = load_module("dist_monitor", SCRIPT)
PROJECTIONS = dm.PROJECTIONS
TOKENS_PER_STEP = GLOBAL_BATCH * dm.MODEL_KW["seq_len"]


def launch(pool, out: Path, *extra: str) -> None:
    """Run the script's ``main`` on the two ranks of ``pool``; fail with their output on error or timeout."""
    pool.run(SCRIPT, "main", ["--out", str(out), *ARGS, *extra], timeout_s=TIMEOUT_S)


def summaries(out: Path) -> dict[int, dict]:
    """rank -> that rank's JSON summary, for the ranks that finished."""
    paths = {r: out / f"rank{r}.json" for r in range(dm.WORLD_SIZE)}
    return {r: json.loads(p.read_text()) for r, p in paths.items() if p.exists()}


def hdi_event_files(out: Path) -> list[Path]:
    """Event files under ``out`` holding at least one ``hdi/`` scalar."""
    found = []
    for f in sorted(out.rglob("events.out.tfevents.*")):
        (acc,) = read_events_file(f)
        if any(tag.startswith("hdi/") for tag in acc.Tags()["scalars"]):
            found.append(f)
    return found


def read_events_file(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return [acc]


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo2):
    """``runs(strategy)``: the output folder of one 2-rank run per strategy, launched on first use."""
    done: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp(strategy)
            launch(gloo2, out, "--strategy", strategy)
            done[strategy] = out
        return done[strategy]

    return get


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def dist_run(request, runs) -> tuple[str, Path]:
    return request.param, runs(request.param)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """The same script in this process, one device, the whole global batch per step."""
    out = tmp_path_factory.mktemp("single")
    dm.run(dm.parse_args(["--strategy", "single", "--out", str(out), *ARGS]))
    return out


@pytest.fixture(scope="module")
def reference():
    """head_diversity() of the unsharded model, with and without each measured step's global batch."""
    model = dm.build_model(seed=0)
    weights = head_diversity(model, projections=PROJECTIONS)
    x, _ = dm.global_batches(STEPS, GLOBAL_BATCH, seed=1)
    acts = {s: head_diversity(model, inputs=x[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]) for s in MEASURED}
    return weights, acts


# -------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_runs_finish_on_every_rank(dist_run):
    strategy, out = dist_run
    ranks = summaries(out)
    assert sorted(ranks) == [0, 1]
    for summary in ranks.values():
        assert summary["finished"] and summary["world_size"] == 2
        assert summary["measured_steps"] == MEASURED  # every rank measured, so every rank ran the collectives
        assert summary["monitoring_warnings"] == []
    # under fsdp2 the monitor really saw sharded (DTensor) parameters
    assert ranks[0]["dtensor_parameters"] is (strategy == "fsdp2")


@pytest.mark.slow
def test_exactly_one_event_file_holds_hdi_scalars(dist_run):
    _, out = dist_run
    files = hdi_event_files(out)
    assert len(files) == 1, f"HDI scalars in {len(files)} event files: {files}"
    accs = read_events(out)
    for layer in LAYERS:
        assert sorted(scalar_series(accs, f"hdi/key/{layer}")) == MEASURED  # no duplicate points either


@pytest.mark.slow
def test_logged_hdi_equals_unsharded_head_diversity(dist_run, reference):
    _, out = dist_run
    weights, _ = reference
    assert [layer.name for layer in weights.layers] == LAYERS
    assert weights.layers[0].hdi["key"] != pytest.approx(weights.layers[1].hdi["key"], abs=1e-4)  # layers differ
    accs = read_events(out)
    for layer in weights.layers:
        for projection in PROJECTIONS:
            series = scalar_series(accs, f"hdi/{projection}/{layer.name}")
            assert sorted(series) == MEASURED
            for value in series.values():
                assert value == pytest.approx(layer.hdi[projection], rel=1e-6, abs=1e-7)
    for projection in PROJECTIONS:
        mean = scalar_series(accs, f"hdi/{projection}/mean")
        assert mean[4] == pytest.approx(weights.mean_hdi(projection), rel=1e-6)


@pytest.mark.slow
def test_covariance_summed_over_ranks_equals_single_process(dist_run, single_run, reference):
    _, out = dist_run
    _, acts = reference
    ranks = summaries(out)
    x, _ = dm.global_batches(STEPS, GLOBAL_BATCH, seed=1)
    for step in MEASURED:  # the premise: the ranks' batches together are exactly the global batch
        seen = torch.tensor(ranks[0]["batches"][str(step)] + ranks[1]["batches"][str(step)])
        expected = x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
    for summary in ranks.values():  # every rank holds the all-rank token count after the sync
        assert summary["token_counts"] == [TOKENS_PER_STEP] * len(LAYERS)
    dist = torch.load(out / "measurement.pt", weights_only=False)
    single = torch.load(single_run / "measurement.pt", weights_only=False)
    assert sorted(dist) == sorted(single) == MEASURED
    for step in MEASURED:
        for d, s, ref in zip(dist[step], single[step], acts[step].layers, strict=True):
            assert d["name"] == s["name"] == ref.name
            torch.testing.assert_close(d["covariance"], s["covariance"], rtol=1e-6, atol=0)
            scale = float(ref.covariance.abs().max())  # eval-mode forward of another batch shape: rounding
            torch.testing.assert_close(d["covariance"], ref.covariance.double(), rtol=1e-5, atol=1e-6 * scale)
            assert d["effective_heads"] == pytest.approx(ref.effective_heads, rel=1e-5)
    accs = read_events(out)
    for step in MEASURED:
        for layer in acts[step].layers:
            logged = scalar_series(accs, f"effective_heads/{layer.name}")[step]
            assert logged == pytest.approx(layer.effective_heads, rel=1e-5)


@pytest.mark.slow
def test_fsdp2_gathers_one_layer_at_a_time(runs):
    """Peak memory of the weight measurement stays at one layer: no two encoder layers' gathered
    (``full_tensor()``) weights are alive at the same time."""
    for summary in summaries(runs("fsdp2")).values():
        assert summary["gathers"] > 0
        assert summary["peak_gathered_layers"] == 1, (
            f"rank {summary['rank']}: gathered weights of {summary['peak_gathered_layers']} layers were alive "
            "at once; compute_report should gather, reduce and free one layer at a time under FSDP2"
        )


@pytest.mark.slow
@pytest.mark.parametrize("where", ["report", "hook", "compute"])
def test_failure_on_one_rank_does_not_hang(where, tmp_path, gloo2):
    """Monitoring raises on rank 1 at step 2 only (while measuring the weights, or inside the
    head-output hook during the forward pass): both ranks warn-or-continue, drop that measurement,
    keep training, and finish; the other measured steps are logged."""
    launch(gloo2, tmp_path, "--strategy", "ddp", "--fail-rank", "1", "--fail-step", "2", "--fail-where", where)
    ranks = summaries(tmp_path)
    assert sorted(ranks) == [0, 1], "a rank did not finish"
    assert ranks[0]["monitoring_warnings"] == []
    (message,) = ranks[1]["monitoring_warnings"]
    assert "injected failure" in message
    for summary in ranks.values():
        assert summary["measured_steps"] == [0, 4]
    accs = read_events(tmp_path)
    for layer in LAYERS:
        assert sorted(scalar_series(accs, f"hdi/key/{layer}")) == [0, 4]
        assert sorted(scalar_series(accs, f"effective_heads/{layer}")) == [0, 4]


# ------------------------------------------------------------------------------ scale benchmark smoke


def test_scale_benchmark_smoke_run():
    """``benchmarks/bench_hdi_scale.py --device cpu --small``: both shapes, both variants run; one
    layer at a time gives the batched HDIs; random Gaussian heads sit at the analytic chance level."""
    from hdi_monitor.functional.diversity import chance_hdi

    bench = load_module("bench_hdi_scale", SCRIPT.parents[2] / "benchmarks" / "bench_hdi_scale.py")
    results = bench.main(["--device", "cpu", "--small", "--repeats", "1"])
    assert [(r["shape"].name, r["variant"]) for r in results] == [
        ("7b-small", "batched"),
        ("7b-small", "per-layer"),
        ("70b-small", "batched"),
        ("70b-small", "per-layer"),
    ]
    for r in results:
        shape = r["shape"]
        assert r["best"] > 0 and r["hdi"].shape == (shape.layers, len(PROJECTIONS))
        assert r["max_hdi_diff"] <= 1e-6  # per-layer == batched
        for projection, value in r["mean_hdi"].items():
            assert value == pytest.approx(chance_hdi(model_dim=shape.model_dim, head_dim=shape.head_dim), abs=6e-3), (
                projection
            )
