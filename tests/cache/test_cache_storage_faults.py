"""Prefetch policies and storage faults: a fault is a miss or a dropped backup, never garbage."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from factories import kv_of, run_request
from factories import make_cache as _make_cache

from kvtier.controller import prefetch as prefetch_mod
from kvtier.storage.file import FileBackend

TOKENS = list(range(200, 233))  # 33 tokens: 8 whole pages and a valid tail of 1


def make_cache(tmp_path, **kw):
    return _make_cache(tmp_path, **{"device_pages": 16, "host_pages": 32, **kw})


def _seed_storage(tmp_path) -> torch.Tensor:
    c = make_cache(tmp_path)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][:33])
    c.close()
    return orig


class GatedFile(FileBackend):
    """File backend whose reads wait for ``gate`` (deterministic in-flight prefetches)."""

    gate: threading.Event

    def batch_get(self, keys, buffers):
        self.gate.wait()
        return super().batch_get(keys, buffers)


def _gated_cache(tmp_path, policy, **kw):
    c = make_cache(tmp_path, prefetch_policy=policy, **kw)
    gated = GatedFile(c.storage.root, c.namespace, c.config.storage_bytes)
    gated.gate = threading.Event()
    c.controller.io.backend = gated
    return c, gated


def test_best_effort_never_waits_and_pages_arrive_later(tmp_path):
    orig = _seed_storage(tmp_path)
    c, gated = _gated_cache(tmp_path, "best_effort")
    m = c.match(TOKENS)
    assert m.storage_len == 33
    pf = c.prefetch(m)
    assert c.prefetch_ready(pf)
    assert c.finish_prefetch(pf) == 0  # nothing arrived yet: the request recomputes
    assert c.match(TOKENS).host_len == 0
    gated.gate.set()
    pf.future.result()
    c.poll()
    m = c.match(TOKENS)
    assert (m.host_len, m.storage_len) == (33, 0)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), orig)
    c.unlock(m.handle)
    c.poll()
    c.check_integrity()
    c.close()


def test_wait_complete_waits_for_every_page(tmp_path):
    _seed_storage(tmp_path)
    c, gated = _gated_cache(tmp_path, "wait_complete")
    pf = c.prefetch(c.match(TOKENS))
    assert not c.prefetch_ready(pf)
    gated.gate.set()
    pf.future.result()
    assert c.prefetch_ready(pf)
    assert c.finish_prefetch(pf) == 33
    c.check_integrity()
    c.close()


def test_timeout_gives_up_at_the_deadline(tmp_path, monkeypatch):
    _seed_storage(tmp_path)
    now = [1000.0]
    monkeypatch.setattr(prefetch_mod.time, "monotonic", lambda: now[0])
    c, gated = _gated_cache(tmp_path, "timeout", prefetch_timeout_s=2.0)
    pf = c.prefetch(c.match(TOKENS))
    now[0] += 1.9
    assert not c.prefetch_ready(pf)
    now[0] += 0.2
    assert c.prefetch_ready(pf)
    assert c.finish_prefetch(pf) == 0
    gated.gate.set()
    c.drain()
    assert c.match(TOKENS).host_len == 33  # late pages still become visible
    c.check_integrity()
    c.close()


def _object_paths(tmp_path) -> list[str]:
    out = []
    for root, _, files in os.walk(tmp_path / "l3"):
        out += [os.path.join(root, f) for f in files]
    return out


def _page_files_in_order(c) -> list[str]:
    from kvtier.keys import chain_keys

    return [c.storage._path(k) for k in chain_keys(c.namespace, TOKENS, 4)]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_object_is_a_miss_not_garbage(tmp_path, damage):
    orig = _seed_storage(tmp_path)
    c = make_cache(tmp_path)
    victim = _page_files_in_order(c)[5]  # page 5 of 9
    with open(victim, "r+b") as f:
        if damage == "flip":
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
        else:
            f.truncate(os.path.getsize(victim) - 3)
    m = c.match(TOKENS)
    assert m.storage_len == 33  # existence looks fine; the read verifies
    pf = c.prefetch(m)
    pf.future.result()
    assert c.finish_prefetch(pf) == 20  # pages 0..4 verified, page 5 failed
    kind = "checksum" if damage == "flip" else "short_read"
    assert c.stats()["storage_errors"] == {kind: 1}
    assert c.stats()["prefetch_failed_pages"] == 4
    assert not os.path.exists(victim)
    m = c.match(TOKENS)
    assert (m.host_len, m.storage_len) == (20, 0)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), orig[:, :20])
    c.unlock(m.handle)
    c.poll()
    c.check_integrity()
    c.close()


class FullDisk(FileBackend):
    def batch_set(self, keys, buffers):
        self.fault("no_space", "simulated ENOSPC")
        return 0


def test_full_disk_drops_backups_without_crashing(tmp_path):
    c = make_cache(tmp_path)
    c.controller.io.backend = FullDisk(c.storage.root, c.namespace, c.config.storage_bytes)
    run_request(c, TOKENS)
    c.drain()
    s = c.stats()
    assert s["dropped_storage_backups"] == 9 and s["storage_backup_pages"] == 0
    assert s["storage_errors"] == {"no_space": 1}
    (node,) = c.tree.nodes()
    assert node.host is not None and not node.in_storage
    assert c.match(TOKENS).device_len == 33  # the device and host copies are unaffected
    c.check_integrity()
    c.close()


def test_unreadable_directory_is_a_miss(tmp_path):
    _seed_storage(tmp_path)
    c = make_cache(tmp_path)
    for p in _page_files_in_order(c):
        os.remove(p)
        os.mkdir(p)  # a directory where an object file should be: reads fail with EISDIR
    m = c.match(TOKENS)
    if m.storage_len:
        pf = c.prefetch(m)
        pf.future.result()
        assert c.finish_prefetch(pf) == 0
    assert c.match(TOKENS).host_len == 0
    c.check_integrity()
    c.close()


def test_concurrent_prefetches_of_one_prefix_share_the_reads(tmp_path):
    orig = _seed_storage(tmp_path)
    c, gated = _gated_cache(tmp_path, "wait_complete")
    longer = TOKENS[:32] + list(range(900, 909))  # same 8 stored pages (not the tail) + 2
    a = c.prefetch(c.match(TOKENS))
    b = c.prefetch(c.match(longer))
    assert b.deps == [a] and b.keys == []  # nothing of its own to read
    assert not c.prefetch_ready(b)
    gated.gate.set()
    a.future.result()
    assert c.prefetch_ready(b)
    assert c.finish_prefetch(b) == 0
    assert c.match(longer).host_len == 32  # b's wait made a's pages visible
    assert c.finish_prefetch(a) == 33
    assert c.stats()["prefetched_pages"] == 9
    m = c.match(longer)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), orig[:, :32])
    c.unlock(m.handle)
    c.poll()
    assert c.controller.prefetcher.ops == []
    c.check_integrity()
    c.close()
