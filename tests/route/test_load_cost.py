"""``LoadCost``: the cost of a request ahead by where it is, from literal samples."""

from __future__ import annotations

import pytest

from kvtier.route.load_cost import Ahead, LoadCost

IDLE, DECODE, PREFILL = Ahead(), Ahead(decoding=1), Ahead(prefilling=1)


def test_the_costs_are_the_excess_over_the_idle_median_per_request_ahead() -> None:
    """Idle excesses 1, 2 and 100 ms (median 2 ms); two requests behind one that streamed,
    at 5 and 7 ms (3 + 5 = 8 ms over two: 4 ms each); two behind one in its prefill and one
    that streamed, at 12 and 16 ms: (12 - 2 - 4) + (16 - 2 - 4) = 16 ms over two, 8 ms
    each. Durations 10 ms each, one of 40 ms."""
    cost = LoadCost(window=16, min_samples=7)
    both = Ahead(prefilling=1, decoding=1)
    samples = [(IDLE, 0.001), (IDLE, 0.002), (IDLE, 0.100), (DECODE, 0.005), (DECODE, 0.007)]
    samples += [(both, 0.012), (both, 0.016)]
    for i, (ahead, excess) in enumerate(samples):
        assert (cost.decode_cost_s(), cost.prefill_cost_s(), cost.duration_s()) == (None,) * 3
        cost.observe(ahead, excess, 0.04 if i == 0 else 0.01)
    assert cost.decode_cost_s() == pytest.approx(0.004)
    assert cost.prefill_cost_s() == pytest.approx(0.008)
    assert cost.duration_s() == pytest.approx(0.1 / 7)
    assert len(cost) == 7


def test_no_sample_of_a_kind_gives_no_cost_of_that_kind_and_none_is_negative() -> None:
    cost = LoadCost(window=4, min_samples=2)
    cost.observe(IDLE, 0.010, 0.0)
    cost.observe(PREFILL, 0.005, 0.0)  # less than the idle excess: priced 0, not below
    assert cost.decode_cost_s() is None and cost.prefill_cost_s() == 0.0
    for _ in range(4):  # the window keeps the newest: the idle sample is gone
        cost.observe(DECODE, 0.003, 0.0)
    assert cost.prefill_cost_s() is None and cost.decode_cost_s() == pytest.approx(0.003)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        LoadCost(window=1)
    with pytest.raises(ValueError, match="min_samples"):
        LoadCost(window=4, min_samples=5)
    cost = LoadCost()
    with pytest.raises(ValueError, match="ahead"):
        cost.observe(Ahead(prefilling=-1), 0.0, 0.0)
    with pytest.raises(ValueError, match="held_s"):
        cost.observe(IDLE, 0.0, -1.0)
