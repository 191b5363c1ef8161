"""The server's Prometheus exporter: one ``CollectorRegistry`` per server (two servers in one
process never share figures).

Server-level families (the names the README lists):

- ``kvtier_cached_tokens_total{cache_source="device|host|storage"}``: prompt tokens served
  from each tier (counted once per admitted request, as ``usage`` reports them)
- ``kvtier_recomputed_tokens_total``: prompt tokens the model computed
- ``kvtier_pool_pages{tier="device|host",state="total|used"}``,
  ``kvtier_storage_bytes{state="used|budget"}`` (file backend)
- ``kvtier_transfer_bytes_total`` / ``kvtier_transfer_seconds_total``
  ``{direction="host_to_device|device_to_host|storage_write|storage_read"}``
- ``kvtier_transfer_rate_bytes_per_second{direction="host_to_device|storage_write|storage_read"}``,
  ``kvtier_prefill_rate_tokens_per_second``: the measured rates restores are priced with
  (``kvtier.controller.restore_cost``; its priors before the first measurement)
- ``kvtier_storage_errors_total{kind}``
- ``kvtier_queue_depth``, ``kvtier_running_requests``
- ``kvtier_time_to_first_token_seconds``, ``kvtier_inter_token_latency_seconds``
  (histograms, measured from the HTTP request's arrival)
- ``kvtier_requests_total{finish_reason}``, ``kvtier_rejected_requests_total{reason}``

plus every figure of ``LLM.stats()`` under ``kvtier_cache_*`` (``kvtier.metrics``).
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.metrics import metric_families
from kvtier.types import TIERS

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

_DIRECTIONS = {
    "host_to_device": "load",
    "device_to_host": "backup",
    "storage_write": "storage_write",
    "storage_read": "storage_read",
}
"""Transfer direction label -> the ``stats()`` prefix of its ``_bytes``/``_seconds`` keys."""

_RATES = {
    "host_to_device": "restore_load_bytes_per_s",
    "storage_write": "restore_storage_write_bytes_per_s",
    "storage_read": "restore_storage_read_bytes_per_s",
}
"""Transfer direction label -> the ``stats()`` key of its measured rate."""


class ServerMetrics:
    """Histograms and counters the engine thread updates, and the scrape-time rendering of
    the engine's ``stats()`` snapshot (taken on the engine thread: cache structures are not
    read from anywhere else)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram(
            "kvtier_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvtier_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvtier_requests",
            "Requests the engine ended, by finish reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvtier_rejected_requests",
            "Requests answered with an error before reaching the engine, by reason",
            ["reason"],
            registry=self.registry,
        )
        self._snap = _Snapshot()
        self.registry.register(self._snap)
        self._lock = threading.Lock()

    def render(self, stats: dict[str, Any], queue: dict[str, int]) -> bytes:
        """The exposition text for one scrape of ``stats`` (``LLM.stats()``) and ``queue``
        (``EngineLoop.queue_depth()``)."""
        from prometheus_client import generate_latest

        with self._lock:  # the snapshot collector reads what this scrape set
            self._snap.stats, self._snap.queue = stats, queue
            return generate_latest(self.registry)


class _Snapshot:
    """Collector of the families derived from one ``stats()`` snapshot."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.queue: dict[str, int] = {}

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.stats
        fam = CounterMetricFamily(
            "kvtier_cached_tokens",
            "Prompt tokens served from a cache tier instead of being computed",
            labels=["cache_source"],
        )
        for tier in TIERS:
            fam.add_metric([tier], st.get(f"{tier}_hit_tokens", 0))
        yield fam
        yield CounterMetricFamily(
            "kvtier_recomputed_tokens",
            "Prompt tokens computed by prefill",
            value=st.get("recomputed_tokens", 0),
        )
        pages = GaugeMetricFamily(
            "kvtier_pool_pages", "Pages of a tier's pool", labels=["tier", "state"]
        )
        for tier in ("device", "host"):
            for state in ("total", "used"):
                pages.add_metric([tier, state], st.get(f"{tier}_pages_{state}", 0))
        yield pages
        if "storage_bytes_used" in st:
            sb = GaugeMetricFamily(
                "kvtier_storage_bytes", "Bytes of the storage tier", labels=["state"]
            )
            sb.add_metric(["used"], st["storage_bytes_used"])
            if "storage_budget_bytes" in st:
                sb.add_metric(["budget"], st["storage_budget_bytes"])
            yield sb
        for unit, doc in (("bytes", "Bytes moved"), ("seconds", "Seconds spent moving pages")):
            fam = CounterMetricFamily(
                f"kvtier_transfer_{unit}", f"{doc} between tiers", labels=["direction"]
            )
            for direction, key in _DIRECTIONS.items():
                fam.add_metric([direction], st.get(f"{key}_{unit}", 0))
            yield fam
        rate = GaugeMetricFamily(
            "kvtier_transfer_rate_bytes_per_second",
            "Measured rate of a path restores take (exponentially weighted; the configured "
            "prior before the first transfer)",
            labels=["direction"],
        )
        for direction, key in _RATES.items():
            if key in st:
                rate.add_metric([direction], st[key])
        yield rate
        if "restore_prefill_tokens_per_s" in st:
            yield GaugeMetricFamily(
                "kvtier_prefill_rate_tokens_per_second",
                "Measured prefill rate recomputing is priced with (exponentially weighted; the "
                "configured prior before the first forward)",
                value=st["restore_prefill_tokens_per_s"],
            )
        errs = CounterMetricFamily(
            "kvtier_storage_errors", "Storage faults by kind", labels=["kind"]
        )
        for kind, n in sorted(st.get("storage_errors", {}).items()):
            errs.add_metric([kind], n)
        yield errs
        yield GaugeMetricFamily(
            "kvtier_queue_depth",
            "Requests waiting for the engine (not yet admitted)",
            value=self.queue.get("queued", 0),
        )
        yield GaugeMetricFamily(
            "kvtier_running_requests",
            "Requests the engine is computing",
            value=self.queue.get("running", 0),
        )
        yield from metric_families(st, prefix="kvtier_cache")
