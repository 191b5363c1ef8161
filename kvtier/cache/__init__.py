"""The facade an engine talks to (``TieredCache``) and what only it uses: how it is built
(``parts``), its result types, resume points, the engine-page ledger, window rules, its report
and its context-parallel rank contract."""

from kvtier.cache.results import Handle, InsertResult, LoadResult, MatchResult
from kvtier.cache.tiered_cache import TieredCache

__all__ = ["Handle", "InsertResult", "LoadResult", "MatchResult", "TieredCache"]
