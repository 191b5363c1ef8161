"""Packs: the objects of one large ``batch_set`` round of small objects in one file.

A file per object costs a create and a link per write and an open and a close per read, which
bounded 64 KiB objects near 25 µs a read on one thread (``results/file-tier/README.md``, run
r). A pack holds many objects under ``<namespace>/.packs/<name>.pack``::

    pack header: magic "KVTP" | version u16 | count u32 | header XXH3-64 u64     (PACK_HEAD)
    count x object envelope header (``kvtier.storage.envelope``, HEADER_BYTES each)
    ceil(count / GROUP) x group digest u64: XXH3-64 of GROUP consecutive payloads
    zeros up to the next multiple of PAYLOAD_ALIGN                      (payloads_at(count))
    the payloads, in the same order, back to back

Object ``i``'s envelope header sits at ``PACK_HEAD + i * HEADER_BYTES``; its payload at
``payloads_at(count)`` plus the payloads before it. The envelope headers name namespace, key,
length and payload digest exactly as a single-object file's does, and are all verified before
a payload byte is read into a caller's buffer: a run of objects read back costs one header
read, one group-digest read and one payload read per group, whatever the number of objects.
Packs are published whole (``file_io.publish``) and never modified; they leave the tier whole.

Payloads start on a page boundary: the page cache copies page-aligned file ranges into
page-aligned buffers about a fifth faster than ranges 16 + 112 * count bytes off
(``results/file-tier/pack_read_scaling.py``). Version 1 packs, without the padding or group
digests, read as a ``format`` fault and are deleted at start-up.

Group digests are a shortcut, never the authority: a read of a whole group into back-to-back
buffers digests it with one call (which releases the GIL, where a 64 KiB payload's digest
holds it: four I/O threads digesting packed 64 KiB pages one by one ran no faster than two on
the 16-core host), and where that digest differs the objects' own digests decide.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.errors import KvtierError, StorageError
from kvtier.storage import envelope, file_io
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file_io import PAYLOAD_ALIGN, WRITE_CHUNK, CorruptObject, writev_all

_HEAD = struct.Struct("<4sHI")
_DIGEST = struct.Struct("<Q")
MAGIC = b"KVTP"
VERSION = 2
PACK_HEAD = _HEAD.size + _DIGEST.size
"""Bytes of a pack's own header."""
GROUP = 16
"""Objects per group digest, and the most objects one ``preadv`` of a run reads (a 64 KiB
page's group is 1 MiB: digested while still in the cache)."""
PACK_MIN_OBJECTS = 16
"""Rounds of at least this many objects to write are packed (when their objects are small)."""
IOV_MAX = 1024
"""Buffers one ``preadv``/``writev`` takes (Linux)."""
PACKS_DIR = ".packs"
"""Where packs live in a namespace directory (hidden: never an object's directory)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """Where one packed object is."""

    pack: str
    """Path of its pack."""
    number: int
    """Its place in the pack (0 first)."""
    payload_at: int
    """File offset of its payload."""
    count: int
    """Objects in its pack."""


class RunFault(KvtierError):
    """A read of a run of packed objects stopped at object ``at`` of the run, for ``cause``
    (what a single-object read of it would have raised)."""

    def __init__(self, at: int, cause: BaseException) -> None:
        super().__init__(at, cause)
        self.at = at
        self.cause = cause


def pack_name(directory: str) -> str:
    """A new pack's path under a namespace ``directory``. Names sort in write order (time,
    then this process's counter), which orders packs whose mtimes tie at a restart."""
    return f"{directory}/{PACKS_DIR}/{time.time_ns():020d}-{file_io.unique_tag()}.pack"


def _groups_at(count: int) -> int:
    return PACK_HEAD + count * HEADER_BYTES


