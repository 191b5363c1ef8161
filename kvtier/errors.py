"""Exception types: every error kvtier raises on purpose is a ``KvtierError``.

User mistakes raise ``ConfigError``/``RequestError`` naming the option or value (both are also
``ValueError``s); broken internal bookkeeping raises ``IntegrityError`` with node/page/rank
context; L3 backends raise ``StorageError`` internally and turn it into a counted miss at their
boundary, so it never reaches the caller of ``batch_get``/``batch_set``.

The argument checks at the bottom are what public entry points refuse a wrong type or value
with: the message names the call, the argument and the value (with its type), e.g.
``alloc: num_tokens must be an integer >= 0, got -4 (int)``. They import nothing heavy (no
torch: the command line imports this module before it knows it needs torch).
"""

from __future__ import annotations

import math
import operator
from typing import Any, TypeVar

_T = TypeVar("_T")


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


def describe(value: object, limit: int = 60) -> str:
    """``value`` as an error message shows it: its repr (shortened past ``limit`` characters)
    and its type, e.g. ``'x' (str)``."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def _where(where: str) -> str:
    return f"{where}: " if where else ""


def check_int(
    value: object,
    name: str,
    where: str = "",
    minimum: int | None = 0,
    error: type[KvtierError] = RequestError,
) -> int:
    """``value`` as a Python ``int`` (numpy and 0-d torch integers too; ``bool`` refused) that
    is ``>= minimum`` (``None``: any); else ``error`` naming ``where``, ``name`` and the value."""
    bound = "" if minimum is None else f" >= {minimum}"
    if not isinstance(value, bool) and not (
        hasattr(value, "dtype") and str(getattr(value, "dtype", "")).endswith("bool")
    ):
        try:
            v = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if minimum is None or v >= minimum:
                return v
    raise error(f"{_where(where)}{name} must be an integer{bound}, got {describe(value)}")


def check_bool(
    value: object, name: str, where: str = "", error: type[KvtierError] = RequestError
) -> bool:
    """``value`` if it is ``True`` or ``False``; else ``error`` naming it (``1``, ``"no"`` and
    ``None`` are refused: a flag read as truthy text is a bug waiting)."""
    if isinstance(value, bool):
        return value
    raise error(f"{_where(where)}{name} must be True or False, got {describe(value)}")


def check_number(
    value: object,
    name: str,
    where: str = "",
    minimum: float = 0.0,
    error: type[KvtierError] = RequestError,
) -> float:
    """``value`` as a finite ``float >= minimum`` (ints taken, ``bool`` and NaN refused)."""
    if not isinstance(value, bool) and isinstance(value, int | float):
        v = float(value)
        if math.isfinite(v) and v >= minimum:
            return v
    raise error(
        f"{_where(where)}{name} must be a finite number >= {minimum:g}, got {describe(value)}"
    )


def check_type(
    value: Any,
    types: type[_T] | tuple[type, ...],
    name: str,
    where: str = "",
    expected: str = "",
    error: type[KvtierError] = RequestError,
) -> _T:
    """``value`` if it is an instance of ``types``; else ``error`` saying what was
    ``expected`` (default: the types' names) and what came."""
    if isinstance(value, types):
        return value
    if not expected:
        ts = types if isinstance(types, tuple) else (types,)
        expected = " or ".join("None" if t is type(None) else t.__name__ for t in ts)
    raise error(f"{_where(where)}{name} must be {expected}, got {describe(value)}")
