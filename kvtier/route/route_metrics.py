"""The router's Prometheus exporter (``/metrics``), one registry per router:

- ``kvtier_route_decisions_total{reason}``: choices by reason (``scorer.REASONS``)
- ``kvtier_route_requests_total{instance}``: requests sent to each instance (retries included)
- ``kvtier_route_retries_total{instance}``: requests that failed on an instance before any
  output and went to another
- ``kvtier_route_stream_errors_total{instance}``: streams cut by an instance after they started
- ``kvtier_route_expected_hit_tokens_total{tier}``: prompt tokens the chosen instance was
  expected to hold in each tier (from its KV events)
- ``kvtier_route_cached_tokens_total{tier}``: prompt tokens the instances reported serving from
  each tier (``usage.prompt_tokens_details.cached_tokens_by_tier`` of JSON answers)
- ``kvtier_route_in_flight{instance}``, ``kvtier_route_healthy{instance}``,
  ``kvtier_route_indexed_pages{instance}``: read at scrape time
- ``kvtier_route_load_seconds{instance,term}``: what each instance's load is priced with now,
  read at scrape time: ``prefill`` (a request ahead in its prefill), ``decode`` (one that
  streams output), ``duration`` (how long a request holds its device pages); measured by the
  router once it has samples (``Instance.priced_rates``), else reported or the defaults
"""

from __future__ import annotations

from typing import Any

from kvtier.route.prefix_index import TIERS


class RouteMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = Counter(
            "kvtier_route_decisions",
            "Routing choices by reason",
            ["reason"],
            registry=self.registry,
        )
        self.requests = Counter(
            "kvtier_route_requests", "Requests sent to each instance", ["instance"],
            registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            "kvtier_route_retries",
            "Requests that failed on an instance before any output and were sent elsewhere",
            ["instance"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "kvtier_route_stream_errors",
            "Streams an instance cut after they had started",
            ["instance"],
            registry=self.registry,
        )
        self.expected_hits = Counter(
            "kvtier_route_expected_hit_tokens",
            "Prompt tokens the chosen instance was expected to hold, by tier",
            ["tier"],
            registry=self.registry,
        )
        self.cached = Counter(
            "kvtier_route_cached_tokens",
            "Prompt tokens instances reported serving from each tier",
            ["tier"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvtier_route_in_flight", "Requests in flight per instance", ["instance"],
            registry=self.registry,
        )  # fmt: skip
        self.healthy = Gauge(
            "kvtier_route_healthy", "1 when the instance is in the pool", ["instance"],
            registry=self.registry,
        )  # fmt: skip
        self.indexed = Gauge(
            "kvtier_route_indexed_pages", "Pages the KV events say each instance holds",
            ["instance"], registry=self.registry,
        )  # fmt: skip
        self.load = Gauge(
            "kvtier_route_load_seconds",
            "Seconds each instance's load is priced with: a request ahead in its prefill, one "
            "streaming output, a request's duration",
            ["instance", "term"],
            registry=self.registry,
        )
        for reason in ("prefix", "least_loaded", "stale_events", "only_healthy"):
            self.decisions.labels(reason)
        for tier in TIERS:
            self.expected_hits.labels(tier)
            self.cached.labels(tier)

    def count_usage(self, body: Any) -> None:
        """Add a JSON answer's per-tier cached tokens (when it reports them)."""
        try:
            by_tier = body["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
        except (KeyError, TypeError):
            return
        if isinstance(by_tier, dict):
            for tier in TIERS:
                n = by_tier.get(tier)
                if isinstance(n, int) and n > 0:
                    self.cached.labels(tier).inc(n)

    def render(self, fleet: Any) -> bytes:
        """The text exposition, with the per-instance gauges read from ``fleet`` now."""
        from prometheus_client import generate_latest

        for inst in fleet.instances:
            self.in_flight.labels(inst.name).set(inst.in_flight)
            self.healthy.labels(inst.name).set(1 if inst.healthy else 0)
            self.indexed.labels(inst.name).set(fleet.index.pages(inst.name))
            rates = inst.priced_rates(fleet.options.rates) or fleet.options.rates
            self.load.labels(inst.name, "prefill").set(rates.request_cost_s)
            self.load.labels(inst.name, "decode").set(rates.streaming_cost_s)
            self.load.labels(inst.name, "duration").set(rates.request_duration_s)
        return generate_latest(self.registry)
