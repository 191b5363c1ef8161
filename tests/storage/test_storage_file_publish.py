"""How the file backend publishes an object: an unnamed file (``O_TMPFILE``) linked under its
name, or where that is refused, a named temp file renamed over it; either way readers only see
whole objects, an existing file is replaced, and nothing is left behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import file_io
from kvtier.storage.file import HEADER_BYTES, FileBackend

NS = Namespace("ns0")
SIZES = (4096, 3 << 20)  # one writev; pieces with the header written last

pytestmark = pytest.mark.skipif(
    not file_io._tmpfile_ok[0], reason="no O_TMPFILE or /proc here: only the named path runs"
)


def obj_path(be: FileBackend, key: str) -> Path:
    return Path(be.dir) / key[:2] / key


def entries(be: FileBackend) -> list[str]:
    return sorted(p.name for p in Path(be.dir).rglob("*") if p.is_file() and p.name[0] != ".")


def hidden(be: FileBackend) -> list[str]:
    return sorted(p.name for p in Path(be.dir).rglob(".*") if p.name != ".recency")


def page(seed: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def watch_writes(monkeypatch: pytest.MonkeyPatch, be: FileBackend) -> list[tuple[str, list]]:
    """Record, at every payload write, what the fd names and which files the backend holds."""
    seen: list[tuple[str, list]] = []
    real = file_io.writev_all

    def spy(fd: int, views: list[memoryview]) -> None:
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), entries(be) + hidden(be)))
        real(fd, views)

    monkeypatch.setattr(file_io, "writev_all", spy)
    return seen


def read_back(be: FileBackend, key: str, src: torch.Tensor) -> bool:
    out = torch.zeros_like(src)
    return be.batch_get([PageKey(key)], [out]) == 1 and torch.equal(out, src)


@pytest.mark.parametrize("size", SIZES)
def test_unnamed_file_is_written_then_linked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(file_io, "_tmpfile_ok", [True])
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 24, io_threads=1)
    seen = watch_writes(monkeypatch, be)
    src = page(1, size)
    assert be.batch_set([PageKey("ab01")], [src]) == 1
    assert seen and all(name.endswith("(deleted)") and files == [] for name, files in seen)
    assert entries(be) == ["ab01"] and hidden(be) == []
    assert obj_path(be, "ab01").stat().st_size == file_io.file_bytes(size)
    assert read_back(be, "ab01", src)
    assert file_io._tmpfile_ok == [True]


@pytest.mark.parametrize("fsync", [False, True])
def test_existing_file_is_replaced_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    monkeypatch.setattr(file_io, "_tmpfile_ok", [True])
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 24, io_threads=1, fsync=fsync)
    target = obj_path(be, "ab01")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"stale bytes of an unindexed file")
    old_inode = target.stat().st_ino
    src = page(2, 4096)
    assert be.batch_set([PageKey("ab01")], [src]) == 1
    assert target.stat().st_ino != old_inode and target.stat().st_size == HEADER_BYTES + 4096
    assert entries(be) == ["ab01"] and hidden(be) == []
    assert read_back(be, "ab01", src) and be.errors == {}


def test_refused_unnamed_file_falls_back_to_named_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = [True]
    monkeypatch.setattr(file_io, "_tmpfile_ok", flag)
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 24, io_threads=1)
    real_open = os.open
    refused = 0

    def no_tmpfile(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        nonlocal refused
        if flags & file_io._O_TMPFILE == file_io._O_TMPFILE:
            refused += 1
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", no_tmpfile)
    seen = watch_writes(monkeypatch, be)
    srcs = [page(3, 4096), page(4, 4096)]
    assert be.batch_set([PageKey("ab01"), PageKey("ab02")], srcs) == 2
    assert refused == 1 and flag == [False]  # asked once, then the named path only
    assert [n.rsplit("/", 1)[1].startswith(f".ab0{i + 1}.") for i, (n, _) in enumerate(seen)] == [
        True,
        True,
    ]
    assert all(n.endswith(".tmp") for n, _ in seen)
    assert entries(be) == ["ab01", "ab02"] and hidden(be) == []
    assert read_back(be, "ab01", srcs[0]) and read_back(be, "ab02", srcs[1])


def test_refused_link_rewrites_through_named_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = [True]
    monkeypatch.setattr(file_io, "_tmpfile_ok", flag)
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 24, io_threads=1)
    real_link = os.link
    refused = 0

    def no_proc_link(src: str, dst: str, **kw: object) -> None:
        nonlocal refused
        if src.startswith("/proc/self/fd/"):
            refused += 1
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", no_proc_link)
    seen = watch_writes(monkeypatch, be)
    src = page(5, 4096)
    assert be.batch_set([PageKey("ab01")], [src]) == 1
    assert refused == 1 and flag == [False]
    assert [n.endswith("(deleted)") for n, _ in seen] == [True, False]  # unnamed, then named
    assert entries(be) == ["ab01"] and hidden(be) == []
    assert read_back(be, "ab01", src) and be.errors == {}


def test_failed_link_is_a_fault_without_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_io, "_tmpfile_ok", [True])
    be = FileBackend(tmp_path, NS, budget_bytes=1 << 24, io_threads=1)

    def full(src: str, dst: str, **kw: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "link", full)
    assert be.batch_set([PageKey("ab01"), PageKey("ab02")], [page(6, 64), page(7, 64)]) == 0
    assert be.errors == {"io": 1}
    assert entries(be) == [] and hidden(be) == []
    assert be.stats()["bytes_used"] == 0 and be.batch_exists([PageKey("ab01")]) == 0
    assert file_io._tmpfile_ok == [True]  # a fault, not a refusal: unnamed files stay on


def test_a_relative_storage_dir_publishes_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    be = FileBackend("rel-l3", NS, 1 << 30)
    keys, pages = (
        [PageKey("ab" + "0" * 30), PageKey("cd" + "1" * 30)],
        [page(1, 4096), page(2, 999)],
    )
    assert be.batch_set(keys, pages) == 2
    monkeypatch.chdir("/")  # a later chdir does not move the tier
    out = [torch.zeros_like(p) for p in pages]
    assert be.batch_get(keys, out) == 2
    assert all(torch.equal(a, b) for a, b in zip(out, pages, strict=True))
    assert entries(be) == sorted(keys) and obj_path(be, keys[0]).is_relative_to(tmp_path)


def test_publishing_to_a_relative_path_links_it_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    payload = page(3, 4096).numpy()
    file_io.write_object("sub/obj", NS, "k" * 32, payload, fsync=False)
    assert (tmp_path / "sub" / "obj").stat().st_size == HEADER_BYTES + 4096
