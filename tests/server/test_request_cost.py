"""The per-request cost an instance fits from the requests it served
(``kvtier.server.request_cost``)."""

from __future__ import annotations

import pytest

from kvtier.server.request_cost import RequestCost, predicted_prefill_s


def test_the_excess_over_the_idle_one_per_request_ahead() -> None:
    cost = RequestCost(window=8, min_samples=4)
    # excess = 0.004 + 0.025 * ahead: what an idle request pays is not charged per request
    for ahead in (0, 1, 2, 3):
        cost.observe(ahead, 0.004 + 0.025 * ahead, 0.0)
    assert cost.seconds() == pytest.approx(0.025, abs=1e-12)


def test_a_slow_idle_start_does_not_lower_the_cost() -> None:
    """Idle excesses 0.004, 0.005 and a cold first request's 0.200: the baseline is their
    median 0.005, so the two busy samples cost (0.035 - 0.005 + 0.025 - 0.005) / (1 + 1)
    (a mean baseline, 0.0697, would price them at 0)."""
    cost = RequestCost(window=8, min_samples=4)
    for ahead, excess in ((0, 0.200), (0, 0.004), (1, 0.035), (0, 0.005), (1, 0.025)):
        cost.observe(ahead, excess, 0.0)
    assert cost.seconds() == pytest.approx(0.025, abs=1e-12)


def test_too_few_samples_or_none_with_a_request_ahead_give_no_estimate() -> None:
    cost = RequestCost(window=8, min_samples=4)
    for ahead in (0, 3, 5):
        cost.observe(ahead, 0.1 * ahead, 0.0)
    assert cost.seconds() is None
    idle = RequestCost(window=8, min_samples=4)
    for excess in (0.01, 0.02, 0.03, 0.04):
        idle.observe(0, excess, 0.0)
    assert idle.seconds() is None


def test_a_busy_instance_is_charged_its_first_request_ahead_in_full() -> None:
    """Never idle: no baseline, so the whole excess counts; 1 ahead cost 0.03 s and 2 ahead
    0.04 s (a concave load): (0.03 + 0.04 + 0.03 + 0.04) / (1 + 2 + 1 + 2)."""
    cost = RequestCost(window=8, min_samples=4)
    for ahead, excess in ((1, 0.03), (2, 0.04), (1, 0.03), (2, 0.04)):
        cost.observe(ahead, excess, 0.0)
    assert cost.seconds() == pytest.approx(0.14 / 6, abs=1e-12)


def test_a_falling_line_costs_nothing() -> None:
    cost = RequestCost(window=8, min_samples=2)
    cost.observe(0, 0.05, 0.0)
    cost.observe(4, 0.01, 0.0)
    assert cost.seconds() == 0.0


def test_only_the_newest_window_counts() -> None:
    cost = RequestCost(window=4, min_samples=4)
    for ahead in (0, 1, 2, 3):
        cost.observe(ahead, 1.0 * ahead, 0.0)  # pushed out by the four below
    for ahead in (0, 1, 2, 3):
        cost.observe(ahead, 0.01 * ahead, 0.0)
    assert len(cost) == 4
    assert cost.seconds() == pytest.approx(0.01, abs=1e-12)


@pytest.mark.parametrize(
    ("kw", "name"),
    [({"window": 1}, "window"), ({"window": 8, "min_samples": 9}, "min_samples")],
)
def test_bad_settings_name_themselves(kw: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RequestCost(**kw)
    with pytest.raises(ValueError, match="ahead"):
        RequestCost().observe(-1, 0.0, 0.0)
    with pytest.raises(ValueError, match="held_s"):
        RequestCost().observe(0, 0.0, float("nan"))


def test_the_duration_is_the_mean_hold_of_the_window() -> None:
    cost = RequestCost(window=4, min_samples=3)
    cost.observe(0, 0.0, 9.0)  # pushed out below
    cost.observe(0, 0.0, 0.02)
    assert cost.duration_s() is None
    cost.observe(1, 0.0, 0.04)
    assert cost.duration_s() == pytest.approx(9.06 / 3)
    cost.observe(2, 0.0, 0.06)
    cost.observe(3, 0.0, 0.08)
    assert cost.duration_s() == pytest.approx(0.05)


def test_the_own_prefill_prices_each_tier_the_instance_has() -> None:
    rates = {"prefill_tokens_per_s": 1000.0, "host_tokens_per_s": 4000.0}
    # 100 computed + (200 host + 400 storage) loaded; no storage rate: its read is free
    assert predicted_prefill_s(100, 200, 400, rates) == pytest.approx(0.1 + 0.15)
    rates["storage_tokens_per_s"] = 2000.0
    assert predicted_prefill_s(100, 200, 400, rates) == pytest.approx(0.1 + 0.15 + 0.2)
    assert predicted_prefill_s(0, 0, 0, {"prefill_tokens_per_s": 1.0}) == 0.0
