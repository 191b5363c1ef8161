"""What the cache needs of its context-parallel group: the checks at start, the handshake that
every rank built the same cache, and the owned-page storage probe (the MIN over ranks is the
group's answer)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import PageKey
from kvtier.parallel.acks import shard_ready
from kvtier.parallel.group import Group, SoloGroup
from kvtier.pools.spec import PoolSpec
from kvtier.storage.base import StorageBackend
from kvtier.transfer.translate import PageTranslator


def check_group(
    config: CacheConfig,
    specs: Sequence[PoolSpec],
    group: Group | None,
    translator: PageTranslator | None,
) -> Group:
    """The CP group a cache with ``config`` runs in; ``ConfigError`` naming the options for a
    group that does not match ``cp_size``/``cp_rank`` and for what CP does not support yet."""
    cp = config.cp_size
    if group is None:
        if cp > 1:
            raise ConfigError(
                f"cp_size={cp} needs the CP group: TieredCache(..., group=GlooGroup.init(...))"
            )
        return SoloGroup()
    if (group.size, group.rank) != (cp, config.cp_rank):
        raise ConfigError(
            f"cp_size={cp}, cp_rank={config.cp_rank} but the group has size {group.size} "
            f"and this process is its rank {group.rank}"
        )
    if cp > 1:
        states = [s.name for s in specs if s.kind == "state"]
        if states:
            raise ConfigError(
                f"cp_size={cp} with the state pool(s) {states} (a recurrent model) is not "
                "supported yet: recurrent state is not split by page owner; use cp_size=1"
            )
        if translator is not None:
            raise ConfigError(
                f"cp_size={cp} with a translator: under context parallelism the cache "
                "translates through the CP layout (cp_pattern) itself"
            )
    return group


def handshake(
    group: Group, config: CacheConfig, namespace: str, page_size: int, host_pages: int
) -> None:
    """Every rank of the CP group started a cache with the same shape: the same namespace,
    tree page and pool sizes (else their trees would diverge at the first eviction).
    Raises ``ConfigError`` on a mismatch, ``RankError`` naming a rank that never came."""
    shape = f"{namespace}|{page_size}|{config.device_pages}|{host_pages}"
    shape += f"|{config.cp_pattern}|{config.write_policy}"
    digest = int.from_bytes(hashlib.blake2b(shape.encode(), digest_size=7).digest(), "big")
    low, neg = group.all_reduce_min_many([digest, -digest])
    if low != -neg:
        raise ConfigError(
            f"cp_rank={config.cp_rank}: the ranks of the CP group started caches of "
            "different shapes (model_fingerprint, page_size, device_pages, host pool size, "
            "cp_pattern or write_policy differ); every rank needs the same configuration"
        )


def owned_exists(
    backend: StorageBackend, keys: list[PageKey], owners: Sequence[int] | None, rank: int
) -> int:
    """Leading ``keys`` present in storage as far as this rank can tell. With ``owners`` (the
    rank owning each key's page, under CP) it asks only about its own pages, the objects it
    writes and reads: a page owned elsewhere counts as present here, so the MIN over ranks is
    exactly the leading run every owner found."""
    if owners is None:
        return backend.batch_exists(keys)
    mine = [i for i, o in enumerate(owners) if o == rank]
    return shard_ready(rank, owners, backend.batch_exists([keys[i] for i in mine]) if mine else 0)
