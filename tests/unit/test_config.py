"""Bad arguments fail at once, naming what is wrong (issue 30, item 12).

* ``MonitorConfig(seed=2**64)`` and ``history_budget=2**40`` were accepted and failed later inside
  torch (``manual_seed``: "Overflow when unpacking long long"; the history's preallocation) without
  naming the setting. The reference for the seed's range is ``torch.Generator.manual_seed`` itself.
* The history preallocates ``budget`` float64 values per series: the documented cost (8 bytes per
  series per kept step, 16 more per kept step) is checked against the store's own tensors.
* ``prune_heads(model, {layer: "01"})`` removed heads 0 and 1 (the string was iterated); a string,
  bytes, a bare int, a float or a bool where head indices are expected are refused, and the model is
  left as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hdi_monitor import HDITracker, MonitorConfig
from hdi_monitor.ablation import ablate_heads, prune_heads
from hdi_monitor.config import MAX_HISTORY_BUDGET
from hdi_monitor.models import find_attention_layers

transformers = pytest.importorskip("transformers")

SEED_MAX = 2**64 - 1


def test_the_seed_range_is_the_generators():
    torch.Generator().manual_seed(SEED_MAX)  # the reference: what torch takes
    with pytest.raises((ValueError, RuntimeError), match="Overflow"):
        torch.Generator().manual_seed(SEED_MAX + 1)
    tracker = HDITracker(nn.MultiheadAttention(8, 2), seed=SEED_MAX)
    assert tracker.generator.initial_seed() == SEED_MAX
    for bad in (SEED_MAX + 1, 2**70, -1):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 18446744073709551615\]"):
            MonitorConfig(seed=bad)


def test_the_history_budget_is_bounded_at_construction():
    assert MonitorConfig(history_budget=MAX_HISTORY_BUDGET).history_budget == MAX_HISTORY_BUDGET
    for bad in (MAX_HISTORY_BUDGET + 1, 2**40, 3):
        with pytest.raises(ValueError, match=rf"history_budget must be an integer in \[4, {MAX_HISTORY_BUDGET}\]"):
            MonitorConfig(history_budget=bad)


def _llama(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("kernel_stats", [False, True])
def test_the_documented_memory_cost_of_the_history(kernel_stats):
    """``MonitorConfig.history_budget``: 8 bytes per series per kept step (7 series per layer, 9 with
    kernel statistics, about 35 for the model with the default detectors), plus 16 bytes per kept step."""
    model, budget = _llama(4), 64
    tracker = HDITracker(model, every_n_steps=1, history_budget=budget, kernel_stats=kernel_stats)
    ids = torch.randint(0, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        with tracker.capture({"input_ids": ids}):
            model(input_ids=ids)
        tracker.step()
    keys = tracker.history.keys()
    per_layer = sum(1 for k in keys if k.layer == "model.layers.0.self_attn")
    assert per_layer == (9 if kernel_stats else 7)  # with the logit bound
    assert 27 <= sum(1 for k in keys if k.layer is None) <= 36
    assert tracker.history.nbytes == (8 * len(keys) + 16) * budget


def _bert() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertModel(cfg).eval()


@pytest.mark.parametrize("heads", ["01", b"\x00\x01", 1, [0.0, 1.0], [True], None], ids=repr)
def test_head_indices_must_be_a_sequence_of_integers(heads):
    model = _bert()
    name = find_attention_layers(model)[0].name
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=name):
        prune_heads(model, {name: heads})
    with pytest.raises(TypeError, match=name), ablate_heads(model, {name: heads}):
        pass
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_integer_likes_are_still_head_indices():
    """A list, a tuple, a range, a tensor or numpy integers keep working (the same heads removed)."""
    import numpy as np

    name = find_attention_layers(_bert())[0].name
    ids = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = prune_heads(_bert(), {name: [0, 1]})(input_ids=ids).last_hidden_state
        for heads in ((0, 1), range(2), torch.tensor([0, 1]), np.array([0, 1]), [np.int64(1), 0]):
            got = prune_heads(_bert(), {name: heads})(input_ids=ids).last_hidden_state
            torch.testing.assert_close(got, reference, rtol=0, atol=0)
