"""Eviction order: the policies (LRU, LFU) that say which unlocked leaf goes first. Smaller
priority is evicted first."""

from __future__ import annotations

from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.tree.node import Node


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: Node) -> tuple[int, ...]:
        """Sort key; the candidate with the smallest key is evicted first."""
        ...


class LRU:
    name = "lru"

    def priority(self, node: Node) -> tuple[int, ...]:
        return (node.last_access, node.id)


class LFU:
    name = "lfu"

    def priority(self, node: Node) -> tuple[int, ...]:
        return (node.hits, node.last_access, node.id)


def make_policy(name: str) -> EvictionPolicy:
    policies: dict[str, type] = {"lru": LRU, "lfu": LFU}
    if name not in policies:
        raise ConfigError(f"eviction_policy={name!r} is not one of {', '.join(policies)}")
    return policies[name]()