def payloads_at(count: int) -> int:
    """File offset of the first payload of a pack of ``count`` objects."""
    end = _groups_at(count) + -(-count // GROUP) * _DIGEST.size
    return -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def places(path: str, payload_bytes: Sequence[int]) -> list[Packed]:
    """Where each object of the pack ``path`` of payloads ``payload_bytes`` long is."""
    count = len(payload_bytes)
    out: list[Packed] = []
    at = payloads_at(count)
    for n, length in enumerate(payload_bytes):
        out.append(Packed(path, n, at, count))
        at += length
    return out


def _pack_head(count: int) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, count)
    return head + _DIGEST.pack(xxhash.xxh3_64_intdigest(head))


def write_pack(
    fd: int, namespace: str, keys: Sequence[str], payloads: Sequence[memoryview]
) -> None:
    """Write the pack of ``payloads`` under ``keys`` to the empty file ``fd``: the payloads
    first, after the headers' place, digested (each, and each group) piece by piece just
    before they are written (so the write copies them from the cache), then the headers."""
    count = len(keys)
    os.lseek(fd, payloads_at(count), os.SEEK_SET)
    digests: list[int] = []
    groups: list[int] = []
    group = envelope.hasher()
    batch: list[memoryview] = []
    held = 0
    for n, payload in enumerate(payloads):
        digests.append(envelope.digest(payload))
        group.update(payload)
        if n % GROUP == GROUP - 1 or n == count - 1:
            groups.append(group.intdigest())
            group.reset()
        batch.append(payload)
        held += len(payload)
        if held >= WRITE_CHUNK or len(batch) == IOV_MAX:
            writev_all(fd, batch)
            batch, held = [], 0
    if batch:
        writev_all(fd, batch)
    heads = [_pack_head(count)]
    for key, payload, d in zip(keys, payloads, digests, strict=True):
        heads.append(envelope.pack(namespace, key, len(payload), d))
    heads.append(struct.pack(f"<{len(groups)}Q", *groups))
    # The padding written, not left a hole: a pack's bytes are all allocated when published.
    blob = b"".join(heads).ljust(payloads_at(count), b"\0")
    if os.pwrite(fd, blob, 0) != len(blob):
        raise OSError(5, "short pack header write")


def object_sizes(payload_bytes: Sequence[int]) -> list[int]:
    """Bytes each object of a pack is charged: its envelope header and payload, and the first
    also the pack header and the padding (so a pack's file size is the sum)."""
    sizes = [HEADER_BYTES + n for n in payload_bytes]
    if sizes:
        sizes[0] += payloads_at(len(sizes)) - len(sizes) * HEADER_BYTES
    return sizes


@dataclass(frozen=True, slots=True)
class PackScan:
    """What a start-up scan found in one pack: the objects it can serve and those it cannot.

    A damaged byte costs only the objects it is in: the pack header's count is recovered from
    the object headers when the pack header's own digest fails; an object whose envelope
    header fails is dropped alone, its neighbours located from the pack's start before it and
    from the file's end after it (objects between two damaged headers cannot be located and are
    dropped too); objects past the end of a file cut short are dropped. Payloads are not read
    here: a damaged payload is found, and dropped alone, by the first read of it."""

    objects: list[tuple[str, int, Packed]]
    """``(key, size charged, where)`` of every object served, in pack order."""
    dropped: list[tuple[int, str, str]]
    """``(object number, fault kind, detail)`` of every object dropped."""
    size: int
    """The pack file's size: what it holds on disk, served objects or not."""

    @property
    def dead_bytes(self) -> int:
        """Bytes of the file no served object is charged (dropped objects, a damaged tail)."""
        return self.size - sum(z for _, z, _ in self.objects)


_HEADER_CHUNK = 1024
"""Object headers read at a time while recovering a damaged pack header's count."""


