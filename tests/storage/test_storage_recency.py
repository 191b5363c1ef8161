"""Storage recency follows use at every tier: a prefix served from device or host keeps its L3
objects (and so every conversation stored behind it) from being evicted first, and objects
found gone are written again."""

from __future__ import annotations

import os

import torch
from factories import PS, kv_of, make_cache, run_request

from kvtier.keys import chain_keys
from kvtier.storage.file import HEADER_BYTES

SYS = list(range(1000, 1032))  # a shared system prompt: 8 pages
CONVERSATIONS = 30
BUDGET_OBJECTS = 20


def conversation(i: int) -> list[int]:
    return SYS + list(range(2000 + 16 * i, 2016 + 16 * i))  # + 4 pages of its own


def small_l3(tmp_path, **kw):  # noqa: ANN001, ANN201
    probe = make_cache(tmp_path, storage=None)
    size = HEADER_BYTES + probe.host_pool.page_bytes
    probe.close()
    return make_cache(
        tmp_path, device_pages=16, host_pages=16, storage_bytes=BUDGET_OBJECTS * size, **kw
    )


def test_shared_prefix_hit_on_device_stays_in_storage(tmp_path) -> None:
    c = small_l3(tmp_path)
    sys_keys = chain_keys(c.namespace, SYS, PS)
    kv = {}
    for i in range(CONVERSATIONS):
        out = run_request(c, conversation(i), seed=i)
        if i:
            assert out["load"].device_tokens == len(SYS)  # never read from storage
        kv[i] = kv_of(c, out["locs"][: len(conversation(i))])
        c.drain()
    st = c.stats()
    assert st["storage_evictions"] == 8 + 4 * CONVERSATIONS - BUDGET_OBJECTS
    assert st["storage_objects"] == BUDGET_OBJECTS
    assert c.storage.batch_exists(sys_keys) == len(sys_keys)
    assert st["storage_errors"] == {}
    c.close()

    fresh = small_l3(tmp_path)  # empty device and host tiers, the same storage directory
    last = conversation(CONVERSATIONS - 1)
    m = fresh.match(last)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 0, len(last))
    pf = fresh.prefetch(m)
    pf.future.result()
    assert fresh.finish_prefetch(pf) == len(last)
    m = fresh.match(last)
    fresh.lock(m.handle)
    ld = fresh.load(m)
    assert ld.storage_tokens == len(last)
    assert torch.equal(kv_of(fresh, ld.locs), kv[CONVERSATIONS - 1])
    fresh.unlock(m.handle)
    fresh.check_integrity()
    fresh.close()


def test_object_deleted_behind_the_tree_is_written_again_after_use(tmp_path) -> None:
    c = make_cache(tmp_path, device_pages=16, host_pages=32)
    sys_keys = chain_keys(c.namespace, SYS, PS)
    first = run_request(c, conversation(0))
    orig = kv_of(c, first["locs"][: len(SYS)])
    c.drain()
    assert c.storage.batch_exists(sys_keys) == 8
    gone = c.storage._path(sys_keys[3])
    os.remove(gone)
    written = c.stats()["storage_backup_pages"]
    assert written == 12
    out = run_request(c, conversation(1), seed=1)
    assert out["load"].device_tokens == len(SYS)
    c.drain()  # the touch finds the object gone and re-queues the prefix's backup
    c.drain()  # that backup lands
    assert os.path.exists(gone)
    assert c.storage.batch_exists(sys_keys) == 8
    (sys_node,) = [n for n in c.tree.nodes() if n.tokens == tuple(SYS)]
    assert sys_node.in_storage
    st = c.stats()
    assert st["storage_errors"] == {"missing": 1}
    # conversation(1)'s own 4 pages, then the prefix again (7 of its 8 objects were present)
    assert st["storage_backup_pages"] == written + 4 + 8
    assert st["storage_objects"] == 16
    c.close()

    fresh = make_cache(tmp_path, device_pages=16, host_pages=32)
    m = fresh.match(SYS)
    assert m.storage_len == len(SYS)
    pf = fresh.prefetch(m)
    pf.future.result()
    assert fresh.finish_prefetch(pf) == len(SYS)
    m = fresh.match(SYS)
    fresh.lock(m.handle)
    assert torch.equal(kv_of(fresh, fresh.load(m).locs), orig)
    fresh.unlock(m.handle)
    fresh.close()


def test_object_evicted_from_storage_is_unmarked_and_rewritten(tmp_path) -> None:
    c = make_cache(tmp_path, device_pages=16, host_pages=32)
    sys_keys = chain_keys(c.namespace, SYS, PS)
    run_request(c, conversation(0))
    c.drain()
    c.storage._forget(sys_keys[0], delete=True)  # as LRU eviction drops an object
    run_request(c, conversation(1), seed=1)
    c.drain()
    c.drain()
    assert c.storage.batch_exists(sys_keys) == 8
    assert all(n.in_storage for n in c.tree.nodes())
    assert c.stats()["storage_errors"] == {}
    c.close()


def test_touch_queued_before_a_split_blames_only_the_node_that_lost_an_object(tmp_path) -> None:
    c = make_cache(tmp_path, device_pages=16, host_pages=32)
    keys0 = chain_keys(c.namespace, conversation(0), PS)
    run_request(c, conversation(0))
    c.drain()
    (whole,) = c.tree.nodes()
    m0 = c.match(conversation(0))
    c.lock(m0.handle)  # queues a touch of all 12 objects of ``whole``
    m1 = c.match(conversation(1))
    c.lock(m1.handle)  # splits ``whole`` into the prompt and conversation 0's own pages
    prompt = whole.parent
    assert prompt.tokens == tuple(SYS) and whole.tokens == tuple(conversation(0)[len(SYS) :])
    os.remove(c.storage._path(keys0[9]))
    c.drain()
    assert prompt.in_storage and not whole.in_storage
    c.drain()  # the re-queued backup of ``whole`` lands
    assert whole.in_storage and c.storage.batch_exists(keys0) == 12
    assert c.stats()["storage_errors"] == {"missing": 1}
    c.unlock(m1.handle)
    c.unlock(m0.handle)
    c.check_integrity()
    c.close()
