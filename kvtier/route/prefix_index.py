"""Which tiers of which instance hold which pages, as the instances' KV events report them.

Pages are named by the chained hashes of ``kvtier.events.hashing`` (a page's hash covers its
whole prefix), so a prompt's hashes are looked up one by one: a page is held by an instance
when the instance last reported storing it in some tier and has not reported removing it there.
The index never sees tokens; it only keeps ``hash -> tiers`` per instance.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TIERS = ("device", "host", "storage")
"""Tiers from the cheapest to resume from to the dearest (the order a match prefers)."""

MEDIUM_ALIASES = {"gpu": "device", "cpu": "host", "disk": "storage"}
"""vLLM's medium names, read as kvtier's tiers (a vLLM publisher says ``GPU``/``CPU``)."""


def tier_of(medium: object) -> str:
    """The tier a KV event's ``medium`` names; ``None`` (vLLM's default) is the device.
    Raises ``ValueError`` for a medium that names no tier."""
    if medium is None:
        return "device"
    name = str(medium).lower()
    name = MEDIUM_ALIASES.get(name, name)
    if name not in TIERS:
        raise ValueError(f"unknown KV event medium {medium!r} (expected one of {TIERS})")
    return name


@dataclass(frozen=True)
class PrefixMatch:
    """How many leading pages of a prompt one instance holds, each page counted once at the
    cheapest tier holding it; the walk stops at the first page no tier holds."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def pages(self) -> int:
        return self.device + self.host + self.storage


class PrefixIndex:
    """Per instance, ``page hash -> tiers holding it``. Thread-safe: event subscribers write
    from their threads while the proxy reads from the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, dict[int, set[str]]] = {}

    def stored(self, instance: str, hashes: Iterable[int], tier: str) -> None:
        """``instance`` now holds ``hashes`` in ``tier`` (besides wherever else it held them)."""
        with self._lock:
            pages = self._pages.setdefault(instance, {})
            for h in hashes:
                pages.setdefault(h, set()).add(tier)

    def removed(self, instance: str, hashes: Iterable[int], tier: str) -> None:
        """``instance`` dropped ``hashes`` from ``tier``; a hash it never reported is ignored
        (events may start after the store they undo)."""
        with self._lock:
            pages = self._pages.get(instance)
            if pages is None:
                return
            for h in hashes:
                tiers = pages.get(h)
                if tiers is None:
                    continue
                tiers.discard(tier)
                if not tiers:
                    del pages[h]

    def clear(self, instance: str) -> None:
        """Forget every page of ``instance`` in every tier (``AllBlocksCleared``, a lost event
        history, an instance that left)."""
        with self._lock:
            self._pages.pop(instance, None)

    def tiers(self, instance: str, page_hash: int) -> frozenset[str]:
        """The tiers of ``instance`` holding the page (empty when none does)."""
        with self._lock:
            return frozenset(self._pages.get(instance, {}).get(page_hash, ()))

    def pages(self, instance: str) -> int:
        """How many distinct pages ``instance`` holds in any tier."""
        with self._lock:
            return len(self._pages.get(instance, {}))

    def match(
        self, instance: str, hashes: Sequence[int], shared: Sequence[str] = ()
    ) -> PrefixMatch:
        """The leading pages of ``hashes`` (a prompt's chained page hashes, in order) that
        ``instance`` holds, by the cheapest tier holding each (``PrefixMatch``). A page that
        ``instance`` does not hold but one of ``shared`` (instances whose storage tier it
        reads: one L3 shared by all) has in storage counts as a storage page."""
        counts = dict.fromkeys(TIERS, 0)
        with self._lock:
            pages = self._pages.get(instance, {})
            others = [self._pages.get(s, {}) for s in shared if s != instance]
            for h in hashes:
                tiers = pages.get(h)
                if tiers:
                    counts[next(t for t in TIERS if t in tiers)] += 1
                elif any("storage" in o.get(h, ()) for o in others):
                    counts["storage"] += 1
                else:
                    break
        return PrefixMatch(**counts)
