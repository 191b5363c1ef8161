"""Write policies: when device pages get a host copy. Each is one object with three hooks the
controller calls; nothing else in kvtier branches on ``CacheConfig.write_policy``.

    on_insert(nodes)     nodes just took the engine's device pages
    on_hit(path)         a request locked ``path`` (hit counts already include this use)
    before_evict(node)   the device copy of ``node`` is about to go: True lets it go now

``write_back`` never waits for a copy: a node without a host copy starts its backup and is
passed over (evictable once the copy landed, at a later poll); if the host tier cannot take it,
the backup is dropped (counted in ``dropped_host_backups``) and the node goes uncopied, since
a cache that cannot evict cannot serve.
"""

from __future__ import annotations

from kvtier.config import CacheConfig
from kvtier.controller.backup import Backups
from kvtier.errors import ConfigError
from kvtier.tree.node import Node


class WritePolicy:
    """Base: no copies at all (every hook is a no-op)."""

    name = "none"

    def __init__(self, backups: Backups | None, config: CacheConfig) -> None:
        self.backups = backups
        self.config = config

    def on_insert(self, nodes: list[Node]) -> None:
        """``nodes`` just took device pages from the engine."""

    def on_hit(self, path: list[Node]) -> None:
        """A request locked ``path``."""

    def before_evict(self, node: Node) -> bool:
        """Whether ``node``'s device copy may go now."""
        return True


class WriteThrough(WritePolicy):
    """Back up every inserted node at once."""

    name = "write_through"

    def on_insert(self, nodes: list[Node]) -> None:
        if self.backups is not None:
            self.backups.to_host(nodes)


class WriteThroughSelective(WritePolicy):
    """Back up a prefix once it was hit ``write_threshold`` times."""

    name = "write_through_selective"

    def on_hit(self, path: list[Node]) -> None:
        if self.backups is not None:
            self.backups.to_host([n for n in path if n.hits >= self.config.write_threshold])


class WriteBack(WritePolicy):
    """Back up a node when its device copy is evicted (without waiting for the copy)."""

    name = "write_back"

    def before_evict(self, node: Node) -> bool:
        if node.on_host or self.backups is None:
            return True
        if node.device_io:
            return False  # its backup is in flight
        return self.backups.to_host([node]) is None  # dropped: the host tier is full


POLICIES = {p.name: p for p in (WriteThrough, WriteThroughSelective, WriteBack)}


def make_policy(config: CacheConfig, backups: Backups | None) -> WritePolicy:
    """The policy ``config.write_policy`` names (``WritePolicy`` itself without a host tier)."""
    if backups is None:
        return WritePolicy(None, config)
    if config.write_policy not in POLICIES:
        raise ConfigError(f"write_policy={config.write_policy!r} is not one of {list(POLICIES)}")
    return POLICIES[config.write_policy](backups, config)
