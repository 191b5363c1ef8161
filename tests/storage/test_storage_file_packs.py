"""Packs: a large round of small objects written as one file, read back by runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope, file_layout
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_pack import (
    GROUP,
    PACK_HEAD,
    PACK_MIN_OBJECTS,
    PACKS_DIR,
    Packed,
    payloads_at,
)

NS = Namespace("ns0")
N = PACK_MIN_OBJECTS + 4
PAGE = 256  # bytes per test page
OLD = 10**18  # ns: older than any read, whatever the clock's resolution


def pack_size(n: int) -> int:
    return payloads_at(n) + n * PAGE


def names(lo: int, hi: int) -> list[PageKey]:
    return [PageKey(f"k{i:03d}") for i in range(lo, hi)]


def pages(n: int, seed: int = 0, nbytes: int = PAGE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.uint8))


def packs(be: FileBackend) -> list[Path]:
    return sorted((Path(be.dir) / PACKS_DIR).glob("*.pack"))


def object_files(be: FileBackend) -> list[Path]:
    return [p for p in Path(be.dir).glob("*/*") if not p.parent.name.startswith(".")]


def empty(n: int, nbytes: int = PAGE) -> list[torch.Tensor]:
    return list(torch.zeros(n, nbytes, dtype=torch.uint8))


def test_a_large_round_of_small_objects_is_one_pack_read_back_byte_exact(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    [pack] = packs(be)
    assert object_files(be) == []
    assert payloads_at(N) == 4096  # 16 + 20 x 112 bytes of headers, padded to a page
    assert pack.stat().st_size == 4096 + N * PAGE
    assert be.stats()["bytes_used"] == pack.stat().st_size
    out = empty(N)
    assert be.batch_get(names(0, N), out) == N
    assert all(torch.equal(a, b) for a, b in zip(out, src, strict=True))
    # a run starting inside the pack, and one object alone
    out = empty(3)
    assert be.batch_get(names(5, 8), out) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, src[5:8], strict=True))
    be.check_integrity()


def test_small_rounds_and_large_objects_stay_one_file_each(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=64 << 20)
    assert be.batch_set(names(0, PACK_MIN_OBJECTS - 1), pages(PACK_MIN_OBJECTS - 1)) == 15
    big = pages(N, nbytes=256 << 10)
    assert be.batch_set(names(100, 100 + N), big) == N
    assert packs(be) == []
    assert len(object_files(be)) == PACK_MIN_OBJECTS - 1 + N
    be.check_integrity()


def test_packs_survive_a_restart_in_write_order(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    first, second = pages(N, 1), pages(N, 2)
    assert be.batch_set(names(0, N), first) == N
    assert be.batch_set(names(N, 2 * N), second) == N
    be.close()
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert again.keys() == names(0, 2 * N)
    out = empty(2 * N)
    assert again.batch_get(names(0, 2 * N), out) == 2 * N  # two runs, one per pack
    assert all(torch.equal(a, b) for a, b in zip(out, first + second, strict=True))
    again.check_integrity()


def test_reads_of_packed_keys_order_the_restart_and_move_the_packs_mtime(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N, 1)) == N  # pack one
    assert be.batch_set(names(N, 2 * N), pages(N, 2)) == N  # pack two, newer
    first = packs(be)[0]
    for i, p in enumerate(packs(be)):
        os.utime(p, ns=(OLD + i, OLD + i))
    assert be.batch_get(names(3, 4), empty(1)) == 1  # a read of one key of pack one
    be.close()
    size = pack_size(N)
    again = FileBackend(tmp_path, NS, budget_bytes=size + size // 2)  # room for one pack
    assert again.keys() == names(0, N)  # pack one was read last: pack two went
    assert packs(again) == [first] and first.stat().st_mtime_ns > OLD + 1
    assert again.batch_get(names(0, N), empty(N)) == N
    again.check_integrity()


def test_group_digests_then_zeros_then_payloads_from_a_page(tmp_path: Path):
    # 16 + 36 x 112 + 3 x 8 = 4072; 37 objects: 4184
    assert [payloads_at(n) for n in (1, 36, 37, 73)] == [4096, 4096, 8192, 12288]
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    [pack] = packs(be)
    raw = pack.read_bytes()
    payloads = [bytes(p.numpy()) for p in src]
    at = PACK_HEAD + N * HEADER_BYTES
    groups = [b"".join(payloads[:GROUP]), b"".join(payloads[GROUP:])]  # 16 and 4 objects
    assert raw[at : at + 16] == b"".join(
        xxhash.xxh3_64_intdigest(g).to_bytes(8, "little") for g in groups
    )
    assert raw[at + 16 : 4096] == bytes(4096 - at - 16)
    assert raw[4096:] == b"".join(payloads)
    be.close()


@pytest.mark.parametrize("joined", [True, False])
def test_whole_groups_into_joined_buffers_take_one_digest_each(tmp_path: Path, monkeypatch, joined):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20, io_threads=1)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    calls: list[int] = []
    real = envelope.digest
    monkeypatch.setattr(envelope, "digest", lambda d: calls.append(len(d)) or real(d))
    out = empty(N) if joined else empty(2 * N)[::2]  # every other row: not back to back
    assert be.batch_get(names(0, N), out) == N
    assert all(torch.equal(a, b) for a, b in zip(out, src, strict=True))
    # groups 0-15 and 16-19 whole: two digests; apart, one per object
    assert calls == ([16 * PAGE, 4 * PAGE] if joined else [PAGE] * N)
    calls.clear()
    assert be.batch_get(names(2, 18), empty(16)) == 16  # starts and ends inside groups
    assert calls == [PAGE] * 16
    be.check_integrity()


@pytest.mark.parametrize("damage", ["group", "payload"])
def test_a_damaged_group_digest_is_only_a_shortcut_lost(tmp_path: Path, damage):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    [pack] = packs(be)
    raw = bytearray(pack.read_bytes())
    if damage == "group":
        raw[PACK_HEAD + N * HEADER_BYTES] ^= 0xFF  # group 0's digest: the objects' own decide
    else:
        raw[payloads_at(N) + 11 * PAGE] ^= 0xFF  # object 11, inside group 0
    pack.write_bytes(bytes(raw))
    out = empty(N)
    got = be.batch_get(names(0, N), out)
    assert (got, be.errors) == ((N, {}) if damage == "group" else (11, {"checksum": 1}))
    assert all(torch.equal(a, b) for a, b in zip(out[:got], src[:got], strict=True))
    be.check_integrity()


def test_a_pack_of_another_version_is_deleted_at_start_up(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N)) == N
    be.close()
    [pack] = packs(be)
    raw = bytearray(pack.read_bytes())
    raw[4:6] = (1).to_bytes(2, "little")  # version 1: payloads right after the headers
    pack.write_bytes(bytes(raw))
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert packs(again) == [] and again.stats()["objects"] == 0
    again.check_integrity()


def test_a_corrupt_payload_stops_the_run_there_and_only_its_object_leaves(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    [pack] = packs(be)
    raw = bytearray(pack.read_bytes())
    raw[payloads_at(N) + 7 * PAGE + 3] ^= 0xFF  # object 7's payload
    pack.write_bytes(bytes(raw))
    out = empty(N)
    assert be.batch_get(names(0, N), out) == 7
    assert all(torch.equal(a, b) for a, b in zip(out[:7], src[:7], strict=True))
    assert be.errors == {"checksum": 1}
    assert packs(be) == [pack] and be.stats()["objects"] == N - 1
    assert be.stats()["bytes_used"] == pack_size(N)  # its bytes stay on disk with the pack
    assert be.batch_get(names(8, N), out[8:]) == N - 8
    assert all(torch.equal(a, b) for a, b in zip(out[8:], src[8:], strict=True))
    be.check_integrity()


@pytest.mark.parametrize("corrupt", [None, 3])
def test_a_pack_cut_short_behind_the_index_reads_up_to_the_cut(tmp_path: Path, corrupt):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    src = pages(N)
    assert be.batch_set(names(0, N), src) == N
    [pack] = packs(be)
    raw = bytearray(pack.read_bytes()[: payloads_at(N) + 9 * PAGE + 100])  # inside object 9
    if corrupt is not None:
        raw[payloads_at(N) + corrupt * PAGE] ^= 0xFF
    pack.write_bytes(bytes(raw))
    out = empty(N)
    got = be.batch_get(names(0, N), out)
    # the first fault in key order counts: a payload before the cut is checked before the cut
    assert (got, be.errors) == (
        (9, {"short_read": N - 9}) if corrupt is None else (3, {"checksum": 1})
    )
    assert all(torch.equal(a, b) for a, b in zip(out[:got], src[:got], strict=True))
    if corrupt is not None:  # the objects after the damaged one read up to the cut
        assert be.batch_get(names(4, N), out[4:]) == 5
        assert all(torch.equal(a, b) for a, b in zip(out[4:9], src[4:9], strict=True))
        assert be.errors == {"checksum": 1, "short_read": N - 9}
    # the cut drops the object it is in and those after it, each counted; the pack stays
    assert packs(be) == [pack] and be.stats()["objects"] == (9 if corrupt is None else 8)
    assert be.stats()["bytes_used"] == len(raw)
    be.check_integrity()


def test_a_foreign_header_in_a_pack_never_lands_in_the_buffer(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N)) == N
    [pack] = packs(be)
    raw = bytearray(pack.read_bytes())
    at = PACK_HEAD + 4 * HEADER_BYTES  # object 4's header, rewritten for another namespace
    head = envelope.pack("other", "k004", PAGE, envelope.digest(bytes(PAGE)))
    raw[at : at + HEADER_BYTES] = head
    pack.write_bytes(bytes(raw))
    out = empty(N)
    assert be.batch_get(names(0, N), out) == 4
    assert not any(o.any() for o in out[4:])  # nothing of object 4 on was copied
    assert be.errors == {"foreign": 1}
    assert packs(be) == [pack] and be.stats()["objects"] == N - 1
    be.check_integrity()


def test_a_restart_drops_the_damaged_object_of_a_pack_and_keeps_the_rest(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N, 1)) == N
    assert be.batch_set(names(N, 2 * N), pages(N, 2)) == N
    be.close()
    a, b = packs(be)
    a.write_bytes(a.read_bytes()[:-1])  # truncated inside its last object
    again = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert len(packs(again)) == 2 and again.stats()["objects"] == 2 * N - 1
    assert again.errors == {"short_read": 1}
    again.check_integrity()


def test_eviction_takes_a_pack_whole_and_keeps_the_budget(tmp_path: Path):
    size = pack_size(N)
    be = FileBackend(tmp_path, NS, budget_bytes=size + size // 2)
    assert be.batch_set(names(0, N), pages(N, 1)) == N
    assert be.batch_exists(names(0, 1)) == 1  # k000 is the most recent now; its pack still goes
    assert be.batch_set(names(N, 2 * N), pages(N, 2)) == N
    assert be.keys() == names(N, 2 * N)
    assert len(packs(be)) == 1 and be.stats()["evictions"] == N
    assert be.stats()["bytes_used"] == size <= be.budget_bytes
    be.check_integrity()


def test_a_key_twice_in_a_round_is_packed_once_and_stored_keys_are_not_rewritten(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, 2), pages(2, 9)) == 2  # two single files
    ks = names(0, N) + names(3, 4)
    assert be.batch_set(ks, pages(N + 1)) == N + 1
    [pack] = packs(be)
    assert pack.stat().st_size == pack_size(N - 2)
    out = empty(2)
    assert be.batch_get(names(0, 2), out) == 2
    assert all(torch.equal(a, b) for a, b in zip(out, pages(2, 9), strict=True))
    be.check_integrity()


def test_a_removed_pack_is_a_missing_miss_for_all_its_keys(tmp_path: Path):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N)) == N
    packs(be)[0].unlink()
    assert be.batch_get(names(0, N), empty(N)) == 0
    assert be.errors == {"missing": 1} and be.stats()["objects"] == 0
    be.check_integrity()


@pytest.mark.parametrize("wrong", [PAGE // 2, PAGE * 2])
def test_a_buffer_of_another_size_is_a_checksum_miss_and_keeps_the_pack(tmp_path: Path, wrong: int):
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(names(0, N), pages(N)) == N
    out = empty(2) + empty(1, wrong)
    assert be.batch_get(names(0, 3), out) == 2
    assert be.errors == {"checksum": 1} and len(packs(be)) == 1
    be.check_integrity()


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["set", "get", "restart"]),
            st.integers(0, 60),  # first key
            st.integers(1, 40),  # keys in the batch
            st.sampled_from([64, 256, 4096]),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_reads_return_what_was_stored_through_packs_eviction_and_restarts(ops, tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")
    budget = 40 * (HEADER_BYTES + 4096)
    be = FileBackend(root, NS, budget_bytes=budget)
    stored: dict[str, torch.Tensor] = {}  # content is a function of the key: any copy is right
    sizes: dict[str, int] = {}
    for op, lo, n, nbytes in ops:
        ks = names(lo, lo + n)
        if op == "set":
            data = [_content(k, sizes.get(k, nbytes)) for k in ks]
            done = be.batch_set(ks, data)
            assert done == n  # every object fits the budget alone; eviction makes room
            for k, d in zip(ks, data, strict=True):
                stored[k] = d
                sizes[k] = d.numel()
        elif op == "get":
            ks = [k for k in ks if k in stored]
            out = [torch.zeros(sizes[k], dtype=torch.uint8) for k in ks]
            got = be.batch_get(ks, out)
            for k, o in zip(ks[:got], out[:got], strict=True):
                assert torch.equal(o, stored[k])
        else:
            be.close()
            be = FileBackend(root, NS, budget_bytes=budget)
        be.check_integrity()
        assert be.errors == {}
    be.close()


def _content(key: str, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(key[1:]))
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def test_a_key_stored_by_another_batch_while_its_pack_is_written_ends_in_the_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from kvtier.storage import file as file_mod

    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    real = file_mod.write_pack
    src = pages(N)

    def meanwhile(fd, namespace, keys, payloads):  # noqa: ANN001, ANN202
        assert be.batch_set(names(3, 4), [src[3]]) == 1  # a single file of a packed key
        real(fd, namespace, keys, payloads)

    monkeypatch.setattr(file_mod, "write_pack", meanwhile)
    assert be.batch_set(names(0, N), src) == N
    assert object_files(be) == [] and len(packs(be)) == 1
    out = empty(N)
    assert be.batch_get(names(0, N), out) == N
    assert all(torch.equal(a, b) for a, b in zip(out, src, strict=True))
    be.check_integrity()


def test_long_runs_are_cut_where_a_group_starts():
    pb = 64 << 10  # RUN_BYTES (4 MiB) holds 64 such objects
    where = {f"p{n}": Packed("pack", n, 4096 + n * pb, 100) for n in range(100)}
    keys = [f"p{n}" for n in range(5, 100)]
    paths, runs = file_layout.reads(keys, where, lambda k: f"file/{k}", [pb] * len(keys))
    assert paths == ["pack"] * 95
    # keys 0-63 (objects 5-68) fill 4 MiB; the run goes on to object 80, where group 5 starts
    assert [(lo, hi, w.number) for lo, hi, w in runs] == [(0, 75, 5), (75, 95, 80)]
    assert file_layout.RUN_BYTES == 4 << 20
