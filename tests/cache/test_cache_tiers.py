"""TieredCache end to end on CPU bookkeeping: write policies, load-back, storage round trips."""

from __future__ import annotations

import pytest
import torch
from factories import PS, SPEC, kv_of, make_cache, run_request

TOKENS = list(range(100, 117))  # 17 tokens: 4 whole pages + a valid tail of 1 (5 pages)


def test_device_hit_then_host_restore_is_byte_exact(tmp_path):
    c = make_cache(tmp_path)
    first = run_request(c, TOKENS)
    assert first["load"].locs.numel() == 0
    orig = kv_of(c, first["locs"][:17])
    c.drain()
    c.check_integrity()

    m = c.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (17, 0, 0)

    assert c.controller.evict_device(100) == 5
    c.check_integrity()
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len) == (0, 17)
    c.lock(m.handle)
    ld = c.load(m)
    assert (ld.device_tokens, ld.host_tokens, ld.storage_tokens) == (0, 17, 0)
    assert torch.equal(kv_of(c, ld.locs), orig)
    assert c.stats()["host_hit_tokens"] == 0  # counted once the request is admitted
    c.record_hits(m.handle)
    c.unlock(m.handle)
    c.drain()
    c.check_integrity()
    s = c.stats()
    assert s["host_hit_tokens"] == 17 and s["load_bytes"] == 5 * c.device_pool.page_bytes
    c.close()


def test_match_never_mutates(tmp_path):
    c = make_cache(tmp_path)
    run_request(c, TOKENS)
    before = [(n.id, n.lock_ref, n.last_access, n.hits, len(n.tokens)) for n in c.tree.nodes()]
    c.match(TOKENS[:9])  # ends inside the cached node
    after = [(n.id, n.lock_ref, n.last_access, n.hits, len(n.tokens)) for n in c.tree.nodes()]
    assert before == after
    c.close()


def test_write_through_backs_up_on_insert(tmp_path):
    c = make_cache(tmp_path, write_policy="write_through", storage=None)
    run_request(c, TOKENS)
    c.drain()
    (node,) = c.tree.nodes()
    assert node.host is not None and node.host.tolist() == [0, 1, 2, 3, 4]
    assert c.stats()["host_backup_pages"] == 5
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("share", [0.0, 0.8])
def test_write_through_paced_or_whole(tmp_path, share):
    c = make_cache(tmp_path, write_policy="write_through", storage=None, backup_share=share)
    mover = c.controller.mover
    assert mover is not None
    assert (mover.pacer is not None) == (share > 0 and mover.cuda)
    run_request(c, TOKENS)
    c.poll()  # paced: queues the backup's first chunk
    c.drain()
    (node,) = c.tree.nodes()
    assert node.host is not None and node.host.tolist() == [0, 1, 2, 3, 4]
    assert node.device is not None
    host = c.host_pool.page_bytes_view(SPEC.name)[:, node.host]
    dev = c.device_pool.page_bytes_view(SPEC.name)[:, node.device.to(c.device_pool.device)]
    assert torch.equal(host, dev.cpu())
    c.check_integrity()
    c.close()


def test_write_through_selective_waits_for_threshold(tmp_path):
    c = make_cache(
        tmp_path, write_policy="write_through_selective", write_threshold=2, storage=None
    )
    run_request(c, TOKENS)
    c.drain()
    (node,) = c.tree.nodes()
    assert node.host is None
    for expect_host in (False, True):  # hit 1, then hit 2 reaches the threshold
        m = c.match(TOKENS)
        c.lock(m.handle)
        c.unlock(m.handle)
        c.drain()  # any backup started lands
        assert (node.host is not None) is expect_host
    c.check_integrity()
    c.close()


def test_write_back_copies_on_eviction_only(tmp_path):
    c = make_cache(tmp_path, write_policy="write_back", storage=None)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][:17])
    c.drain()
    (node,) = c.tree.nodes()
    assert node.host is None and c.stats()["host_backup_pages"] == 0
    # Eviction never waits for a copy: the first try starts the backup and passes the node
    # over; once the copy landed the node can go.
    assert c.controller.evict_device(1) == 0
    assert node.device is not None and node.device_io == 1 and node.host is None
    c.check_integrity()
    c.drain()
    assert c.controller.evict_device(1) == 5
    assert node.device is None and node.host is not None
    assert c.stats()["host_backup_pages"] == 5
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len) == (0, 17)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), orig)
    c.unlock(m.handle)
    c.drain()
    c.check_integrity()
    c.close()


