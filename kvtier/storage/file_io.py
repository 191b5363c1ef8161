"""Small pieces under the local-file L3 backend (``kvtier.storage.file``): the corrupt-object
fault, payload reads in one ``preadv`` straight into the caller's buffer, vectored writes
published whole (an unnamed file linked under its name), and OS-error kinds."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import uuid
from collections.abc import Callable

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


WRITE_CHUNK = 1 << 20
"""Payload bytes per write syscall: each piece is digested just before it is written, so the
write copies it from the core's cache. Against 256 KiB pieces, 1 MiB pieces measured writes
of 1.01 against 0.94 of plain I/O for 1 MiB objects and 0.99 against 0.75 for 2 MiB ones
(``results/file-tier/file_tier_ab.py``, CHUNK=...); a single write of 2 MiB or more into a new
file ran at times ten times slower than 1 MiB pieces here (``results/file-tier/``, run w)."""

READ_CHUNK = 2 << 20
"""Payload bytes per read syscall of an object of its own, digested right after it lands
(one ``preadv`` and one digest for objects up to this size). Reading 2 MiB objects in one
piece instead of two 1 MiB pieces measured 6.96-7.36 against 6.65-6.85 GB/s on two I/O
threads in four runs, and 4 MiB objects in 2 MiB pieces 7.14 against 6.84 (1 MiB pieces;
``results/file-tier/file_read_ceiling.py``, ``results/file-tier/`` run x); 256 KiB pieces were
slower at both sizes."""


class _Scratch(threading.local):
    """Per-thread buffers reused by every read: no allocation or view per object."""

    def __init__(self) -> None:
        self.head = bytearray(HEADER_BYTES)
        self.fields = memoryview(self.head)[: envelope.FIELDS_BYTES]
        self.spare = memoryview(bytearray(1))


_scratch = _Scratch()
_O_NOATIME = getattr(os, "O_NOATIME", 0)
_read_flags = [os.O_RDONLY | os.O_CLOEXEC | _O_NOATIME]
"""Flags of object opens. ``O_NOATIME``: the first read of a file after its write would
otherwise update its atime (``relatime``), about 1.2 of a 64 KiB read's 25 µs here, and
nothing uses atimes (recency is mtimes and the journal); dropped the first time a file the
process does not own refuses it (``EPERM``)."""


def _open_read(path: str) -> int:
    try:
        return os.open(path, _read_flags[0])
    except PermissionError as e:
        if e.errno != errno.EPERM or not _read_flags[0] & _O_NOATIME:
            raise
        _read_flags[0] &= ~_O_NOATIME
        return os.open(path, _read_flags[0])


ALIGNED_MIN = 128 << 10
"""Payloads of at least this many bytes start at ``PAYLOAD_ALIGN`` in their file, after the
header and zeros: the page cache copies page-aligned file ranges into page-aligned buffers
faster (1 MiB files read 8.5 / 7.8 GB/s with the payload 112 bytes in, 10.8 / 9.5 at 4096,
two runs on the 2-core reference host; ``results/file-tier/file_payload_align.py``). Smaller
ones follow the header: a page of padding would be a large share of them (and large rounds
of them are packs, ``file_pack``, aligned as a whole)."""
PAYLOAD_ALIGN = 4096


def payload_at(n: int) -> int:
    """File offset of an ``n``-byte payload in its object file."""
    return PAYLOAD_ALIGN if n >= ALIGNED_MIN else HEADER_BYTES


def file_bytes(n: int) -> int:
    """Size of the object file of an ``n``-byte payload."""
    return payload_at(n) + n


_PADDING = memoryview(bytes(PAYLOAD_ALIGN - HEADER_BYTES))


def _read_payload(fd: int, dest: memoryview, spare: memoryview, at: int) -> tuple[int, int]:
    """Read the payload at ``at`` into ``dest`` (in ``READ_CHUNK`` pieces when larger,
    digesting each as it lands); returns the file size seen and the digest (meaningful only
    when the size is right). The last read asks for one byte more, into ``spare``, so a longer
    file shows without an extra syscall (a regular file's read only comes back short at its
    end)."""
    n = len(dest)
    if n <= READ_CHUNK:
        got = os.preadv(fd, [dest, spare], at)
        return at + got, envelope.digest(dest if got == n else dest[: min(got, n)])
    h = envelope.hasher()
    off = 0
    while off < n:
        end = min(off + READ_CHUNK, n)
        got = os.preadv(fd, [dest[off:end], spare] if end == n else [dest[off:end]], at + off)
        if not got:
            break
        h.update(dest[off : min(off + got, n)])
        off += got
    return at + off, h.intdigest()


def read_object(
    path: str, namespace: Namespace, key: str, prefix: bytes, dest: memoryview | np.ndarray
) -> None:
    """Fill ``dest`` (a flat byte buffer) with the payload at ``path`` and verify header,
    sizes and payload digest; ``prefix`` is ``envelope.expected_prefix(namespace, key,
    dest.nbytes)``.

    The header is verified before any byte lands in ``dest`` (another deployment's payload is
    never copied into the caller's buffer); the payload then arrives straight in ``dest``
    (``_read_payload``): two read syscalls for an object up to ``READ_CHUNK``. Raises
    ``CorruptObject`` for a file that is not a whole, intact object of ``key``,
    ``StorageError`` (``checksum``) when the object is whole but ``dest`` has another size,
    and ``OSError`` when the file cannot be opened or read. ``dest`` may hold partial bytes
    after a failure."""
    scratch = _scratch
    head = scratch.head
    n = dest.nbytes
    fd = _open_read(path)
    try:
        got = os.preadv(fd, [head], 0)
        want = (
            envelope.fast_payload_digest(head, scratch.fields, prefix)
            if got == HEADER_BYTES
            else None
        )
        if want is not None:
            length = n  # the prefix names it
        else:
            try:
                length, want = envelope.unpack(head[:got], namespace, key)
            except StorageError as e:
                raise CorruptObject(e.kind, e.detail) from None
        at = payload_at(length)
        if length != n:
            file_size, got_digest = os.fstat(fd).st_size, 0
        elif n < ALIGNED_MIN:  # the common case inline: a tenth of a 64 KiB read is Python
            got = os.preadv(fd, [dest, scratch.spare], at)
            file_size = at + got
            got_digest = envelope.digest(dest) if got == n else 0  # else a size fault below
        else:
            file_size, got_digest = _read_payload(fd, memoryview(dest), scratch.spare, at)
    finally:
        os.close(fd)
    if file_size != at + length:
        if file_size < at + length:
            raise CorruptObject(
                "short_read", f"file has {max(0, file_size - at)} of {length} payload bytes"
            )
        raise CorruptObject("checksum", f"file size exceeds header + {length}")
    if length != n:
        raise StorageError("checksum", f"stored payload is {length} bytes, buffer {n}")
    if got_digest != want:
        raise CorruptObject("checksum", "payload checksum mismatch")


def _write_payload(fd: int, namespace: str, key: str, payload: memoryview) -> None:
    """Write the object (header, padding to ``payload_at``, then ``payload``) to the empty file
    ``fd``. Up to ``WRITE_CHUNK`` it is digested, then written in one ``writev``; larger
    payloads are written after the header's place in ``WRITE_CHUNK`` pieces, each digested
    just before (so the write copies it from the cache), and header and padding land last."""
    n = len(payload)
    pad = _PADDING[: payload_at(n) - HEADER_BYTES]
    if n <= WRITE_CHUNK:
        header = envelope.pack(namespace, key, n, envelope.digest(payload))
        writev_all(fd, [memoryview(header), pad, payload])
        return
    h = envelope.hasher()
    os.lseek(fd, payload_at(n), os.SEEK_SET)
    for off in range(0, n, WRITE_CHUNK):
        piece = payload[off : off + WRITE_CHUNK]
        h.update(piece)
        writev_all(fd, [piece])
    header = envelope.pack(namespace, key, n, h.intdigest()) + bytes(pad)
    if os.pwrite(fd, header, 0) != len(header):
        raise OSError(errno.EIO, "short header write")


_tag = ["", 0]  # process-unique prefix, pid it was made in
_tmp_seq = itertools.count()


def unique_tag() -> str:
    """A temp-name part no other write in this or another process uses: a random tag made
    once per process plus a counter (``next`` is atomic under the GIL), so a write costs no
    ``getrandom`` call."""
    if _tag[1] != os.getpid():
        _tag[:] = [uuid.uuid4().hex[:16], os.getpid()]
    return f"{_tag[0]}-{next(_tmp_seq)}"


_ROOT_FD = [-1, 0]  # a descriptor of "/", pid it was opened in
_ROOT_LOCK = threading.Lock()


def _link_anchor() -> int:
    """A directory descriptor to pass as ``os.link``'s ``dst_dir_fd``, so Python calls
    ``linkat`` with ``AT_SYMLINK_FOLLOW`` (plain ``link`` does not follow ``/proc/self/fd``'s
    links); destination paths are absolute, so the kernel ignores which directory it is."""
    if _ROOT_FD[1] != os.getpid():
        with _ROOT_LOCK:  # once per process: no descriptor leaked by racing threads
            if _ROOT_FD[1] != os.getpid():
                fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                _ROOT_FD[:] = [fd, os.getpid()]
    return _ROOT_FD[0]


_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_tmpfile_ok = [_O_TMPFILE != 0 and os.path.isdir("/proc/self/fd")]
"""Whether unnamed temp files are used (they are linked through ``/proc/self/fd``): cleared
the first time the kernel or file system refuses to make or link one, after which writes use
named temp files."""

_TMPFILE_REFUSED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.EXDEV, errno.EPERM)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _open_in(d: str, name: str | None) -> int:
    """Open a new file for writing in ``d`` (created if missing): unnamed (``O_TMPFILE``)
    when ``name`` is ``None``."""
    target, flags = (
        (d, _O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC) if name is None else (name, _CREATE)
    )
    try:
        return os.open(target, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(d, exist_ok=True)
        return os.open(target, flags, 0o666)


def _publish_unnamed(fd: int, path: str) -> bool:
    """Give the written unnamed file ``fd`` the name ``path`` (which then holds it whole);
    over an existing file through a named link and ``os.replace``, as the named path does.
    ``False`` when the file system refuses to link it: nothing was published."""
    src = f"/proc/self/fd/{fd}"
    # relative to the anchor ("/") a relative path would name another file
    path = path if os.path.isabs(path) else os.path.abspath(path)
    try:
        os.link(src, path, dst_dir_fd=_link_anchor(), follow_symlinks=True)
        return True
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno in _TMPFILE_REFUSED:
            return False
        raise
    tmp = _tmp_name(path)
    os.link(src, tmp, dst_dir_fd=_link_anchor(), follow_symlinks=True)
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    return True


def object_files(directory: str) -> tuple[list[tuple[int, str, int]], list[str]]:
    """The object files under a namespace ``directory``: ``(mtime_ns, key, size)`` of each
    (a file that vanishes meanwhile is left out), and the paths of unpublished temp files."""
    found: list[tuple[int, str, int]] = []
    temps: list[str] = []
    for sub in os.scandir(directory):
        if sub.name.startswith(".") or not sub.is_dir(follow_symlinks=False):
            continue  # hidden directories (packs) hold no object named by its key
        for entry in os.scandir(sub.path):
            if entry.name.endswith(TMP_SUFFIX):
                temps.append(entry.path)
            elif entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append((st.st_mtime_ns, entry.name, st.st_size))
    return found, temps


def _tmp_name(path: str) -> str:
    d, base = path.rsplit("/", 1)
    return f"{d}/.{base}.{unique_tag()}{TMP_SUFFIX}"


def write_object(
    path: str, namespace: str, key: str, payload: memoryview | np.ndarray, fsync: bool
) -> None:
    """Publish the object of ``key`` holding ``payload`` as the file ``path`` (``publish``,
    contents by ``_write_payload``)."""
    view = memoryview(payload)
    publish(path, lambda fd: _write_payload(fd, namespace, key, view), fsync)


def publish(path: str, write: Callable[[int], None], fsync: bool) -> None:
    """Publish the file ``path`` with the contents ``write(fd)`` puts in an empty file, so
    readers only ever see it whole: written to an unnamed file in the same directory
    (``O_TMPFILE``, created if missing), then linked as ``path``; where the file system has no
    unnamed files, to a named temp file then ``os.replace``d. An existing ``path`` is replaced
    atomically either way. With ``fsync`` the file and the directory are synced. On any
    failure nothing of it is left behind (the caller has not indexed it yet).

    An unnamed file costs no rename: 1-5 µs over a plain create-and-write of a 64 KiB file
    against 8-17 µs for temp file plus rename, measured interleaved on ext4 here."""
    d = path.rsplit("/", 1)[0]
    tmp: str | None = None
    fd = -1
    try:
        if _tmpfile_ok[0]:
            try:
                fd = _open_in(d, None)
            except OSError as e:
                if e.errno not in _TMPFILE_REFUSED:
                    raise
                _tmpfile_ok[0] = False
        if fd < 0:
            tmp = _tmp_name(path)
            fd = _open_in(d, tmp)
        try:
            write(fd)
            if fsync:
                os.fsync(fd)
            if tmp is None and not _publish_unnamed(fd, path):
                _tmpfile_ok[0] = False
                os.close(fd)
                fd = -1
                publish(path, write, fsync)
                return
        finally:
            if fd >= 0:
                os.close(fd)
        if tmp is not None:
            os.replace(tmp, path)
        if fsync:
            fsync_dir(d)
    except BaseException:
        if tmp is not None:
            unlink_quiet(tmp)
        unlink_quiet(path)
        raise
