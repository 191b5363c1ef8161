"""Copy-engine transfers of many scattered blocks in one driver call.

``cuMemcpyBatchAsync`` (CUDA driver 12.8+) queues a list of ``(dst, src, size)`` copies on a
stream; the copy engines run them without occupying a single SM, so a load overlapping the
forward pass, or a backup overlapping decode, does not slow the kernels beside it. Per-block
cost makes it lose to kernels for small blocks: measured on an H200 (64 MiB..1 GiB batches),
host → device reached 0.97 of a contiguous copy with 64 KiB blocks but 0.88 with 32 KiB and 0.04
with 4 KiB; device → host 0.97 with 256 KiB blocks, 0.88 with 64 KiB. Callers pick it by block
size (see ``kvtier.transfer.plan``) and use kernels otherwise.

The binding goes through ``ctypes`` to ``libcuda`` (always present with the driver), so nothing is
compiled; where the symbol is missing, :func:`available` is false and kernels do everything.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kvtier.errors import TransferError


class DmaError(TransferError):
    """The driver refused a copy-engine list (raised before or while queueing it)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``; zeroed location hints mean "no hint"."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _Location),
        ("dst_loc_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


BATCH_BLOCKS = 512
"""Blocks per driver call. The driver spends about 0.7 µs per block before the copy engines
start on a call, so long lists go in slices: the first copies run while later ones are queued."""
FEW_BLOCKS = 16
"""Lists this short may be queued as one ``cuMemcpyAsync`` per block (a few µs of CPU each),
where a copy shares the link with one the other way. A staged slice with host pages in node runs
is a handful of blocks; both directions at once, those slices moved 0.88-0.95 of two contiguous
copies as batched lists and 0.90-0.97 as single copies on an H200, in every family at page sizes
1, 16 and 64 (results/h200-dma/run11). Beside decode they cost it: paced backups as single
copies stalled a decode step 1.055-1.129x, as batched lists 0.997-1.018x, alternated on one
machine (results/h200-dma/run12/stall_few_blocks.json; batched lists on another: 1.054-1.076x)."""
_SRC_ACCESS_ORDER_STREAM = 1
"""The source is read in stream order (it may be written by earlier work on the stream)."""


@functools.cache
def _entry() -> tuple[object, bool] | None:
    """``(function, takes_fail_index)`` or ``None`` when the driver lacks batched copies."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    # CUDA 13 drivers export the failIdx-less signature as _v2; 12.8/12.9 only the first one.
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if fn is not None:
        return fn, False
    fn = getattr(lib, "cuMemcpyBatchAsync", None)
    return (fn, True) if fn is not None else None


def available() -> bool:
    """Whether batched copy-engine transfers can be used in this process."""
    return torch.cuda.is_available() and _entry() is not None


def coalesce(
    dst: np.ndarray, src: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbouring blocks that are contiguous on both sides (same order, same result).

    >>> coalesce(np.array([0, 8, 32]), np.array([100, 108, 200]), np.array([8, 8, 8]))[2]
    array([16,  8])
    """
    if dst.size <= 1:
        return dst, src, size
    joins = (dst[1:] == dst[:-1] + size[:-1]) & (src[1:] == src[:-1] + size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return dst[starts], src[starts], np.add.reduceat(size, starts)


def copy_blocks(
    dst: np.ndarray,
    src: np.ndarray,
    size: np.ndarray,
    stream: torch.cuda.Stream,
    single_upto: int = 0,
) -> None:
    """Queue ``size[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every ``i`` on
    ``stream`` (addresses are device pointers or pinned host pointers; unified addressing tells
    the driver which is which): as batched lists, or one copy per block when there are at most
    ``single_upto`` blocks. Returns once queued; the arrays may be dropped then."""
    if _entry() is None:
        raise DmaError("cuMemcpyBatchAsync is not available in this CUDA driver")
    n = int(size.size)
    if n == 0:
        return
    if n <= single_upto:
        _copy_each(dst, src, size, stream)
    else:
        _copy_batched(dst, src, size, stream)


def _copy_batched(
    dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: torch.cuda.Stream
) -> None:
    """The blocks by ``cuMemcpyBatchAsync``, ``BATCH_BLOCKS`` per call."""
    entry = _entry()
    if entry is None:
        raise DmaError("cuMemcpyBatchAsync is not available in this CUDA driver")
    fn, fail_index = entry
    n = int(size.size)
    d, s, z = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, size))
    attrs = _Attributes(_SRC_ACCESS_ORDER_STREAM)
    attr_index = (ctypes.c_size_t * 1)(0)
    failed = ctypes.c_size_t(0)
    handle = ctypes.c_void_p(stream.cuda_stream)
    for lo in range(0, n, BATCH_BLOCKS):
        k = min(BATCH_BLOCKS, n - lo)
        args = [
            ctypes.c_void_p(d.ctypes.data + 8 * lo),
            ctypes.c_void_p(s.ctypes.data + 8 * lo),
            ctypes.c_void_p(z.ctypes.data + 8 * lo),
            ctypes.c_size_t(k),
            ctypes.byref(attrs),
            attr_index,
            ctypes.c_size_t(1),
        ]
        if fail_index:
            args.append(ctypes.byref(failed))
        rc = fn(*args, handle)  # type: ignore[operator]
        if rc != 0:
            raise DmaError(f"cuMemcpyBatchAsync failed with CUresult {rc} ({k} blocks)")


@functools.cache
def _memcpy() -> object:
    fn = ctypes.CDLL("libcuda.so.1").cuMemcpyAsync
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _copy_each(
    dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: torch.cuda.Stream
) -> None:
    """One ``cuMemcpyAsync`` per block on ``stream`` (unified addressing: pinned host pointers
    are device pointers)."""
    fn = _memcpy()
    handle = ctypes.c_void_p(stream.cuda_stream)
    for d, s, z in zip(dst.tolist(), src.tolist(), size.tolist(), strict=True):
        rc = fn(d, s, z, handle)  # type: ignore[operator]
        if rc != 0:
            raise DmaError(f"cuMemcpyAsync failed with CUresult {rc} ({z} bytes)")
