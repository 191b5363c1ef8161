"""Exception types. User mistakes raise ``ConfigError``/``RequestError`` naming the option or
value; broken internal bookkeeping raises ``IntegrityError`` with node/rank context."""

from __future__ import annotations


class KvtierError(Exception):
    """Base class for every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """Invalid configuration; the message names the option(s) and why."""


class RequestError(KvtierError, ValueError):
    """A request kvtier or its engine cannot serve (empty, too long, unknown token ids)."""


class CapacityError(KvtierError, RuntimeError):
    """A pool cannot satisfy an allocation even after eviction."""


class StorageError(KvtierError, OSError):
    """An L3 backend fault. Callers treat it as a miss or a dropped backup, never a crash.

    ``kind`` is a short label used for metrics: ``timeout``, ``unreachable``, ``short_read``,
    ``checksum``, ``no_space``, ``permission``, ``io``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class IntegrityError(KvtierError, RuntimeError):
    """kvtier's own metadata is inconsistent: a bug, reported loudly with context."""
