"""The storage I/O's leases on a relocatable host pool (``host_compaction``): a fetch's pages
and a write's pages are leased from submission until the I/O thread is done with them, so a
compaction meanwhile leaves them where they are; a write the backend abandoned by timeout keeps
its leases until its fence completes, and a page the tree lets go of meanwhile is freed then."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from factories import WINDOW_SPECS, cache_config

from kvtier import TieredCache
from kvtier.storage.file import FileBackend

SHAPE = (2, 1, 4)
SPECS = list(WINDOW_SPECS)
TOKENS = list(range(300, 324))  # 6 whole pages


def make(tmp_path, **kw) -> TieredCache:  # noqa: ANN001
    cfg = cache_config(
        tmp_path / "l3", host_compaction="eager", compaction="eager", debug_checks=True, **kw
    )
    return TieredCache(cfg, SPECS)


def run(c: TieredCache, tokens: list[int], seed: int = 0) -> torch.Tensor:
    """One request: the uncached tokens get seeded anchor and window rows; returns the anchor
    rows of every token (what a restore must give back)."""
    m = c.match(tokens)
    c.lock(m.handle)
    ld = c.load(m)
    new = c.alloc(len(tokens) - ld.locs.numel())[: len(tokens) - ld.locs.numel()]
    g = torch.Generator().manual_seed(seed)
    kv = c.kv_buffers
    for name in ("kv", "swa"):
        slots = kv.slots(new, name).to(kv.device)
        for layer in range(2):
            rows = torch.randn((new.numel(), *SHAPE), generator=g)
            kv.layer(layer, name)[slots] = rows.to(kv.device)
    locs = torch.cat([ld.locs, new])
    c.finish(tokens, locs, ld.locs.numel(), m.handle)
    return anchor(c, locs)


def anchor(c: TieredCache, locs: torch.Tensor) -> torch.Tensor:
    kv = c.kv_buffers
    slots = kv.slots(locs).to(kv.device)
    return torch.stack([kv.layer(i)[slots] for i in range(2)]).cpu()


class Gated(FileBackend):
    """File backend whose reads and writes wait for their gate (in flight as long as a test
    needs), and whose write fence is a future the test completes."""

    read_gate: threading.Event
    write_gate: threading.Event
    fence: Future | None = None

    def batch_get(self, keys, buffers):  # noqa: ANN001, ANN201
        self.read_gate.wait()
        return super().batch_get(keys, buffers)

    def batch_set(self, keys, buffers):  # noqa: ANN001, ANN201
        self.write_gate.wait()
        return super().batch_set(keys, buffers)

    def write_fence(self) -> Future | None:
        return self.fence


@pytest.fixture
def gate():  # noqa: ANN201
    """Gates a cache's backend; every gate opens when the test ends, so a failed assertion
    never leaves the I/O thread waiting."""
    made: list[Gated] = []

    def put(c: TieredCache) -> Gated:
        g = Gated(c.storage.root, c.namespace, c.config.storage_bytes)
        g.read_gate, g.write_gate = threading.Event(), threading.Event()
        g.read_gate.set()
        g.write_gate.set()
        c.controller.io.backend = g
        made.append(g)
        return g

    yield put
    for g in made:
        g.read_gate.set()
        g.write_gate.set()


def test_a_fetch_holds_its_pages_still_until_committed(tmp_path, gate):
    c = make(tmp_path)
    want = run(c, TOKENS)
    c.drain()
    c.close()
    c = make(tmp_path)
    g = gate(c)
    g.read_gate.clear()
    host = c.host_pool
    spare = host.alloc_pages(2)  # below the fetch's pages: freeing them opens a hole
    m = c.match(TOKENS)
    pf = c.prefetch(m)
    assert pf.pages.tolist() == [2, 3, 4, 5, 6, 7]
    assert host.lease_count(pf.pages).tolist() == [1] * 6
    before = host.physical(pf.pages, "kv").tolist()
    host.free_pages(spare)
    host.compact()
    assert host.physical(pf.pages, "kv").tolist() == before  # leased: not moved
    g.read_gate.set()
    pf.future.result()
    assert c.finish_prefetch(pf) == len(TOKENS)
    assert host.lease_count(pf.pages).tolist() == [0] * 6
    host.compact()  # free to move now
    assert host.physical(pf.pages, "kv").tolist() != before
    m = c.match(TOKENS)
    c.lock(m.handle)
    assert torch.equal(anchor(c, c.load(m).locs), want)
    c.unlock(m.handle)
    c.drain()
    c.close()


def test_a_write_holds_its_pages_still_until_reaped(tmp_path, gate):
    c = make(tmp_path)
    g = gate(c)
    g.write_gate.clear()
    run(c, TOKENS)
    while not c.controller.io.pinned():
        c.poll()  # the backup lands, then its storage write starts and waits at the gate
    (node,) = {sp.node for sp in c.controller.io.pinned()}
    assert c.host_pool.lease_count(node.host).tolist() == [1] * 6
    g.write_gate.set()
    c.drain()
    assert c.host_pool.lease_count(node.host).tolist() == [0] * 6
    assert c.match(TOKENS).handle.locked is None
    c.close()


def test_an_abandoned_write_keeps_its_leases_until_its_fence(tmp_path, gate):
    c = make(tmp_path, write_policy="write_through")
    g = gate(c)
    g.fence = Future()  # a timed-out put may still be reading the pages
    run(c, TOKENS)
    c.drain()
    host = c.host_pool
    pages = host.allocator.used
    assert pages == 6
    c.flush()  # the tree lets go of every copy; the leased pages wait for the fence
    assert host.allocator.used == 6
    assert c.stats()["host_pages_used"] == 6
    c.check_integrity()
    g.fence.set_result(None)
    c.poll()
    assert host.allocator.used == 0
    assert not c.in_flight()
    c.close()
