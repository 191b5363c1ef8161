"""``scorer.choose``: expected prefill time with literal prefixes, tiers and loads."""

from __future__ import annotations

import pytest

from kvtier.route.prefix_index import PrefixMatch
from kvtier.route.scorer import Candidate, Rates, choose, expected_seconds

RATES = Rates(
    prefill_tokens_per_s=1000.0,
    host_tokens_per_s=10000.0,
    storage_tokens_per_s=2000.0,
    request_cost_s=0.5,
)


def _c(name: str, in_flight: int = 0, **pages: int) -> Candidate:
    return Candidate(name, in_flight, PrefixMatch(**pages), page_size=16)


def test_the_longest_device_prefix_wins() -> None:
    d = choose([_c("a", device=2), _c("b", device=5), _c("c", device=1)], 160, RATES)
    assert (d.name, d.reason) == ("b", "prefix")
    assert d.expected_s == pytest.approx((160 - 80) / 1000)


def test_host_beats_storage_for_the_same_prefix() -> None:
    d = choose([_c("s", storage=4), _c("h", host=4)], 128, RATES)
    assert d.name == "h"
    assert d.expected_s == pytest.approx(64 / 1000 + 64 / 10000)
    # also where the storage rate (a prior, say) is above the host rate: a storage page is
    # loaded from host after it is read
    fast = Rates(1000.0, 10000.0, 1e9, 0.5)
    assert choose([_c("s", storage=4), _c("h", host=4)], 128, fast).name == "h"


def test_a_loaded_instance_loses_to_an_idle_one_with_a_shorter_prefix() -> None:
    # 10 pages more on "busy" save 0.16 s of prefill; its 1 request in flight costs 0.5 s
    busy, idle = _c("busy", in_flight=1, device=10), _c("idle", device=0)
    assert choose([busy, idle], 320, RATES).name == "idle"
    # without the queueing cost the longer prefix wins
    free = Rates(1000.0, 10000.0, 2000.0, request_cost_s=0.0)
    assert choose([busy, idle], 320, free).name == "busy"


def test_stale_events_fall_back_to_the_least_loaded() -> None:
    stale = Candidate("a", 3, None, stale=True)
    d = choose([stale, _c("b", in_flight=1, device=9), _c("c", in_flight=0)], 160, RATES)
    assert (d.name, d.reason) == ("c", "stale_events")


def test_no_prefix_anywhere_is_least_loaded_and_one_candidate_is_only_healthy() -> None:
    d = choose([_c("a", in_flight=2), _c("b", in_flight=1)], 160, RATES)
    assert (d.name, d.reason) == ("b", "least_loaded")
    assert choose([_c("a", in_flight=9)], 160, RATES).reason == "only_healthy"
    with pytest.raises(ValueError):
        choose([], 1, RATES)


def test_expected_seconds_and_rate_checks() -> None:
    m = PrefixMatch(device=1, host=1, storage=1)
    # the storage page is read, then loaded like the host page
    assert expected_seconds(64, m, 16, 2, RATES) == pytest.approx(
        16 / 1000 + 16 / 10000 + (16 / 2000 + 16 / 10000) + 1.0
    )
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Rates(prefill_tokens_per_s=0)


def test_each_instance_is_priced_with_the_rates_it_reported() -> None:
    """The same 4 host pages on both: on the router's rates "a" (listed first) wins the tie;
    "b" reported a host path ten times faster (its loads measured), so it wins, and an
    instance that reported nothing keeps the router's rates."""
    fast = Rates(1000.0, 100000.0, 2000.0, 0.5)
    a = _c("a", host=4)
    b = Candidate("b", 0, PrefixMatch(host=4), page_size=16, rates=fast)
    d = choose([a, b], 128, RATES)
    assert d.name == "b"
    assert d.expected_s == pytest.approx(64 / 1000 + 64 / 100000)
    assert choose([a, _c("b", host=4)], 128, RATES).name == "a"


def test_ties_are_broken_in_turn() -> None:
    """Equal expected time and load: the candidates take turns (``turn`` rotates who is
    first); a lower load or a longer prefix still wins whatever the turn."""
    same = [_c("a", host=4), _c("b", host=4), _c("c", host=4)]
    assert [choose(same, 128, RATES, turn).name for turn in range(4)] == ["a", "b", "c", "a"]
    idle = [_c("a"), _c("b"), _c("c")]  # nothing held anywhere: least loaded, in turn
    picks = [choose(idle, 128, RATES, turn) for turn in range(3)]
    assert [(d.name, d.reason) for d in picks] == [(n, "least_loaded") for n in "abc"]
    busy = [_c("a", in_flight=1), _c("b", in_flight=1), _c("c")]
    assert {choose(busy, 128, RATES, turn).name for turn in range(3)} == {"c"}
    longer = [_c("a", host=4), _c("b", host=5), _c("c", host=4)]
    assert {choose(longer, 128, RATES, turn).name for turn in range(3)} == {"b"}
