from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import create_backend, file_io
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_recency import JOURNAL

NS = Namespace("ns0")
PAGE = 64  # elements per test page


def keys(*names: str) -> list[PageKey]:
    return [PageKey(n) for n in names]


def page(seed: int, dtype: torch.dtype = torch.float32, n: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-128, 128, (n,), generator=g, dtype=dtype)


def obj_path(be: FileBackend, key: str) -> Path:
    return Path(be.dir) / key[:2] / key


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def be(tmp_path: Path) -> Iterator[FileBackend]:
    backend = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    yield backend
    backend.check_integrity()  # after every scenario: index, bytes and files agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_roundtrip_byte_exact(be: FileBackend, dtype: torch.dtype) -> None:
    src = [page(i, dtype) for i in range(3)]
    assert be.batch_set(keys("k0", "k1", "k2"), src) == 3
    dst = [torch.empty_like(t) for t in src]
    assert be.batch_get(keys("k0", "k1", "k2"), dst) == 3
    for s, d in zip(src, dst, strict=True):
        assert as_bytes(s) == as_bytes(d)
    assert os.path.getsize(obj_path(be, "k0")) == HEADER_BYTES + src[0].numel() * src[0].itemsize
    assert not be.errors


def test_roundtrip_views_of_page_first_buffer(be: FileBackend) -> None:
    host = torch.randn(6, 4, PAGE).to(torch.bfloat16)  # page-first: host[i] is one page
    assert be.batch_set(keys("p3", "p5"), [host[3], host[5]]) == 2
    dest = torch.zeros_like(host)
    assert be.batch_get(keys("p3", "p5"), [dest[1], dest[4]]) == 2
    assert as_bytes(dest[1]) == as_bytes(host[3])
    assert as_bytes(dest[4]) == as_bytes(host[5])
    assert as_bytes(dest[0]) == bytes(4 * PAGE * 2)  # neighbours untouched


def test_batch_exists_prefix(be: FileBackend) -> None:
    assert be.batch_set(keys("k0", "k1", "k3"), [page(0), page(1), page(3)]) == 3
    assert be.batch_exists(keys("k0", "k1", "k2", "k3")) == 2
    assert be.batch_exists(keys("k2", "k0")) == 0
    assert be.batch_exists(keys("k3")) == 1
    assert be.batch_exists([]) == 0


def test_batch_get_stops_at_first_miss(be: FileBackend) -> None:
    assert be.batch_set(keys("k0", "k1", "k3"), [page(0), page(1), page(3)]) == 3
    dst = [torch.zeros(PAGE) for _ in range(4)]
    assert be.batch_get(keys("k0", "k1", "k2", "k3"), dst) == 2
    assert torch.equal(dst[1], page(1))
    assert torch.equal(dst[3], torch.zeros(PAGE))  # nothing read past the miss
    assert not be.errors


def test_existing_key_not_rewritten(be: FileBackend) -> None:
    assert be.batch_set(keys("k0"), [page(0)]) == 1
    mtime = os.stat(obj_path(be, "k0")).st_mtime_ns
    os.utime(obj_path(be, "k0"), ns=(1_000_000_000, 1_000_000_000))
    assert be.batch_set(keys("k0", "k1"), [page(9), page(1)]) == 2
    assert os.stat(obj_path(be, "k0")).st_mtime_ns == 1_000_000_000 != mtime
    dst = torch.empty(PAGE)
    assert be.batch_get(keys("k0"), [dst]) == 1
    assert torch.equal(dst, page(0))


def test_corrupted_payload_is_a_checksum_miss(be: FileBackend) -> None:
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    p = obj_path(be, "k1")
    raw = bytearray(p.read_bytes())
    raw[HEADER_BYTES + 17] ^= 0x01
    p.write_bytes(bytes(raw))
    dst = [torch.zeros(PAGE), torch.zeros(PAGE)]
    assert be.batch_get(keys("k0", "k1"), dst) == 1
    assert be.errors["checksum"] == 1
    assert not p.exists()
    assert be.batch_exists(keys("k0", "k1")) == 1
    assert be.stats()["objects"] == 1
    assert be.stats()["bytes_used"] == HEADER_BYTES + PAGE * 4


def test_bad_magic_is_a_format_miss(be: FileBackend) -> None:
    assert be.batch_set(keys("k0"), [page(0)]) == 1
    p = obj_path(be, "k0")
    raw = bytearray(p.read_bytes())
    raw[0:4] = b"XXXX"
    p.write_bytes(bytes(raw))
    assert be.batch_get(keys("k0"), [torch.zeros(PAGE)]) == 0
    assert be.errors["format"] == 1
    assert not p.exists()


def test_corrupted_header_is_a_checksum_miss(be: FileBackend) -> None:
    assert be.batch_set(keys("k0"), [page(0)]) == 1
    p = obj_path(be, "k0")
    raw = bytearray(p.read_bytes())
    raw[12] ^= 0x01  # a bit of the payload length: caught by the header checksum
    p.write_bytes(bytes(raw))
    assert be.batch_get(keys("k0"), [torch.zeros(PAGE)]) == 0
    assert be.errors["checksum"] == 1
    assert not p.exists()


