"""Local-file L3 backend: an object is a file of its own, ``root/<namespace>/<key[:2]>/<key>``,
or, written in a round of many small objects, one object of a pack (``kvtier.storage.file_pack``,
under ``root/<namespace>/.packs/``), which is written, read back by runs and evicted whole.

Each object is an envelope (``kvtier.storage.envelope``: a header naming the namespace and key,
with checksums of header and payload) and its payload bytes. Writes go to an unnamed file in
the same directory, then linked under the file's name (where the file system refuses that, a
named temp file and ``os.replace``), so readers only ever see whole files. A byte budget with
LRU eviction bounds the disk use (a full disk lowers it to what the disk held); the index is
rebuilt from the directory on start-up (``kvtier.storage.file_layout``), least recent first
by mtime or a later read in the read-recency journal (``kvtier.storage.file_recency``); a
pack's objects take the pack's recency. Files removed behind the index's back (another
process, an operator) leave it when a read, touch or backup finds them gone.

The budget is the directory's. Under context parallelism every rank's backend opens the same
namespace directory, writes its own objects and keeps within ``storage_bytes / cp_size``: it
charges its own writes their size and the objects its start-up scan found (every rank's) their
``cp_size``-th share (``FileIndex``), so the directory holds at most ``storage_bytes`` however
the ranks' writes and evictions interleave. (A rank evicting a found object deletes it for
all; the others' reads of it are counted misses.)
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import ConfigError, IntegrityError, RequestError, StorageError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope, file_layout
from kvtier.storage.base import (
    StorageBackend,
    StorageCapabilities,
    check_lengths,
    cpu_byte_views,
    joined_view,
)
from kvtier.storage.file_index import FileIndex
from kvtier.storage.file_io import (
    TMP_SUFFIX,
    CorruptObject,
    file_bytes,
    os_kind,
    publish,
    read_object,
    unlink_quiet,
    write_object,
)
from kvtier.storage.file_pack import (
    PACK_MIN_OBJECTS,
    object_sizes,
    pack_name,
    places,
    read_run,
    write_pack,
)
from kvtier.storage.file_pool import (
    NOT_RUN,
    POOL_MIN_OBJECT_BYTES,
    BatchProgress,
    OrderedIO,
    leading,
)
from kvtier.storage.file_recency import RecencyJournal

if TYPE_CHECKING:
    from kvtier.config import CacheConfig

HEADER_BYTES = envelope.HEADER_BYTES
"""Bytes a stored object takes beyond its payload (the envelope header)."""

_Planned = tuple[str, str, int, "memoryview | None"]
"""An object of a ``batch_set`` round: key, path, size, payload (``None``: already stored)."""


class FileBackend(StorageBackend):
    """Objects as files in a local directory, bounded by ``budget_bytes`` (file sizes including
    headers) with LRU eviction; persistent across restarts on the same dir. Thread-safe: one
    lock guards the index (``FileIndex``); reads and writes of object files happen outside
    it."""

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
        io_threads: int | None = None,
        sharers: int = 1,
    ) -> None:
        """Create ``root/<namespace>`` and index what it holds; large batches run on
        ``io_threads`` threads including the caller's (default: one per core, at most 4; 1:
        all on the calling thread). ``budget_bytes`` bounds the directory, which ``sharers``
        processes (a context-parallel group) share: this one keeps within
        ``budget_bytes // sharers`` (see the module).

        Raises ``ConfigError`` (naming ``storage_dir``/``storage_bytes``/``io_threads``/
        ``cp_size``) when the directory cannot be created or written, or the budget, thread
        count or sharers is not positive, or the budget is under one byte per sharer.
        """
        super().__init__()
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"storage_bytes must be a positive integer, got {budget_bytes!r}")
        if isinstance(sharers, bool) or not isinstance(sharers, int) or sharers <= 0:
            raise ConfigError(f"cp_size must be a positive integer, got {sharers!r}")
        if budget_bytes < sharers:
            raise ConfigError(
                f"storage_bytes={budget_bytes} leaves no budget for each of cp_size={sharers} ranks"
            )
        # absolute: publishing links to absolute paths, and a later chdir must not move the tier
        self.root = os.path.abspath(os.fspath(root))
        self.namespace = namespace
        self.dir = os.path.join(self.root, namespace)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index = FileIndex(budget_bytes // sharers, self._path, self.dir, sharers)
        threads = min(4, os.cpu_count() or 1) if io_threads is None else io_threads
        self._io = OrderedIO(threads, "kvtier-file")
        probe = os.path.join(self.dir, f".probe-{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(probe, "xb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"storage_dir={self.root!r}: cannot create or write {self.dir!r}: {e.strerror or e}"
            ) from e
        self._recency = RecencyJournal(self.dir, self._index.file_of)
        # The journal orders the scan, and is applied after it: only then does a packed
        # key resolve to its pack, whose mtime its reads must move.
        read_ns = self._recency.read_times()
        self._scan(read_ns)
        self._recency.apply(read_ns)

    @classmethod
    def from_config(cls, config: CacheConfig, namespace: Namespace) -> FileBackend:
        """Backend for ``config.storage_dir`` with budget ``config.storage_bytes``, shared by
        the ``config.cp_size`` ranks of a context-parallel group."""
        return cls(config.storage_dir, namespace, config.storage_bytes, sharers=config.cp_size)

    def _path(self, key: str) -> str:
        """Where ``key``'s object lives; raises ``RequestError`` naming a key that is empty,
        hidden or holds a path separator (it would name a file outside the namespace)."""
        if not key or key[0] == "." or "/" in key or os.sep in key:
            raise RequestError(f"invalid storage key {key!r}: empty, hidden or a path")
        return f"{self.dir}/{key[:2]}/{key}"

    @property
    def budget_bytes(self) -> int:
        """This process's byte budget (``storage_bytes // sharers``; lowered to what the disk
        held when it fills up)."""
        return self._index.budget_bytes

    def _scan(self, read_ns: dict[str, int]) -> None:
        found = file_layout.scan(self.dir, self.namespace, read_ns)
        with self._lock:
            for key, size, where in found.objects:
                self._index.add(key, size, where)
            for pack, size in found.dead.items():
                self._index.add_dead(pack, size)
            self._index.evict(0)
        # Each damaged object the scan dropped is a miss to come: counted like a read's.
        for kind, detail in found.faults:
            self.fault(kind, detail)

    def _forget(self, key: str, delete: bool) -> None:
        with self._lock:
            if key in self._index:
                self._index.drop(key, delete)
            elif delete:
                unlink_quiet(self._path(key))

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Length of the leading run of ``keys`` in the index; hits become most recent."""
        with self._lock:
            return self._index.leading(keys)

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Read and verify objects into ``buffers``; returns the leading count read and
        verified, stopping at the first miss or fault. Large batches run on the I/O threads
        (``OrderedIO``); all reads have ended when this returns.

        Faults: ``missing`` (indexed, file removed behind the index), ``short_read``
        (truncated), ``format`` (another envelope version), ``checksum`` (bad digest or size,
        or a buffer of another size than the payload), ``permission``/``io`` (OS errors). Only
        the first failure in key order counts; objects past it are not looked at again. A
        failed object leaves the index (and ``bytes_used``), so the next backup of its key
        writes it again; corrupt or truncated files are deleted. A damaged object of a pack
        leaves alone (``FileIndex.discard``): the pack's other objects stay readable (a pack
        cut short inside an object loses the objects after it too, each counted).
        """
        check_lengths(keys, buffers)
        dests = cpu_byte_views(buffers)
        whole = joined_view(dests)
        with self._lock:
            run = self._index.leading(keys)
            sizes = [d.nbytes for d in dests[:run]]
            paths, runs = file_layout.reads(keys[:run], self._index.where, self._path, sizes)
        ns = self.namespace

        def read(j: int) -> None:
            lo, hi, first = runs[j]
            # Each read builds its own expected headers: built up front, they were serial work
            # on the calling thread before any I/O thread started.
            prefixes = [
                envelope.expected_prefix(ns, keys[i], dests[i].nbytes) for i in range(lo, hi)
            ]
            if first is None:
                read_object(paths[lo], ns, keys[lo], prefixes[0], dests[lo])
            else:
                size = dests[lo].nbytes  # all of one size where they are joined
                joined = None if whole is None else whole[lo * size : hi * size]
                read_run(first, ns, keys[lo:hi], prefixes, dests[lo:hi], joined)

        by_run = self._io.run_ordered(read, len(runs), sum(sizes))
        outcomes = file_layout.per_key(runs, by_run, run)
        n = leading(outcomes)
        # Persists recency so a restart rebuilds the LRU order (one append per batch).
        self._recency.record(keys[:n])
        if n == run:
            return n
        key, path, failure = keys[n], paths[n], outcomes[n]
        if isinstance(failure, FileNotFoundError):
            self._drop_vanished(key)  # or evicted meanwhile: a plain miss
        elif isinstance(failure, StorageError):
            self.fault(failure.kind, f"{path}: {failure.detail}")
            if isinstance(failure, CorruptObject):
                # Only the damaged object goes (a pack keeps the others); a pack cut short
                # inside it loses the objects after it too, each counted.
                cut = failure.kind == "short_read"
                with self._lock:
                    size = _size_now(self._index.file_of(key)) if cut else None
                    gone = self._index.discard(key, cut, size)
                    if not gone:  # evicted meanwhile
                        unlink_quiet(self._path(key))
                for _ in range(gone - 1):
                    self.fault(failure.kind, f"{path}: {failure.detail}")
        elif isinstance(failure, OSError):
            # Unreadable now, so not stored as far as lookups go: the next backup rewrites it.
            self.fault(os_kind(failure), f"read {path}: {failure}")
            self._forget(key, delete=False)
        elif failure is not None:
            raise failure
        return n

    def close(self) -> None:
        """Stop the I/O threads and close the recency journal; the backend is not used
        afterwards."""
        self._io.close()
        self._recency.close()

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store ``buffers`` under ``keys``, evicting LRU objects to fit the budget; returns
        the leading count stored, stopping at the first fault (``no_space``, ``permission``,
        ``io``). Rounds: objects are reserved in key order while they fit beside the round's
        own writes, written (large rounds on the I/O threads; a round of at least
        ``file_pack.PACK_MIN_OBJECTS`` objects under 128 KiB on average as one pack, stored
        or failed whole), indexed.

        Only the first fault in key order counts; objects past it already written stay stored
        (not counted). Stored keys are not rewritten and count as stored (and become most
        recent) unless their file is gone (``missing``). A full disk (``ENOSPC``/``EDQUOT``)
        lowers the budget to what the disk held and evicts LRU objects, retrying until the
        write fits or nothing is left to evict.
        """
        check_lengths(keys, buffers)
        payloads = cpu_byte_views(buffers)
        state = BatchProgress()
        i = 0
        while i < len(keys) and not state.failed:
            plan, refused = self._plan(keys, payloads, i)
            i += len(plan)
            self._write_round(plan, state)
            if refused is not None and not state.failed:
                self.fault(refused.kind, refused.detail)
                state.failed = True
        return state.done

    def _plan(
        self, keys: Sequence[PageKey], payloads: list[memoryview], start: int
    ) -> tuple[list[_Planned], StorageError | None]:
        """Reserve the bytes of objects from ``start`` on in key order, until one does not fit
        beside this round's reservations; returns ``(key, path, size, payload)`` for each
        (``payload`` ``None`` when already stored) and the fault of an object no budget fits."""
        plan: list[_Planned] = []
        writes = 0
        for key, payload in zip(keys[start:], payloads[start:], strict=True):
            size = file_bytes(payload.nbytes)
            path = self._path(key)
            self._drop_vanished(key)
            with self._lock:
                index = self._index
                if index.hit(key):
                    plan.append((key, path, size, None))
                    continue
                if size > index.budget_bytes:
                    return plan, StorageError(
                        "no_space", f"{size}-byte object exceeds budget {index.budget_bytes}"
                    )
                # Reserved now so concurrent writers cannot overshoot the budget.
                if not index.reserve(size, round_holds=writes > 0):
                    return plan, None
            plan.append((key, path, size, payload))
            writes += 1
        return plan, None

    def _write_round(self, plan: list[_Planned], state: BatchProgress) -> None:
        """Write the reserved objects of ``plan`` (as one pack when there are many small
        ones), index those written, return the reservations of the rest, and count the first
        fault."""

        def write(i: int) -> None:
            key, path, size, payload = plan[i]
            if payload is not None:
                self._write_reserved(path, key, payload, size)

        fresh = [i for i, (*_, p) in enumerate(plan) if p is not None]
        nbytes = sum(plan[i][3].nbytes for i in fresh)  # type: ignore[union-attr]
        outcomes = None
        if len(fresh) >= PACK_MIN_OBJECTS and nbytes < len(fresh) * POOL_MIN_OBJECT_BYTES:
            outcomes = self._write_pack(plan, fresh)
        if outcomes is None:
            outcomes = self._io.run_ordered(write, len(plan), nbytes)
            self._index_written(plan, outcomes)
        for (_, path, _, _), outcome in zip(plan, outcomes, strict=True):
            if outcome is None:
                state.done += 0 if state.failed else 1
            elif not state.failed:
                state.failed = True
                if not isinstance(outcome, OSError):
                    raise outcome
                self.fault(os_kind(outcome), f"write {path}: {outcome}")

    def _index_written(self, plan: list[_Planned], outcomes: list[BaseException | None]) -> None:
        """Index the objects of ``plan`` written to their own files; return the reservations
        of those not written and of keys indexed meanwhile (or twice in the round)."""
        with self._lock:
            for (key, _, size, payload), outcome in zip(plan, outcomes, strict=True):
                if outcome is None and payload is not None:
                    self._index.settle(key, size)
                elif outcome is NOT_RUN:
                    self._index.release(size)

    def _write_pack(
        self, plan: list[_Planned], fresh: list[int]
    ) -> list[BaseException | None] | None:
        """Write the reserved objects ``fresh`` of ``plan`` as one pack and index them; returns
        each object's outcome. A key twice in the round is packed once; the pack header's
        bytes are reserved here; a full disk shrinks the budget and evicts before each retry,
        as for single objects. ``None`` (nothing written) when the budget has no room for the
        pack header."""
        seen: set[str] = set()
        packed: list[int] = []
        for i in fresh:
            if plan[i][0] not in seen:
                seen.add(plan[i][0])
                packed.append(i)
        keys = [plan[i][0] for i in packed]
        payloads: list[memoryview] = [plan[i][3] for i in packed]  # type: ignore[misc]
        sizes = object_sizes([p.nbytes for p in payloads])
        path = pack_name(self.dir)
        total = sum(sizes)
        reserved = sum(plan[i][2] for i in fresh)
        with self._lock:
            # The round reserved every fresh object's size; the pack's is ``total``.
            if not self._index.exchange(reserved, total):  # no room for the pack header
                return None
        outcomes: list[BaseException | None] = [None] * len(plan)
        try:
            self._write_reserved(
                path,
                keys[0],
                payloads[0],
                total,
                lambda fd: write_pack(fd, self.namespace, keys, payloads),
            )
        except OSError as e:
            for i in fresh:
                outcomes[i] = e
            return outcomes
        where = places(path, [p.nbytes for p in payloads])
        with self._lock:
            self._index.add_pack(path, keys, sizes, where)
        return outcomes

    def _drop_vanished(self, key: str) -> bool:
        """If ``key`` is indexed but its file is gone (removed behind the index), drop it from
        the index, count it ``missing`` and return True. Checked under the lock, which eviction
        also unlinks under, so an object evicted meanwhile is not taken for a vanished one."""
        with self._lock:
            if key not in self._index:
                return False
            path = self._index.file_of(key)
            if os.path.exists(path):
                return False
            self._index.drop(key, False)
        self.fault("missing", f"{path}: indexed object file is gone")
        return True

    def _write_reserved(
        self,
        path: str,
        key: str,
        payload: memoryview,
        size: int,
        contents: Callable[[int], None] | None = None,
    ) -> None:
        """Write one object (or, given ``contents``, the file ``contents(fd)`` writes) whose
        ``size`` bytes are reserved in the index; on failure the reservation is returned and
        the ``OSError`` raised. A full disk shrinks the budget and evicts before each retry."""
        while True:
            try:
                if contents is None:
                    self._write(path, key, payload)
                else:
                    publish(path, contents, self.fsync)
                return
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                with self._lock:
                    retry = self._index.write_failed(size, full)
                if not retry:
                    raise

    def touch(self, keys: Sequence[PageKey]) -> int:
        """Mark the leading run of ``keys`` whose objects exist as most recently used, in the
        index and in the files' mtimes (a restart rebuilds the same order); returns its length.
        An indexed key whose file is gone leaves the index (counted ``missing``)."""
        n = 0
        for key in keys:
            with self._lock:
                if not self._index.hit(key):
                    break
                path = self._index.file_of(key)
            try:
                os.utime(path)
            except FileNotFoundError:
                self._drop_vanished(key)
                break
            except OSError as e:
                # mtime is only the restart order; the object itself is still readable.
                self.fault(os_kind(e), f"utime {path}: {e}")
            n += 1
        return n

    def _write(self, path: str, key: str, payload: memoryview) -> None:
        write_object(path, self.namespace, key, payload, self.fsync)

    def stats(self) -> dict[str, float]:
        """``bytes_used``, ``objects``, ``budget_bytes`` and ``evictions`` so far."""
        with self._lock:
            return {
                "bytes_used": self._index.used,
                "objects": len(self._index),
                "budget_bytes": self._index.budget_bytes,
                "evictions": self._index.evictions,
            }

    def check_integrity(self) -> None:
        """Between batches: the bytes in use are what the indexed objects are charged and
        within the budget (``FileIndex.check_integrity``), and disk and index agree
        (``file_layout.disagreements``; in a directory shared by several ranks, on the indexed
        files still there). (A file the index dropped may remain: one unreadable when read is
        left for the next backup of its key to replace.) Raises ``IntegrityError``."""
        with self._lock:
            self._index.check_integrity()
            index, where, packs, dead = self._index.snapshot()
        shared = self._index.sharers > 1
        odd = file_layout.disagreements(self.dir, index, where, packs, shared, dead)
        if odd:
            raise IntegrityError(f"file backend: files and index disagree, e.g. {odd}")

    def keys(self) -> list[str]:
        """Stored keys, least recently used first (for inspection and tests)."""
        with self._lock:
            return self._index.keys()


def _size_now(path: str) -> int | None:
    """The size of the file at ``path``, ``None`` when it cannot be had."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None
