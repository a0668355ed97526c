"""HDITracker under FSDP1 (``FullyShardedDataParallel``): a 2-rank gloo run on CPU, and name stripping.

The distributed run is ``tests/scripts/fsdp1_tracker.py``'s scenario on the session's persistent gloo
ranks (FSDP1 needs a process group; ``tests/helpers/pool.py`` keeps it out of the pytest process). References are independent of the
monitor's FSDP code: ``head_diversity()`` of the unsharded model built with the same seed (lr=0,
so the weights never change), ``head_diversity(inputs=global batch)`` in one process for the
head-output covariance, the unsharded model's own forward pass for the training loss, and scipy's
``subspace_angles`` for the principal-angle histograms.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from hdi_monitor import HDITracker, head_diversity
from hdi_monitor.models import AttentionSpec, find_attention_layers
from hdi_monitor.models.discovery import unwrapped_name
from hdi_monitor.models.sharding import contains_fsdp1, fsdp1_units, full_weights, gathers_weights

SCRIPT = Path(__file__).parents[1] / "scripts" / "fsdp1_tracker.py"
TIMEOUT_S = 120
CONFIGS = ["orig_params=False", "orig_params=True"]


def _load_script():
    name = "fsdp1_tracker"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


script = _load_script()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo2) -> dict:
    out = tmp_path_factory.mktemp("fsdp1") / "fsdp1.pt"
    gloo2.run(SCRIPT, "scenario", str(out), timeout_s=TIMEOUT_S)
    results = torch.load(out, weights_only=False)
    assert sorted(results) == sorted(CONFIGS)
    return results


@pytest.fixture(scope="module")
def reference():
    """The unsharded model and its one-process reports per global batch."""
    model = script.build_model()
    batches = script.global_batches()
    weights = head_diversity(model, projections=script.PROJECTIONS)
    acts = [
        head_diversity(model, projections=("key",), inputs=batches[s], max_tokens=None) for s in range(len(batches))
    ]
    return model, batches, weights, acts


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_hdi_equals_unsharded_head_diversity(runs, reference, config):
    _, _, weights, _ = reference
    run = runs[config]
    assert run["layer_names"] == [lay.name for lay in weights.layers]  # no _fsdp_wrapped_module segments
    assert all("_fsdp_wrapped_module" not in n for n in run["layer_names"])
    hdis = {lay.name: lay.hdi for lay in weights.layers}
    assert len({v for h in hdis.values() for v in h.values()}) == 8  # the layers and projections differ
    for step in run["steps"]:
        for name, per_proj in step["hdi"].items():
            for proj in script.PROJECTIONS:
                assert per_proj[proj] == pytest.approx(hdis[name][proj], rel=1e-6), (config, name, proj)
    # the logit bound, from the same per-unit gather: the unsharded model's
    for lay in weights.layers:
        assert lay.logit_bound is not None
        for step in run["steps"]:
            torch.testing.assert_close(step["logit_bound"][lay.name], lay.logit_bound, rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_covariance_equals_single_process_global_batch(runs, reference, config):
    _, batches, _, acts = reference
    for s, step in enumerate(runs[config]["steps"]):
        ref = acts[s].layers
        assert step["num_tokens"] == [batches.shape[1] * batches.shape[2]] * len(ref)
        assert step["effective_heads_by_rank"][0] == step["effective_heads_by_rank"][1]
        for i, lay in enumerate(ref):
            assert step["effective_heads"][i] == pytest.approx(lay.effective_heads, rel=1e-5)
            torch.testing.assert_close(step["covariance"][i].double(), lay.covariance.double(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_unshards_one_unit_at_a_time(runs, config):
    """Peak extra memory is one FSDP unit (one encoder layer), plus the root's own parameters once,
    before FSDP1's lazy initialisation."""
    run = runs[config]
    assert run["peak_units"] == 1, f"{run['peak_units']} encoder-layer units were unsharded at the same time"
    assert run["peak_total"] <= 2
    assert run["peak_unsharded"] == 1, f"{run['peak_unsharded']} encoder layers' flat parameters were full at once"
    assert run["unsharded_after"] == 0  # everything resharded after training
    assert all(n >= script.NUM_LAYERS for n in run["summons_per_step"])  # weights really were summoned


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_training_unaffected(runs, reference, config):
    """Forward passes after the measurements (the first one before FSDP1's lazy init) give the
    unsharded model's loss on rank 0's samples: summoning neither broke nor changed the model."""
    model, batches, _, _ = reference
    with torch.no_grad():
        expected = [float(model(batches[s][0 :: script.WORLD_SIZE]).logsumexp(-1).mean()) for s in range(len(batches))]
    assert runs[config]["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_angle_histograms_match_scipy(runs, reference, config):
    model, _, _, _ = reference
    layers = find_attention_layers(model)
    for proj in script.PROJECTIONS:
        expected = []
        for lay in layers:
            w = lay.head_weights(proj).double().numpy()
            for i in range(w.shape[0]):
                for j in range(i + 1, w.shape[0]):
                    expected += list(np.degrees(scipy.linalg.subspace_angles(w[i], w[j])))
        per_layer = [v for k, v in runs[config]["histograms"].items() if k.startswith(f"principal_angles_deg/{proj}/")]
        got = np.sort(torch.cat(per_layer).double().numpy())
        np.testing.assert_allclose(got, np.sort(expected), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp1_without_root_warns_what_to_pass(runs, config):
    run = runs[config]
    assert run["blind_result_is_none"]
    assert run["blind_summons"] == 0  # nothing was unsharded (so no nested unit became root)
    assert len(run["blind_warnings"]) == 1
    message = run["blind_warnings"][0]
    assert "FSDP1" in message and "fsdp_root" in message and "encoder.layers.0.self_attn" in message


# ------------------------------------------------------------------------------------------ in-process


class _Wrapper(nn.Module):
    """Inserts a name segment the way FSDP1 / checkpoint wrappers do, without sharding anything."""

    def __init__(self, attr: str, inner: nn.Module) -> None:
        super().__init__()
        setattr(self, attr, inner)

    def forward(self, *args, **kwargs):  # pragma: no cover - not called
        raise NotImplementedError


def _wrapped(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same model twice: plain, and with every encoder layer (and the root) behind wrapper segments."""
    plain = script.build_model(seed)
    wrapped = script.build_model(seed)
    for i, layer in enumerate(wrapped.encoder.layers):
        wrapped.encoder.layers[i] = _Wrapper("_fsdp_wrapped_module", _Wrapper("_checkpoint_wrapped_module", layer))
    return plain, _Wrapper("_fsdp_wrapped_module", wrapped)


def test_unwrapped_name():
    assert unwrapped_name("_fsdp_wrapped_module.encoder.layers.0._fsdp_wrapped_module.self_attn") == (
        "encoder.layers.0.self_attn"
    )
    assert unwrapped_name("layers.3._checkpoint_wrapped_module.attn") == "layers.3.attn"
    assert unwrapped_name("my_fsdp_wrapped_module_x.attn") == "my_fsdp_wrapped_module_x.attn"  # whole segments only
    assert unwrapped_name("") == ""


def test_discovery_reports_names_without_wrapper_segments():
    plain, wrapped = _wrapped()
    names = [lay.name for lay in find_attention_layers(plain)]
    found = find_attention_layers(wrapped)
    assert [lay.name for lay in found] == names == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    # the layers= filter and AttentionSpec regexes see the same names
    assert [lay.name for lay in find_attention_layers(wrapped, layers=[names[1]])] == [names[1]]
    spec = AttentionSpec(
        modules=r"encoder\.layers\.\d+\.self_attn",
        query="out_proj",
        key="out_proj",
        value="out_proj",
        output="out_proj",
        num_heads=4,
    )
    assert [lay.name for lay in find_attention_layers(wrapped, spec=spec)] == names
    # and the weights are those of the unwrapped model
    ref = head_diversity(plain, projections=("key",))
    got = head_diversity(wrapped, projections=("key",))
    assert [lay.hdi["key"] for lay in got.layers] == pytest.approx([lay.hdi["key"] for lay in ref.layers], rel=1e-12)


def test_plain_modules_need_no_summon():
    model = script.build_model()
    layers = find_attention_layers(model)
    assert not contains_fsdp1(model)
    for lay in layers:
        assert not gathers_weights(lay) and not gathers_weights(lay, model)
        assert fsdp1_units(lay.module) == [] and fsdp1_units(lay.module, model) == []
        with full_weights(lay, model):
            inside = lay.head_weights("key").clone()
        torch.testing.assert_close(inside, lay.head_weights("key"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a submodule of fsdp_root"):
        fsdp1_units(layers[0].module, nn.Linear(2, 2))


def test_tracker_rejects_a_non_module_root():
    with pytest.raises(TypeError, match="fsdp_root"):
        HDITracker(script.build_model(), fsdp_root="model")  # type: ignore[arg-type]
