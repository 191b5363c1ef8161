"""PageAllocator: exact free-list order, refusal without side effects, integrity checks."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import CapacityError, IntegrityError
from kvtier.pools.allocator import PageAllocator


def ids(t: torch.Tensor | None) -> list[int]:
    assert t is not None
    assert t.dtype == torch.int64 and t.device.type == "cpu" and t.dim() == 1
    return t.tolist()


def pages(*p: int) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.int64)


def check(a: PageAllocator) -> None:
    a.check_integrity()
    assert a.used + a.available == a.num_pages
    assert 0 <= a.available <= a.num_pages


def free_list(a: PageAllocator) -> list[int]:
    """Drain the allocator to read its free list in order, then restore it unchanged."""
    n = a.available
    got = ids(a.alloc(n))
    a.free(pages(*got))
    return got


def test_fresh_allocator_is_all_free() -> None:
    a = PageAllocator(4)
    check(a)
    assert (a.used, a.available) == (0, 4)
    assert free_list(a) == [0, 1, 2, 3]
    check(a)


def test_alloc_front_free_back() -> None:
    a = PageAllocator(4)
    assert ids(a.alloc(2)) == [0, 1]
    check(a)
    assert ids(a.alloc(1)) == [2]
    check(a)
    assert (a.used, a.available) == (3, 1)
    a.free(pages(0))
    check(a)
    assert (a.used, a.available) == (2, 2)
    assert ids(a.alloc(2)) == [3, 0]
    check(a)
    assert (a.used, a.available) == (4, 0)


def test_free_order_is_preserved() -> None:
    a = PageAllocator(6)
    assert ids(a.alloc(6)) == [0, 1, 2, 3, 4, 5]
    a.free(pages(4, 1))
    a.free(pages(5))
    a.free(pages(0, 3))
    check(a)
    assert ids(a.alloc(3)) == [4, 1, 5]
    assert ids(a.alloc(2)) == [0, 3]
    assert a.available == 0
    a.free(pages(2))
    assert ids(a.alloc(1)) == [2]
    check(a)


def test_alloc_zero_returns_empty() -> None:
    a = PageAllocator(3)
    assert ids(a.alloc(0)) == []
    assert a.available == 3
    a.free(pages())
    check(a)
    assert a.available == 3


def test_alloc_negative_raises() -> None:
    a = PageAllocator(3)
    with pytest.raises(ValueError):
        a.alloc(-1)
    check(a)
    assert a.available == 3


def test_alloc_beyond_available_returns_none_and_changes_nothing() -> None:
    a = PageAllocator(4)
    assert ids(a.alloc(3)) == [0, 1, 2]
    a.free(pages(1))
    before = (a.used, a.available)
    assert a.alloc(3) is None
    check(a)
    assert (a.used, a.available) == before
    assert a.alloc(5) is None
    check(a)
    assert free_list(a) == [3, 1]
    assert ids(a.alloc(2)) == [3, 1]
    assert a.alloc(1) is None
    check(a)


def test_exact_capacity() -> None:
    a = PageAllocator(2)
    assert ids(a.alloc(2)) == [0, 1]
    assert a.alloc(1) is None
    a.free(pages(1, 0))
    check(a)
    assert ids(a.alloc(2)) == [1, 0]


@pytest.mark.parametrize("n", [0, -3])
def test_nonpositive_capacity_rejected(n: int) -> None:
    with pytest.raises(CapacityError):
        PageAllocator(n, name="kv")


def test_double_free_raises_and_changes_nothing() -> None:
    a = PageAllocator(4)
    assert ids(a.alloc(2)) == [0, 1]
    a.free(pages(0))
    with pytest.raises(IntegrityError, match="double free of page 0"):
        a.free(pages(0))
    check(a)
    assert (a.used, a.available) == (1, 3)
    # a never-allocated page is free too
    with pytest.raises(IntegrityError, match="double free of page 3"):
        a.free(pages(3))
    check(a)
    assert free_list(a) == [2, 3, 0]


def test_double_free_within_one_call_changes_nothing() -> None:
    a = PageAllocator(4)
    assert ids(a.alloc(3)) == [0, 1, 2]
    with pytest.raises(IntegrityError, match="double free"):
        a.free(pages(1, 1))
    check(a)
    assert (a.used, a.available) == (3, 1)
    with pytest.raises(IntegrityError, match="double free of page 3"):
        a.free(pages(0, 3))
    check(a)
    assert (a.used, a.available) == (3, 1)
    a.free(pages(1))
    check(a)
    assert free_list(a) == [3, 1]


@pytest.mark.parametrize("bad", [4, -1, 100])
def test_out_of_range_free_raises_and_changes_nothing(bad: int) -> None:
    a = PageAllocator(4, name="kv")
    assert ids(a.alloc(4)) == [0, 1, 2, 3]
    with pytest.raises(IntegrityError, match=f"kv: free of out-of-range page {bad}"):
        a.free(pages(bad))
    check(a)
    # a valid page ahead of the bad one in the same call is not freed either
    with pytest.raises(IntegrityError, match="out-of-range"):
        a.free(pages(2, bad))
    check(a)
    assert (a.used, a.available) == (4, 0)
    a.free(pages(2))
    check(a)
    assert ids(a.alloc(1)) == [2]


def test_check_integrity_detects_corruption() -> None:
    a = PageAllocator(4)
    a.alloc(2)
    a._free.append(2)  # page 2 listed twice
    with pytest.raises(IntegrityError, match="duplicate"):
        a.check_integrity()

    b = PageAllocator(4)
    b.alloc(2)
    b._is_free[0] = 1  # flagged free but not listed
    with pytest.raises(IntegrityError, match="disagree"):
        b.check_integrity()

    c = PageAllocator(4)
    c.alloc(2)
    c._free.popleft()  # page 2 flagged free but not listed ...
    c._free.append(0)  # ... and page 0 listed while flagged used
    with pytest.raises(IntegrityError, match="marked used"):
        c.check_integrity()


def test_interleaved_sequence_matches_a_queue() -> None:
    a = PageAllocator(8)
    expected = list(range(8))
    held: list[int] = []
    script = [("a", 3), ("f", [1]), ("a", 2), ("f", [0, 4]), ("a", 4), ("f", [3, 2, 6]), ("a", 1)]
    for op, arg in script:
        if op == "a":
            got = a.alloc(arg)
            if arg > len(expected):
                assert got is None
            else:
                want, expected = expected[:arg], expected[arg:]
                assert ids(got) == want
                held += want
        else:
            a.free(pages(*arg))
            expected += arg
            for p in arg:
                held.remove(p)
        check(a)
        assert a.used == len(held) and a.available == len(expected)
    assert free_list(a) == expected


# -- lanes: one free list per context-parallel rank ------------------------------------------


def test_lanes_hand_out_each_page_from_its_owner_lane() -> None:
    a = PageAllocator(8, lanes=2)
    check(a)
    assert (a.available_in(0), a.available_in(1)) == (4, 4)
    assert ids(a.alloc_owned([0, 1, 1, 0])) == [0, 1, 3, 2]
    assert (a.available_in(0), a.available_in(1), a.used) == (2, 2, 4)
    assert ids(a.alloc_owned([1, 0])) == [5, 4]
    check(a)


def test_lanes_refuse_a_plain_allocation() -> None:
    a = PageAllocator(8, lanes=2)
    with pytest.raises(IntegrityError, match="plain allocation"):
        a.alloc(2)
    assert a.available == 8
    check(a)


def test_lane_shortfall_and_fit() -> None:
    a = PageAllocator(6, lanes=3)
    assert a.shortfall([0, 1, 2]) == {} and a.fit([0, 1, 2]) == 3
    assert a.shortfall([2, 2, 2, 0]) == {2: 1}
    assert a.shortfall([1, 1, 1, 2, 2, 2]) == {1: 1, 2: 1}
    assert a.fit([2, 0, 2, 2, 0]) == 3  # the third page of lane 2 is the first one missing
    assert a.alloc_owned([2, 2, 2]) is None  # nothing taken
    assert (a.available, a.available_in(2)) == (6, 2)
    with pytest.raises(IntegrityError, match="owner 3 outside 3 lanes"):
        a.shortfall([3])
    with pytest.raises(IntegrityError, match="owner 3 outside 3 lanes"):
        a.alloc_owned([0, 3])
    assert a.available == 6
    assert a.fit_like(pages(0, 3, 5)) == 3 and a.fit_like(pages(2, 5, 8)) == 2
    check(a)


def test_lane_free_returns_pages_to_their_lane_in_order() -> None:
    a = PageAllocator(8, lanes=2)
    got = ids(a.alloc_owned([0, 0, 1, 1]))
    assert got == [0, 2, 1, 3]
    a.free(pages(3, 0, 1))
    check(a)
    assert (a.available_in(0), a.available_in(1)) == (3, 4)
    # Lane 0: 4 6 then freed 0; lane 1: 5 7 then freed 3, 1 in the order they came back.
    assert ids(a.alloc_owned([0, 0, 0])) == [4, 6, 0]
    assert ids(a.alloc_owned([1, 1, 1, 1])) == [5, 7, 3, 1]
    with pytest.raises(IntegrityError, match="double free of page 3"):
        a.free(pages(2, 3, 3))
    assert a.used == 8  # the rejected batch changed nothing
    check(a)


def test_lane_integrity_catches_a_page_on_the_wrong_lane() -> None:
    a = PageAllocator(8, lanes=2)
    a._lists[0].append(a._lists[1].pop())
    with pytest.raises(IntegrityError, match="lane 0's free list holds another lane"):
        a.check_integrity()


@pytest.mark.parametrize(("n", "lanes"), [(6, 4), (4, 0)])
def test_pages_that_do_not_split_into_lanes_are_rejected(n: int, lanes: int) -> None:
    with pytest.raises(CapacityError, match=f"{n} pages do not split into {lanes} lanes"):
        PageAllocator(n, lanes=lanes)


def test_one_lane_behaves_like_no_lanes() -> None:
    a, b = PageAllocator(6), PageAllocator(6, lanes=1)
    assert b.lanes == 1 and b.available_in(0) == 6
    for step in range(4):
        x, y = ids(a.alloc(2)), ids(b.alloc(2))
        assert x == y
        a.free(pages(*x[::-1]))
        b.free(pages(*y[::-1]))
        assert free_list(a) == free_list(b), step
    assert a.alloc(7) is None and b.alloc(7) is None
    assert ids(b.alloc_owned([0, 0])) == ids(a.alloc(2))
    assert b.shortfall([0] * 5) == {0: 1} and b.fit([0] * 5) == 4
    assert b.fit_like(pages(0, 1, 2, 3, 4)) == 4
    check(a)
    check(b)
