"""File backend envelope v3 (XXH3-64 digests) and the parallel batch paths: faults are exact
kinds, and ``batch_get``/``batch_set`` on the I/O threads keep leading-count semantics when
object k of n is missing, corrupt or fails to write."""

from __future__ import annotations

import errno
import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope, file_io
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_io import ALIGNED_MIN, WRITE_CHUNK
from kvtier.storage.file_pool import POOL_MIN_BYTES, POOL_MIN_OBJECT_BYTES, OrderedIO
from kvtier.storage.file_recency import JOURNAL

NS = Namespace("ns0")
BIG = 1 << 20  # bytes per page: a batch of two is past POOL_MIN_BYTES
BIG_AT = 4096  # where a BIG payload starts in its file (file_io.payload_at)
N = 8


def keys(n: int = N) -> list[PageKey]:
    return [PageKey(f"k{i}") for i in range(n)]


def pages(n: int = N, size: int = BIG) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
    )


def obj_path(be: FileBackend, key: str) -> Path:
    return Path(be.dir) / key[:2] / key


def flip(p: Path, offset: int) -> None:
    raw = bytearray(p.read_bytes())
    raw[offset] ^= 0x01
    p.write_bytes(bytes(raw))


def files(be: FileBackend) -> set[str]:
    return {p.name for p in Path(be.dir).rglob("*") if p.is_file() and p.name != JOURNAL}


@pytest.fixture
def be(tmp_path: Path) -> FileBackend:
    b = FileBackend(tmp_path, NS, budget_bytes=64 << 20, io_threads=4)
    yield b
    b.check_integrity()
    b.close()


def test_batches_here_go_to_the_threads() -> None:
    assert 2 * BIG >= POOL_MIN_BYTES and HEADER_BYTES == 112 and file_io.payload_at(BIG) == BIG_AT


def test_object_digests_are_xxh3_64_of_header_and_payload(be: FileBackend) -> None:
    src = pages(1, 4096)
    assert be.batch_set(keys(1), list(src)) == 1
    raw = obj_path(be, "k0").read_bytes()
    assert len(raw) == HEADER_BYTES + 4096 and raw[:6] == b"KVTO\x04\x00"
    payload_digest, head_digest = struct.unpack("<QQ", raw[96:HEADER_BYTES])
    assert payload_digest == xxhash.xxh3_64_intdigest(raw[HEADER_BYTES:])
    assert head_digest == xxhash.xxh3_64_intdigest(raw[:104])
    assert raw[HEADER_BYTES:] == src[0].numpy().tobytes()


@pytest.mark.parametrize(
    ("offset", "what"),
    [
        (HEADER_BYTES + 4095, "last payload byte"),
        (HEADER_BYTES, "first payload byte"),
        (20, "namespace byte"),
        (100, "payload digest byte"),
        (108, "header digest byte"),
    ],
)
def test_flipped_byte_is_a_checksum_fault(be: FileBackend, offset: int, what: str) -> None:
    src = pages(2, 4096)
    assert be.batch_set(keys(2), list(src)) == 2
    flip(obj_path(be, "k1"), offset)
    out = torch.zeros_like(src)
    assert be.batch_get(keys(2), list(out)) == 1, what
    assert be.errors == {"checksum": 1}
    assert torch.equal(out[0], src[0])
    assert files(be) == {"k0"}  # the corrupt object is deleted and leaves the index
    assert be.batch_exists(keys(2)) == 1 and be.stats()["bytes_used"] == HEADER_BYTES + 4096


def _v2_object(ns: str, key: str, payload: bytes) -> bytes:
    head = struct.pack(
        "<4sHHQ32s48sI",
        b"KVTO",
        2,
        len(key),
        len(payload),
        ns.encode(),
        key.encode(),
        zlib.crc32(payload),
    )
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def test_version_2_object_is_a_format_miss_and_never_lands_in_the_buffer(tmp_path: Path) -> None:
    payload = pages(1, 4096)[0].numpy().tobytes()
    p = tmp_path / NS / "k0" / "k0"
    p.parent.mkdir(parents=True)
    p.write_bytes(_v2_object(NS, "k0", payload))
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)  # indexes the old object
    assert be.batch_exists(keys(1)) == 1
    out = torch.zeros(4096, dtype=torch.uint8)
    assert be.batch_get(keys(1), [out]) == 0
    assert be.errors == {"format": 1}
    assert not out.any()
    assert not p.exists() and be.stats()["objects"] == 0


