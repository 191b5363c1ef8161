"""Counters and gauges of the cache, as a ``stats()`` snapshot and as Prometheus metrics.

``Metrics`` is a plain counter bag (no dependency). ``prometheus_registry`` exposes a snapshot
callable through prometheus_client, imported lazily so the core needs torch alone.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvtier.errors import IntegrityError
from kvtier.types import TIERS, Tier, check_tier

COUNTERS: dict[str, str] = {
    "device_hit_tokens": "Prompt tokens served from the device tier",
    "host_hit_tokens": "Prompt tokens loaded back from the host tier",
    "storage_hit_tokens": "Prompt tokens prefetched from storage and used",
    "recomputed_tokens": "Prompt tokens computed by prefill",
    "host_backup_pages": "Pages copied device to host",
    "window_backup_pages": "Pages whose window rows alone were copied device to host",
    "window_backup_seconds": "Wall time of window-only backups, submit to completion",
    "storage_backup_pages": "Pages written host to storage (with every component they need)",
    "storage_backup_tokens": "Tokens of those pages (storage pages x storage page size)",
    "evicted_device_pages": "Device pages evicted",
    "evicted_host_pages": "Host pages evicted",
    "dropped_host_backups": "Pages whose device to host backup was dropped (host full)",
    "layer_backup_pages": "Pages copied to host during the forward that computed them",
    "dropped_layer_backups": "Pages whose per-layer backup found no host room (backed up later)",
    "dropped_storage_backups": "Pages whose storage backup failed",
    "skipped_storage_writes": (
        "Pages not written to storage: computing them again beats reading them back "
        "(storage_admission=cost; counted each time a write passes them over)"
    ),
    "prefetched_pages": "Pages read from storage into the host tier",
    "prefetch_failed_pages": "Pages a prefetch wanted but storage could not deliver",
    "load_bytes": "Bytes loaded host to device",
    "load_seconds": "Seconds spent in host to device loads (issue to completion)",
    "backup_bytes": "Bytes copied device to host",
    "backup_seconds": "Seconds spent in device to host backups (issue to completion)",
    "storage_write_bytes": "Bytes written to storage",
    "storage_write_seconds": "Seconds spent writing to storage",
    "storage_read_bytes": "Bytes read from storage",
    "storage_read_seconds": "Seconds spent reading from storage",
    "kv_events_dropped": "KV events dropped because the publisher's queue was full",
}


LABELED: dict[str, tuple[str, tuple[str, ...]]] = {
    "storage_errors": ("Storage faults by kind", ("kind",)),
    "hit_pages": (
        "Pages served per tier and component (a state component counts the checkpoint a "
        "request resumed from)",
        ("tier", "component"),
    ),
}
"""Counters with labels: snapshot values are dicts keyed by the label values joined by '/'."""

_LABEL_CHECKS: dict[str, Callable[[object, str], object]] = {"tier": check_tier}
"""Labels whose values form a closed set, checked on every ``inc``."""


class Metrics:
    """Thread-safe counters; names are the keys of ``COUNTERS`` and ``LABELED``.

    Counting under a name that is not one of those, with the wrong number of labels, or with a
    ``tier`` label that is not a ``Tier`` raises ``IntegrityError``: metric names and labels are
    written by kvtier itself, so a bad one is a bug that would otherwise vanish from dashboards.
    """

    def __init__(self) -> None:
        self._c: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self._labeled: dict[str, Counter[str]] = {k: Counter() for k in LABELED}
        self._lock = threading.Lock()

    def inc(self, name: str, value: float = 1, labels: tuple[str, ...] = ()) -> None:
        """Add ``value`` to counter ``name`` (labelled by ``labels`` for ``LABELED`` ones)."""
        if labels:
            if name not in LABELED or len(labels) != len(LABELED[name][1]):
                known = ", ".join(f"{k}{v[1]}" for k, v in LABELED.items())
                raise IntegrityError(
                    f"metric {name!r} with labels {labels}: not a labelled metric ({known})"
                )
            for label, v in zip(LABELED[name][1], labels, strict=True):
                if label in _LABEL_CHECKS:
                    _LABEL_CHECKS[label](v, f"metric {name!r} label {label}")
            with self._lock:
                self._labeled[name]["/".join(labels)] += value
            return
        if name not in COUNTERS:
            raise IntegrityError(f"metric {name!r} is not a counter (see kvtier.metrics.COUNTERS)")
        with self._lock:
            self._c[name] += value

    def count_hits(self, ld: Any, specs: Any, page_size: int) -> None:
        """Count one admitted request's cached prefix (a ``LoadResult``) per tier, and per
        component in ``hit_pages``: token-indexed components by pages, state components by the
        one checkpoint the request resumed from."""
        by_tier: dict[Tier, int] = dict(
            zip(TIERS, (ld.device_tokens, ld.host_tokens, ld.storage_tokens), strict=True)
        )
        for tier, tokens in by_tier.items():
            self.inc(f"{tier}_hit_tokens", tokens)
            for spec in specs:
                if tokens and spec.token_indexed:
                    self.inc("hit_pages", tokens // page_size, (tier, spec.name))
        if ld.state_source is not None:
            for spec in specs:
                if not spec.token_indexed:
                    self.inc("hit_pages", 1, (check_tier(ld.state_source), spec.name))

    def values(self, names: tuple[str, ...]) -> list[float]:
        """The current values of the unlabelled counters ``names`` (one lock, no snapshot)."""
        with self._lock:
            return [self._c[n] for n in names]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = dict(self._c)
            snap.update({k: dict(v) for k, v in self._labeled.items() if k != "storage_errors"})
            return snap


def metric_families(snap: dict[str, Any], prefix: str = "kvtier") -> Any:
    """Prometheus metric families of a ``stats()`` snapshot: keys of ``COUNTERS`` become
    counters, keys of ``LABELED`` (dicts) labelled counters, other numeric keys gauges."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key, value in snap.items():
        name = f"{prefix}_{key}"
        if key in COUNTERS:
            yield CounterMetricFamily(name, COUNTERS[key], value=value)
        elif key in LABELED:
            doc, labels = LABELED[key]
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for joined, n in sorted(value.items()):
                fam.add_metric(joined.split("/"), n)
            yield fam
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield GaugeMetricFamily(name, key.replace("_", " "), value=value)


def prometheus_registry(stats: Callable[[], dict[str, Any]], prefix: str = "kvtier") -> Any:
    """A prometheus_client registry whose collector reports ``stats()`` on every scrape
    (``metric_families``)."""
    from prometheus_client import CollectorRegistry

    class _Collector:
        def collect(self):  # noqa: ANN202 - prometheus_client protocol
            yield from metric_families(stats(), prefix)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry
