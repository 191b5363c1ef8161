"""Page arithmetic: slot expansion, page recovery, the whole-page validator and the debug check
of a copy's page ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.cache import slot_checks
from kvtier.errors import IntegrityError, RequestError
from kvtier.paging import (
    align_down,
    check_page_ids,
    locs_to_pages,
    num_full_pages,
    pages_to_locs,
)


def t(*v: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype)


def test_num_full_pages_and_align_down() -> None:
    assert [num_full_pages(n, 4) for n in (0, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert [align_down(n, 4) for n in (0, 3, 4, 7, 8, 9)] == [0, 0, 4, 4, 8, 8]
    assert [align_down(n, 1) for n in (0, 5)] == [0, 5]


def test_pages_to_locs_page_size_1() -> None:
    out = pages_to_locs(t(5, 0, 3), 1)
    assert out.dtype == torch.int64
    assert out.tolist() == [5, 0, 3]
    out32 = pages_to_locs(t(2, 7, dtype=torch.int32), 1)
    assert out32.dtype == torch.int64 and out32.tolist() == [2, 7]


def test_pages_to_locs_page_size_4() -> None:
    out = pages_to_locs(t(2, 0, 5), 4)
    assert out.dtype == torch.int64
    assert out.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23]
    assert pages_to_locs(t(1, dtype=torch.int32), 4).tolist() == [4, 5, 6, 7]
    assert pages_to_locs(t(), 4).tolist() == []


def test_locs_to_pages_page_size_1() -> None:
    out = locs_to_pages(t(9, 1, 4, dtype=torch.int32), 1)
    assert out.dtype == torch.int64
    assert out.tolist() == [9, 1, 4]


def test_locs_to_pages_page_size_4() -> None:
    locs = t(12, 13, 14, 15, 4, 5, 6, 7)
    out = locs_to_pages(locs, 4)
    assert out.dtype == torch.int64
    assert out.tolist() == [3, 1]
    assert locs_to_pages(t(), 4).tolist() == []


@pytest.mark.parametrize("page_size", [1, 4])
def test_roundtrip(page_size: int) -> None:
    pages = t(7, 0, 3, 11, 2)
    locs = pages_to_locs(pages, page_size)
    assert locs.numel() == pages.numel() * page_size
    assert slot_checks.whole_pages(locs.numpy(), page_size, "locs").tolist() == pages.tolist()
    assert locs_to_pages(locs, page_size).tolist() == pages.tolist()


@pytest.mark.parametrize(
    ("locs", "page_size", "pages"),
    [
        ([], 4, []),
        ([0, 1, 2, 3], 4, [0]),
        ([8, 9, 10, 11, 0, 1, 2, 3], 4, [2, 0]),
        ([4, 5, 6, 7, 4, 5, 6, 7], 4, [1, 1]),  # repeated pages are still whole pages
        ([3, 9, 0], 1, [3, 9, 0]),
        ([], 1, []),
    ],
)
def test_whole_pages_accepts_aligned_pages(
    locs: list[int], page_size: int, pages: list[int]
) -> None:
    for dtype in (np.int64, np.int32):
        got = slot_checks.whole_pages(np.array(locs, dtype=dtype), page_size, "slots")
        assert got.tolist() == pages


@pytest.mark.parametrize(
    ("locs", "match"),
    [
        ([1, 2, 3, 4], r"page 0 of the slots \(\[1, 2, 3, 4\]\)"),
        ([0, 1, 2, 3, 6, 7, 8, 9], r"page 1 of the slots \(\[6, 7, 8, 9\]\)"),
        ([0, 1, 3, 2], "page 0 of the slots"),
        ([4, 5, 6, 8], "page 0 of the slots"),
        ([0, 1, 2, 3, 8, 9, 10, 10], "page 1 of the slots"),
    ],
)
def test_whole_pages_rejects(locs: list[int], match: str) -> None:
    with pytest.raises(RequestError, match=match) as e:
        slot_checks.whole_pages(np.array(locs, dtype=np.int64), 4, "dst")
    assert str(e.value).startswith("dst: ")
    assert "multiple of page_size=4" in str(e.value)


def test_check_page_ids() -> None:
    check_page_ids(t(), 4, "x", distinct=True)
    check_page_ids(t(3, 0, 3), 4, "x", distinct=False)  # a source may repeat
    with pytest.raises(IntegrityError, match=r"h2d device pages: page 3 is a destination twice"):
        check_page_ids(t(3, 0, 3), 4, "h2d device pages", distinct=True)
    with pytest.raises(IntegrityError, match=r"x: page 4 is not in \[0, 4\)"):
        check_page_ids(t(0, 4), 4, "x", distinct=False)
    with pytest.raises(IntegrityError, match=r"x: page -1 is not in \[0, 4\)"):
        check_page_ids(t(-1), 4, "x", distinct=False)
    with pytest.raises(IntegrityError, match=r"x: expected 1-D page ids, got shape \(2, 2\)"):
        check_page_ids(t(0, 1, 2, 3).reshape(2, 2), 4, "x", distinct=False)


def test_mover_debug_checks_refuse_bad_pages() -> None:
    """With ``debug_checks`` a copy to a page out of range, or into one page twice, raises
    before any byte moves."""
    from kvtier.pools.device import DevicePool
    from kvtier.pools.host import HostPool
    from kvtier.pools.spec import PoolSpec
    from kvtier.transfer.mover import Mover

    spec = PoolSpec("kv", num_layers=2, row_shape=(2, 4), dtype=torch.float32)
    dev = DevicePool([spec], 4, 2, torch.device("cpu"))
    host = HostPool([spec], 6, 2)
    kv = dev.buffers["kv"]
    kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).view_as(kv))
    before = kv.clone()
    mover = Mover(dev, host, debug_checks=True)
    with pytest.raises(IntegrityError, match="h2d device pages: page 1 is a destination twice"):
        mover.host_to_device(t(0, 1), t(1, 1))
    with pytest.raises(IntegrityError, match=r"d2h host pages: page 6 is not in \[0, 6\)"):
        mover.device_to_host(t(0), t(6))
    with pytest.raises(IntegrityError, match="d2h host pages: page 2 is a destination twice"):
        mover.device_to_host(t(0, 1), t(2, 2))
    assert not host.buffers["kv"].any() and torch.equal(kv, before)  # nothing moved
    # the same pages in range and distinct move: device 0, 1 -> host 2, 3 -> device 3, 2
    mover.device_to_host(t(0, 1), t(2, 3)).wait()
    mover.host_to_device(t(2, 3), t(3, 2)).wait()
    v = dev.page_bytes_view("kv")
    assert torch.equal(v[:, 3], v[:, 0]) and torch.equal(v[:, 2], v[:, 1])
    assert not torch.equal(v[:, 0], v[:, 1])