def test_foreign_and_renamed_objects_are_never_served(tmp_path: Path) -> None:
    mine = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    other_ns = type(NS)("f" * 32)
    other = FileBackend(tmp_path, other_ns, budget_bytes=1 << 20)
    assert other.batch_set(keys("k0", "k1"), [page(1), page(2)]) == 2
    # Another deployment's object dropped under our namespace with the same key.
    dst = obj_path(mine, "k0")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(obj_path(other, "k0").read_bytes())
    # One of our own objects renamed to another key.
    assert mine.batch_set(keys("k2"), [page(3)]) == 1
    renamed = obj_path(mine, "k3")
    renamed.parent.mkdir(parents=True, exist_ok=True)
    renamed.write_bytes(obj_path(mine, "k2").read_bytes())
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)  # indexes the planted files
    out = torch.zeros(PAGE)
    assert fresh.batch_get(keys("k0"), [out]) == 0
    assert fresh.batch_get(keys("k3"), [out]) == 0
    assert fresh.errors["foreign"] == 2
    assert torch.equal(out, torch.zeros(PAGE))
    assert not dst.exists() and not renamed.exists()
    assert fresh.batch_get(keys("k2"), [out]) == 1 and torch.equal(out, page(3))


def test_truncated_object_is_a_short_read(be: FileBackend) -> None:
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    p = obj_path(be, "k0")
    os.truncate(p, HEADER_BYTES + 10)
    assert be.batch_get(keys("k0", "k1"), [torch.zeros(PAGE), torch.zeros(PAGE)]) == 0
    assert be.errors["short_read"] == 1
    assert not p.exists()
    assert be.batch_exists(keys("k0")) == 0
    os.truncate(obj_path(be, "k1"), 5)  # not even a header
    assert be.batch_get(keys("k1"), [torch.zeros(PAGE)]) == 0
    assert be.errors["short_read"] == 2


def test_buffer_size_mismatch_is_a_fault_not_an_exception(be: FileBackend) -> None:
    assert be.batch_set(keys("k0"), [page(0)]) == 1
    assert be.batch_get(keys("k0"), [torch.zeros(PAGE + 1)]) == 0
    assert be.errors["checksum"] == 1
    dst = torch.zeros(PAGE)
    assert be.batch_get(keys("k0"), [dst]) == 1  # the object itself is intact
    assert torch.equal(dst, page(0))


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (errno.ENOSPC, "no_space"),
        (errno.EACCES, "permission"),
        (errno.EPERM, "permission"),
        (errno.EIO, "io"),
    ],
)
def test_write_errors_are_faults_without_leftovers(
    be: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, kind: str
) -> None:
    calls = 0

    def failing_write(fd: int, views: list[memoryview]) -> None:
        nonlocal calls
        calls += 1
        os.write(fd, views[0])  # header written, payload fails: a partial temp file exists
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(file_io, "writev_all", failing_write)
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 0
    assert (calls, be.errors) == (1, {kind: 1})
    assert temp_files(tmp_path) == []
    assert not obj_path(be, "k0").exists()
    assert be.batch_exists(keys("k0")) == 0
    assert be.stats()["bytes_used"] == 0


