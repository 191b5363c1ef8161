"""Small pieces under the local-file L3 backend (``kvtier.storage.file``): the corrupt-object
fault, unbuffered whole-buffer reads and writes, and OS-error kinds."""

from __future__ import annotations

import contextlib
import errno
import os
from concurrent.futures import Future

import numpy as np

from kvtier.errors import StorageError
from kvtier.keys import Namespace
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES


class CorruptObject(StorageError):
    """A ``StorageError`` on an object file that can never be read back (bad envelope,
    truncated, wrong size): the backend deletes it."""


def readinto_all(f: object, dest: memoryview) -> int:
    """Fill ``dest`` from the unbuffered file ``f``; returns the bytes read (short at EOF)."""
    done = 0
    while done < len(dest):
        n = f.readinto(dest[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def result_of(value: Future[int] | int) -> int:
    return value if isinstance(value, int) else value.result()


def os_kind(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "io"


def read_object(path: str, namespace: Namespace, key: str, dest: np.ndarray) -> int:
    """Fill ``dest`` with the payload at ``path`` after verifying the envelope header and
    sizes; returns the stored payload crc32 for the caller to verify.

    Raises ``CorruptObject`` for a file that is not a whole object of ``key``, ``StorageError``
    (``checksum``) when the object is whole but ``dest`` has another size, and ``OSError``
    when the file cannot be opened or read."""
    with open(path, "rb", buffering=0) as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
        try:
            length, crc = envelope.unpack(head, namespace, key)
        except StorageError as e:
            raise CorruptObject(e.kind, e.detail) from None
        if file_size < HEADER_BYTES + length:
            raise CorruptObject(
                "short_read", f"file has {file_size - HEADER_BYTES} of {length} payload bytes"
            )
        if file_size > HEADER_BYTES + length:
            raise CorruptObject("checksum", f"file size {file_size} exceeds header + {length}")
        if length != dest.nbytes:
            raise StorageError(
                "checksum", f"stored payload is {length} bytes, buffer {dest.nbytes}"
            )
        got = readinto_all(f, memoryview(dest))
    if got != length:
        raise CorruptObject("short_read", f"read {got} of {length} payload bytes")
    return crc
