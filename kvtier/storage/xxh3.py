"""XXH3-64 of a buffer that lets other threads run while it hashes.

python-xxhash releases the GIL only for buffers over 65,536 bytes, so I/O threads that digest
64 KiB pages (the file tier's packed pages) take turns at the interpreter lock for every page:
on the reference host two threads hashing 64 KiB buffers ran no faster than one
(``scripts/probes/xxhash_gil.py``). The same library's C function, called through ``ctypes``
(which releases the GIL for the call), hashes them in parallel at a fixed cost of a few tenths
of a microsecond a call. This module binds it once and checks it against python-xxhash; where
the symbol is missing or disagrees, ``digest`` is python-xxhash alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import xxhash

GIL_FREE_MIN = 16 << 10
"""Buffers from this size up to python-xxhash's own release threshold go through ``ctypes``:
below it the call's fixed cost outweighs the hash (about 0.25 µs a 4 KiB buffer)."""
LIBRARY_RELEASES_ABOVE = 65536
"""python-xxhash releases the GIL itself for buffers over this many bytes (measured, 4.1.0)."""

_char = ctypes.c_char
_addressof = ctypes.addressof
_intdigest = xxhash.xxh3_64_intdigest


def _bind() -> Callable[[int, int], int] | None:
    """python-xxhash's bundled ``XXH3_64bits`` (its CPU-dispatching variant when exported) as
    a ``ctypes`` function of (address, length), or ``None`` when it cannot be bound or gives
    another digest than python-xxhash on a test buffer."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    probe = bytearray(os.urandom(GIL_FREE_MIN + 7))
    address = _addressof(_char.from_buffer(probe))
    if fn(address, len(probe)) != _intdigest(probe):
        return None
    return fn


_gil_free = _bind()


def bound() -> bool:
    """Whether the GIL-free path is in use (else every buffer goes to python-xxhash)."""
    return _gil_free is not None


def digest(data: memoryview | bytes | bytearray) -> int:
    """XXH3-64 of ``data``, equal to ``xxhash.xxh3_64_intdigest(data)``; without the GIL for
    writable buffers of ``GIL_FREE_MIN`` bytes and more. ``data``: bytes, a bytearray, or
    anything with ``nbytes`` that exports a contiguous buffer (memoryviews, numpy arrays)."""
    n = len(data) if isinstance(data, (bytes, bytearray)) else data.nbytes
    if _gil_free is None or n < GIL_FREE_MIN or n > LIBRARY_RELEASES_ABOVE:
        return _intdigest(data)
    try:
        where = _char.from_buffer(data)
    except TypeError:  # read-only (bytes) or not contiguous: the library's own path
        return _intdigest(data)
    return _gil_free(_addressof(where), n)
