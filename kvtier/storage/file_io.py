"""Small pieces under the local-file L3 backend (``kvtier.storage.file``): the corrupt-object
fault, payload reads in one ``preadv`` straight into the caller's buffer, vectored
writes, and OS-error kinds."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid

import numpy as np

from kvtier.errors import StorageError
from kvtier.keys import Namespace
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES

TMP_SUFFIX = ".tmp"
"""Names of files a write has not published yet (a restart removes them)."""


class CorruptObject(StorageError):
    """A ``StorageError`` on an object file that can never be read back (bad envelope,
    truncated, wrong size, payload digest mismatch): the backend deletes it."""


def _tail(views: list[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out: list[memoryview] = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


def writev_all(fd: int, views: list[memoryview]) -> None:
    """Write all of ``views`` to ``fd`` in order; one syscall unless the kernel takes less."""
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        done += os.writev(fd, _tail(views, done) if done else views)


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_kind(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "io"


READ_CHUNK = 256 << 10
"""Payload bytes per read syscall: each chunk is digested while it is still in the core's
cache (measured here against one read of the whole payload, then the digest: 0.89 against
0.77 of plain I/O for 1 MiB objects)."""


def _read_payload(fd: int, dest: memoryview) -> tuple[int, int]:
    """Read the payload after the header into ``dest`` in ``READ_CHUNK`` pieces, digesting
    each as it lands; returns the file size seen and the digest (meaningful only when the
    size is right). The last read asks for one byte more, so a longer file shows without an
    extra syscall (a regular file's read only comes back short at its end)."""
    h = envelope.hasher()
    spare = memoryview(bytearray(1))
    off, n = 0, len(dest)
    while off < n:
        end = min(off + READ_CHUNK, n)
        got = os.preadv(
            fd, [dest[off:end], spare] if end == n else [dest[off:end]], HEADER_BYTES + off
        )
        if not got:
            break
        h.update(dest[off : min(off + got, n)])
        off += got
    return HEADER_BYTES + off, h.intdigest()


def read_object(path: str, namespace: Namespace, key: str, dest: np.ndarray) -> None:
    """Fill ``dest`` with the payload at ``path`` and verify header, sizes and payload digest.

    The header is verified before any byte lands in ``dest`` (another deployment's payload is
    never copied into the caller's buffer); the payload then arrives straight in ``dest``
    (``_read_payload``). Raises
    ``CorruptObject`` for a file that is not a whole, intact object of ``key``,
    ``StorageError`` (``checksum``) when the object is whole but ``dest`` has another size,
    and ``OSError`` when the file cannot be opened or read. ``dest`` may hold partial bytes
    after a failure."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
        try:
            length, want = envelope.unpack(head, namespace, key)
        except StorageError as e:
            raise CorruptObject(e.kind, e.detail) from None
        if length == dest.nbytes:
            file_size, got_digest = _read_payload(fd, memoryview(dest))
        else:
            file_size, got_digest = os.fstat(fd).st_size, 0
    finally:
        os.close(fd)
    if file_size < HEADER_BYTES + length:
        raise CorruptObject(
            "short_read", f"file has {file_size - HEADER_BYTES} of {length} payload bytes"
        )
    if file_size > HEADER_BYTES + length:
        raise CorruptObject("checksum", f"file size exceeds header + {length}")
    if length != dest.nbytes:
        raise StorageError("checksum", f"stored payload is {length} bytes, buffer {dest.nbytes}")
    if got_digest != want:
        raise CorruptObject("checksum", "payload checksum mismatch")


def write_object(path: str, views: list[memoryview], fsync: bool) -> None:
    """Publish ``views`` (header, payload) as the file ``path``: written in one ``writev`` to
    a temp file in the same directory (created if missing), then ``os.replace``d, so readers
    only see whole objects; with ``fsync`` the file and the directory are synced. On any
    failure nothing of it is left behind (the caller has not indexed the key yet)."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:
            os.makedirs(d, exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        try:
            writev_all(fd, views)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if fsync:
            fsync_dir(d)
    except BaseException:
        unlink_quiet(tmp)
        unlink_quiet(path)
        raise
