"""The instances a router sends to: how ``--instance`` names one, and what the router knows
about each at run time (health, requests in flight, page size, its KV event stream)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvtier.route.scorer import Footprint, Rates
from kvtier.route.subscriber import EventSubscriber


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


@dataclass
class Instance:
    """What the router knows about one instance. Read and written on the event loop only
    (the subscriber's fields are its own, thread-safe)."""

    spec: InstanceSpec
    healthy: bool = False
    """Its ``/health`` answered 200 at the last check (instances join when it does and leave
    when it does not, or when a request to it fails to connect)."""
    in_flight: int = 0
    """Requests sent to it that have not finished (the load)."""
    flights: list[Flight] = field(default_factory=list)
    """Those requests, oldest first; ``begin`` and ``end`` keep it and ``in_flight``
    together."""
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
    subscriber: EventSubscriber | None = None

    @property
    def name(self) -> str:
        return self.spec.url

    def serves(self, model: object) -> bool:
        """Whether a request naming ``model`` belongs here: one of its model cards has that
        ``id``. A request without a model name (not a string) may go anywhere: the instance
        answers it as it would without a router."""
        return not isinstance(model, str) or any(c.get("id") == model for c in self.models)

    def begin(self, footprint: Footprint | None) -> Flight:
        """A request was sent to it, holding ``footprint`` while it runs; the handle to
        ``end`` it with."""
        flight = Flight(footprint, time.monotonic())
        self.in_flight += 1
        self.flights.append(flight)
        return flight

    def end(self, flight: Flight) -> None:
        """That request finished (answered, failed or cut off)."""
        self.in_flight -= 1
        self.flights.remove(flight)

    def page_size_or(self, default: int) -> int:
        """Its page size: the KV events' ``block_size``, else the model card's, else
        ``default`` (``--page-size``)."""
        if self.subscriber is not None and self.subscriber.page_size:
            return self.subscriber.page_size
        return self.page_size or default
