"""Token runs as packed int32 bytes: the tree's storage and comparison format.

A node's tokens are one ``bytes`` object holding native-endian int32 values (4 bytes a token):
no Python int per token, nothing for the cyclic collector to scan, equality and prefix tests
at ``memcmp`` speed over half the bytes int64 would take, and a page's bytes are its key in the
parent's ``children``. Token ids are vocabulary indices, so int32 holds every real one; an id
outside ``[-2**31, 2**31)`` is refused (``RequestError`` naming its index and value), never
wrapped, since a wrapped id would match another prompt's tokens.

``as_array`` is the one conversion at the tree's API boundary. Containers that already hold
int32 contiguously (``array('i')``, int32 numpy arrays, int32 CPU tensors: what the engine's
requests hold) are viewed without a copy; other integer arrays and tensors are range-checked
and cast once by numpy; lists and tuples are packed once by ``struct``.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import struct
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from kvtier.errors import RequestError

TOKEN_BYTES = 4
"""Bytes per stored token (int32)."""
TOKEN_MIN, TOKEN_MAX = -(2**31), 2**31 - 1
"""The token ids the tree can hold (int32)."""


def _libc_fn(name: str, restype: type, argtypes: list) -> object | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(lib, name)
    except (OSError, AttributeError, TypeError):  # no C library to load (not a POSIX system)
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


_memcmp = _libc_fn("memcmp", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])
HAS_MEMCMP = _memcmp is not None
"""Whether ``memequal`` works here (a C library to load); without it the token arena is off."""


def memequal(a: int, b: int, n: int) -> bool:
    """Whether the ``n`` bytes at addresses ``a`` and ``b`` are equal (callers keep both alive)."""
    return _memcmp(a, b, n) == 0  # type: ignore[misc,operator]


Tokens = Union[Sequence[int], np.ndarray, torch.Tensor, "array.array[int]"]
"""Token containers the tree accepts: lists, tuples, ``array('i')`` (or any integer typecode),
integer numpy arrays and integer CPU tensors, all one-dimensional."""

_NARROW = frozenset(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16))
"""Integer dtypes whose every value fits in int32 (cast without a range check)."""


def _is_i32(tokens: object) -> bool:
    """Whether ``tokens`` is an ``array.array`` of 4-byte signed ints (viewable as int32)."""
    return (
        type(tokens) is array.array and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "il"
    )


def as_array(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a one-dimensional, C-contiguous int32 numpy array; a view when the
    container already is one (callers must not write to it). Raises ``RequestError`` for a
    non-integer, multi-dimensional or non-CPU container, or a token outside int32."""
    if _is_i32(tokens):
        return np.frombuffer(tokens, dtype=np.int32)
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.int32 and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens
        arr = tokens
    elif isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            raise RequestError(f"tokens on {tokens.device}: the tree reads CPU tokens only")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise RequestError(f"tokens of dtype {tokens.dtype}: need an integer tensor")
        arr = tokens.detach().numpy()  # a view: an int32 contiguous tensor is not copied
    elif isinstance(tokens, array.array):
        arr = np.asarray(tokens)
    else:
        return _pack_ints(tokens)
    if arr.ndim != 1:
        raise RequestError(f"tokens of shape {tuple(arr.shape)}: need one dimension")
    if arr.dtype != np.int32:
        if arr.dtype.kind not in "iu":
            raise RequestError(f"tokens of dtype {arr.dtype}: need integers")
        if (
            arr.dtype not in _NARROW
            and arr.size
            and (arr.min() < TOKEN_MIN or arr.max() > TOKEN_MAX)
        ):
            i = int(np.flatnonzero((arr < TOKEN_MIN) | (arr > TOKEN_MAX))[0])
            raise _out_of_range(i, int(arr[i]))
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def packed(tokens: Tokens) -> memoryview:
    """``tokens`` as a flat byte view of native int32 values (``as_array``'s conversions; no
    copy for an int32 container). Callers only read it and drop it before returning."""
    if _is_i32(tokens):
        return memoryview(tokens).cast("B")
    return memoryview(as_array(tokens)).cast("B")


def _out_of_range(i: int, value: int) -> RequestError:
    return RequestError(f"token {i} is {value}: token ids must fit in int32")


def _pack_ints(tokens: Sequence[int]) -> np.ndarray:
    # struct packs a list about twice as fast as np.array converts it, and refuses non-ints.
    try:
        return np.frombuffer(struct.pack(f"{len(tokens)}i", *tokens), dtype=np.int32)
    except struct.error as e:
        for i, t in enumerate(tokens):  # name the culprit (the error path only)
            if isinstance(t, int) and not TOKEN_MIN <= t <= TOKEN_MAX:
                raise _out_of_range(i, t) from None
        raise RequestError(f"tokens must be int32 integers: {e}") from None


def list_head(tokens: Tokens, page_size: int) -> bytes | None:
    """The packed first page of a list or tuple holding more than a page, else ``None``: a
    lookup can miss on it without converting the whole list."""
    if type(tokens) in (list, tuple) and len(tokens) > page_size:
        return _pack_ints(tokens[:page_size]).tobytes()
    return None


def unpack(buf: bytes) -> np.ndarray:
    """The tokens packed in ``buf`` as a read-only int32 array (a view, no copy)."""
    return np.frombuffer(buf, dtype=np.int32)


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
    (``kvtier.tree.token_arena``), compared by ``memcmp``; else ``buf`` is ``bytes``. ``differs``:
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
    if _is_i32(tokens):
        return tokens.buffer_info()[0]  # ``qm`` is a view of it; a fifth of numpy's cost
    return np.frombuffer(qm, dtype=np.uint8).ctypes.data