def test_write_fault_stops_after_stored_prefix(
    be: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = file_io.writev_all
    calls = 0

    def failing_write(fd: int, views: list[memoryview]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the second object
            raise OSError(errno.EIO, "Input/output error")
        real(fd, views)

    monkeypatch.setattr(file_io, "writev_all", failing_write)
    assert be.batch_set(keys("k0", "k1", "k2"), [page(0), page(1), page(2)]) == 1
    assert (calls, be.errors) == (2, {"io": 1})
    assert temp_files(tmp_path) == []
    assert be.batch_exists(keys("k0", "k1", "k2")) == 1


def test_object_larger_than_budget_is_refused(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=HEADER_BYTES + PAGE * 4 - 1)
    assert be.batch_set(keys("k0"), [page(0)]) == 0
    assert be.errors["no_space"] == 1
    assert be.stats()["objects"] == 0


def test_unwritable_dir_is_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(ConfigError, match="storage_dir") as info:
        FileBackend(bad, NS, budget_bytes=1 << 20)
    assert str(bad) in str(info.value)
    assert "Not a directory" in str(info.value)


def test_non_positive_budget_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage_bytes"):
        FileBackend(tmp_path, NS, budget_bytes=0)


def test_budget_lru_eviction_order(tmp_path: Path) -> None:
    obj = HEADER_BYTES + PAGE * 4
    be = FileBackend(tmp_path, NS, budget_bytes=3 * obj)
    assert be.batch_set(keys("a", "b", "c"), [page(0), page(1), page(2)]) == 3
    assert be.batch_get(keys("a"), [torch.empty(PAGE)]) == 1
    assert be.batch_set(keys("d"), [page(3)]) == 1
    assert set(be.keys()) == {"a", "c", "d"}
    assert not obj_path(be, "b").exists()
    assert be.batch_exists(keys("c")) == 1  # c becomes most recent; a is now oldest
    assert be.batch_set(keys("e"), [page(4)]) == 1
    assert be.keys() == ["d", "c", "e"]
    assert be.stats() == {
        "bytes_used": 3 * obj,
        "objects": 3,
        "budget_bytes": 3 * obj,
        "evictions": 2,
    }
    assert sorted(p.name for p in Path(be.dir).rglob("*") if p.is_file() and p.name != JOURNAL) == [
        "c",
        "d",
        "e",
    ]


def test_restart_persistence_and_mtime_order(tmp_path: Path) -> None:
    obj = HEADER_BYTES + PAGE * 4
    first = FileBackend(tmp_path, NS, budget_bytes=3 * obj)
    src = {k: page(i) for i, k in enumerate(["a", "b", "c"])}
    assert first.batch_set(keys(*src), list(src.values())) == 3
    # Recency on disk: b oldest, then c, then a.
    for k, t in [("b", 100), ("c", 200), ("a", 300)]:
        os.utime(obj_path(first, k), ns=(t * 10**9, t * 10**9))
    leftover = obj_path(first, "a").parent / ".a.dead.tmp"
    leftover.write_bytes(b"partial")

    second = FileBackend(tmp_path, NS, budget_bytes=3 * obj)
    assert not leftover.exists()
    assert second.keys() == ["b", "c", "a"]
    assert second.stats()["bytes_used"] == 3 * obj
    for k, t in src.items():
        dst = torch.empty(PAGE)
        assert second.batch_get(keys(k), [dst]) == 1
        assert as_bytes(dst) == as_bytes(t)
    assert second.keys() == ["a", "b", "c"]

    for k, t in [("a", 100), ("b", 200), ("c", 300)]:
        os.utime(obj_path(second, k), ns=(t * 10**9, t * 10**9))
    third = FileBackend(tmp_path, NS, budget_bytes=2 * obj)  # smaller budget: oldest goes
    assert third.keys() == ["b", "c"]
    assert not obj_path(third, "a").exists()
    assert third.stats()["evictions"] == 1


def test_namespaces_are_separate(tmp_path: Path) -> None:
    one = FileBackend(tmp_path, Namespace("one"), budget_bytes=1 << 20)
    two = FileBackend(tmp_path, Namespace("two"), budget_bytes=1 << 20)
    assert one.batch_set(keys("k0"), [page(0)]) == 1
    assert two.batch_exists(keys("k0")) == 0


def test_registry_creates_file_backend(tmp_path: Path) -> None:
    cfg = CacheConfig(storage="file", storage_dir=str(tmp_path / "l3"), storage_bytes=1 << 20)
    be = create_backend("file", cfg, NS)
    assert isinstance(be, FileBackend)
    assert be.name == "file"
    assert be.capabilities.persistent and be.capabilities.zero_copy
    assert be.capabilities.page_spans and not be.capabilities.shared_across_hosts
    assert be.stats()["budget_bytes"] == 1 << 20
    assert be.batch_set(keys("k0"), [page(0)]) == 1
    assert (tmp_path / "l3" / NS / "k0" / "k0").is_file()


def test_registry_unknown_name_is_config_error(tmp_path: Path) -> None:
    cfg = CacheConfig(storage="file", storage_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="nosuch"):
        create_backend("nosuch", cfg, NS)


def test_concurrent_writers_and_readers_stay_within_budget(tmp_path: Path) -> None:
    obj = HEADER_BYTES + PAGE * 4
    be = FileBackend(tmp_path, NS, budget_bytes=8 * obj)
    bad: list[str] = []

    def worker(w: int) -> None:
        for i in range(40):
            k = PageKey(f"w{w}-{i}")
            src = page(w * 1000 + i)
            if be.batch_set([k], [src]) != 1:
                bad.append(f"set {k}")
            dst = torch.empty(PAGE)
            if be.batch_get([k], [dst]) == 1 and not torch.equal(dst, src):
                bad.append(f"garbage {k}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    assert not be.errors
    st = be.stats()
    assert st["objects"] == 8 and st["bytes_used"] == 8 * obj
    assert len([p for p in Path(be.dir).rglob("*") if p.is_file() and p.name != JOURNAL]) == 8


def test_large_pages_checksummed_on_worker_threads(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=64 << 20)
    src = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8)
    ks = keys("L0", "L1", "L2", "L3")
    assert be.batch_set(ks, list(src)) == 4
    dst = torch.zeros_like(src)
    assert be.batch_get(ks, list(dst)) == 4
    assert torch.equal(dst, src)
    p = obj_path(be, "L2")
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    assert be.batch_get(ks, list(torch.zeros_like(src))) == 2
    assert be.errors == {"checksum": 1}
    assert not p.exists()
    be.close()
