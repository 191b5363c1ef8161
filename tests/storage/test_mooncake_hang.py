"""Mooncake reads that hang: every call returns within ``timeout_s`` as a counted miss, a hung
call does not hold up the next ones, and its late answer never lands in memory the caller has
reused (a fence for registered buffers, the backend's own arena for bounced ones)."""

from __future__ import annotations

import threading
import time
from typing import Any

import mooncake_harness
import pytest
import torch
from factories import kv_of, make_cache, run_request
from mooncake_harness import MooncakeCluster

from kvtier.keys import Namespace, PageKey
from kvtier.storage.mooncake import MooncakeBackend

pytestmark = pytest.mark.mooncake

mooncake_cluster = mooncake_harness.mooncake_cluster
NS = Namespace("c" * 32)
TIMEOUT_S = 0.5
TOKENS = list(range(200, 233))  # 8 whole pages and a valid tail of 1


class Controls:
    """While ``hang`` is set, gets block until ``release`` is set, then really run (so a late
    answer writes into the buffers it was given); ``entered`` counts blocked gets."""

    def __init__(self) -> None:
        self.hang, self.release = threading.Event(), threading.Event()
        self.hang_puts = threading.Event()
        self.entered = 0
        self.removed: list[str] = []
        self.all_removed = threading.Event()
        self.expect_removed = -1


class HangingStore:
    """A real Mooncake client whose ``batch_get_into_multi_buffers`` obeys ``Controls``."""

    def __init__(self, ctl: Controls) -> None:
        self._real = mooncake_harness.MooncakeDistributedStore()
        self._ctl = ctl

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def batch_get_into_multi_buffers(self, names: Any, ptrs: Any, sizes: Any) -> Any:
        if self._ctl.hang.is_set():
            self._ctl.entered += 1
            self._ctl.release.wait()
        return self._real.batch_get_into_multi_buffers(names, ptrs, sizes)

    def batch_put_from_multi_buffers(self, names: Any, ptrs: Any, sizes: Any) -> Any:
        if self._ctl.hang_puts.is_set():
            self._ctl.entered += 1
            self._ctl.release.wait()
        return self._real.batch_put_from_multi_buffers(names, ptrs, sizes)

    def remove(self, name: str, force: bool) -> int:
        rc = self._real.remove(name, force)
        self._ctl.removed.append(name)
        if len(self._ctl.removed) == self._ctl.expect_removed:
            self._ctl.all_removed.set()
        return rc


def hanging_backend(cluster: MooncakeCluster, ns: Namespace, ctl: Controls) -> MooncakeBackend:
    b = MooncakeBackend(cluster.url(timeout_s=TIMEOUT_S), ns, store_cls=lambda: HangingStore(ctl))
    assert b.stats()["healthy"] == 1.0
    return b


def keys(n: int) -> list[PageKey]:
    return [PageKey(f"{i:032x}") for i in range(n)]


def test_hung_get_is_a_timeout_miss_and_the_next_get_runs(
    mooncake_cluster: MooncakeCluster,
) -> None:
    ctl = Controls()
    b = hanging_backend(mooncake_cluster, NS, ctl)
    pool = torch.zeros(8, 4096, dtype=torch.uint8)
    b.register_buffers([pool])
    data = list(torch.randint(0, 256, (4, 4096), dtype=torch.uint8))
    ks = keys(4)
    assert b.batch_set(ks, data) == 4
    assert b.read_fence() is None

    ctl.hang.set()
    t0 = time.monotonic()
    assert b.batch_get(ks, list(pool[:4])) == 0  # zero-copy into registered memory
    assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    assert ctl.entered == 1 and b.errors == {"timeout": 1}
    fence = b.read_fence()
    assert fence is not None and not fence.done()

    # The hung call keeps its thread and arena; the next call runs on others.
    assert b.wait_healthy(5.0)
    ctl.hang.clear()
    assert b.batch_get(ks, list(pool[4:])) == 4
    assert all(torch.equal(pool[4 + i], data[i]) for i in range(4))
    assert not fence.done()
    assert torch.count_nonzero(pool[:4]) == 0  # nothing has landed yet

    ctl.release.set()
    fence.result(timeout=30)
    # The late answer did write into the registered buffers: why callers honour the fence.
    assert all(torch.equal(pool[i], data[i]) for i in range(4))
    assert b.read_fence() is None
    assert b.errors == {"timeout": 1}
    b.close()