def test_unpack_reports_an_old_version_before_the_header_length() -> None:
    old = _v2_object(NS, "k0", b"x" * 8)
    with pytest.raises(Exception, match="^format: magic/version b'KVTO'/2, not b'KVTO'/4$"):
        envelope.unpack(old[:104], NS, "k0")


@pytest.mark.parametrize(
    ("size", "at"),
    [(ALIGNED_MIN - 1, HEADER_BYTES), (ALIGNED_MIN, 4096), (WRITE_CHUNK + 8, 4096)],
)
def test_large_payloads_start_on_a_page(be: FileBackend, size: int, at: int) -> None:
    src = pages(1, size)
    assert be.batch_set(keys(1), list(src)) == 1
    raw = obj_path(be, "k0").read_bytes()
    assert len(raw) == at + size == be.stats()["bytes_used"]
    assert raw[HEADER_BYTES:at] == bytes(at - HEADER_BYTES)
    assert raw[at:] == src[0].numpy().tobytes()
    payload_digest, head_digest = struct.unpack("<QQ", raw[96:HEADER_BYTES])
    assert payload_digest == xxhash.xxh3_64_intdigest(raw[at:])
    out = torch.zeros_like(src)
    assert be.batch_get(keys(1), list(out)) == 1 and torch.equal(out, src)
    if at > HEADER_BYTES:  # the padding is never read: a flipped byte there changes nothing
        flip(obj_path(be, "k0"), HEADER_BYTES + 5)
        out.zero_()
        assert be.batch_get(keys(1), list(out)) == 1 and torch.equal(out, src)
    obj_path(be, "k0").write_bytes(raw[:HEADER_BYTES] + raw[at:])  # the payload moved up
    assert be.batch_get(keys(1), list(out)) == (1 if at == HEADER_BYTES else 0)
    assert be.errors == ({} if at == HEADER_BYTES else {"short_read": 1})


def test_io_threads_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="io_threads must be a positive integer, got 0"):
        FileBackend(tmp_path, NS, budget_bytes=1 << 20, io_threads=0)


def test_parallel_roundtrip_byte_exact(be: FileBackend) -> None:
    src = pages()
    assert be.batch_set(keys(), list(src)) == N
    out = torch.zeros_like(src)
    assert be.batch_get(keys(), list(out)) == N
    assert torch.equal(out, src) and not be.errors
    assert be.stats() == {
        "bytes_used": N * (4096 + BIG),  # payloads of 128 KiB and more start at 4096
        "objects": N,
        "budget_bytes": 64 << 20,
        "evictions": 0,
    }


@pytest.mark.parametrize("k", [0, 3, N - 1])
def test_parallel_get_stops_at_a_missing_object(be: FileBackend, k: int) -> None:
    src = pages()
    assert be.batch_set(keys(), list(src)) == N
    obj_path(be, f"k{k}").unlink()
    out = torch.zeros_like(src)
    assert be.batch_get(keys(), list(out)) == k
    assert be.errors == {"missing": 1}
    assert torch.equal(out[:k], src[:k])
    assert be.stats()["objects"] == N - 1  # only the missing one left the index
    assert be.batch_exists(keys()[k + 1 :]) == N - 1 - k


