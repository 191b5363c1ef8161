"""File backend against a directory changed behind its index, and a disk that fills up before
the budget: vanished objects leave the index and are written again, a full disk evicts, and
``check_integrity`` tells files and index apart."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvtier.errors import IntegrityError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import file_io
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_recency import JOURNAL

NS = Namespace("ns0")
PAGE = 64  # float32 elements per test page
SIZE = HEADER_BYTES + PAGE * 4  # bytes one stored page takes


def keys(*names: str) -> list[PageKey]:
    return [PageKey(n) for n in names]


def page(seed: int) -> torch.Tensor:
    return torch.randn(PAGE, generator=torch.Generator().manual_seed(seed))


def obj_path(be: FileBackend, key: str) -> Path:
    return Path(be.dir) / key[:2] / key


def stored_bytes(be: FileBackend) -> int:
    return sum(
        p.stat().st_size for p in Path(be.dir).rglob("*") if p.is_file() and p.name != JOURNAL
    )


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_vanished_object_leaves_the_index_on_read_and_is_written_again(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    ks, data = keys("k0", "k1", "k2"), [page(0), page(1), page(2)]
    assert be.batch_set(ks, data) == 3
    obj_path(be, "k1").unlink()
    out = [torch.empty(PAGE) for _ in ks]
    assert be.batch_get(ks, out) == 1
    assert be.errors == {"missing": 1}
    assert be.stats()["bytes_used"] == 2 * SIZE and be.stats()["objects"] == 2
    assert be.batch_exists(ks) == 1
    assert be.batch_set(ks, data) == 3  # k1 is written, not skipped as already stored
    assert obj_path(be, "k1").stat().st_size == SIZE
    assert be.stats()["bytes_used"] == 3 * SIZE == stored_bytes(be)
    out = [torch.empty(PAGE) for _ in ks]
    assert be.batch_get(ks, out) == 3
    assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))


def test_backup_of_an_indexed_key_whose_file_is_gone_rewrites_it(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    obj_path(be, "k0").unlink()
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    assert be.errors == {"missing": 1}
    assert be.stats()["bytes_used"] == 2 * SIZE == stored_bytes(be)
    assert be.stats()["objects"] == 2
    be.close()
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)  # survives a restart
    out = [torch.empty(PAGE), torch.empty(PAGE)]
    assert fresh.batch_get(keys("k0", "k1"), out) == 2
    assert torch.equal(out[0], page(0)) and torch.equal(out[1], page(1))
    assert not fresh.errors


def test_unreadable_object_leaves_the_index(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    p = obj_path(be, "k1")
    p.unlink()
    p.mkdir()  # reading it fails with EISDIR
    out = [torch.empty(PAGE), torch.empty(PAGE)]
    assert be.batch_get(keys("k0", "k1"), out) == 1
    assert be.errors == {"io": 1}
    assert be.keys() == ["k0"] and be.stats()["bytes_used"] == SIZE
    assert be.batch_exists(keys("k0", "k1")) == 1


class FullDisk:
    """Replaces ``FileBackend._write``: raises ``ENOSPC`` when the object would take the files
    under the parent of the backend's root past ``capacity`` bytes, as a disk of that size
    would."""

    def __init__(self, be: FileBackend, capacity: int) -> None:
        self.root, self.capacity, self.refused = Path(be.root).parent, capacity, 0
        self._write = be._write

    def __call__(self, path: str, key: str, payload) -> None:  # noqa: ANN001
        if disk_bytes(self.root) + HEADER_BYTES + payload.nbytes > self.capacity:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._write(path, key, payload)


def test_full_disk_evicts_lru_and_lowers_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    be = FileBackend(tmp_path / "l3", NS, budget_bytes=1 << 20)  # the disk holds far less
    disk = FullDisk(be, capacity=3 * SIZE + SIZE // 2)
    monkeypatch.setattr(be, "_write", disk)
    assert be.batch_set(keys("k0", "k1", "k2"), [page(0), page(1), page(2)]) == 3
    assert disk.refused == 0
    assert be.batch_set(keys("k3"), [page(3)]) == 1
    assert disk.refused == 1
    assert be.stats()["budget_bytes"] == 3 * SIZE
    assert be.keys() == ["k1", "k2", "k3"] and be.stats()["evictions"] == 1
    # The lowered budget now evicts before the disk refuses.
    assert be.batch_set(keys("k4", "k5"), [page(4), page(5)]) == 2
    assert disk.refused == 1
    assert be.keys() == ["k3", "k4", "k5"]
    assert be.stats()["bytes_used"] == 3 * SIZE == stored_bytes(be)
    assert not be.errors
    assert sum("budget lowered" in r.getMessage() for r in caplog.records) == 1
    out = [torch.empty(PAGE) for _ in range(3)]
    assert be.batch_get(keys("k3", "k4", "k5"), out) == 3
    assert torch.equal(out[2], page(5))


def test_full_disk_retries_until_the_object_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = FileBackend(tmp_path / "l3", NS, budget_bytes=1 << 20)
    assert be.batch_set(keys("k0", "k1", "k2", "k3"), [page(i) for i in range(4)]) == 4
    disk = FullDisk(be, capacity=4 * SIZE)
    (tmp_path / "other").write_bytes(bytes(2 * SIZE))  # someone else filled the disk
    monkeypatch.setattr(be, "_write", disk)
    assert be.batch_set(keys("k4"), [page(4)]) == 1
    assert disk.refused == 3  # evicted k0, then k1, then k2
    assert be.keys() == ["k3", "k4"]
    assert be.stats()["budget_bytes"] == 2 * SIZE
    assert not be.errors


def test_full_disk_with_nothing_to_evict_is_a_no_space_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = FileBackend(tmp_path / "l3", NS, budget_bytes=1 << 20)
    disk = FullDisk(be, capacity=SIZE - 1)
    monkeypatch.setattr(be, "_write", disk)
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 0
    assert disk.refused == 1
    assert be.errors == {"no_space": 1}
    assert be.stats()["bytes_used"] == 0 and be.stats()["budget_bytes"] == 1 << 20


def test_touch_refreshes_recency_across_a_restart(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    ks = keys("k0", "k1", "k2", "k3")
    assert be.batch_set(ks, [page(i) for i in range(4)]) == 4
    for i, k in enumerate(ks):  # distinct old mtimes, whatever the clock's resolution
        os.utime(obj_path(be, k), ns=(10**18 + i, 10**18 + i))
    assert be.touch(keys("k0", "k1")) == 2
    assert be.keys() == ["k2", "k3", "k0", "k1"]
    be.close()
    fresh = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert fresh.keys() == ["k2", "k3", "k0", "k1"]
    obj_path(fresh, "k3").unlink()
    assert fresh.touch(keys("k2", "k3", "k0")) == 1
    assert fresh.errors == {"missing": 1}
    assert fresh.keys() == ["k0", "k1", "k2"]
    assert fresh.touch(keys("zz", "k0")) == 0


def test_check_integrity_finds_files_and_index_apart(tmp_path: Path) -> None:
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 20)
    assert be.batch_set(keys("k0", "k1"), [page(0), page(1)]) == 2
    be.check_integrity()
    stray = obj_path(be, "k1").parent / f".k1.x{file_io.TMP_SUFFIX}"  # a write left behind
    stray.write_bytes(b"x")
    with pytest.raises(IntegrityError, match="files and index disagree"):
        be.check_integrity()
    stray.unlink()
    obj_path(be, "k1").write_bytes(b"short")  # another size than indexed
    with pytest.raises(IntegrityError, match="'k1'"):
        be.check_integrity()
    assert be.batch_get(keys("k1"), [torch.zeros(PAGE)]) == 0  # a short read: dropped
    be.check_integrity()
    obj_path(be, "k0").unlink()  # removed behind the index
    with pytest.raises(IntegrityError, match="'k0'"):
        be.check_integrity()
    assert be.batch_get(keys("k0"), [torch.zeros(PAGE)]) == 0  # a miss, counted
    assert be.errors["missing"] == 1
    be.check_integrity()  # the miss dropped it from the index
    be._index.used += 1
    with pytest.raises(IntegrityError, match="bytes in use"):
        be.check_integrity()
