"""``cpu_byte_views``: the byte views the file backend reads into and writes from."""

from __future__ import annotations

import gc

import pytest
import torch

from kvtier.errors import RequestError
from kvtier.storage.base import cpu_byte_views, flat_cpu_bytes


def test_rows_of_one_tensor_are_slices_of_one_view() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = cpu_byte_views(list(base))
    assert [v.nbytes for v in views] == [24] * 4
    assert all(v.obj is views[0].obj for v in views)  # one ctypes array underneath
    for row, v in zip(base, views, strict=True):
        assert bytes(v) == flat_cpu_bytes(row).tobytes()
    views[2][0:4] = bytes(4)  # writes land in the tensor
    assert base[2, 0].item() == 0.0 and base[2, 1].item() == 13.0


def test_scattered_buffers_of_mixed_sizes_and_dtypes() -> None:
    a = torch.arange(8, dtype=torch.int16)
    b = torch.arange(3, dtype=torch.float64)
    c = torch.arange(10, dtype=torch.uint8)[2:7]  # contiguous slice with a storage offset
    views = cpu_byte_views([a, b, c, a])
    assert [v.nbytes for v in views] == [16, 24, 5, 16]
    assert views[0].obj is not views[3].obj
    for t, v in zip([a, b, c, a], views, strict=True):
        assert bytes(v) == flat_cpu_bytes(t).tobytes()
    assert bytes(views[2]) == bytes([2, 3, 4, 5, 6])


def test_adjacent_rows_out_of_order_are_viewed_one_by_one() -> None:
    base = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    views = cpu_byte_views([base[1], base[0], base[2]])
    assert [bytes(v) for v in views] == [bytes(range(4, 8)), bytes(range(4)), bytes(range(8, 12))]
    assert views[0].obj is not views[1].obj


def test_empty_inputs() -> None:
    assert cpu_byte_views([]) == []
    views = cpu_byte_views([torch.empty(0), torch.empty(0)])
    assert [v.nbytes for v in views] == [0, 0]


def test_view_keeps_its_tensor_alive() -> None:
    t = torch.full((1 << 16,), 7, dtype=torch.uint8)
    (v,) = cpu_byte_views([t])
    del t
    gc.collect()
    torch.zeros(1 << 16, dtype=torch.uint8)  # would likely reuse freed memory
    assert bytes(v) == bytes([7]) * (1 << 16)


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(8)[::2],
        torch.zeros(3, 3).t(),
        torch.zeros(4).to_sparse(),
        torch.zeros(2, dtype=torch.complex64).conj(),
    ],
    ids=["strided", "transposed", "sparse", "conj"],
)
def test_non_contiguous_or_non_cpu_buffers_are_request_errors(bad: torch.Tensor) -> None:
    with pytest.raises(RequestError, match="storage buffers must be contiguous CPU tensors"):
        cpu_byte_views([torch.zeros(2), bad])
