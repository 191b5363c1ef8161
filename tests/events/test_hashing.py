"""Page hashes: whole pages only, each bound to its whole prefix, the same in any process."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.events.hashing import ROOT, chain_hashes, page_hash


def test_a_page_hash_is_blake2b_of_the_parent_and_the_tokens() -> None:
    raw = (0).to_bytes(8, "big") + b"".join(t.to_bytes(8, "little") for t in (1, 2, 3, 4))
    want = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big", signed=True)
    assert page_hash(ROOT, [1, 2, 3, 4]) == want


def test_chain_hashes_cover_whole_pages_and_bind_the_prefix() -> None:
    a = chain_hashes(list(range(10)), 4)
    assert len(a) == 2  # the 2-token tail has none
    assert a[0] == page_hash(ROOT, [0, 1, 2, 3])
    assert a[1] == page_hash(a[0], [4, 5, 6, 7])
    # the same second page after another first page hashes differently
    b = chain_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert b[1] != a[1] and chain_hashes(list(range(8)), 4) == a
    # continuing from a parent equals hashing the whole sequence
    assert chain_hashes([4, 5, 6, 7], 4, parent=a[0]) == a[1:]
    assert all(-(2**63) <= h < 2**63 for h in a + b)
    with pytest.raises(ValueError, match="page_size must be positive"):
        chain_hashes([1], 0)
