"""L3 keys: a hash chain over pages inside a namespace digest.

``key(i) = H(namespace, key(i-1), tokens of page i)`` with ``key(-1) = namespace``. The namespace
covers everything that changes the stored bytes or their meaning, so different deployments never
read each other's objects by accident.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np

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
) -> Namespace:
    """Digest of everything that makes stored bytes specific to one deployment."""
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
    ]
    h = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=_DIGEST)
    return Namespace(h.hexdigest())


def chain_keys(
    namespace: Namespace, tokens: Sequence[int], page_size: int, prev: PageKey | None = None
) -> list[PageKey]:
    """Keys of every whole page of ``tokens``, chained after ``prev`` (``None``: chain start)."""
    n_pages = len(tokens) // page_size
    if n_pages == 0:
        return []
    arr = np.asarray(tokens[: n_pages * page_size], dtype=np.int64).reshape(n_pages, page_size)
    ns = namespace.encode()
    last = (prev or namespace).encode()
    out: list[PageKey] = []
    for row in arr:
        h = hashlib.blake2b(ns, digest_size=_DIGEST)
        h.update(last)
        h.update(row.tobytes())
        last = h.hexdigest().encode()
        out.append(PageKey(last.decode()))
    return out


def state_key(key: PageKey) -> PageKey:
    """Key of the state-pool checkpoint stored for the page ``key`` (present only when valid)."""
    return PageKey(key + "-state")
