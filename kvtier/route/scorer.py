"""Choosing an instance for a request by its expected time to first token.

For an instance whose KV events are current, the expected prefill time of a prompt of ``n``
tokens of which the instance holds ``d`` on device, ``h`` on host and ``s`` in storage (leading
pages, ``PrefixIndex.match``) is::

    (n - d - h - s) / prefill_rate  +  (h + s) / host_rate  +  s / storage_rate
        +  load  +  room_wait

Device pages cost nothing (attention reads them where they are); a storage page is read into
the host tier and then loaded like a host page, so it pays both (whatever the rates say, a
host hit is never dearer than a storage hit of the same pages). Each instance is priced with
the rates its cache measured (reported by its ``/health``), the router's own where it reports
none, and with the request cost and duration the router measured on that instance's streamed
answers once it has them (``Instance.priced_rates``). The smallest time wins; ties go to the fewer requests in flight, then to the instance
first in turn: the candidates' order rotated by ``turn`` (the fleet advances it every request,
so idle instances take turns instead of the first-listed taking every tie). When some instance's
events are stale the index cannot be trusted for the comparison, so the request goes to the
least-loaded instance instead (reason ``stale_events``).

``load`` is what sharing the engine with the requests already there costs, each priced by
where it is (``kvtier.server.load_cost``): one still in its prefill ``request_cost``, one that
streams output already ``decode_cost``; a candidate that does not say how many of its requests
stream is priced ``in_flight * request_cost``. ``room_wait`` is the room term. An instance
admits a request only when its device pool has pages for it (what it does not hold on device:
prompt and output tokens less the device hit), and until then the request waits for running
ones to finish. The router knows the pool's size (``device_tokens`` on the instance's model card) and what each
request it sent there and that has not finished holds (its ``Footprint``), so it counts the
requests in flight that must finish, oldest first, before the new one fits (``blocking``): 0
where it fits now. Shared prefixes are counted once (the largest device prefix among them and
the new request), as the pool holds them once. Without the size, or while a request in flight
has an unknown footprint (it was routed without its tokens), the term is 0. Those requests run
side by side, so the wait ends when the youngest of them ends: ``request_duration`` less that
request's age (its time since it was sent; a whole duration where the age is not known), never
below 0 (``room_wait``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.route.prefix_index import PrefixMatch

log = logging.getLogger("kvtier.route")

REASONS = ("prefix", "least_loaded", "stale_events", "only_healthy")
"""Why an instance was chosen: ``prefix`` by expected time with some page held somewhere;
``least_loaded`` without any prefix knowledge to use (no events configured, no tokens, no page
held anywhere); ``stale_events`` some candidate's events went quiet; ``only_healthy`` one
candidate was left."""


@dataclass(frozen=True)
class Rates:
    """Per-tier rates the expected time is priced with (tokens per second), and what the
    requests already in flight on the instance cost a new one (seconds)."""

    prefill_tokens_per_s: float = 8000.0
    """Prompt tokens an instance computes per second (the uncached suffix)."""
    host_tokens_per_s: float = 200000.0
    """Tokens of KV an instance loads from its host tier per second."""
    storage_tokens_per_s: float = 40000.0
    """Tokens of KV an instance reads from its storage tier per second."""
    request_cost_s: float = 0.05
    """Expected delay each request in flight that is still in its prefill adds before this
    one's prefill (one that streams output: ``decode_cost_s``)."""
    request_duration_s: float = 0.05
    """Expected seconds a request holds its device pages (from its prefill to its end): the
    wait for each request in flight that must finish before this one fits."""
    decode_cost_s: float | None = None
    """Expected delay a request in flight that streams output already adds (``None``: as
    ``request_cost_s``)."""

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_tokens_per_s", "storage_tokens_per_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v}")
        for name in ("request_cost_s", "request_duration_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v}")
        d = self.decode_cost_s
        if d is not None and not (math.isfinite(d) and d >= 0):
            raise ValueError(f"decode_cost_s must be >= 0 or None, got {d}")

    @property
    def streaming_cost_s(self) -> float:
        """What a request in flight that streams output costs: ``decode_cost_s``, else
        ``request_cost_s``."""
        return self.request_cost_s if self.decode_cost_s is None else self.decode_cost_s


