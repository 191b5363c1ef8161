"""The file backend's index alone: LRU order, reservations, packs entering and leaving whole,
a full disk lowering the budget."""

from __future__ import annotations

import pytest

from kvtier.errors import IntegrityError
from kvtier.storage.file_index import FileIndex
from kvtier.storage.file_pack import Packed


def make(budget: int, tmp_path) -> FileIndex:  # noqa: ANN001
    return FileIndex(budget, lambda key: str(tmp_path / key), str(tmp_path))


def test_eviction_takes_the_least_recent_and_deletes_its_file(tmp_path) -> None:
    index = make(30, tmp_path)
    for key in "abc":
        (tmp_path / key).write_bytes(b"x")
        index.add(key, 10)
    assert index.leading(["a", "z", "b"]) == 1  # "a" most recent; the run stops at "z"
    index.evict(10)
    assert index.keys() == ["c", "a"] and index.used == 20 and index.evictions == 1
    assert not (tmp_path / "b").exists() and (tmp_path / "c").exists()
    index.check_integrity()


def test_a_reservation_is_settled_or_given_back(tmp_path) -> None:
    index = make(100, tmp_path)
    index.add("a", 10)
    index.used += 40  # two writes in flight, 20 bytes each
    index.settle("b", 20)
    index.settle("a", 20)  # indexed meanwhile: the reservation goes back
    assert index.keys() == ["a", "b"] and index.used == 30
    index.check_integrity()
    index.used += 1
    with pytest.raises(IntegrityError, match="31 bytes in use, 30 indexed"):
        index.check_integrity()


def test_a_pack_enters_and_leaves_whole(tmp_path) -> None:
    index = make(100, tmp_path)
    pack = tmp_path / "p1"
    pack.write_bytes(b"x")
    index.add("a", 10)
    index.add("z", 5)
    index.used += 35
    places = [Packed(str(pack), n, 100 + 10 * n, 3) for n in range(3)]
    index.add_pack(str(pack), ["a", "b", "c"], [15, 10, 10], places)  # "a" was a file of its own
    assert index.keys() == ["z", "a", "b", "c"] and index.used == 40
    assert index.file_of("b") == str(pack) and index.file_of("z") == str(tmp_path / "z")
    assert index.snapshot()[2] == {str(pack): ["a", "b", "c"]}
    assert index.drop("b", False) == 3  # one key drops its whole pack, which is deleted
    assert index.keys() == ["z"] and index.used == 5 and index.where == {}
    assert not pack.exists()
    index.check_integrity()


def test_a_full_disk_lowers_the_budget_to_what_it_holds(tmp_path) -> None:
    index = make(100, tmp_path)
    assert not index.shrink(10)  # nothing to evict
    index.add("a", 30)
    index.add("b", 30)
    assert index.shrink(20)
    assert index.budget_bytes == 60 and index.keys() == ["b"] and index.used == 30
    index.check_integrity()


def test_shared_scan_charges_each_sharer_its_share(tmp_path) -> None:
    index = FileIndex(100, lambda key: str(tmp_path / key), str(tmp_path), sharers=4)
    index.add("a", 10)  # found by the scan: ceil(10 / 4)
    index.add("b", 8)
    assert index.used == 3 + 2
    index.used += 10  # this process's own write of "c": reserved, then settled at its size
    index.settle("c", 10)
    assert index.used == 15
    index.check_integrity()
    assert index.drop("a", False) == 1 and index.used == 12
    index.check_integrity()
    index.evict(100 - 12 + 3)  # 3 more than fits: "b" (2) then "c" (10) go
    assert index.keys() == [] and index.used == 0 and index.evictions == 2
    index.check_integrity()
