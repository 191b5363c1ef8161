"""Choosing an instance for a request by its expected time to first token.

For an instance whose KV events are current, the expected prefill time of a prompt of ``n``
tokens of which the instance holds ``d`` on device, ``h`` on host and ``s`` in storage (leading
pages, ``PrefixIndex.match``) is::

    (n - d - h - s) / prefill_rate  +  (h + s) / host_rate  +  s / storage_rate
        +  in_flight * request_cost

Device pages cost nothing (attention reads them where they are); a storage page is read into
the host tier and then loaded like a host page, so it pays both (whatever the rates say, a
host hit is never dearer than a storage hit of the same pages). Each instance is priced with
the rates its cache measured (reported by its ``/health``), the router's own where it reports
none. The smallest time wins; ties go to the fewer requests in flight, then to the instance
first in turn: the candidates' order rotated by ``turn`` (the fleet advances it every request,
so idle instances take turns instead of the first-listed taking every tie). When some instance's
events are stale the index cannot be trusted for the comparison, so the request goes to the
least-loaded instance instead (reason ``stale_events``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.route.prefix_index import PrefixMatch

REASONS = ("prefix", "least_loaded", "stale_events", "only_healthy")
"""Why an instance was chosen: ``prefix`` by expected time with some page held somewhere;
``least_loaded`` without any prefix knowledge to use (no events configured, no tokens, no page
held anywhere); ``stale_events`` some candidate's events went quiet; ``only_healthy`` one
candidate was left."""


@dataclass(frozen=True)
class Rates:
    """Per-tier rates the expected time is priced with (tokens per second), and the cost of a
    request already in flight on the instance (seconds)."""

    prefill_tokens_per_s: float = 8000.0
    """Prompt tokens an instance computes per second (the uncached suffix)."""
    host_tokens_per_s: float = 200000.0
    """Tokens of KV an instance loads from its host tier per second."""
    storage_tokens_per_s: float = 40000.0
    """Tokens of KV an instance reads from its storage tier per second."""
    request_cost_s: float = 0.05
    """Expected delay each request in flight adds before this one's prefill."""

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_tokens_per_s", "storage_tokens_per_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v}")
        if not (math.isfinite(self.request_cost_s) and self.request_cost_s >= 0):
            raise ValueError(f"request_cost_s must be >= 0, got {self.request_cost_s}")


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


@dataclass(frozen=True)
class Decision:
    """The chosen instance, why, and its expected seconds (``None`` for a load-only choice)."""

    name: str
    reason: str
    expected_s: float | None = None
    match: PrefixMatch | None = None


def expected_seconds(
    prompt_tokens: int, match: PrefixMatch, page_size: int, in_flight: int, rates: Rates
) -> float:
    """The expected prefill time (module docstring) of ``prompt_tokens`` tokens."""
    device, host, storage = (p * page_size for p in (match.device, match.host, match.storage))
    uncached = max(prompt_tokens - device - host - storage, 0)
    return (
        uncached / rates.prefill_tokens_per_s
        + (host + storage) / rates.host_tokens_per_s
        + storage / rates.storage_tokens_per_s
        + in_flight * rates.request_cost_s
    )


def least_loaded(candidates: Sequence[Candidate], turn: int = 0) -> Candidate:
    """The candidate with the fewest requests in flight (on a tie, the first in turn: see
    the module docstring)."""
    n = len(candidates)
    return min(enumerate(candidates), key=lambda ic: (ic[1].in_flight, (ic[0] - turn) % n))[1]


def choose(
    candidates: Sequence[Candidate], prompt_tokens: int, rates: Rates, turn: int = 0
) -> Decision:
    """Where one request goes (module docstring). ``candidates`` are the healthy instances
    not yet tried for it, in the configured order; ``rates`` price those that report none;
    ``turn`` rotates the order ties are broken in. Raises ``ValueError`` when there are
    none."""
    if not candidates:
        raise ValueError("no instance to choose from")
    if len(candidates) == 1:
        c = candidates[0]
        return Decision(c.name, "only_healthy", match=c.match)
    if any(c.stale for c in candidates):
        return Decision(least_loaded(candidates, turn).name, "stale_events")
    if any(c.match is None for c in candidates) or not any(
        c.match is not None and c.match.pages for c in candidates
    ):
        return Decision(least_loaded(candidates, turn).name, "least_loaded")
    n = len(candidates)
    scored = [
        (
            expected_seconds(prompt_tokens, c.match, c.page_size, c.in_flight, c.rates or rates),
            c.in_flight,
            (i - turn) % n,
            i,
        )
        for i, c in enumerate(candidates)
        if c.match is not None
    ]
    seconds, _, _, i = min(scored)
    best = candidates[i]
    return Decision(best.name, "prefix", seconds, best.match)
