"""``LoadCost``: the cost of a request ahead by where it is and a request's duration, from
literal samples, and ``predicted_prefill_s`` (``kvtier.server.load_cost``)."""

from __future__ import annotations

import pytest

from kvtier.server.load_cost import Ahead, LoadCost, predicted_prefill_s

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
    with pytest.raises(ValueError, match="held_s"):
        cost.observe(IDLE, 0.0, float("nan"))


def test_a_slow_idle_start_does_not_lower_the_cost() -> None:
    """Idle excesses 0.004, 0.005 and a cold first request's 0.200: the baseline is their
    median 0.005, so the two requests behind one in its prefill cost (0.035 - 0.005 + 0.025 -
    0.005) / (1 + 1) (a mean baseline, 0.0697, would price them at 0)."""
    cost = LoadCost(window=8, min_samples=4)
    for ahead, excess in ((IDLE, 0.200), (IDLE, 0.004), (PREFILL, 0.035), (IDLE, 0.005)):
        cost.observe(ahead, excess, 0.0)
    cost.observe(PREFILL, 0.025, 0.0)
    assert cost.prefill_cost_s() == pytest.approx(0.025, abs=1e-12)


def test_a_busy_instance_is_charged_its_first_request_ahead_in_full() -> None:
    """Never idle: no baseline, so the whole excess counts; 1 ahead cost 0.03 s and 2 ahead
    0.04 s (a concave load): (0.03 + 0.04 + 0.03 + 0.04) / (1 + 2 + 1 + 2)."""
    cost = LoadCost(window=8, min_samples=4)
    for n, excess in ((1, 0.03), (2, 0.04), (1, 0.03), (2, 0.04)):
        cost.observe(Ahead(prefilling=n), excess, 0.0)
    assert cost.prefill_cost_s() == pytest.approx(0.14 / 6, abs=1e-12)


def test_a_falling_line_costs_nothing_and_only_the_newest_window_counts() -> None:
    cost = LoadCost(window=4, min_samples=2)
    cost.observe(IDLE, 0.05, 0.0)
    cost.observe(Ahead(prefilling=4), 0.01, 0.0)
    assert cost.prefill_cost_s() == 0.0
    for n in (0, 1, 2, 3):  # push the two above out
        cost.observe(Ahead(prefilling=n), 0.01 * n, 0.0)
    assert len(cost) == 4
    assert cost.prefill_cost_s() == pytest.approx(0.01, abs=1e-12)


def test_the_duration_is_the_mean_hold_of_the_window() -> None:
    cost = LoadCost(window=4, min_samples=3)
    cost.observe(IDLE, 0.0, 9.0)  # pushed out below
    cost.observe(IDLE, 0.0, 0.02)
    assert cost.duration_s() is None
    cost.observe(PREFILL, 0.0, 0.04)
    assert cost.duration_s() == pytest.approx(9.06 / 3)
    cost.observe(DECODE, 0.0, 0.06)
    cost.observe(PREFILL, 0.0, 0.08)
    assert cost.duration_s() == pytest.approx(0.05)


def test_the_own_prefill_prices_each_tier_the_instance_has() -> None:
    rates = {"prefill_tokens_per_s": 1000.0, "host_tokens_per_s": 4000.0}
    # 100 computed + (200 host + 400 storage) loaded; no storage rate: its read is free
    assert predicted_prefill_s(100, 200, 400, rates) == pytest.approx(0.1 + 0.15)
    rates["storage_tokens_per_s"] = 2000.0
    assert predicted_prefill_s(100, 200, 400, rates) == pytest.approx(0.1 + 0.15 + 0.2)
    assert predicted_prefill_s(0, 0, 0, {"prefill_tokens_per_s": 1.0}) == 0.0
