"""L3 objects of a window pool set (anchor ``kv`` + window ``swa``) through ``StorageIO``: a
page object per page and a window object (``state_key``) per page with window rows; restores
byte-exact with each page's window flag; exact object counts; window rows that arrive after
the page was stored; a pool set without a partial component keeps one object per page."""

from __future__ import annotations

import time
from collections.abc import Sequence

import mooncake_harness
import pytest
import torch

from kvtier.controller.records import PrefetchOp
from kvtier.controller.storage_io import CHUNK_PAGES, StorageIO
from kvtier.keys import Namespace, PageKey, chain_keys, state_key
from kvtier.metrics import Metrics
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.storage.base import StorageBackend
from kvtier.storage.file import FileBackend
from kvtier.tree.node import Node

mooncake_cluster = mooncake_harness.mooncake_cluster
PS = 4
KV = PoolSpec("kv", 2, (2, 1, 4), torch.float32)
SWA = PoolSpec("swa", 2, (2, 1, 4), torch.float32, kind="window", window=8)
NS = Namespace("c" * 32)


class Counting(StorageBackend):
    """Counts what reaches the backend it wraps."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.exists: list[int] = []  # keys per call
        self.gets: list[list[PageKey]] = []
        self.got = 0
        self.sets: list[list[PageKey]] = []

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        self.exists.append(len(keys))
        return self.inner.batch_exists(keys)

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        self.gets.append(list(keys))
        got = self.inner.batch_get(keys, buffers)
        self.got += got
        return got

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        self.sets.append(list(keys))
        return self.inner.batch_set(keys, buffers)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        self.inner.register_buffers(buffers)

    def close(self) -> None:
        self.inner.close()


def storage_io_of(backend: StorageBackend, n: int, specs=(KV, SWA)) -> tuple[StorageIO, Counting]:
    host = HostPool(list(specs), 2 * n, PS)
    g = torch.Generator().manual_seed(n)
    for b in host.buffers.values():
        b.copy_(torch.randn(b.shape, generator=g))
    counting = Counting(backend)
    return StorageIO(counting, host, Metrics(), PS), counting


def keys_of(n: int, seed: int = 0) -> list[PageKey]:
    return chain_keys(NS, [seed * 1000 + t for t in range(n * PS)], PS)


def write(io: StorageIO, keys: list[PageKey], pages: torch.Tensor, ckpt: torch.Tensor | None):
    node = Node(1, None, b"")
    node.host, node.ckpt = pages, ckpt
    op = io.write([node], [keys])
    assert bool(op.future.result().all())
    assert io.reap_writes()[0][1]


def restore(io: StorageIO, keys: list[PageKey], pages: torch.Tensor, partial: bool = True):
    op = PrefetchOp(None, (), (), keys, pages, time.monotonic() + 30)
    if partial:
        op.ckpt = torch.zeros(len(keys), dtype=torch.bool)
    io.read(op)
    op.future.result()
    assert op.done_pages == len(keys)
    return op


def rows(io: StorageIO, name: str, pages: torch.Tensor) -> torch.Tensor:
    return io.host.read_pages(name, pages)


def roundtrip(backend: StorageBackend) -> None:
    """Six pages, window rows on three of them: restored byte-exact, flags as stored, and the
    window rows of the pages without them left as they were in the destination."""
    flags = torch.tensor([False, True, False, False, True, True])
    n = flags.numel()
    io, counting = storage_io_of(backend, n)
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    keys = keys_of(n)
    write(io, keys, src, flags.clone())
    assert counting.sets == [keys, [state_key(keys[i]) for i in (1, 4, 5)]]
    before = rows(io, "swa", dst)
    op = restore(io, keys, dst)
    assert op.ckpt.tolist() == flags.tolist()
    assert torch.equal(rows(io, "kv", dst), rows(io, "kv", src))
    assert torch.equal(rows(io, "swa", dst[flags]), rows(io, "swa", src[flags]))
    assert torch.equal(rows(io, "swa", dst[~flags]), before[~flags])
    io.close()


def test_roundtrip_with_and_without_window_rows_file(tmp_path) -> None:
    roundtrip(FileBackend(str(tmp_path), NS, 1 << 24))


@pytest.mark.mooncake
def test_roundtrip_with_and_without_window_rows_mooncake(mooncake_cluster) -> None:
    from kvtier.storage.mooncake import MooncakeBackend

    roundtrip(MooncakeBackend(mooncake_cluster.url(), NS))


def test_objects_written_and_read_per_restore(tmp_path) -> None:
    """40 pages (two prefetch chunks), window rows on the last five: 45 objects written in two
    calls; a restore reads 45 objects (a call per chunk of page objects, one per window
    object) after one existence probe per page."""
    n, w = 40, 5
    assert CHUNK_PAGES == 32
    io, counting = storage_io_of(FileBackend(str(tmp_path), NS, 1 << 24), n)
    keys = keys_of(n)
    flags = torch.zeros(n, dtype=torch.bool)
    flags[n - w :] = True
    write(io, keys, torch.arange(n), flags)
    assert [len(s) for s in counting.sets] == [n, w]
    op = restore(io, keys, torch.arange(n, 2 * n))
    assert op.ckpt.tolist() == flags.tolist()
    assert [len(g) for g in counting.gets] == [32, 8, 1, 1, 1, 1, 1]
    assert counting.gets[2:] == [[state_key(k)] for k in keys[n - w :]]
    assert counting.got == n + w
    assert counting.exists == [1] * n
    io.close()


def test_a_pool_set_without_a_partial_component_keeps_one_object_per_page(tmp_path) -> None:
    n = 40
    io, counting = storage_io_of(FileBackend(str(tmp_path), NS, 1 << 24), n, specs=(KV,))
    keys = keys_of(n)
    write(io, keys, torch.arange(n), None)
    assert counting.sets == [keys]
    dst = torch.arange(n, 2 * n)
    op = restore(io, keys, dst, partial=False)
    assert op.ckpt is None
    assert counting.gets == [keys[:32], keys[32:]] and counting.got == n
    assert counting.exists == []
    assert torch.equal(rows(io, "kv", dst), rows(io, "kv", torch.arange(n)))
    io.close()


def test_window_rows_that_arrive_later_are_stored_and_restored(tmp_path) -> None:
    """Pages stored without window rows, written again once their rows arrived (what a
    window-only backup does): the page objects stay as they were, the window objects are
    written, and a restore brings the later rows back flagged."""
    n = 4
    backend = FileBackend(str(tmp_path), NS, 1 << 24)
    io, counting = storage_io_of(backend, n)
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    keys = keys_of(n, seed=1)
    write(io, keys, src, torch.zeros(n, dtype=torch.bool))
    assert backend.stats()["objects"] == n
    op = restore(io, keys, dst)
    assert op.ckpt.tolist() == [False] * n
    late = torch.randn(rows(io, "swa", src[2:]).shape)
    io.host.write_pages("swa", src[2:], late)
    write(io, keys, src, torch.tensor([False, False, True, True]))
    assert counting.sets[-1] == [state_key(k) for k in keys[2:]]
    assert backend.stats()["objects"] == n + 2
    op = restore(io, keys, dst)
    assert op.ckpt.tolist() == [False, False, True, True]
    assert torch.equal(rows(io, "swa", dst[2:]), late)
    assert torch.equal(rows(io, "kv", dst), rows(io, "kv", src))
    io.close()
