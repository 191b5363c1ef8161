"""The file backend's read path for objects up to ``READ_CHUNK`` (one payload read, inline)
and larger ones (in pieces): exact faults for truncated, extended and flipped files, and the
``O_NOATIME`` open with its fallback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvtier.errors import StorageError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope, file_io
from kvtier.storage.base import cpu_byte_views
from kvtier.storage.file import FileBackend
from kvtier.storage.file_io import READ_CHUNK, CorruptObject, read_object

NS = Namespace("ns0")
KEY = PageKey("ab01")
SIZES = (64, READ_CHUNK, READ_CHUNK + 1, 3 * READ_CHUNK + 5)


@pytest.fixture
def be(tmp_path: Path) -> FileBackend:
    b = FileBackend(tmp_path, NS, budget_bytes=64 << 20, io_threads=1)
    yield b
    b.check_integrity()
    b.close()


def stored(be: FileBackend, size: int) -> tuple[torch.Tensor, Path]:
    src = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)
    )
    assert be.batch_set([KEY], [src]) == 1
    return src, Path(be.dir) / KEY[:2] / KEY


def read(path: Path, dest: torch.Tensor) -> None:
    (view,) = cpu_byte_views([dest])
    read_object(str(path), NS, KEY, envelope.expected_prefix(NS, KEY, dest.nbytes), view)


@pytest.mark.parametrize("size", SIZES)
def test_whole_object_reads_back(be: FileBackend, size: int) -> None:
    src, path = stored(be, size)
    out = torch.zeros_like(src)
    read(path, out)
    assert torch.equal(out, src)


@pytest.mark.parametrize("size", SIZES)
def test_truncated_payload_is_a_short_read(be: FileBackend, size: int) -> None:
    src, path = stored(be, size)
    os.truncate(path, file_io.file_bytes(size) - 1)
    with pytest.raises(
        CorruptObject, match=f"^short_read: file has {size - 1} of {size} payload bytes$"
    ):
        read(path, torch.zeros_like(src))
    assert be.batch_get([KEY], [torch.zeros_like(src)]) == 0
    assert be.errors == {"short_read": 1} and not path.exists()


@pytest.mark.parametrize("size", SIZES)
def test_extended_file_is_a_checksum_fault(be: FileBackend, size: int) -> None:
    src, path = stored(be, size)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptObject, match=f"^checksum: file size exceeds header \\+ {size}$"):
        read(path, torch.zeros_like(src))
    assert be.batch_get([KEY], [torch.zeros_like(src)]) == 0
    assert be.errors == {"checksum": 1} and not path.exists()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("where", ["first", "last"])
def test_flipped_payload_byte_is_a_checksum_fault(be: FileBackend, size: int, where: str) -> None:
    src, path = stored(be, size)
    raw = bytearray(path.read_bytes())
    raw[file_io.payload_at(size) if where == "first" else -1] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObject, match="^checksum: payload checksum mismatch$"):
        read(path, torch.zeros_like(src))
    assert be.batch_get([KEY], [torch.zeros_like(src)]) == 0
    assert be.errors == {"checksum": 1} and not path.exists()


def test_wrong_buffer_size_is_not_corrupt(be: FileBackend) -> None:
    src, path = stored(be, 64)
    with pytest.raises(
        StorageError, match="^checksum: stored payload is 64 bytes, buffer 65$"
    ) as e:
        read(path, torch.zeros(65, dtype=torch.uint8))
    assert not isinstance(e.value, CorruptObject) and path.exists()


def spy_open(monkeypatch: pytest.MonkeyPatch, refuse: int | None) -> list[int]:
    """Record the flags of every object open; with ``refuse``, fail opens asking O_NOATIME."""
    flags_seen: list[int] = []
    real = os.open

    def fake(path: str, flags: int, *a: object, **kw: object) -> int:
        if "/ab/" in str(path):
            flags_seen.append(flags)
            if refuse is not None and flags & os.O_NOATIME:
                raise OSError(refuse, os.strerror(refuse), path)
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", fake)
    return flags_seen


def test_reads_open_without_atime_updates(be: FileBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_io, "_read_flags", [os.O_RDONLY | os.O_CLOEXEC | os.O_NOATIME])
    src, _ = stored(be, 64)
    seen = spy_open(monkeypatch, None)
    out = torch.zeros_like(src)
    assert be.batch_get([KEY], [out]) == 1 and torch.equal(out, src)
    assert seen == [os.O_RDONLY | os.O_CLOEXEC | os.O_NOATIME]


def test_noatime_refused_for_a_file_not_owned_is_dropped(
    be: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = [os.O_RDONLY | os.O_CLOEXEC | os.O_NOATIME]
    monkeypatch.setattr(file_io, "_read_flags", flags)
    src, _ = stored(be, 64)
    seen = spy_open(monkeypatch, errno.EPERM)
    for _ in range(2):
        out = torch.zeros_like(src)
        assert be.batch_get([KEY], [out]) == 1 and torch.equal(out, src)
    plain = os.O_RDONLY | os.O_CLOEXEC
    assert seen == [plain | os.O_NOATIME, plain, plain] and flags == [plain]
    assert be.errors == {}


def test_unreadable_file_is_a_permission_fault_not_retried(
    be: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = [os.O_RDONLY | os.O_CLOEXEC | os.O_NOATIME]
    monkeypatch.setattr(file_io, "_read_flags", flags)
    src, path = stored(be, 64)
    seen = spy_open(monkeypatch, errno.EACCES)
    assert be.batch_get([KEY], [torch.zeros_like(src)]) == 0
    assert be.errors == {"permission": 1} and len(seen) == 1
    assert flags == [os.O_RDONLY | os.O_CLOEXEC | os.O_NOATIME] and path.exists()
