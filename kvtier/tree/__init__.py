"""The radix tree over token pages: which prefixes are cached and in which tiers.
It records page ids but never allocates or frees memory."""

from kvtier.tree.eviction_order import EvictionPolicy, make_policy
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import Evicted, InsertOutcome, TreeMatch, truncate_match

__all__ = [
    "Evicted",
    "EvictionPolicy",
    "InsertOutcome",
    "Node",
    "RadixTree",
    "TreeMatch",
    "make_policy",
    "truncate_match",
]
