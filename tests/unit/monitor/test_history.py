"""The bounded history keeps the whole run's shape (issue 30, item 7).

Budget 512: after 10,000 measured steps the old store kept rows 0, 8832, 8960, ... (the same old
rows halved at every compaction). The documented rule (`hdi_monitor.monitor.history`): the newest
``budget // 2`` measurements in full; the older ones on an even grid of spacing ``s`` (the younger
part of them at ``s / 2``), with ``s`` the smallest power of two that fits them in `OLDER_ROWS`
rows; the first measurement always kept. The reference is the counted measurements themselves:
the test appends measurement ``i`` at training step ``10 * i`` with value ``f(i)`` and checks every
kept row against that.
"""

from __future__ import annotations

import base64
import math

import pytest
import torch

from hdi_monitor.measure.measurement import Series
from hdi_monitor.monitor.history import History, older_rows

KEY, OTHER = Series("hdi", "key", "layers.0"), Series("hdi", "key", stat="mean")


def _value(i: int) -> float:
    return math.sin(i / 7.0) + i * 1e-6


def _documented_spacing(n: int, budget: int) -> int:
    """The documented bound on a gap among the older rows after ``n`` measurements: the smallest power
    of two ``s`` with ``ceil((n - budget // 2) / s) <= older_rows(budget)``."""
    older, cap = n - budget // 2, older_rows(budget)
    s = 1
    while -(-older // s) > cap:
        s *= 2
    return s


def _fill(history: History, n: int, start: int = 0) -> None:
    for i in range(start, n):
        history.append(10 * i, {KEY: _value(i), OTHER: -_value(i)})


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_the_whole_run_is_kept_at_a_spacing_that_grows_with_age(n):
    budget = 512
    history = History(budget)
    _fill(history, n)
    steps = history.steps
    kept = [s // 10 for s in steps]  # the measurement each kept row is
    window = budget // 2
    assert len(history) <= budget
    assert kept[0] == 0  # the first measurement
    assert kept[-window:] == list(range(n - window, n))  # the newest half of the budget, every one
    gaps = [b - a for a, b in zip(kept, kept[1:], strict=False)]
    s = _documented_spacing(n, budget)
    assert s == {10_000: 64, 100_000: 512}[n]  # vs the even spacing (n - 256) / 256 = 38.1 and 389.6
    assert max(gaps) <= s  # the old store left one gap of 8,832 measurements at n = 10,000
    assert gaps == sorted(gaps, reverse=True)  # never denser with age
    grid = [g for g in gaps if g >= s // 2]  # the older rows: on the grid of s, the younger of them of s / 2
    assert set(grid) <= {s // 2, s} and len(grid) >= 0.9 * older_rows(budget)  # they use their share
    # every kept point is the value measured at its step, in both series
    assert history.column(KEY).tolist() == [_value(i) for i in kept]
    assert history.column(OTHER).tolist() == [-_value(i) for i in kept]


def test_memory_and_checkpoint_stay_bounded_by_the_budget():
    budget = 512
    history = History(budget)
    sizes, done = [], 0
    for n in (600, 10_000, 30_000):
        _fill(history, n, start=done)
        done = n
        state = history.state_dict()
        assert len(state["steps"]) == len(history) <= budget
        sizes.append((history.nbytes, len(state["columns"][0][-1])))
    assert sizes[0][0] == sizes[1][0] == sizes[2][0]  # flat once every series has appeared
    assert max(size for _, size in sizes) <= len(base64.b64encode(bytes(8 * budget)))  # at most budget values
    assert history.nbytes == 2 * budget * 8 + 2 * budget * 8  # two float64 series, the steps, the ordinals


def test_a_checkpoint_round_trip_keeps_the_same_rows_and_goes_on_the_same_way():
    budget = 64
    history = History(budget)
    _fill(history, 3_000)
    restored = History.from_state(history.state_dict(), budget)
    assert restored == history and restored.steps == history.steps
    torch.testing.assert_close(restored.column(KEY), history.column(KEY), rtol=0, atol=0)
    # the restored store continues exactly as the uninterrupted one
    _fill(history, 5_000, start=3_000)
    _fill(restored, 5_000, start=3_000)
    assert restored.steps == history.steps and restored == history
    # into a smaller budget: the same rule, at the smaller size
    small = History.from_state(history.state_dict(), 16)
    kept = [s // 10 for s in small.steps]
    assert len(small) <= 16 and kept[0] == 0 and kept[-8:] == list(range(4_992, 5_000))
    gaps = [b - a for a, b in zip(kept, kept[1:], strict=False)]
    assert max(gaps) <= _documented_spacing(5_000, 16) and gaps == sorted(gaps, reverse=True)


def test_a_malformed_state_is_refused_naming_the_history():
    history = History(16)
    _fill(history, 40)
    good = history.state_dict()
    for change in (
        {"ordinals": list(reversed(good["ordinals"]))},
        {"ordinals": good["ordinals"][:-1]},
        {"ordinals": "0,1,2"},
        {"count": None},
        {"count": good["ordinals"][-1]},  # a kept measurement beyond the count
    ):
        with pytest.raises(ValueError, match="malformed history state"):
            History.from_state({**good, **change}, 16)
    # a state saved before the measurement numbers (version 2) loads its rows as consecutive measurements
    old = {k: v for k, v in good.items() if k not in ("ordinals", "count")} | {"version": 2}
    restored = History.from_state(old, 16)
    assert restored.steps == history.steps and restored == history
