"""A damaged pack of the file backend keeps its intact objects: a bad byte costs the objects it
is in (counted in the backend's faults, ``storage_errors`` of the cache), never the pack, and
never garbage. At start-up (headers, size) and at a read (payloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import make_cache

from kvtier.keys import Namespace, PageKey
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_pack import PACK_HEAD, PACK_MIN_OBJECTS, PACKS_DIR, payloads_at

NS = Namespace("ns0")
N = PACK_MIN_OBJECTS + 4  # 20 objects: two digest groups
PAGE = 256  # bytes per object payload


def names(lo: int, hi: int) -> list[PageKey]:
    return [PageKey(f"k{i:03d}") for i in range(lo, hi)]


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, PAGE), generator=g, dtype=torch.uint8))


def packs(be: FileBackend) -> list[Path]:
    return sorted((Path(be.dir) / PACKS_DIR).glob("*.pack"))


def flip(path: Path, *offsets: int) -> None:
    raw = bytearray(path.read_bytes())
    for at in offsets:
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


def header(i: int) -> int:
    """A byte inside object ``i``'s envelope header (its key field)."""
    return PACK_HEAD + i * HEADER_BYTES + 40


def payload(i: int) -> int:
    return payloads_at(N) + i * PAGE + 17


def written(tmp_path: Path) -> tuple[Path, list[torch.Tensor]]:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    be.close()
    [pack] = packs(be)
    return pack, src


def readable(be: FileBackend, src: list[torch.Tensor]) -> list[int]:
    """The objects ``be`` serves, each read alone and compared byte for byte."""
    ok = []
    for i, key in enumerate(names(0, N)):
        out = [torch.zeros(PAGE, dtype=torch.uint8)]
        if be.batch_get([key], out) == 1:
            assert torch.equal(out[0], src[i]), f"object {i} read back other bytes"
            ok.append(i)
    return ok


GROUP_DIGEST = PACK_HEAD + N * HEADER_BYTES + 3
PADDING = payloads_at(N) - 5  # the zeros between the group digests and the payloads

CASES = {
    # damage: (where, bytes kept on restart, faults counted at start-up)
    "pack count": ([6], list(range(N)), {}),  # the count comes back from the object headers
    "pack digest": ([PACK_HEAD - 1], list(range(N)), {}),
    "one object header": ([header(5)], [i for i in range(N) if i != 5], {"checksum": 1}),
    "last object header": ([header(N - 1)], list(range(N - 1)), {"checksum": 1}),
    # objects between two damaged headers cannot be located: dropped with them
    "two object headers": ([header(5), header(9)], [*range(5), *range(10, N)], {"checksum": 5}),
    "group digest": ([GROUP_DIGEST], list(range(N)), {}),  # a shortcut lost, nothing else
    "padding": ([PADDING], list(range(N)), {}),
    "pack count and a header": ([6, header(3)], [], {"checksum": 1}),  # no count to trust
    "pack magic": ([0], [], {"format": 1}),
}


@pytest.mark.parametrize("damage", list(CASES))
def test_a_restart_keeps_every_object_a_damaged_byte_is_not_in(tmp_path: Path, damage) -> None:
    pack, src = written(tmp_path)
    offsets, kept, faults = CASES[damage]
    flip(pack, *offsets)
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.errors == faults  # counted at start-up, before any read
    assert sorted(be.keys()) == [f"k{i:03d}" for i in kept]
    assert be.stats()["bytes_used"] == (pack.stat().st_size if kept else 0)
    assert packs(be) == ([pack] if kept else [])
    be.check_integrity()
    assert readable(be, src) == kept
    assert be.errors == faults  # nothing more failed on reading
    be.close()


def test_a_pack_cut_short_keeps_the_objects_before_the_cut(tmp_path: Path) -> None:
    pack, src = written(tmp_path)
    pack.write_bytes(pack.read_bytes()[: payloads_at(N) + 12 * PAGE + 100])  # inside object 12
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.errors == {"short_read": N - 12}
    assert readable(be, src) == list(range(12))
    assert be.stats()["bytes_used"] == pack.stat().st_size
    be.check_integrity()


def test_a_damaged_payload_is_found_by_its_read_and_leaves_alone(tmp_path: Path) -> None:
    pack, src = written(tmp_path)
    flip(pack, payload(7))
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.errors == {} and len(be.keys()) == N  # payloads are not read at start-up
    assert readable(be, src) == [i for i in range(N) if i != 7]
    assert be.errors == {"checksum": 1}
    assert be.stats()["objects"] == N - 1 and packs(be) == [pack]
    be.check_integrity()
    be.close()
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)  # found again by its read
    assert readable(again, src) == [i for i in range(N) if i != 7]
    assert again.errors == {"checksum": 1}


def test_a_dropped_key_is_stored_again_and_the_pack_leaves_whole_on_eviction(
    tmp_path: Path,
) -> None:
    pack, src = written(tmp_path)
    flip(pack, header(5))
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_exists(names(0, N)) == 5
    assert be.batch_set(names(5, 6), src[5:6]) == 1  # its next backup writes it on its own
    assert be.batch_exists(names(0, N)) == N
    be.check_integrity()
    be.close()
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert again.errors == {"checksum": 1}  # the pack's copy is still damaged; the file serves
    assert readable(again, src) == list(range(N))
    again.check_integrity()
    # evicting any of the pack's objects takes the pack, its dead bytes too
    used = again.stats()["bytes_used"]
    single = used - pack.stat().st_size
    assert again.batch_exists(names(5, 6)) == 1  # the single file is the most recent
    again._index.evict(again.budget_bytes - used + 1)  # noqa: SLF001 - one byte short
    assert packs(again) == [] and again.stats()["bytes_used"] == single
    again.check_integrity()


def test_the_cache_counts_what_a_damaged_pack_lost_and_restores_the_rest(tmp_path: Path) -> None:
    """Through ``TieredCache``: a request of 20 pages written through as one pack; object 5's
    header damaged; a fresh cache reports it in ``storage_errors`` and restores pages 0-4."""
    tokens = list(range(1000, 1080))  # 20 pages of 4 tokens
    c = make_cache(tmp_path, device_pages=32, host_pages=64, write_policy="write_through")
    m = c.match(tokens)
    c.lock(m.handle)
    c.load(m)
    locs = c.alloc(len(tokens))
    rows = torch.randn(2, len(tokens), 2, 1, 4, generator=torch.Generator().manual_seed(3))
    c.write_kv(locs, rows)
    c.finish(tokens, locs, 0, m.handle)
    c.drain()
    c.close()
    [pack] = packs(c.storage)
    flip(pack, header(5))
    fresh = make_cache(tmp_path, device_pages=32, host_pages=64)
    assert fresh.stats()["storage_errors"] == {"checksum": 1}
    adm = fresh.admit(tokens)
    assert fresh.admit_ready(adm, timeout=30.0)
    assert (adm.storage_tokens, adm.num_new) == (20, 60)  # up to the dropped page
    assert torch.equal(fresh.read_kv(adm.locs).cpu(), rows[:, :20])
    fresh.abandon(adm)
    fresh.check_integrity()
    fresh.close()