def test_storage_restore_in_fresh_cache_is_byte_exact(tmp_path):
    c = make_cache(tmp_path)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][:17])
    c.close()  # drains the storage writes

    fresh = make_cache(tmp_path)
    m = fresh.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 0, 17)
    pf = fresh.prefetch(m)
    assert pf is not None
    pf.future.result()
    assert fresh.prefetch_ready(pf)
    assert fresh.finish_prefetch(pf) == 17
    m = fresh.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 17, 0)
    fresh.lock(m.handle)
    ld = fresh.load(m)
    assert (ld.host_tokens, ld.storage_tokens) == (0, 17)
    assert torch.equal(kv_of(fresh, ld.locs), orig)
    fresh.unlock(m.handle)
    fresh.poll()
    fresh.check_integrity()
    fresh.close()


def test_storage_extends_a_partial_tree_hit(tmp_path):
    c = make_cache(tmp_path)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][:17])
    c.drain()
    c.controller.evict_device(100)
    c.controller.evict_host(100)
    run_request(c, TOKENS[:8] + [1, 2, 3, 4], seed=1)  # re-caches the first two pages only
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (8, 0, 9)
    pf = c.prefetch(m)
    pf.future.result()
    assert c.finish_prefetch(pf) == 9
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (8, 9, 0)
    c.lock(m.handle)
    ld = c.load(m)
    assert torch.equal(kv_of(c, ld.locs[8:]), orig[:, 8:])
    c.unlock(m.handle)
    c.drain()
    c.check_integrity()
    c.close()


def test_namespace_isolates_models(tmp_path):
    c = make_cache(tmp_path, model_fingerprint="model-a")
    run_request(c, TOKENS)
    c.close()
    other = make_cache(tmp_path, model_fingerprint="model-b")
    assert other.match(TOKENS).storage_len == 0
    other.close()
    same = make_cache(tmp_path, model_fingerprint="model-a")
    assert same.match(TOKENS).storage_len == 17
    same.close()


def test_locked_prefix_survives_pressure_and_alloc_fails_cleanly(tmp_path):
    import pytest

    from kvtier.errors import CapacityError

    c = make_cache(tmp_path, storage=None)
    run_request(c, TOKENS)
    c.drain()  # the tail's backup lands: unpinned, it can go under pressure
    m = c.match(TOKENS)
    c.lock(m.handle)
    c.load(m)
    # 4 of 8 pages are locked and 1 holds the request's copy of the (unpinned) tail; the
    # allocations continue the copy, so 5 * PS tokens need 5 more pages and 3 * PS need 3.
    with pytest.raises(CapacityError, match="device pool: 5 pages requested"):
        c.alloc(5 * PS)
    got = c.alloc(3 * PS)
    assert c.match(TOKENS).device_len == 16  # the tail went under pressure, the lock held
    c.free(got)
    c.unlock(m.handle)
    c.check_integrity()
    c.close()


def test_prometheus_export(tmp_path):
    from prometheus_client import generate_latest

    c = make_cache(tmp_path)
    run_request(c, TOKENS)
    c.drain()
    text = generate_latest(c.prometheus_registry()).decode()
    assert "kvtier_host_backup_pages_total 5.0" in text
    assert "kvtier_storage_backup_pages_total 5.0" in text
    assert "kvtier_host_pages_total 16.0" in text
    c.close()


def test_write_back_with_a_full_host_tier_drops_the_backup_and_says_so(tmp_path):
    """A host tier held entirely by locked prefixes cannot take a write-back copy: the device
    copy still goes (a cache that cannot evict cannot serve), the dropped backup is counted,
    never reported as a copy, and nothing waits."""
    c = make_cache(tmp_path, write_policy="write_back", storage=None, device_pages=5, host_pages=5)
    held = list(range(500, 520))
    run_request(c, held)
    c.controller.evict_device(5)  # starts held's backup
    c.drain()
    assert c.controller.evict_device(5) == 5  # held is host-only now
    m = c.match(held)
    c.lock(m.handle)  # and pinned there: the host tier is full
    assert c.stats()["host_pages_used"] == 5
    run_request(c, TOKENS)
    c.drain()
    (node,) = [n for n in c.tree.nodes() if n.on_device]
    assert c.controller.evict_device(4) == 5
    assert node.parent is None  # gone from the tree: no copy was made
    s = c.stats()
    assert s["dropped_host_backups"] == 5 and s["host_backup_pages"] == 5
    assert c.match(TOKENS).cached_len == 0
    c.unlock(m.handle)
    c.check_integrity()
    c.close()
