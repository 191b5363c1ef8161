"""Where a window pool can resume: the deepest page boundary whose window is flagged."""

from __future__ import annotations

import torch

from kvtier.cache.resume import Resume, window_pages, windowed_pages
from kvtier.pools import PoolSpec


def flags(bits: str) -> torch.Tensor:
    return torch.tensor([b == "1" for b in bits], dtype=torch.bool)


def test_window_pages_counts_the_pages_the_first_query_reads() -> None:
    # page size 4, window 6: resuming at token 12 reads (6, 12] = tokens 7..11 from the cache
    assert window_pages(3, 4, 6) == 2  # pages 1 (7) and 2 (8..11)
    assert window_pages(1, 4, 6) == 1  # tokens 0..3: page 0
    assert window_pages(0, 4, 6) == 0
    assert window_pages(5, 4, 1) == 0  # a window of one reads only the new token
    assert window_pages(5, 4, 5) == 1  # tokens 16..19
    assert window_pages(5, 4, 6) == 2  # tokens 15..19


def test_windowed_pages_is_the_deepest_boundary_with_its_window() -> None:
    # window 6 over pages of 4: a boundary needs its last two pages flagged (one at k = 1)
    assert windowed_pages(flags("111111"), 4, 6) == 6
    assert windowed_pages(flags("001111"), 4, 6) == 6
    assert windowed_pages(flags("000011"), 4, 6) == 6
    assert windowed_pages(flags("000110"), 4, 6) == 5  # page 5 lacks rows: resume at 5
    assert windowed_pages(flags("100000"), 4, 6) == 1  # only the first page
    assert windowed_pages(flags("010000"), 4, 6) == 0
    assert windowed_pages(flags(""), 4, 6) == 0
    # a window longer than the prefix needs every page before the boundary
    assert windowed_pages(flags("0111"), 4, 64) == 0
    assert windowed_pages(flags("1101"), 4, 64) == 2


def test_resume_of_a_pool_set() -> None:
    row = (2, 1, 4)
    kv = PoolSpec("kv", 1, row, torch.float32)
    win = PoolSpec("swa", 1, row, torch.float32, kind="window", window=48)
    state = PoolSpec("state", 1, (8,), torch.float32, kind="state")
    assert Resume.of([kv]) == Resume()
    assert not Resume.of([kv]).partial
    assert Resume.of([kv, win]) == Resume(window=48)
    assert Resume.of([kv, state]) == Resume(state=True)
    assert Resume.of([kv, win]).partial and Resume.of([kv, state]).partial
