"""``PrefixIndex``: per-instance ``hash -> tiers`` from stored/removed/cleared events, and the
leading-page match a prompt's hashes get, each page at its cheapest tier."""

from __future__ import annotations

import pytest

from kvtier.route.prefix_index import PrefixIndex, PrefixMatch, tier_of


def test_match_counts_leading_pages_at_their_cheapest_tier() -> None:
    ix = PrefixIndex()
    ix.stored("a", [1, 2], "device")
    ix.stored("a", [1, 2, 3], "host")
    ix.stored("a", [4], "storage")
    assert ix.match("a", [1, 2, 3, 4, 5]) == PrefixMatch(device=2, host=1, storage=1)
    # the walk stops at the first page held nowhere, whatever follows
    assert ix.match("a", [1, 9, 3]) == PrefixMatch(device=1)
    assert ix.match("b", [1, 2]) == PrefixMatch()


def test_removal_is_per_tier_and_clear_is_per_instance() -> None:
    ix = PrefixIndex()
    ix.stored("a", [1, 2], "device")
    ix.stored("a", [1, 2], "host")
    ix.stored("b", [1], "device")
    ix.removed("a", [1, 2], "device")
    assert ix.tiers("a", 1) == {"host"}
    assert ix.match("a", [1, 2]) == PrefixMatch(host=2)
    ix.removed("a", [2, 77], "host")  # 77 was never reported: ignored
    assert ix.match("a", [1, 2]) == PrefixMatch(host=1)
    assert ix.pages("a") == 1
    ix.clear("a")
    assert ix.pages("a") == 0 and ix.tiers("b", 1) == {"device"}


def test_mediums_name_tiers() -> None:
    assert [tier_of(m) for m in (None, "device", "GPU", "cpu", "storage")] == [
        "device",
        "device",
        "device",
        "host",
        "storage",
    ]
    with pytest.raises(ValueError, match="unknown KV event medium 'tape'"):
        tier_of("tape")


def test_a_shared_l3_counts_every_instances_stored_pages_as_storage() -> None:
    """One L3 for all: b holds page 1 on device, a wrote pages 1-3 to storage and holds 4 on
    host. With ``shared``, b's match runs on through a's stored pages (storage hits b can
    take as well as a), but not through a's host page, which only a can load."""
    ix = PrefixIndex()
    ix.stored("a", [1, 2, 3], "storage")
    ix.stored("a", [4], "host")
    ix.stored("b", [1], "device")
    prompt = [1, 2, 3, 4]
    assert ix.match("b", prompt) == PrefixMatch(device=1)
    assert ix.match("b", prompt, ["a", "b"]) == PrefixMatch(device=1, storage=2)
    assert ix.match("c", prompt, ["a", "b", "c"]) == PrefixMatch(storage=3)
    # its own pages, as without sharing
    assert (
        ix.match("a", prompt, ["a", "b"]) == ix.match("a", prompt) == PrefixMatch(host=1, storage=3)
    )