def test_late_answer_into_a_bounced_buffer_stays_in_the_arena(
    mooncake_cluster: MooncakeCluster,
) -> None:
    ctl = Controls()
    b = hanging_backend(mooncake_cluster, NS, ctl)
    data = list(torch.randint(0, 256, (2, 4096), dtype=torch.uint8))
    assert b.batch_set(keys(2), data) == 2
    ctl.hang.set()
    out = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]  # not registered
    assert b.batch_get(keys(2), out) == 0
    fence = b.read_fence()
    assert fence is not None
    ctl.release.set()
    fence.result(timeout=30)
    assert all(torch.count_nonzero(o) == 0 for o in out)
    assert b.wait_healthy(5.0)
    ctl.hang.clear()
    assert b.batch_get(keys(2), out) == 2
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))
    b.close()


def test_hung_put_is_a_timeout_miss_and_its_late_objects_are_removed(
    mooncake_cluster: MooncakeCluster,
) -> None:
    ctl = Controls()
    b = hanging_backend(mooncake_cluster, NS, ctl)
    pool = torch.zeros(4, 4096, dtype=torch.uint8)
    b.register_buffers([pool])
    pool.copy_(torch.randint(0, 256, (4, 4096), dtype=torch.uint8))
    ks = keys(3)
    ctl.hang_puts.set()
    ctl.expect_removed = 3
    t0 = time.monotonic()
    assert b.batch_set(ks, list(pool[:3])) == 0
    assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    assert ctl.entered == 1 and b.errors == {"timeout": 1}
    assert b.wait_healthy(5.0)
    # Meanwhile the caller reuses its pages; the late put may read them.
    pool[:3] = 0
    ctl.hang_puts.clear()
    assert b.batch_set(keys(4)[3:], list(pool[3:])) == 1  # the next put is not held up
    ctl.release.set()
    assert ctl.all_removed.wait(30)
    assert sorted(ctl.removed) == sorted(b.store_key(k) for k in ks)
    assert b.batch_exists(ks) == 0 and b.batch_exists(keys(4)[3:]) == 1
    b.close()


def _cache(tmp_path, backend_of) -> Any:  # noqa: ANN001
    c = make_cache(
        tmp_path, storage=None, prefetch_policy="wait_complete", device_pages=16, host_pages=32
    )
    c.attach_storage(backend_of(c.namespace))
    return c


def test_wait_complete_prefetch_is_released_within_the_timeout(
    mooncake_cluster: MooncakeCluster, tmp_path
) -> None:
    url = mooncake_cluster.url(timeout_s=TIMEOUT_S)
    seed = _cache(tmp_path, lambda ns: MooncakeBackend(url, ns))
    orig = kv_of(seed, run_request(seed, TOKENS)["locs"][:33])
    seed.drain()
    seed.close()

    ctl = Controls()
    c = _cache(tmp_path, lambda ns: hanging_backend(mooncake_cluster, ns, ctl))
    ctl.hang.set()
    m = c.match(TOKENS)
    assert m.storage_len == 33
    t0 = time.monotonic()
    pf = c.prefetch(m)
    pf.future.result(timeout=10)
    assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    assert ctl.entered == 1 and c.prefetch_ready(pf)
    assert c.finish_prefetch(pf) == 0
    assert c.match(TOKENS, probe_storage=False).host_len == 0
    # The abandoned read may still write into the fetch's host pages: they stay allocated.
    c.poll()
    assert c.controller.prefetcher.ops == [pf] and c.stats()["host_pages_used"] == 9
    c.check_integrity()

    ctl.release.set()
    for fence in pf.fences:
        fence.result(timeout=30)
    c.poll()
    assert c.controller.prefetcher.ops == [] and c.stats()["host_pages_used"] == 0
    assert c.stats()["prefetch_failed_pages"] == 9
    c.check_integrity()

    assert c.storage.wait_healthy(5.0)
    ctl.hang.clear()
    m = c.match(TOKENS)
    pf = c.prefetch(m)
    pf.future.result(timeout=10)
    assert c.finish_prefetch(pf) == 33
    m = c.match(TOKENS)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), orig)
    c.unlock(m.handle)
    assert c.storage.errors == {"timeout": 1}
    c.close()
