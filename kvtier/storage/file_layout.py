"""Where the local-file L3 backend's objects are on disk: its restart scan, the reads a
``batch_get`` makes, and the check of disk against index (``FileBackend.check_integrity``).

An object is either a file of its own, ``<namespace>/<key[:2]>/<key>``, or one object of a
pack (``kvtier.storage.file_pack``) under ``<namespace>/.packs/``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.storage.base import log
from kvtier.storage.file_io import TMP_SUFFIX, CorruptObject, object_files, unlink_quiet
from kvtier.storage.file_pack import GROUP, PACKS_DIR, Packed, PackScan, RunFault, scan_pack
from kvtier.storage.file_pool import NOT_RUN

Run = tuple[int, int, "Packed | None"]
"""Keys ``lo:hi`` of a ``batch_get``, read from one object file (``None``) or from
consecutive objects of one pack, the first of them given."""


@dataclass(slots=True)
class Scan:
    """What a restart scan found under a namespace directory."""

    objects: list[tuple[str, int, Packed | None]] = field(default_factory=list)
    """``(key, size, where)`` of every object to index, least recent first (a pack's objects
    in their order), ``where`` ``None`` for a file of its own."""
    dead: dict[str, int] = field(default_factory=dict)
    """Per pack kept, the bytes of it that no indexed object is charged (objects dropped as
    damaged or stored elsewhere): still on disk until the pack leaves."""
    faults: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, detail)`` per object dropped as damaged (one for a pack deleted whole): the
    backend counts each (``StorageBackend.fault``)."""


def scan(directory: str, namespace: str, read_ns: Mapping[str, int] | None = None) -> Scan:
    """Every stored object under a namespace ``directory`` (``Scan``). An object's recency is
    its file's mtime or, when later, its last read in ``read_ns`` (key → time in ns: the
    recency journal not yet applied); a pack's is the latest of its own and its keys' (it is
    evicted whole).

    Deletes what can never be read as written: temp files of writes that died before
    publishing, files that are no pack of this version, and packs none of whose objects is
    left. Of a damaged pack only the damaged objects are dropped (``file_pack.PackScan``); an
    object of a pack whose key is stored elsewhere (or earlier in the pack) is not indexed
    from the pack. Unreadable packs are left alone and not indexed."""
    out = Scan()
    found, temps = object_files(directory)
    for path in temps:
        unlink_quiet(path)
    reads = read_ns or {}
    stored = {key for _, key, _ in found}
    items: list[tuple[int, str, str, int, Packed | None]] = [
        (max(mtime, reads.get(key, 0)), key, key, size, None) for mtime, key, size in found
    ]
    for mtime, pack, ps in _packs(directory, namespace, out.faults):
        out.faults += [(kind, f"{pack}: object {n}: {detail}") for n, kind, detail in ps.dropped]
        objects = []
        for key, size, where in ps.objects:
            if key not in stored:
                stored.add(key)
                objects.append((key, size, where))
        if len(objects) < len(ps.objects):
            log.warning(
                "L3 file backend: pack %s: %d object(s) whose keys are stored elsewhere are not "
                "read from it",
                pack,
                len(ps.objects) - len(objects),
            )
        if not objects:
            log.warning("L3 file backend: deleting pack %s: none of its objects is left", pack)
            unlink_quiet(pack)
            continue
        dead = ps.size - sum(z for _, z, _ in objects)
        if dead:
            out.dead[pack] = dead
        t = max([mtime, *(reads.get(k, 0) for k, _, _ in objects)])
        items += [(t, f"{pack}/{w.number:09d}", k, z, w) for k, z, w in objects]
    items.sort()
    out.objects = [(key, size, where) for _, _, key, size, where in items]
    return out


def _packs(
    directory: str, namespace: str, faults: list[tuple[str, str]]
) -> list[tuple[int, str, PackScan]]:
    """Every readable pack with its mtime and scan; a file that is no pack of this version is
    deleted, its fault appended to ``faults``."""
    out: list[tuple[int, str, PackScan]] = []
    try:
        entries = list(os.scandir(f"{directory}/{PACKS_DIR}"))
    except FileNotFoundError:
        return out
    for entry in entries:
        if entry.name.endswith(TMP_SUFFIX):
            unlink_quiet(entry.path)
            continue
        try:
            out.append((entry.stat().st_mtime_ns, entry.path, scan_pack(entry.path, namespace)))
        except CorruptObject as e:
            log.warning("L3 file backend: deleting pack %s: %s", entry.path, e)
            faults.append((e.kind, f"{entry.path}: {e.detail}"))
            unlink_quiet(entry.path)
        except OSError:
            continue
    return out


