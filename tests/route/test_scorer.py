"""``scorer.choose``: expected prefill time with literal prefixes, tiers and loads."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.route.prefix_index import PrefixMatch
from kvtier.route.scorer import (
    Candidate,
    Footprint,
    Rates,
    blocking,
    choose,
    expected_seconds,
    room_wait,
)

RATES = Rates(
    prefill_tokens_per_s=1000.0,
    host_tokens_per_s=10000.0,
    storage_tokens_per_s=2000.0,
    request_cost_s=0.5,
    request_duration_s=0.5,
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


def test_a_request_ahead_is_priced_by_where_it_is() -> None:
    """ "home" holds 8 of the 10 pages on host; its one request in flight is still in its
    prefill. "other" holds nothing; its one request streams output. At a request cost of
    0.2 s and a decode cost of 0.01 s, home costs 32 computed + 128 loaded tokens + 0.2 s,
    other 160 computed + 0.01 s: other wins. Once home's request streams too, home wins.
    Where it is not known how many stream, every request is priced at the request cost,
    and the host pages win."""
    rates = Rates(1000.0, 10000.0, 2000.0, request_cost_s=0.2, decode_cost_s=0.01)
    home = Candidate("home", 1, PrefixMatch(host=8), page_size=16, streaming=0)
    other = Candidate("other", 1, PrefixMatch(), page_size=16, streaming=1)
    assert home.load_s(rates) == 0.2 and other.load_s(rates) == 0.01
    d = choose([home, other], 160, rates)
    assert d.name == "other" and d.expected_s == pytest.approx(0.16 + 0.01)
    assert d.prefill_s == pytest.approx(0.16)
    streaming = dataclasses.replace(home, streaming=1)
    d = choose([streaming, other], 160, rates)
    assert d.name == "home" and d.expected_s == pytest.approx(0.032 + 0.0128 + 0.01)
    unknown = [dataclasses.replace(c, streaming=None) for c in (home, other)]
    assert [c.load_s(rates) for c in unknown] == [0.2, 0.2]
    assert choose(unknown, 160, rates).name == "home"
    # two in flight, one streaming
    assert Candidate("x", 2, None, streaming=1).load_s(rates) == pytest.approx(0.21)
    # without a decode cost of its own, a streaming request costs the request cost
    assert other.load_s(Rates(request_cost_s=0.05)) == 0.05
    with pytest.raises(ValueError, match="decode_cost_s"):
        Rates(decode_cost_s=-1.0)


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


def test_blocking_counts_the_requests_that_must_finish_before_a_request_fits() -> None:
    """A 1024-token pool; flights hold 256 shared prefix tokens each plus their own."""
    a, b = Footprint(own=448, prefix=256), Footprint(own=192, prefix=256)
    new = Footprint(own=448, prefix=256)
    assert blocking(1024, [], new) == 0
    assert blocking(1024, [b], new) == 0  # 256 + 192 + 448 = 896
    assert blocking(1024, [a], new) == 1  # 256 + 448 + 448 = 1152: a must finish
    assert blocking(1024, [a, b], new) == 1  # then 896: b may stay
    assert blocking(1024, [b, a], new) == 2  # oldest first: b, then a
    # a prefix of its own is not shared: the largest prefix counts once, the rest as own
    assert blocking(1024, [Footprint(own=64, prefix=0)], Footprint(own=512, prefix=512)) == 1
    assert blocking(1024, [Footprint(own=448, prefix=0)], Footprint(own=64, prefix=512)) == 0
    # unknown: no pool size, a flight routed without its tokens, larger than the whole pool
    assert blocking(None, [a], new) == 0
    assert blocking(1024, [None, a], new) == 0
    assert blocking(512, [a], new) == 0


def test_a_footprint_is_whole_pages_beyond_the_device_hit() -> None:
    c = _c("a", device=3, host=2)
    assert c.footprint(100, 8) == Footprint(own=64, prefix=48)  # 60 tokens: 4 pages
    assert _c("b", host=2).footprint(100, 0) == Footprint(own=112, prefix=0)
    assert choose([c, _c("b", in_flight=1)], 100, RATES, output_tokens=8).footprint == (
        Footprint(own=64, prefix=48)
    )
    # tokens not known: no footprint
    assert choose([c, _c("b")], 0, RATES).footprint is None


def test_a_request_goes_where_it_fits_rather_than_wait_behind_a_long_one() -> None:
    """Both instances run one request and hold the 256-token system prompt on device; "home"
    also holds the conversation's 8 earlier pages on host, but its running request leaves no
    room for this one, so it would wait for that request to end: "other" wins. Without the
    pool sizes, or with room on "home", the host pages win."""
    long, short = Footprint(own=448, prefix=256), Footprint(own=96, prefix=256)

    def cand(name: str, flight: Footprint, pool: int | None, **pages: int) -> Candidate:
        match = PrefixMatch(**pages)
        return Candidate(name, 1, match, page_size=16, device_tokens=pool, flights=(flight,))

    home, other = cand("home", long, 1024, device=16, host=8), cand("other", short, 1024, device=16)
    d = choose([home, other], 700, RATES, output_tokens=8)
    assert d.name == "other"
    # 444 computed, one request in flight; 700 + 8 - 256 = 452 -> 464 own tokens
    assert d.expected_s == pytest.approx(444 / 1000 + 0.5)
    assert d.prefill_s == pytest.approx(444 / 1000)  # its own, what the load is measured against
    assert d.footprint == Footprint(own=464, prefix=256)
    assert choose([home, other], 700, RATES, output_tokens=8, turn=1).name == "other"
    unknown = [cand("home", long, None, device=16, host=8), cand("other", short, None, device=16)]
    assert choose(unknown, 700, RATES, output_tokens=8).name == "home"
    roomy = [cand("home", short, 1024, device=16, host=8), cand("other", long, 1024, device=16)]
    assert choose(roomy, 700, RATES, output_tokens=8).name == "home"
    # the wait for room is priced at a request's duration, not at the cost of sharing a step:
    # home 316 computed + 128 loaded + one wait, other 444 computed
    quick = Rates(1000.0, 10000.0, 2000.0, request_cost_s=0.0, request_duration_s=0.2)
    d = choose([home, other], 700, quick, output_tokens=8)
    assert d.name == "other" and d.expected_s == pytest.approx(0.444)
    # the request it waits for is 0.15 s old: 0.05 s of its 0.2 s are left, and home wins
    aged = dataclasses.replace(home, ages=(0.15,))
    d = choose([aged, other], 700, quick, output_tokens=8)
    assert d.name == "home" and d.expected_s == pytest.approx(0.316 + 0.0128 + 0.05)
    assert d.prefill_s == pytest.approx(0.316 + 0.0128)
    instant = Rates(1000.0, 10000.0, 2000.0, request_cost_s=0.1, request_duration_s=0.0)
    d = choose([home, other], 700, instant, output_tokens=8)
    assert d.name == "home" and d.expected_s == pytest.approx(0.316 + 0.0128 + 0.1)


def test_the_wait_for_room_ends_with_the_youngest_request_waited_for() -> None:
    """Requests in flight run side by side: waiting for the two oldest (sent 0.3 s and 0.1 s
    ago, lasting 0.25 s each) ends when the second ends."""
    assert room_wait(0, (0.3, 0.1), 0.25) == 0.0
    assert room_wait(1, (0.3, 0.1), 0.25) == 0.0  # overdue: it may end any moment
    assert room_wait(2, (0.3, 0.1), 0.25) == pytest.approx(0.15)
    assert room_wait(2, (), 0.25) == 0.25  # ages not known: a whole duration


def test_debug_logging_shows_each_candidates_time(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="kvtier.route"):
        choose([_c("a", device=2), _c("b", in_flight=1, host=5)], 160, RATES)
    assert caplog.messages == [
        "candidate a: 128.0 ms (pages device 2 host 0 storage 0 of 160 tokens, 0 in flight "
        "costing 0.0 ms, room wait 0.0 ms)",
        "candidate b: 588.0 ms (pages device 0 host 5 storage 0 of 160 tokens, 1 in flight "
        "costing 500.0 ms, room wait 0.0 ms)",
        "chose a",
    ]
