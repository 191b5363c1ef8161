"""kvtier: a tiered KV cache (device → host → storage) indexed by a radix tree over token pages."""

from kvtier.cache import Handle, InsertResult, LoadResult, MatchResult, TieredCache
from kvtier.config import CacheConfig
from kvtier.pools.spec import PoolSpec

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "Handle",
    "InsertResult",
    "LoadResult",
    "MatchResult",
    "PoolSpec",
    "TieredCache",
    "__version__",
]