RUN_BYTES = 4 << 20
"""Most bytes one read of a pack run fetches: a longer run is several reads, which the I/O
threads share."""


def reads(
    keys: Sequence[str],
    where: Mapping[str, Packed],
    path_of: Callable[[str], str],
    sizes: Sequence[int],
) -> tuple[list[str], list[Run]]:
    """The file holding each of ``keys`` and the reads that fetch them in order: one per
    object file, one per run of consecutive objects of a pack (of at most ``RUN_BYTES`` of
    buffers, ``sizes``, unless one object is larger; a longer run is cut only where a digest
    group of the pack starts, ``file_pack.GROUP``)."""
    paths: list[str] = []
    runs: list[Run] = []
    last: Packed | None = None
    held = 0
    for i, key in enumerate(keys):
        w = where.get(key)
        paths.append(path_of(key) if w is None else w.pack)
        if (
            w is not None
            and last is not None
            and (w.pack, w.number) == (last.pack, last.number + 1)
            and (held + sizes[i] <= RUN_BYTES or w.number % GROUP)
        ):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
            held += sizes[i]
        else:
            runs.append((i, i + 1, w))
            held = sizes[i]
        last = w
    return paths, runs


def per_key(
    runs: Sequence[Run], outcomes: Sequence[BaseException | None], n: int
) -> list[BaseException | None]:
    """Each of ``n`` keys' outcome from its read's: a pack run that stopped at its ``i``-th
    key (``RunFault``) read the keys before it; keys after a failure did not run."""
    out: list[BaseException | None] = [NOT_RUN] * n
    for (lo, hi, _), outcome in zip(runs, outcomes, strict=True):
        if outcome is None:
            out[lo:hi] = [None] * (hi - lo)
        elif isinstance(outcome, RunFault):
            out[lo : lo + outcome.at] = [None] * outcome.at
            out[lo + outcome.at] = outcome.cause
        else:
            out[lo] = outcome
    return out


def disagreements(
    directory: str,
    index: Mapping[str, int],
    where: Mapping[str, Packed],
    packs: Mapping[str, Sequence[str]],
    shared: bool = False,
    dead: Mapping[str, int] | None = None,
) -> list[object]:
    """What disk and index disagree on (empty when they agree): every indexed key not in a
    pack is a file of its indexed size; the packs' keys are exactly the packed keys; every
    pack file on disk is indexed and its size is its objects' sizes plus its ``dead`` bytes (of
    objects dropped from it); no temp file is left.

    ``shared`` (a directory the ranks of a context-parallel group share): other ranks write
    files this index never sees and evict files it still holds, so only the indexed files
    that are on disk are checked, for their sizes."""
    found, temps = object_files(directory)
    singles = {(k, z) for k, z in index.items() if k not in where}
    if shared:
        present = {key for _, key, _ in found}
        singles = {(k, z) for k, z in singles if k in present}
    odd: list[object] = [*sorted(singles - {(key, size) for _, key, size in found})[:3], *temps[:3]]
    if sorted(k for ks in packs.values() for k in ks) != sorted(where) or any(
        where[k].pack != p for p, ks in packs.items() for k in ks
    ):
        odd.append("packed keys and packs disagree")
    on_disk: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(f"{directory}/{PACKS_DIR}"):
            on_disk[e.path] = e.stat().st_size
    dead = dead or {}
    want = {p: sum(index.get(k, -1) for k in ks) + dead.get(p, 0) for p, ks in packs.items()}
    if shared:
        on_disk = {p: z for p, z in on_disk.items() if p in want}
        want = {p: z for p, z in want.items() if p in on_disk}
    if on_disk != want:
        odd.append(f"pack files {sorted(on_disk.items())[:2]}, indexed {sorted(want.items())[:2]}")
    return odd