def _verified_count(fd: int, size: int, namespace: str) -> int:
    """The number of objects of a pack whose own header's digest failed: the leading object
    headers that verify, if their objects account for the file's size exactly; else
    ``CorruptObject`` (the pack cannot be read)."""
    lengths: list[int] = []
    at = PACK_HEAD
    while at < size:
        raw = os.pread(fd, _HEADER_CHUNK * HEADER_BYTES, at)
        for i in range(len(raw) // HEADER_BYTES):
            h = raw[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
            try:
                length, _ = envelope.unpack(h, namespace, envelope.header_key(h))
            except StorageError:
                at = size
                break
            lengths.append(length)
        else:
            at += len(raw)
            if len(raw) < _HEADER_CHUNK * HEADER_BYTES:
                break
    if not lengths or sum(object_sizes(lengths)) != size:
        raise CorruptObject(
            "checksum", "pack header checksum mismatch, and its object headers do not add up"
        )
    return len(lengths)


def scan_pack(path: str, namespace: str) -> PackScan:
    """The objects of the pack ``path``, verified header by header and located against the
    file size (``PackScan``). Raises ``CorruptObject`` for a file that is no pack of this
    version (or whose count cannot be recovered), ``OSError`` when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, PACK_HEAD, 0)
        if len(head) < PACK_HEAD:
            raise CorruptObject("short_read", f"{len(head)}-byte pack header")
        magic, version, count = _HEAD.unpack_from(head)
        if (magic, version) != (MAGIC, VERSION):
            raise CorruptObject("format", f"pack magic/version {magic!r}/{version}")
        if xxhash.xxh3_64_intdigest(head[: _HEAD.size]) != _DIGEST.unpack_from(head, _HEAD.size)[0]:
            count = _verified_count(fd, size, namespace)
        heads = os.pread(fd, count * HEADER_BYTES, PACK_HEAD)
    finally:
        os.close(fd)
    keys: list[str] = []
    lengths: list[int | None] = []
    bad: dict[int, tuple[str, str]] = {}
    for i in range(count):
        h = heads[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
        key = envelope.header_key(h) if len(h) == HEADER_BYTES else ""
        try:
            length, _ = envelope.unpack(h, namespace, key)
        except StorageError as e:
            bad[i] = (e.kind, e.detail)
            length = None
        keys.append(key)
        lengths.append(length)
    return PackScan(*_locate(path, keys, lengths, bad, size), size=size)


def _locate(
    path: str,
    keys: list[str],
    lengths: list[int | None],
    bad: dict[int, tuple[str, str]],
    size: int,
) -> tuple[list[tuple[str, int, Packed]], list[tuple[int, str, str]]]:
    """Where each object whose header verified lies (``PackScan``): from the payloads' start up
    to the first damaged header, from the file's end back to the last one."""
    count = len(keys)
    sizes = object_sizes([n or 0 for n in lengths])
    first = min(bad, default=count)
    last = max(bad, default=count)
    at: list[int | None] = [None] * count
    pos = payloads_at(count)
    for i in range(first):
        at[i], pos = pos, pos + lengths[i]  # type: ignore[operator]
    front_end = pos
    if bad:
        end = size
        for i in range(count - 1, last, -1):
            end -= lengths[i]  # type: ignore[operator]
            if end < front_end:
                break  # the file is shorter than the objects around the damage: not locatable
            at[i] = end
    objects: list[tuple[str, int, Packed]] = []
    dropped: list[tuple[int, str, str]] = []
    cause = bad[first] if bad else ("short_read", "")
    for i in range(count):
        if i in bad:
            dropped.append((i, *bad[i]))
        elif at[i] is None:
            dropped.append((i, cause[0], "its place is lost with a damaged header before it"))
        elif at[i] + lengths[i] > size:  # type: ignore[operator]
            dropped.append((i, "short_read", "pack ends inside the object"))
        else:
            objects.append((keys[i], sizes[i], Packed(path, i, at[i], count)))  # type: ignore[arg-type]
    return objects, dropped


def read_run(
    first: Packed,
    namespace: str,
    keys: Sequence[str],
    prefixes: Sequence[bytes],
    dests: Sequence[memoryview | np.ndarray],
    joined: memoryview | None = None,
) -> None:
    """Fill ``dests`` with the payloads of ``keys``, consecutive objects of one pack starting
    at ``first``, verifying every header before any payload is read and every payload as it
    lands (``prefixes[i]`` is ``envelope.expected_prefix`` of key ``i`` and its buffer size).
    ``joined``: one view of all of ``dests``, when they lie back to back (then a whole group
    is checked against its group digest in one call first).

    Raises ``RunFault`` at the first object that is not a whole, intact object of its key
    (``cause``: ``CorruptObject``, or ``StorageError`` ``checksum`` for a buffer of another
    size); the objects before it are filled and verified. ``OSError`` when the pack cannot be
    opened or read."""
    m = len(keys)
    sizes = [d.nbytes for d in dests]
    digest = envelope.digest
    # Pieces end at group boundaries, so a piece is a whole group unless the run starts or
    # ends inside one:  object   first.number + i ... first.number + j - 1
    #                   group    (first.number + i) // GROUP, whole when it starts there and
    #                            j reaches the group's end (or the pack's)
    base = first.number
    fd = os.open(first.pack, os.O_RDONLY | os.O_CLOEXEC)
    try:
        heads = os.pread(fd, m * HEADER_BYTES, PACK_HEAD + base * HEADER_BYTES)
        wants = envelope.payload_digests(heads, prefixes)
        good = len(wants)
        g0 = base // GROUP
        groups = _group_digests(fd, first.count, g0, base + good) if joined is not None else ()
        at, offset, i = first.payload_at, 0, 0
        while i < good:
            j = min(good, i + GROUP - (base + i) % GROUP)
            nbytes = sum(sizes[i:j])
            got = os.preadv(fd, dests[i:j], at)
            whole = j
            if got < nbytes:  # only the pack's end is short: the objects before it count
                whole = i
                while got >= sizes[whole]:
                    got -= sizes[whole]
                    whole += 1
            g = (base + i) // GROUP - g0
            if not (
                whole == j
                and g < len(groups)
                and (base + i) % GROUP == 0
                and (j - i == GROUP or base + j == first.count)
                and digest(joined[offset : offset + nbytes]) == groups[g]  # type: ignore[index]
            ):
                digests = [digest(d) for d in dests[i:whole]]
                if digests != wants[i:whole]:
                    k = next(k for k in range(i, whole) if digests[k - i] != wants[k])
                    raise RunFault(k, CorruptObject("checksum", "payload checksum mismatch"))
            if whole < j:
                raise RunFault(whole, CorruptObject("short_read", "pack ends inside the object"))
            at += nbytes
            offset += nbytes
            i = j
    finally:
        os.close(fd)
    if good < m:
        head = heads[good * HEADER_BYTES : (good + 1) * HEADER_BYTES]
        raise RunFault(good, _header_fault(head, namespace, keys[good], dests[good]))


def _group_digests(fd: int, count: int, g0: int, end: int) -> tuple[int, ...]:
    """The digests of groups ``g0`` up to the one holding object ``end - 1`` of a pack of
    ``count`` objects (fewer where the file is short: those groups go unchecked)."""
    n = max(0, -(-end // GROUP) - g0)
    raw = os.pread(fd, n * _DIGEST.size, _groups_at(count) + g0 * _DIGEST.size)
    whole = len(raw) // _DIGEST.size
    return struct.unpack(f"<{whole}Q", raw[: whole * _DIGEST.size])


def _header_fault(
    head: bytes, namespace: str, key: str, dest: memoryview | np.ndarray
) -> BaseException:
    """Why the header of ``key``'s object did not match what ``dest`` expects."""
    try:
        length, _ = envelope.unpack(head, namespace, key)
    except StorageError as e:
        return CorruptObject(e.kind, e.detail)
    return StorageError("checksum", f"stored payload is {length} bytes, buffer {dest.nbytes}")
