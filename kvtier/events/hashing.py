"""Page hashes of a token sequence that every process computes alike, from token ids alone.

A KV event names a cached page by the hash of the whole prefix it completes, so a router that
tokenizes a prompt can find which instance holds how much of it without knowing the model's
storage namespace. Page ``i`` (tokens ``[i * page_size, (i + 1) * page_size)``) hashes as::

    h(-1) = 0
    h(i)  = int64(blake2b(int64_be(h(i - 1)) || int64_le(token) for each of page i's tokens,
                          digest_size=8))

``int64`` is the digest read big-endian as a signed 64-bit integer (what msgpack carries and
vLLM's ``ExternalBlockHash`` accepts). Only whole pages are hashed; a partial tail has none.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = 0
"""The parent hash of a sequence's first page."""


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a page holding ``tokens`` after the prefix whose last page hashed
    ``parent`` (``ROOT`` for the first page)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "big", signed=True))
    ids = array("q", tokens)
    if ids.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every supported platform
        raise RuntimeError("int64 arrays are not 8 bytes here")
    if array("q", [1]).tobytes()[0] != 1:  # big-endian host: the hash is defined little-endian
        ids.byteswap()
    h.update(ids.tobytes())
    return int.from_bytes(h.digest(), "big", signed=True)


def chain_hashes(token_ids: Sequence[int], page_size: int, parent: int = ROOT) -> list[int]:
    """The hash of every whole page of ``token_ids`` (module docstring), in order, after a
    prefix whose last page hashed ``parent``."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size])
        out.append(parent)
    return out
