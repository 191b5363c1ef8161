"""Staged copies worked out on the CPU: their slices (``plan.staging_slices``) and each slice's
copy-engine blocks (``kvtier.transfer.staged_blocks``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.transfer.plan import RowGeometry, staging_slices
from kvtier.transfer.staged_blocks import host_breaks, slice_blocks


def geo(layout: str, layers: int = 2, row_bytes: int = 10) -> RowGeometry:
    return RowGeometry(
        layers=layers, row_bytes=row_bytes, device_pages=10, host_pages=10, host_layout=layout
    )


def blocks(host: list[int], slices: list[int], g: RowGeometry) -> list[list[list[int]]]:
    h = np.array(host, dtype=np.int64)
    out = slice_blocks(h, host_breaks(h), slices, g, 1000)
    return [[a.tolist(), b.tolist(), c.tolist()] for a, b, c in out]


def test_page_first_blocks_are_runs_cut_at_slice_starts():
    # Pages 5 6 | 7 2 3 | 9 in slices of 2, 3 and 1; a page is 2 layers of 10 bytes.
    assert blocks([5, 6, 7, 2, 3, 9], [2, 3, 1], geo("page_first")) == [
        [[1100], [0], [40]],
        [[1140, 1040], [0, 20], [20, 40]],
        [[1180], [0], [20]],
    ]


def test_layer_first_blocks_are_runs_per_layer_layer_major():
    # Slice 7 2 3: rows l * 10 + page on the host, l * 3 + i in staging.
    assert blocks([5, 6, 7, 2, 3, 9], [2, 3, 1], geo("layer_first"))[1] == [
        [1070, 1020, 1170, 1120],
        [0, 10, 30, 40],
        [10, 20, 10, 20],
    ]


def test_one_run_across_every_slice_and_no_pages():
    assert blocks([0, 1, 2, 3], [1, 3], geo("page_first")) == [
        [[1000], [0], [20]],
        [[1020], [0], [60]],
    ]
    assert blocks([], [], geo("page_first")) == []


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_blocks_cover_every_row_once_at_its_staging_place(layout: str):
    """Every byte of every slice's pages lands where the staging layout puts it."""
    rng = np.random.default_rng(0)
    g = RowGeometry(layers=3, row_bytes=4, device_pages=64, host_pages=64, host_layout=layout)
    for _ in range(20):
        # Runs of distinct pages as a host tier hands them out: the first pages of 4-page blocks.
        parts = [b * 4 + np.arange(rng.integers(1, 5)) for b in rng.permutation(16)]
        host = np.concatenate(parts).astype(np.int64)
        n = host.size
        cuts = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
        slices = np.diff(np.concatenate(([0], cuts, [n]))).tolist()
        lo = 0
        per_slice = slice_blocks(host, host_breaks(host), slices, g, 0)
        for k, (h, s, z) in zip(slices, per_slice, strict=True):
            got: dict[int, int] = {}  # host byte -> staging byte
            for a, b, size in zip(h.tolist(), s.tolist(), z.tolist(), strict=True):
                for off in range(size):
                    assert a + off not in got
                    got[a + off] = b + off
            want = {}
            for i in range(k):
                for layer in range(3):
                    if layout == "page_first":
                        hrow, srow = host[lo + i] * 3 + layer, i * 3 + layer
                    else:
                        hrow, srow = layer * 64 + host[lo + i], layer * k + i
                    for off in range(4):
                        want[int(hrow) * 4 + off] = srow * 4 + off
            assert got == want
            lo += k


def test_staging_slices_grow_away_from_the_unoverlapped_end():
    mib = 1 << 20
    # 4 MiB pages, 64 MiB staging (8-page buffers): 16 MiB first, then half again per slice.
    assert staging_slices(40, 4 * mib, 64 * mib, "d2h") == [4, 6, 8, 8, 8, 6]
    assert staging_slices(40, 4 * mib, 64 * mib, "h2d") == [6, 8, 8, 8, 6, 4]
    assert staging_slices(3, 4 * mib, 64 * mib, "d2h") == [3]
    assert staging_slices(5, 32 * mib, 64 * mib, "d2h") == [1, 1, 1, 1, 1]  # a page per buffer
    assert staging_slices(7, 64 << 10, 256 * mib, "d2h") == [7]
    assert staging_slices(0, mib, 16 * mib, "d2h") == []
    # Beside a copy the other way, the first slice is 32 MiB.
    assert staging_slices(40, 4 * mib, 256 * mib, "d2h", shared_link=True) == [8, 12, 18, 2]
    assert staging_slices(40, 4 * mib, 256 * mib, "d2h") == [4, 6, 9, 13, 8]