@pytest.mark.parametrize("k", [0, 5, N - 1])
def test_parallel_get_stops_at_a_corrupt_object(be: FileBackend, k: int) -> None:
    src = pages()
    assert be.batch_set(keys(), list(src)) == N
    flip(obj_path(be, f"k{k}"), BIG_AT + BIG // 2)
    out = torch.zeros_like(src)
    assert be.batch_get(keys(), list(out)) == k
    assert be.errors == {"checksum": 1}
    assert torch.equal(out[:k], src[:k])
    assert files(be) == {f"k{i}" for i in range(N) if i != k}


def test_parallel_get_counts_only_the_first_of_two_faults(be: FileBackend) -> None:
    src = pages()
    assert be.batch_set(keys(), list(src)) == N
    flip(obj_path(be, "k2"), BIG_AT + 7)
    flip(obj_path(be, "k6"), BIG_AT + 7)
    out = torch.zeros_like(src)
    assert be.batch_get(keys(), list(out)) == 2
    assert be.errors == {"checksum": 1}
    assert "k6" in files(be)  # past the first fault: not looked at again
    assert be.batch_get(keys()[3:], list(out[3:])) == 3  # k3, k4, k5; then k6
    assert be.errors == {"checksum": 2}
    assert torch.equal(out[3:6], src[3:6])
    assert files(be) == {f"k{i}" for i in range(N) if i not in (2, 6)}


@pytest.mark.parametrize("k", [0, 4, N - 1])
def test_parallel_set_stops_at_a_failed_write(
    be: FileBackend, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    real = file_io.writev_all
    bad = f"k{k}".encode()

    def failing(fd: int, views: list[memoryview]) -> None:
        # An object up to WRITE_CHUNK goes out in one writev, header first: its key field.
        assert BIG <= file_io.WRITE_CHUNK
        if bytes(views[0][48:96]).rstrip(b"\0") == bad:
            raise OSError(errno.EIO, "Input/output error")
        real(fd, views)

    monkeypatch.setattr(file_io, "writev_all", failing)
    src = pages()
    assert be.batch_set(keys(), list(src)) == k
    assert be.errors == {"io": 1}
    assert be.batch_exists(keys()) == k
    on_disk = files(be)
    assert f"k{k}" not in on_disk and {f"k{i}" for i in range(k)} <= on_disk
    assert not any(name.endswith(".tmp") for name in on_disk)
    # Objects past the fault that were written stay stored and accounted for.
    assert be.stats()["objects"] == len(on_disk)
    assert be.stats()["bytes_used"] == len(on_disk) * (BIG_AT + BIG)
    monkeypatch.setattr(file_io, "writev_all", real)
    assert be.batch_set(keys(), list(src)) == N
    out = torch.zeros_like(src)
    assert be.batch_get(keys(), list(out)) == N and torch.equal(out, src)


def test_parallel_set_larger_than_the_budget_evicts_its_own_oldest(tmp_path: Path) -> None:
    obj = BIG_AT + BIG
    be = FileBackend(tmp_path, NS, budget_bytes=5 * obj, io_threads=4)
    src = pages()
    assert be.batch_set(keys(), list(src)) == N
    assert be.keys() == [f"k{i}" for i in range(3, N)]
    assert be.stats()["bytes_used"] == 5 * obj and be.stats()["evictions"] == 3
    assert files(be) == set(be.keys())
    out = torch.zeros_like(src[3:])
    assert be.batch_get(keys()[3:], list(out)) == 5 and torch.equal(out, src[3:])
    be.check_integrity()
    be.close()


def test_parallel_set_refuses_an_object_over_the_budget_after_the_ones_before(
    tmp_path: Path,
) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=4 * (BIG_AT + BIG), io_threads=4)
    small = pages(3)
    big = torch.zeros(5 * BIG, dtype=torch.uint8)
    ks = [PageKey("a0"), PageKey("a1"), PageKey("a2"), PageKey("b0"), PageKey("a3")]
    assert be.batch_set(ks, [*small, big, small[0]]) == 3
    assert be.errors == {"no_space": 1}
    assert be.keys() == ["a0", "a1", "a2"]
    be.check_integrity()
    be.close()


def test_batches_of_small_objects_stay_on_the_calling_thread() -> None:
    io = OrderedIO(4, "t")
    ran: list[int] = []
    n = 64  # 64 objects of 64 KiB: past POOL_MIN_BYTES in all, under POOL_MIN_OBJECT_BYTES each
    assert n * (64 << 10) >= POOL_MIN_BYTES and POOL_MIN_OBJECT_BYTES > 64 << 10
    out = io.run_ordered(lambda i: ran.append(threading.get_ident()), n, n * (64 << 10))
    assert out == [None] * n and set(ran) == {threading.get_ident()} and io._pool is None
    io.close()
