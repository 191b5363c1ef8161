"""Local-file L3 backend: one file per object under ``root/<namespace>/<key[:2]>/<key>``.

Each file is an envelope (``kvtier.storage.envelope``: a header naming the namespace and key,
with checksums of header and payload) followed by the payload bytes. Writes go to a temp file in the same directory and are published
with ``os.replace``, so readers only ever see whole objects. A byte budget with LRU eviction
bounds the disk use; the index is rebuilt from the directory (oldest mtime first) on start-up.
One process owns a namespace directory at a time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.base import StorageBackend, StorageCapabilities

if TYPE_CHECKING:
    from kvtier.config import CacheConfig

HEADER_BYTES = envelope.HEADER_BYTES
"""Bytes a stored object takes beyond its payload (the envelope header)."""
_TMP_SUFFIX = ".tmp"
_POOL_CRC_BYTES = 256 << 10


class _Fault(Exception):
    """A storage fault of ``kind`` on one object; ``corrupt`` objects are deleted."""

    def __init__(self, kind: str, message: str, corrupt: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.corrupt = corrupt


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 numpy array (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"storage buffers must be contiguous CPU tensors, got {tensor.device} "
            f"stride={tuple(tensor.stride())}"
        )
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _write_all(f: object, data: memoryview) -> None:
    """Write all of ``data`` to the unbuffered file ``f``."""
    while data:
        n = f.write(data)  # type: ignore[attr-defined]
        data = data[n:]


def _readinto_all(f: object, dest: memoryview) -> int:
    """Fill ``dest`` from the unbuffered file ``f``; returns the bytes read (short at EOF)."""
    done = 0
    while done < len(dest):
        n = f.readinto(dest[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _result(value: Future[int] | int) -> int:
    return value if isinstance(value, int) else value.result()


def _check_lengths(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> None:
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")


def _os_kind(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "io"


class FileBackend(StorageBackend):
    """Objects as files in a local directory, bounded by ``budget_bytes`` (file sizes including
    headers) with least-recently-used eviction. Persistent across restarts on the same dir.

    Thread-safe: one lock guards the index; reads and writes of object files happen outside it.
    """

    name = "file"
    capabilities = StorageCapabilities(
        page_spans=True, zero_copy=True, persistent=True, shared_across_hosts=False
    )

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        budget_bytes: int,
        fsync: bool = False,
    ) -> None:
        """Create ``root/<namespace>`` and index what it holds.

        Raises ``ConfigError`` (naming ``storage_dir``/``storage_bytes``) when the directory
        cannot be created or written, or the budget is not positive.
        """
        super().__init__()
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"storage_bytes must be a positive integer, got {budget_bytes!r}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.dir = os.path.join(self.root, namespace)
        self.budget_bytes = budget_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._pool: ThreadPoolExecutor | None = None
        probe = os.path.join(self.dir, f".probe-{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(probe, "xb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"storage_dir={self.root!r}: cannot create or write {self.dir!r}: {e.strerror or e}"
            ) from e
        self._scan()

    @classmethod
    def from_config(cls, config: CacheConfig, namespace: Namespace) -> FileBackend:
        """Backend for ``config.storage_dir`` with budget ``config.storage_bytes``."""
        return cls(config.storage_dir, namespace, config.storage_bytes)

    def _path(self, key: str) -> str:
        if not key or key.startswith(".") or "/" in key or os.sep in key:
            raise ValueError(f"invalid storage key {key!r}")
        return os.path.join(self.dir, key[:2], key)

    def _scan(self) -> None:
        found: list[tuple[int, str, int]] = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    # Left by a write that died before os.replace: never a whole object.
                    _unlink_quiet(entry.path)
                elif entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
            self._evict_locked(0)

    def _evict_locked(self, incoming: int) -> None:
        """Drop LRU objects until ``incoming`` more bytes fit. Unlinks under the lock so a
        concurrent re-store of a victim key cannot lose its fresh file."""
        while self._index and self._used + incoming > self.budget_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._evictions += 1
            _unlink_quiet(self._path(key))

    def _forget(self, key: str, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            if delete:
                _unlink_quiet(self._path(key))

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Length of the leading run of ``keys`` in the index; hits become most recent."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._index:
                    break
                self._index.move_to_end(key)
                n += 1
        return n

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Read and verify objects into ``buffers`` in order; stops at the first miss or fault.

        Faults: ``short_read`` (truncated file), ``checksum`` (bad magic/version/size/crc, or a
        buffer whose size differs from the stored payload), ``permission``/``io`` (OS errors).
        Corrupt or truncated objects are deleted so later lookups miss them.
        """
        _check_lengths(keys, buffers)
        # Checksums of large pages run on worker threads, overlapping the next page's read.
        checks: list[tuple[str, str, Future[int] | int, int]] = []
        for key, dest in zip(keys, [_bytes_view(b) for b in buffers], strict=True):
            with self._lock:
                if key not in self._index:
                    break
                self._index.move_to_end(key)
            path = self._path(key)
            try:
                want = self._read(path, key, dest)
            except FileNotFoundError:
                self._forget(key, delete=False)
                break
            except _Fault as f:
                self.fault(f.kind, f"{path}: {f}")
                if f.corrupt:
                    self._forget(key, delete=True)
                break
            except OSError as e:
                self.fault(_os_kind(e), f"read {path}: {e}")
                break
            checks.append((key, path, self._crc(dest), want))
        n = 0
        for key, path, got, want in checks:
            if _result(got) != want:
                self.fault("checksum", f"{path}: payload crc32 mismatch")
                self._forget(key, delete=True)
                break
            with contextlib.suppress(OSError):
                # Persist recency so a restart rebuilds the LRU order from mtimes.
                os.utime(path)
            n += 1
        return n

    def _crc(self, data: np.ndarray) -> Future[int] | int:
        """crc32 of ``data``; large buffers go to worker threads (zlib releases the GIL)."""
        if data.nbytes < _POOL_CRC_BYTES:
            return zlib.crc32(memoryview(data))
        with self._lock:
            if self._pool is None:
                workers = min(4, os.cpu_count() or 1)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-file-crc")
            pool = self._pool
        return pool.submit(zlib.crc32, memoryview(data))

    def close(self) -> None:
        """Stop the checksum threads; the backend is not used afterwards."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _read(self, path: str, key: str, dest: np.ndarray) -> int:
        """Fill ``dest`` with the payload at ``path`` after verifying the envelope header and
        sizes; returns the stored payload crc32 for the caller to verify."""
        with open(path, "rb", buffering=0) as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_BYTES)
            try:
                length, crc = envelope.unpack(head, self.namespace, key)
            except envelope.EnvelopeError as e:
                raise _Fault(e.kind, str(e), corrupt=True) from None
            if file_size < HEADER_BYTES + length:
                raise _Fault(
                    "short_read",
                    f"file has {file_size - HEADER_BYTES} of {length} payload bytes",
                    corrupt=True,
                )
            if file_size > HEADER_BYTES + length:
                raise _Fault(
                    "checksum", f"file size {file_size} exceeds header + {length}", corrupt=True
                )
            if length != dest.nbytes:
                raise _Fault("checksum", f"stored payload is {length} bytes, buffer {dest.nbytes}")
            got = _readinto_all(f, memoryview(dest))
        if got != length:
            raise _Fault("short_read", f"read {got} of {length} payload bytes", corrupt=True)
        return crc

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store ``buffers`` under ``keys`` in order, evicting LRU objects to fit the budget;
        stops at the first fault (``no_space``, ``permission``, ``io``).

        Keys already stored are not rewritten and count as stored (and become most recent).
        """
        _check_lengths(keys, buffers)
        payloads = [_bytes_view(b) for b in buffers]
        with self._lock:
            stored = [k in self._index for k in keys]
        # Checksums of later pages are computed while earlier pages are being written.
        crcs = [None if have else self._crc(p) for have, p in zip(stored, payloads, strict=True)]
        n = 0
        for key, payload, crc in zip(keys, payloads, crcs, strict=True):
            size = HEADER_BYTES + payload.nbytes
            path = self._path(key)
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    n += 1
                    continue
                fits = size <= self.budget_bytes
                if fits:
                    self._evict_locked(size)
                    # Reserve the bytes now so concurrent writers cannot overshoot the budget.
                    self._used += size
            if not fits:
                self.fault("no_space", f"{size}-byte object exceeds budget {self.budget_bytes}")
                break
            try:
                self._write(path, key, payload, _result(self._crc(payload) if crc is None else crc))
            except OSError as e:
                with self._lock:
                    self._used -= size
                self.fault(_os_kind(e), f"write {path}: {e}")
                break
            with self._lock:
                if key in self._index:
                    self._used -= size
                else:
                    self._index[key] = size
            n += 1
        return n

    def _write(self, path: str, key: str, payload: np.ndarray, crc: int) -> None:
        header = envelope.pack(self.namespace, key, payload.nbytes, crc)
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            with open(tmp, "xb", buffering=0) as f:
                _write_all(f, memoryview(header))
                _write_all(f, memoryview(payload))
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(d)
        except BaseException:
            # The key is not indexed yet, so whatever reached the disk is ours to remove.
            _unlink_quiet(tmp)
            _unlink_quiet(path)
            raise

    def stats(self) -> dict[str, float]:
        """``bytes_used``, ``objects``, ``budget_bytes`` and ``evictions`` so far."""
        with self._lock:
            return {
                "bytes_used": self._used,
                "objects": len(self._index),
                "budget_bytes": self.budget_bytes,
                "evictions": self._evictions,
            }

    def keys(self) -> list[str]:
        """Stored keys, least recently used first (for inspection and tests)."""
        with self._lock:
            return list(self._index)
