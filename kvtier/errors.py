"""Exception types: every error kvtier raises on purpose is a ``KvtierError``.

User mistakes raise ``ConfigError``/``RequestError`` naming the option or value (both are also
``ValueError``s); broken internal bookkeeping raises ``IntegrityError`` with node/page/rank
context; L3 backends raise ``StorageError`` internally and turn it into a counted miss at their
boundary, so it never reaches the caller of ``batch_get``/``batch_set``.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class for every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """Invalid configuration; the message names the option(s) and why."""


class RequestError(KvtierError, ValueError):
    """A request kvtier or its engine cannot serve (empty, too long, unknown token ids), or an
    argument a caller passed that no call could accept (a malformed key, mismatched lengths)."""


class CapacityError(KvtierError, RuntimeError):
    """A pool cannot satisfy an allocation even after eviction."""


class StorageError(KvtierError, OSError):
    """An L3 backend fault. Callers treat it as a miss or a dropped backup, never a crash.

    ``kind`` is a short label used for metrics: ``timeout``, ``unreachable``, ``short_read``,
    ``checksum``, ``format``, ``foreign``, ``missing``, ``no_space``, ``permission``, ``io``.
    ``detail`` is the message without the kind.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.detail = message

    def __reduce__(self) -> tuple[type[StorageError], tuple[str, str]]:
        # OSError's own pickling would pass the joined message as a single errno argument.
        return type(self), (self.kind, self.detail)


class TransferError(KvtierError, RuntimeError):
    """A device ↔ host copy failed (a driver or kernel error); the pages it was moving are not
    made visible."""


class IntegrityError(KvtierError, RuntimeError):
    """kvtier's own metadata is inconsistent: a bug, reported loudly with context."""


class RankError(KvtierError, RuntimeError):
    """A peer rank did not take part in a collective within the timeout; ``ranks`` names it."""

    def __init__(self, ranks: tuple[int, ...], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[type[RankError], tuple[tuple[int, ...], str]]:
        return type(self), (self.ranks, str(self))
