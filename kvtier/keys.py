"""L3 keys: a hash chain over pages inside a namespace digest.

``key(i) = H(namespace, key(i-1), tokens of page i)`` with ``key(-1) = namespace``; a leaf's
partial last page is keyed by ``tail_key`` over exactly its valid tokens. The namespace
covers everything that changes the stored bytes or their meaning, so different deployments never
read each other's objects by accident.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NewType

import numpy as np

if TYPE_CHECKING:
    from kvtier.config import CacheConfig
    from kvtier.pools.spec import PoolSpec

PageKey = NewType("PageKey", str)
"""Hex digest naming one storage page (one L3 object)."""

Namespace = NewType("Namespace", str)
"""Hex digest of a deployment's layout; the root of every key chain."""

LAYOUT_VERSION = 1
"""Bumped whenever the byte layout of stored objects changes."""

_DIGEST = 16


def namespace_digest(
    *,
    model_fingerprint: str,
    dtype: str,
    page_size: int,
    tree_page_size: int,
    components: Sequence[str],
    rank: int,
    world_size: int,
    tenant_salt: str = "",
    extra: Sequence[str] = (),
    codec: str = "none",
) -> Namespace:
    """Digest of everything that makes stored bytes specific to one deployment; ``codec``
    names the page codec and the components it codes (``none`` leaves the digest as it was
    before codecs existed)."""
    parts = [
        f"layout={LAYOUT_VERSION}",
        f"model={model_fingerprint}",
        f"dtype={dtype}",
        f"page={page_size}",
        f"tree_page={tree_page_size}",
        "components=" + ",".join(components),
        f"shard={rank}/{world_size}",
        f"salt={tenant_salt}",
        *(f"extra={e}" for e in extra),
        *([f"codec={codec}"] if codec != "none" else []),
    ]
    h = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=_DIGEST)
    return Namespace(h.hexdigest())


def chain_keys(
    namespace: Namespace,
    tokens: Sequence[int],
    page_size: int,
    prev: PageKey | None = None,
    tail: bool = False,
) -> list[PageKey]:
    """Keys of every whole page of ``tokens``, chained after ``prev`` (``None``: chain start);
    with ``tail``, also the key of a trailing partial page (``tail_key``)."""
    n_pages = len(tokens) // page_size
    out: list[PageKey] = []
    if n_pages:
        arr = np.asarray(tokens[: n_pages * page_size], dtype=np.int64)
        arr = arr.reshape(n_pages, page_size)
        ns = namespace.encode()
        last = (prev or namespace).encode()
        for row in arr:
            h = hashlib.blake2b(ns, digest_size=_DIGEST)
            h.update(last)
            h.update(row.tobytes())
            last = h.hexdigest().encode()
            out.append(PageKey(last.decode()))
    if tail and len(tokens) % page_size:
        out.append(tail_key(namespace, tokens[n_pages * page_size :], out[-1] if out else prev))
    return out


def tail_key(namespace: Namespace, tokens: Sequence[int], prev: PageKey | None = None) -> PageKey:
    """Key of a partial page holding exactly ``tokens`` (fewer than a page) after ``prev``.

    It covers exactly the valid tokens and is marked as a tail, so it differs from the key of
    any whole page (and of any other tail): the whole page that later extends the tail is
    stored under its own key. The object still holds the whole physical page."""
    h = hashlib.blake2b(namespace.encode(), digest_size=_DIGEST)
    h.update((prev or namespace).encode())
    h.update(f"tail:{len(tokens)}".encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return PageKey(h.hexdigest())


def state_key(key: PageKey) -> PageKey:
    """Key of the state-pool checkpoint stored for the page ``key`` (present only when valid)."""
    return PageKey(key + "-state")


def cache_namespace(config: CacheConfig, specs: Sequence[PoolSpec], tree_page: int) -> Namespace:
    """The namespace of a cache with ``config`` over the pool set ``specs`` (contract 7): the
    context-parallel layout is not part of it, so any CP size reads the objects; the page
    codec (``config.kv_codec``) and the components it codes are, so objects written under one
    codec are never read under another."""
    coded = [f"{s.name}/b{s.block}" for s in specs if s.lossy]
    codec = (
        f"{config.kv_codec}:{','.join(coded)}" if config.kv_codec != "none" and coded else "none"
    )
    return namespace_digest(
        model_fingerprint=config.model_fingerprint,
        dtype=",".join(s.dtype_name for s in specs),
        page_size=config.page_size,
        tree_page_size=tree_page,
        components=[s.describe() for s in specs],
        rank=config.rank,
        world_size=config.world_size,
        tenant_salt=config.tenant_salt,
        extra=config.extra_namespace,
        codec=codec,
    )