@dataclass(frozen=True)
class Footprint:
    """The device tokens a request holds on the instance it was sent to while it runs."""

    own: int
    """Tokens it needs pages of its own for: its prompt and output less its device hit."""
    prefix: int
    """Tokens of its prompt already on the instance's device (shared with other requests)."""


def blocking(device_tokens: int | None, flights: Sequence[Footprint | None], new: Footprint) -> int:
    """How many of ``flights`` (in the order they were sent) must finish before ``new`` fits
    in a device pool of ``device_tokens`` (module docstring); 0 when it fits now, when the size
    or some flight's footprint is unknown, or when ``new`` could not fit an empty pool."""
    if device_tokens is None or any(f is None for f in flights):
        return 0
    held = [f for f in flights if f is not None]

    def fits(rest: list[Footprint]) -> bool:
        prefix = max([new.prefix, *(f.prefix for f in rest)])
        return prefix + new.own + sum(f.own for f in rest) <= device_tokens

    if not fits([]):
        return 0
    return next(k for k in range(len(held) + 1) if fits(held[k:]))


@dataclass(frozen=True)
class Candidate:
    """One healthy instance as the choice sees it."""

    name: str
    in_flight: int
    match: PrefixMatch | None
    """The prompt's leading pages the instance holds; ``None`` when its events are stale or
    it has no event stream."""
    stale: bool = False
    """Its event stream exists but went quiet (no event or heartbeat within the limit)."""
    page_size: int = 16
    """Tokens per page of ``match``."""
    rates: Rates | None = None
    """The rates the instance measured (its ``/health``); ``None``: the router's."""
    device_tokens: int | None = None
    """Its device pool's size in tokens (its model card's); ``None``: unknown."""
    flights: tuple[Footprint | None, ...] = ()
    """What the requests in flight that the router sent it hold, oldest first (``None``: not
    known)."""
    ages: tuple[float, ...] = ()
    """Seconds since each of ``flights`` was sent (the same order; empty: not known)."""
    streaming: int | None = None
    """How many of the requests in flight stream output already (the rest are in their
    prefill); ``None``: not known (all are priced as in their prefill)."""

    def load_s(self, rates: Rates) -> float:
        """What the requests in flight here cost a new one at ``rates`` (module
        docstring)."""
        streaming = min(self.streaming or 0, self.in_flight)
        prefilling = self.in_flight - streaming
        return prefilling * rates.request_cost_s + streaming * rates.streaming_cost_s

    def footprint(self, prompt_tokens: int, output_tokens: int) -> Footprint:
        """What a request of these sizes would hold here (whole pages)."""
        prefix = min(self.match.device * self.page_size, prompt_tokens) if self.match else 0
        own = -(-(prompt_tokens + output_tokens - prefix) // self.page_size) * self.page_size
        return Footprint(own, prefix)


@dataclass(frozen=True)
class Decision:
    """The chosen instance, why, and its expected seconds (``None`` for a load-only choice)."""

    name: str
    reason: str
    expected_s: float | None = None
    match: PrefixMatch | None = None
    footprint: Footprint | None = None
    """What the request will hold on the chosen instance; ``None`` when its tokens are not
    known."""
    prefill_s: float | None = None
    """The request's own prefill on the chosen instance (``expected_seconds`` without the
    load terms), for a choice by expected time: what the router measures the load's cost
    against (``Instance.end``)."""


def expected_seconds(
    prompt_tokens: int,
    match: PrefixMatch,
    page_size: int,
    in_flight: int,
    rates: Rates,
    room_wait_s: float = 0.0,
    load_s: float | None = None,
) -> float:
    """The expected prefill time (module docstring) of ``prompt_tokens`` tokens, where
    it waits ``room_wait_s`` for room in the device pool and the requests in flight cost
    ``load_s`` (``None``: ``in_flight * request_cost_s``)."""
    device, host, storage = (p * page_size for p in (match.device, match.host, match.storage))
    uncached = max(prompt_tokens - device - host - storage, 0)
    return (
        uncached / rates.prefill_tokens_per_s
        + (host + storage) / rates.host_tokens_per_s
        + storage / rates.storage_tokens_per_s
        + (in_flight * rates.request_cost_s if load_s is None else load_s)
        + room_wait_s
    )


def room_wait(blocked_by: int, ages: Sequence[float], duration_s: float) -> float:
    """Seconds until the oldest ``blocked_by`` requests in flight (``ages``: seconds since
    each was sent, oldest first) have all ended, each lasting ``duration_s``; a request of
    unknown age counts a whole duration (module docstring)."""
    if blocked_by == 0:
        return 0.0
    age = ages[blocked_by - 1] if len(ages) >= blocked_by else 0.0
    return max(duration_s - age, 0.0)


def least_loaded(candidates: Sequence[Candidate], turn: int = 0) -> Candidate:
    """The candidate with the fewest requests in flight (on a tie, the first in turn: see
    the module docstring)."""
    n = len(candidates)
    return min(enumerate(candidates), key=lambda ic: (ic[1].in_flight, (ic[0] - turn) % n))[1]


def choose(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    rates: Rates,
    turn: int = 0,
    output_tokens: int = 0,
) -> Decision:
    """Where one request of ``prompt_tokens`` tokens generating up to ``output_tokens`` goes
    (module docstring). ``candidates`` are the healthy instances not yet tried for it, in the
    configured order; ``rates`` price those that report none; ``turn`` rotates the order ties
    are broken in. A ``prompt_tokens`` of 0 means the tokens are not known (the decision
    then has no footprint). Raises ``ValueError`` when there are none."""
    if not candidates:
        raise ValueError("no instance to choose from")

    def decision(c: Candidate, reason: str, seconds: float | None = None) -> Decision:
        fp = c.footprint(prompt_tokens, output_tokens) if prompt_tokens > 0 else None
        # a match only where the index's prediction was used (``expected_hit_tokens``)
        match = c.match if reason in ("prefix", "only_healthy") else None
        own = None
        if seconds is not None and c.match is not None:
            own = expected_seconds(prompt_tokens, c.match, c.page_size, 0, c.rates or rates)
        return Decision(c.name, reason, seconds, match, fp, own)

    if len(candidates) == 1:
        return decision(candidates[0], "only_healthy")
    if any(c.stale for c in candidates):
        return decision(least_loaded(candidates, turn), "stale_events")
    if any(c.match is None for c in candidates) or not any(
        c.match is not None and c.match.pages for c in candidates
    ):
        return decision(least_loaded(candidates, turn), "least_loaded")
    n = len(candidates)
    scored = []
    for i, c in enumerate(candidates):
        if c.match is None:
            continue
        k = blocking(c.device_tokens, c.flights, c.footprint(prompt_tokens, output_tokens))
        priced = c.rates or rates
        wait = room_wait(k, c.ages, priced.request_duration_s)
        load = c.load_s(priced)
        seconds = expected_seconds(
            prompt_tokens, c.match, c.page_size, c.in_flight, priced, wait, load
        )
        scored.append((seconds, c.in_flight, (i - turn) % n, i))
        if log.isEnabledFor(logging.DEBUG):
            m = c.match
            log.debug(
                "candidate %s: %.1f ms (pages device %d host %d storage %d of %d tokens, "
                "%d in flight costing %.1f ms, room wait %.1f ms)",
                c.name, seconds * 1e3, m.device, m.host, m.storage, prompt_tokens,
                c.in_flight, load * 1e3, wait * 1e3,
            )  # fmt: skip
    seconds, _, _, i = min(scored)
    log.debug("chose %s", candidates[i].name)
    return decision(candidates[i], "prefix", seconds)
