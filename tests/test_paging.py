"""Page arithmetic: slot expansion, page recovery and the whole-page validator."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import IntegrityError
from kvtier.paging import (
    align_down,
    check_whole_pages,
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
    check_whole_pages(locs, page_size)
    assert locs_to_pages(locs, page_size).tolist() == pages.tolist()


@pytest.mark.parametrize(
    ("locs", "page_size"),
    [
        ([], 4),
        ([0, 1, 2, 3], 4),
        ([8, 9, 10, 11, 0, 1, 2, 3], 4),
        ([4, 5, 6, 7, 4, 5, 6, 7], 4),  # repeated pages are still whole pages
        ([3, 9, 0], 1),
        ([], 1),
    ],
)
def test_check_whole_pages_accepts_aligned_pages(locs: list[int], page_size: int) -> None:
    check_whole_pages(t(*locs), page_size)
    check_whole_pages(t(*locs, dtype=torch.int32), page_size)


@pytest.mark.parametrize(
    ("locs", "match"),
    [
        ([0, 1, 2], "not a multiple of page_size=4"),
        ([0, 1, 2, 3, 4, 5], "not a multiple of page_size=4"),
        ([1, 2, 3, 4], "slot 1 is not aligned to 4"),
        ([0, 1, 2, 3, 6, 7, 8, 9], "slot 6 is not aligned to 4"),
        ([0, 1, 3, 2], "not consecutive"),
        ([4, 5, 6, 8], "not consecutive"),
        ([0, 1, 2, 3, 8, 9, 10, 10], "not consecutive"),
    ],
)
def test_check_whole_pages_rejects(locs: list[int], match: str) -> None:
    with pytest.raises(IntegrityError, match=match):
        check_whole_pages(t(*locs), 4)


def test_check_whole_pages_rejects_2d_and_names_what() -> None:
    locs = torch.arange(8, dtype=torch.int64).reshape(2, 4)
    with pytest.raises(
        IntegrityError, match=r"dst: expected a 1-D index tensor, got shape \(2, 4\)"
    ):
        check_whole_pages(locs, 4, what="dst")
    with pytest.raises(IntegrityError, match="1-D"):
        check_whole_pages(torch.tensor(0), 1)


def test_check_whole_pages_skips_non_cpu_tensors() -> None:
    try:
        bad = torch.empty(3, dtype=torch.int64, device="meta")
        bad_2d = torch.empty(2, 3, dtype=torch.int64, device="meta")
    except (RuntimeError, NotImplementedError):
        pytest.skip("meta tensors are not available")
    assert bad.device.type != "cpu"
    # would fail every check on CPU; off-CPU tensors are never inspected
    check_whole_pages(bad, 4)
    check_whole_pages(bad_2d, 4)
