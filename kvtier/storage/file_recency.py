"""Read recency of the local-file L3 backend, persisted without a syscall per object.

A restart rebuilds the LRU order from file mtimes. Writes set them; reads would need a
``utime`` per object (a tenth of a 64 KiB read here), so instead each ``batch_get`` appends
one record to a journal in the namespace directory: a timestamp and the keys it read. When
the journal grows past ``COMPACT_BYTES``, and on start-up, it is applied: every key it names
gets the latest time it was read as its object file's mtime (unless the file is newer:
rewritten or touched since; a packed key's file is its pack), then the journal is emptied. On
start-up the restart scan is ordered by its read times too (``read_times``) and it is applied
after the scan, once packed keys resolve to their packs.

Record: ``u64 time_ns | u32 count | count x (u8 length | key bytes)``, the ``i``-th key read
at ``time_ns + i``. A crash can tear the
last record; applying stops at the first record that does not parse. Recency is advisory: a
journal that cannot be written or read costs restart order, never objects.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.errors import RequestError

JOURNAL = ".recency"
"""Journal file name in the namespace directory (hidden: the scan skips it)."""

COMPACT_BYTES = 4 << 20
"""Journal size past which it is applied and emptied."""

_HEAD = struct.Struct("<QI")


def parse(raw: bytes) -> dict[str, int]:
    """Latest read time (ns) of every key in journal bytes ``raw``, up to the first record
    that does not parse; the ``i``-th key of a record was read at its time + ``i`` ns, so a
    batch's order survives."""
    last: dict[str, int] = {}
    off, end = 0, len(raw)
    while off + _HEAD.size <= end:
        ts, count = _HEAD.unpack_from(raw, off)
        pos = off + _HEAD.size
        keys: list[str] = []
        for _ in range(count):
            if pos >= end or pos + 1 + raw[pos] > end:
                return last
            keys.append(raw[pos + 1 : pos + 1 + raw[pos]].decode(errors="replace"))
            pos += 1 + raw[pos]
        for i, k in enumerate(keys):
            last[k] = ts + i
        off = pos
    return last


class RecencyJournal:
    """The journal of one namespace directory; ``path_of`` maps a key to its object file.
    Thread-safe."""

    def __init__(self, directory: str, path_of: Callable[[str], str]) -> None:
        self.path = os.path.join(directory, JOURNAL)
        self._path_of = path_of
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._bytes = 0
        self._last_ts = 0

    def record(self, keys: Sequence[str]) -> None:
        """Append one record: ``keys`` were read now (one ``write``)."""
        if not keys:
            return
        parts = [b""]
        for k in keys:
            raw = k.encode()
            parts.append(bytes((len(raw),)))
            parts.append(raw)
        with self._lock:
            # Strictly increasing, so no two keys of one process's records tie.
            ts = max(time.time_ns(), self._last_ts + 1)
            self._last_ts = ts + len(keys) - 1
            parts[0] = _HEAD.pack(ts, len(keys))
            data = b"".join(parts)
            try:
                if self._fd is None:
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                    self._fd = os.open(self.path, flags, 0o666)
                self._bytes += os.write(self._fd, data)
            except OSError:
                return
            if self._bytes > COMPACT_BYTES:
                self._apply_locked()

    def read_times(self) -> dict[str, int]:
        """The latest read time (ns) of every key the journal names (empty when it cannot be
        read); changes nothing."""
        try:
            with open(self.path, "rb") as f:
                return parse(f.read())
        except OSError:
            return {}

    def apply(self, times: dict[str, int] | None = None) -> None:
        """Set the mtimes the journal names (``times``: its :meth:`read_times`, read again
        when ``None``) and empty it (start-up, after the scan)."""
        with self._lock:
            self._apply_locked(times)

    def _apply_locked(self, times: dict[str, int] | None = None) -> None:
        if times is None:
            try:
                with open(self.path, "rb") as f:
                    times = parse(f.read())
            except OSError:
                return
        for key, ts in times.items():
            with contextlib.suppress(OSError, RequestError):
                path = self._path_of(key)
                if os.stat(path).st_mtime_ns < ts:
                    os.utime(path, ns=(ts, ts))
        with contextlib.suppress(OSError):
            os.truncate(self.path, 0)
        self._bytes = 0

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
