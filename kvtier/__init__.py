"""kvtier: a tiered KV cache (device → host → storage) indexed by a radix tree over token pages.

The names below are imported on first use, so that ``import kvtier`` (and the command line's
``--help``) does not import torch; ``__version__`` is the installed package's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.cache.results import Admission, Handle, InsertResult, LoadResult, MatchResult
    from kvtier.cache.tiered_cache import TieredCache
    from kvtier.config import CacheConfig
    from kvtier.errors import CapacityError, ConfigError, KvtierError, RequestError
    from kvtier.pools.spec import PoolSpec

_EXPORTS = {
    "Admission": "kvtier.cache.results",
    "CacheConfig": "kvtier.config",
    "CapacityError": "kvtier.errors",
    "ConfigError": "kvtier.errors",
    "KvtierError": "kvtier.errors",
    "RequestError": "kvtier.errors",
    "Handle": "kvtier.cache.results",
    "InsertResult": "kvtier.cache.results",
    "LoadResult": "kvtier.cache.results",
    "MatchResult": "kvtier.cache.results",
    "PoolSpec": "kvtier.pools.spec",
    "TieredCache": "kvtier.cache.tiered_cache",
}

__all__ = [
    "Admission",
    "CacheConfig",
    "CapacityError",
    "ConfigError",
    "Handle",
    "InsertResult",
    "KvtierError",
    "LoadResult",
    "MatchResult",
    "PoolSpec",
    "RequestError",
    "TieredCache",
    "__version__",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
