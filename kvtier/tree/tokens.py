"""Token runs as packed int64 bytes: the tree's storage and comparison format.

A node's tokens are one ``bytes`` object holding native-endian int64 values (8 bytes a token):
no Python int per token, nothing for the cyclic collector to scan, equality and prefix tests
at ``memcmp`` speed, and a page's bytes are its key in the parent's ``children``.

``as_array`` is the one conversion at the tree's API boundary. Containers that already hold
int64 contiguously (``array('q')``, int64 numpy arrays, int64 CPU tensors) are viewed without
a copy; other integer arrays and tensors are cast once by numpy; lists and tuples are packed
once by ``struct``.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from kvtier.errors import RequestError
from kvtier.tree.arena import memequal

TOKEN_BYTES = 8
"""Bytes per stored token (int64)."""

Tokens = Union[Sequence[int], np.ndarray, torch.Tensor, "array.array[int]"]
"""Token containers the tree accepts: lists, tuples, ``array('q')`` (or any integer typecode),
integer numpy arrays and integer CPU tensors, all one-dimensional."""


def as_array(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a one-dimensional, C-contiguous int64 numpy array; a view when the
    container already is one (callers must not write to it). Raises ``RequestError`` for a
    non-integer, multi-dimensional or non-CPU container."""
    if type(tokens) is array.array and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "ql":
        return np.frombuffer(tokens, dtype=np.int64)
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.int64 and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens
        arr = tokens
    elif isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            raise RequestError(f"tokens on {tokens.device}: the tree reads CPU tokens only")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise RequestError(f"tokens of dtype {tokens.dtype}: need an integer tensor")
        arr = tokens.detach().numpy()
    elif isinstance(tokens, array.array):
        if tokens.typecode in ("q", "l") and tokens.itemsize == TOKEN_BYTES:
            return np.frombuffer(tokens, dtype=np.int64)
        arr = np.asarray(tokens)
    else:
        return _pack_ints(tokens)
    if arr.ndim != 1:
        raise RequestError(f"tokens of shape {tuple(arr.shape)}: need one dimension")
    if arr.dtype != np.int64:
        if arr.dtype.kind not in "iu":
            raise RequestError(f"tokens of dtype {arr.dtype}: need integers")
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr)


def packed(tokens: Tokens) -> memoryview:
    """``tokens`` as a flat byte view of native int64 values (``as_array``'s conversions; no
    copy for an int64 container). Callers only read it and drop it before returning."""
    if type(tokens) is array.array and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "ql":
        return memoryview(tokens).cast("B")
    return memoryview(as_array(tokens)).cast("B")


def _pack_ints(tokens: Sequence[int]) -> np.ndarray:
    # struct packs a list about twice as fast as np.array converts it, and refuses non-ints.
    try:
        return np.frombuffer(struct.pack(f"{len(tokens)}q", *tokens), dtype=np.int64)
    except struct.error as e:
        raise RequestError(f"tokens must be int64 integers: {e}") from None


def list_head(tokens: Tokens, page_size: int) -> bytes | None:
    """The packed first page of a list or tuple holding more than a page, else ``None``: a
    lookup can miss on it without converting the whole list."""
    if type(tokens) in (list, tuple) and len(tokens) > page_size:
        return _pack_ints(tokens[:page_size]).tobytes()
    return None


def unpack(buf: bytes) -> np.ndarray:
    """The tokens packed in ``buf`` as a read-only int64 array (a view, no copy)."""
    return np.frombuffer(buf, dtype=np.int64)


def to_tuple(buf: bytes) -> tuple[int, ...]:
    """The tokens packed in ``buf`` as Python ints (for inspection, not for hot paths)."""
    return tuple(unpack(buf).tolist())


def common_len(
    buf: bytes | memoryview,
    qm: memoryview,
    pos: int,
    page_size: int,
    addr: int = 0,
    qaddr: int = 0,
    differs: bool = False,
) -> int:
    """Tokens the packed run ``buf`` shares with the query from token ``pos`` on (``qm``: the
    query's packed bytes): all of them (a partial last page included) when they all match,
    else its whole pages before the first differing token (or before the query's end).
    ``addr``/``qaddr``: the addresses of ``buf`` and ``qm`` when ``buf`` is an arena run
    (``kvtier.tree.arena``), compared by ``memcmp``; else ``buf`` is ``bytes``. ``differs``:
    the caller already found that not all of ``buf`` matches (skips that compare)."""
    at, size = pos * TOKEN_BYTES, len(buf)
    avail = min(size, len(qm) - at)
    whole = not differs and avail == size
    if whole and (memequal(addr, qaddr + at, size) if addr else buf.startswith(qm[at : at + size])):
        return size // TOKEN_BYTES
    page = page_size * TOKEN_BYTES
    # Binary search on pages with memcmp over page ranges: pages [0, lo) are equal.
    lo, hi = 0, avail // page
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if addr:
            same = memequal(addr + lo * page, qaddr + at + lo * page, (mid - lo) * page)
        else:
            same = buf.startswith(qm[at + lo * page : at + mid * page], lo * page)
        if same:
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size


def address(qm: memoryview, tokens: Tokens) -> int:
    """Address of the first byte of ``qm``, ``packed(tokens)`` (for ``memcmp``)."""
    if type(tokens) is array.array and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "ql":
        return tokens.buffer_info()[0]  # ``qm`` is a view of it; a fifth of numpy's cost
    return np.frombuffer(qm, dtype=np.uint8).ctypes.data
