"""The instances a router sends to: how ``--instance`` names one, and what the router knows
about each at run time (health, requests in flight, page size, its KV event stream)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvtier.route.scorer import Footprint, Rates
from kvtier.route.subscriber import EventSubscriber
from kvtier.server.load_cost import Ahead, LoadCost


class RouteConfigError(ValueError):
    """A ``kvtier route`` option is wrong; the message names the option."""


@dataclass(frozen=True)
class InstanceSpec:
    """One ``--instance URL[,events=ENDPOINT][,replay=ENDPOINT]``: the instance's HTTP base URL
    (``http://host:port``), and optionally its KV event PUB endpoint and replay ROUTER endpoint
    (ZMQ addresses such as ``tcp://host:5557``)."""

    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> InstanceSpec:
        """Raises ``RouteConfigError`` naming ``--instance`` for a malformed value."""
        url, *extras = (part.strip() for part in text.split(","))
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise RouteConfigError(
                f"--instance {text!r}: the URL must be http(s)://host:port, got {url!r}"
            )
        if parts.path.rstrip("/") not in ("", "/v1") or parts.query:
            raise RouteConfigError(
                f"--instance {text!r}: give the server's base URL (http://host:port), not a path"
            )
        keys: dict[str, str] = {}
        for extra in extras:
            key, eq, value = extra.partition("=")
            if not eq or key not in ("events", "replay") or not value:
                raise RouteConfigError(
                    f"--instance {text!r}: {extra!r} is not events=ENDPOINT or replay=ENDPOINT"
                )
            if "://" not in value:
                raise RouteConfigError(
                    f"--instance {text!r}: {key}={value!r} is no ZMQ endpoint (tcp://host:port)"
                )
            if key in keys:
                raise RouteConfigError(f"--instance {text!r}: {key}= is given twice")
            keys[key] = value
        if "replay" in keys and "events" not in keys:
            raise RouteConfigError(f"--instance {text!r}: replay= needs events= as well")
        base = f"{parts.scheme}://{parts.netloc}"
        return cls(base, keys.get("events"), keys.get("replay"))


def parse_instances(values: list[str] | None) -> list[InstanceSpec]:
    """Every ``--instance``; at least one, no URL twice (``RouteConfigError`` otherwise)."""
    if not values:
        raise RouteConfigError("--instance is required (once per kvtier serve instance)")
    specs = [InstanceSpec.parse(v) for v in values]
    urls = [s.url for s in specs]
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise RouteConfigError(f"--instance names {dup[0]} more than once")
    return specs


@dataclass(slots=True, eq=False)
class Flight:
    """One request sent to an instance and not finished (its handle for ``Instance.end``)."""

    footprint: Footprint | None
    """What it holds on the instance's device while it runs (``None``: not known)."""
    sent: float
    """When it was sent (``time.monotonic``)."""
    ahead: Ahead = Ahead()
    """The router's requests in flight on the instance when it was sent, by where they
    were."""
    prefill_s: float | None = None
    """Its own prefill at the instance's rates, without the load (``Decision.prefill_s``;
    ``None``: chosen by load only, and not measured)."""
    first: float | None = None
    """When its first output arrived (``Instance.first_output``; ``None``: not yet, or not
    streamed)."""


@dataclass
class Instance:
    """What the router knows about one instance. Read and written on the event loop only
    (the subscriber's fields are its own, thread-safe)."""

    spec: InstanceSpec
    healthy: bool = False
    """Its ``/health`` answered 200 at the last check (instances join when it does and leave
    when it does not, or when a request to it fails to connect)."""
    flights: list[Flight] = field(default_factory=list)
    """Requests sent to it that have not finished (the load), oldest first (``begin``,
    ``end``)."""
    device_tokens: int | None = None
    """Its device pool's size in tokens, from its model card's ``device_tokens``."""
    models: list[dict] = field(default_factory=list)
    """Its ``/v1/models`` cards, read when it joins."""
    page_size: int | None = None
    """Tokens per page, from its model card's ``page_size`` when it has one."""
    byte_vocab: int | None = None
    """The vocabulary of its byte-level tokenizer when its model card says it has one
    (``"tokenizer": "bytes"``): the router then encodes text prompts itself."""
    rates: Rates | None = None
    """The rates its ``/health`` reported at the last check (``None``: it reported none,
    and the router's ``--*-rate`` defaults price it)."""
    observed: LoadCost = field(default_factory=LoadCost)
    """What the requests in flight cost a new one, by where they are, and how long a request
    lasts, as the router measures them on this instance's streamed answers (``end``;
    ``priced_rates``)."""
    fleet_observed: LoadCost | None = None
    """The same measured on every instance of the fleet (``Fleet.observed``, shared): what
    this one is priced with until it has estimates of its own, so that a fleet's first
    requests are priced by measurement sooner than each instance's own 16 samples allow."""
    subscriber: EventSubscriber | None = None

    @property
    def name(self) -> str:
        return self.spec.url

    @property
    def in_flight(self) -> int:
        """How many requests sent to it have not finished."""
        return len(self.flights)

    def serves(self, model: object) -> bool:
        """Whether a request naming ``model`` belongs here: one of its model cards has that
        ``id``. A request without a model name (not a string) may go anywhere: the instance
        answers it as it would without a router."""
        return not isinstance(model, str) or any(c.get("id") == model for c in self.models)

    def begin(
        self,
        footprint: Footprint | None,
        prefill_s: float | None = None,
        now: float | None = None,
    ) -> Flight:
        """A request was sent to it (at ``now``, ``time.monotonic``'s clock; default: now),
        holding ``footprint`` while it runs, its own prefill priced ``prefill_s``; the handle to
        ``end`` it with."""
        sent = time.monotonic() if now is None else now
        flight = Flight(footprint, sent, self.ahead(), prefill_s)
        self.flights.append(flight)
        return flight

    def ahead(self) -> Ahead:
        """The requests in flight, by where they are: in their prefill (no first output
        passed yet) or streaming."""
        streaming = sum(1 for f in self.flights if f.first is not None)
        return Ahead(self.in_flight - streaming, streaming)

    def first_output(self, flight: Flight, now: float | None = None) -> None:
        """That request's first output arrived (at ``now``, as ``begin``)."""
        flight.first = time.monotonic() if now is None else now

    def end(self, flight: Flight, now: float | None = None) -> None:
        """That request finished (answered, failed or cut off; at ``now``, as ``begin``).
        A streamed one priced by its prefill is a sample of ``observed``: its requests ahead
        (by where they were), its time to first output less its own prefill, and its time
        from sending to end."""
        self.flights.remove(flight)
        if flight.first is not None and flight.prefill_s is not None:
            end = time.monotonic() if now is None else now
            excess = flight.first - flight.sent - flight.prefill_s
            for cost in (self.observed, self.fleet_observed):
                if cost is not None:
                    cost.observe(flight.ahead, excess, max(end - flight.sent, 0.0))

    def priced_rates(self, defaults: Rates) -> Rates | None:
        """The rates it is priced with: those it reported (``defaults`` where it reported
        none), with the costs of a request ahead (in its prefill: ``request_cost_s``;
        streaming: ``decode_cost_s``) and the duration the router measured on it where
        ``observed`` has estimates, else on the fleet where ``fleet_observed`` has; ``None``
        (price it with ``defaults``) while neither has any. The
        router's measurement wins over the instance's: it is what the router predicts, the
        time to first output as a client of the router sees it, which also holds what the
        instance's engine cannot see (its HTTP thread waiting for the engine's, the proxy)."""
        own = self.observed
        pooled = self.fleet_observed or own
        cost = _first(own.prefill_cost_s(), pooled.prefill_cost_s())
        decode = _first(own.decode_cost_s(), pooled.decode_cost_s())
        duration = _first(own.duration_s(), pooled.duration_s())
        if cost is None and decode is None and duration is None:
            return self.rates
        base = self.rates or defaults
        return dataclasses.replace(
            base,
            request_cost_s=base.request_cost_s if cost is None else cost,
            decode_cost_s=base.decode_cost_s if decode is None else decode,
            request_duration_s=base.request_duration_s if duration is None else duration,
        )

    def page_size_or(self, default: int) -> int:
        """Its page size: the KV events' ``block_size``, else the model card's, else
        ``default`` (``--page-size``)."""
        if self.subscriber is not None and self.subscriber.page_size:
            return self.subscriber.page_size
        return self.page_size or default


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)
