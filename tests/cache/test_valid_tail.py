"""Padded valid tails: the valid tail of a request's last, partial page is cached; lengths count
valid tokens; a served tail is handed out as a fresh copy page; extending it replaces it; host
and storage restores of a tail are byte-exact; the engine's outputs equal cold ones while it
recomputes fewer tokens (``test_valid_tail_engine``); under context parallelism the tail page
has an owner like any page (``tests/parallel/test_cp_valid_tail.py``)."""

from __future__ import annotations

import pytest
import torch
from factories import make_cache

from kvtier import CacheConfig, PoolSpec, TieredCache
from kvtier.errors import ConfigError
from kvtier.keys import chain_keys, tail_key

KV = PoolSpec("kv", 2, (2, 1, 4), torch.float32)
IDX = PoolSpec("index_rows", 2, (8,), torch.bfloat16, kind="sidecar", tokens_per_row=64)
STATE = PoolSpec("state", 3, (6,), torch.float32, kind="state")
T = list(range(100, 121))  # 21 tokens: one page of 16 and a tail of 5


def make(tmp_path, page_size: int = 16, specs=(KV,), **kw) -> TieredCache:
    base = dict(page_size=page_size, write_policy="write_back", debug_checks=True)
    return make_cache(tmp_path, specs, **{**base, **kw})


def rows(cache: TieredCache, pages: list[int]) -> dict[str, torch.Tensor]:
    """Every component's rows of device ``pages`` (padding included), on the CPU."""
    out = {}
    for s in cache.specs:
        r = s.rows_per_page(cache.page_size)
        idx = torch.cat([torch.arange(p * r, (p + 1) * r) for p in pages])
        out[s.name] = cache.device_pool.buffers[s.name][:, idx].cpu().clone()
    return out


def valid_rows(cache: TieredCache, page: int, n: int) -> dict[str, torch.Tensor]:
    """Every token-indexed component's rows of device ``page`` covering its first ``n`` slots
    (what a request appending after them leaves as they were)."""
    out = {}
    for s in cache.specs:
        r = s.rows_per_page(cache.page_size)
        k = -(-n // s.tokens_per_row)
        out[s.name] = cache.device_pool.buffers[s.name][:, page * r : page * r + k].cpu().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def begin(cache: TieredCache, tokens: list[int]):
    """Match, lock, load and allocate as the scheduler does; writes random rows into the
    request's own slots. Returns ``(handle, load result, all slots)``."""
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    n = ld.locs.numel()
    own = cache.alloc(len(tokens) - n, at=n)
    g = torch.Generator().manual_seed(len(tokens))
    for s in cache.specs:
        buf = cache.device_pool.buffers[s.name]
        idx = torch.unique(own // cache.page_size)
        r = s.rows_per_page(cache.page_size)
        ridx = torch.cat([torch.arange(p * r, (p + 1) * r) for p in idx.tolist()])
        if n % cache.page_size:  # the copy page keeps the tail's rows; write after them only
            ridx = ridx[ridx >= (-(-int(own[0]) // s.tokens_per_row) if s.token_indexed else 0)]
        data = torch.randn((s.num_layers, ridx.numel(), *s.row_shape), generator=g)
        buf[:, ridx.to(buf.device)] = data.to(s.dtype).to(buf.device)
    return m.handle, ld, torch.cat((ld.locs, own))


def play(cache: TieredCache, tokens: list[int]):
    h, ld, locs = begin(cache, tokens)
    cache.finish(tokens, locs, ld.locs.numel(), h)
    cache.check_integrity()
    return ld, locs


def shape(cache: TieredCache) -> list[tuple[int, int, list[int] | None]]:
    """``(depth, tokens, device pages)`` of every node, by depth."""
    out = [
        (n.depth_tokens(), len(n.tokens), n.device.tolist() if n.device is not None else None)
        for n in cache.tree.nodes()
    ]
    return sorted(out)


# ---- bookkeeping at page size 16 ------------------------------------------------------------
def test_finish_caches_the_tail_and_match_counts_valid_tokens(tmp_path):
    c = make(tmp_path)
    ld, locs = play(c, T)
    assert ld.locs.numel() == 0 and locs.tolist() == list(range(32))
    assert shape(c) == [(21, 21, [0, 1])]
    assert c.stats()["device_pages_cached"] == 2 and c.engine_pages.count == 0
    assert c.match(T + [7, 8]).device_len == 21  # all 5 valid tail tokens match
    assert c.match(T).device_len == 21  # ends exactly with the tail
    assert c.match(T[:19]).device_len == 16  # ends inside the tail
    assert c.match(T[:18] + [0, 0, 0, 5]).device_len == 16  # diverges inside it
    c.check_integrity()
    c.close()


def test_a_served_tail_is_a_fresh_copy_and_extending_replaces_it(tmp_path):
    c = make(tmp_path)
    play(c, T)
    tail_rows = valid_rows(c, 1, 5)
    t2 = T + list(range(500, 505))  # 26 tokens: the tail grows from 5 to 10
    h, ld, locs = begin(c, t2)
    assert ld.device_tokens == 21
    # The last loaded page is a copy on a fresh page (2), never the cached tail page 1.
    assert ld.locs.tolist() == list(range(16)) + list(range(32, 37))
    assert same(valid_rows(c, 2, 5), tail_rows)
    assert locs.tolist() == list(range(16)) + list(range(32, 48))  # appends in place
    assert c.engine_pages.count == 1
    c.check_integrity()
    c.finish(t2, locs, ld.locs.numel(), h)
    assert shape(c) == [(16, 16, [0]), (26, 10, [2])]
    assert 1 not in c.tree.held_pages("device").tolist()  # the old tail went back
    assert c.device_pool.allocator.used == 2
    c.check_integrity()
    assert c.match(t2 + [1]).device_len == 26 and c.match(T + [1]).device_len == 16

    t3 = t2 + list(range(600, 614))  # 40 tokens: a whole second page and a tail of 8
    _, locs3 = play(c, t3)
    assert locs3[16:32].tolist() == list(range(48, 64))  # copy of page 2 on page 3
    assert shape(c) == [(16, 16, [0]), (40, 24, [3, 4])]
    assert c.match(t3).device_len == 40
    c.check_integrity()
    c.close()


def test_a_locked_tail_is_kept_beside_the_longer_copy(tmp_path):
    c = make(tmp_path)
    play(c, T)
    a, b = T + [1, 2], T + [3, 4, 5]
    ha, lda, la = begin(c, a)
    assert lda.locs[16:].tolist() == list(range(32, 37))
    (prefix, tail) = sorted(c.tree.nodes(), key=lambda n: n.depth_tokens())
    # With its copy made, a no longer pins the tail (split off its whole page).
    assert (prefix.lock_ref, tail.lock_ref) == (1, 0)
    mb = c.match(b)
    c.lock(mb.handle)  # b pins the tail until its own load
    assert tail.lock_ref == 1
    # the tail is locked: it stays, and a's longer tail goes in beside it
    c.finish(a, la, lda.locs.numel(), ha)
    assert shape(c) == [(16, 16, [0]), (21, 5, [1]), (23, 7, [2])]
    assert c.engine_pages.count == 0
    assert c.match(a + [9]).cached_len == 23 and c.match(T + [9]).cached_len == 21
    c.check_integrity()
    ldb = c.load(mb)
    assert ldb.locs[16:].tolist() == list(range(48, 53))
    lb = torch.cat((ldb.locs, c.alloc(3, at=21)))
    c.finish(b, lb, ldb.locs.numel(), mb.handle)  # nobody holds it now: b's page replaces it
    assert shape(c) == [(16, 16, [0]), (23, 7, [2]), (24, 8, [3])]
    assert c.engine_pages.count == 0 and c.device_pool.allocator.used == 3
    c.check_integrity()
    c.close()


def test_sibling_tails_and_unadmitted_copies(tmp_path):
    c = make(tmp_path)
    play(c, T)
    other = T[:16] + [9, 9, 9]
    play(c, other)  # diverges inside the tail: a sibling tail
    assert shape(c) == [(16, 16, [0]), (19, 3, [2]), (21, 5, [1])]
    assert c.match(other + [1]).device_len == 19 and c.match(T + [1]).device_len == 21
    m = c.match(T + [1])
    c.lock(m.handle)
    c.load(m)
    assert c.engine_pages.count == 1  # the copy
    c.unlock(m.handle)  # admission given up before alloc: the copy goes back
    assert c.engine_pages.count == 0
    c.check_integrity()
    # A request that computes nothing past the tail hands it back as a duplicate.
    m = c.match(T)
    c.lock(m.handle)
    ld = c.load(m)
    c.finish(T, ld.locs, ld.locs.numel(), m.handle)
    assert shape(c) == [(16, 16, [0]), (19, 3, [2]), (21, 5, [1])]
    assert c.engine_pages.count == 0
    c.check_integrity()
    c.close()


def test_opting_out_frees_the_tail(tmp_path):
    c = make(tmp_path, cache_partial_pages=False)
    play(c, T)
    assert shape(c) == [(16, 16, [0])] and c.device_pool.allocator.used == 1
    assert c.match(T + [1]).device_len == 16
    c.close()
    with pytest.raises(ConfigError, match="cache_partial_pages"):
        CacheConfig(cache_partial_pages="yes")  # type: ignore[arg-type]


def test_state_pools_keep_the_page_aligned_behaviour(tmp_path):
    c = make(tmp_path, specs=(KV, STATE))
    m = c.match(T)
    c.lock(m.handle)
    ld = c.load(m)
    locs = c.alloc(len(T))
    c.finish(T, locs, ld.locs.numel(), m.handle, torch.tensor([True]))
    assert shape(c) == [(16, 16, [0])]
    c.check_integrity()
    c.close()


# ---- page size 1, and a tree page of 64 over KV pages of 16 ---------------------------------
def test_page_size_one_has_no_partial_pages(tmp_path):
    c = make(tmp_path, page_size=1, device_pages=64, host_pages=64)
    play(c, T)
    assert shape(c) == [(21, 21, list(range(21)))]
    ld, _ = play(c, T + [5])
    assert ld.locs.tolist() == list(range(21))  # whole pages: the cache's own, no copy
    assert c.match(T[:19]).device_len == 19
    c.close()


def test_tree_page_of_64_over_kv_pages_of_16(tmp_path):
    c = make(tmp_path, page_size=16, specs=(KV, IDX))
    assert c.page_size == 64
    seq = list(range(1000, 1070))  # one tree page and a tail of 6
    play(c, seq)
    assert shape(c) == [(70, 70, [0, 1])]
    tail_rows = valid_rows(c, 1, 6)
    assert c.match(seq[:69]).device_len == 64
    h, ld, locs = begin(c, seq + [3, 4])
    assert ld.locs.tolist() == list(range(64)) + list(range(128, 134))
    assert same(valid_rows(c, 2, 6), tail_rows)  # the KV rows and the sidecar row
    c.finish(seq + [3, 4], locs, ld.locs.numel(), h)
    assert shape(c) == [(64, 64, [0]), (72, 8, [2])]
    c.check_integrity()
    c.close()


# ---- host and storage restores --------------------------------------------------------------
@pytest.mark.parametrize("specs", [(KV,), (KV, IDX)], ids=["kv", "kv+sidecar"])
def test_host_restore_of_a_tail_is_byte_exact(tmp_path, specs):
    c = make(tmp_path, specs=specs, write_policy="write_through", storage=None)
    seq = T if c.page_size == 16 else list(range(1000, 1070))
    play(c, seq)
    c.drain()
    orig = rows(c, c.tree.held_pages("device").tolist())
    c.flush(host=False)
    m = c.match(seq + [1])
    assert (m.device_len, m.host_len) == (0, len(seq))
    c.lock(m.handle)
    ld = c.load(m)
    assert ld.host_tokens == len(seq)
    (node,) = c.tree.nodes()
    assert same(rows(c, node.device.tolist()), orig)
    copy = int(ld.locs[-1]) // c.page_size
    tail = {k: v[:, v.shape[1] // 2 :] for k, v in orig.items()}
    assert copy not in node.device.tolist() and same(rows(c, [copy]), tail)
    c.unlock(m.handle)
    c.check_integrity()
    c.close()


def test_storage_keys_of_a_tail(tmp_path):
    c = make(tmp_path)
    play(c, T)
    (node,) = c.tree.nodes()
    keys = c.tree.ensure_keys(node, c.namespace)
    whole = chain_keys(c.namespace, T, 16)
    assert len(keys) == 2 and keys[0] == whole[0]
    assert keys[1] == tail_key(c.namespace, T[16:], whole[0])
    full = chain_keys(c.namespace, T + list(range(11)), 16)
    assert keys[1] != full[1] and keys[1] != tail_key(c.namespace, T[16:20], whole[0])
    c.close()


@pytest.mark.parametrize("specs", [(KV,), (KV, IDX)], ids=["kv", "kv+sidecar"])
def test_storage_restore_of_a_tail_is_byte_exact(tmp_path, specs):
    c = make(tmp_path, specs=specs, write_policy="write_through")
    seq = T if c.page_size == 16 else list(range(1000, 1070))
    play(c, seq)
    c.drain()
    orig = rows(c, c.tree.held_pages("device").tolist())
    c.close()
    c = make(tmp_path, specs=specs, write_policy="write_through")  # a fresh cache, same store
    assert c.match(seq[:-1] + [7]).storage_len == c.page_size  # ends inside the tail
    m = c.match(seq + [1])
    assert (m.cached_len, m.storage_len) == (0, len(seq))
    pf = c.prefetch(m)
    pf.future.result()
    c.finish_prefetch(pf)
    m = c.match(seq + [1])
    assert m.host_len == len(seq)
    c.lock(m.handle)
    ld = c.load(m)
    assert ld.locs.numel() == len(seq)
    (node,) = [n for n in c.tree.nodes() if n.tail(c.page_size)]
    assert same(rows(c, c.tree.held_pages("device").tolist()), orig)
    c.unlock(m.handle)
    c.check_integrity()
    assert node.in_storage
    c.close()


def test_storage_beyond_a_cached_tail_is_fetched_and_replaces_it(tmp_path):
    """The tree holds a page and a 5-token tail; storage holds that page, the next one and a
    9-token tail (a request that ran on, since evicted). A prompt running on past both is
    matched to the whole page on device and the rest from storage; the fetch replaces the
    cached tail, and the restored rows are the stored ones, byte for byte."""
    longer = T + list(range(500, 520))  # 41 tokens: two pages and a tail of 9
    c = make(tmp_path, write_policy="write_through")
    _, locs = play(c, longer)
    c.drain()
    pages = (locs[16:].div(16, rounding_mode="floor")).unique().tolist()
    orig = rows(c, pages)  # the second page and the tail's page, as stored
    c.flush()
    play(c, T)  # the first page and a 5-token tail: on device, the tail the tree's last page
    c.drain()  # its backups landed: the tail is idle, and a fetch that runs on past it may drop it
    m = c.match(longer + [1])
    assert (m.device_len, m.host_len, m.storage_len) == (16, 0, 25)
    pf = c.prefetch(m)
    pf.future.result()
    c.finish_prefetch(pf)
    assert [n.num_tokens % 16 for n in c.tree.nodes() if n.tail(16)] == [9]  # the 5 went
    m = c.match(longer + [1])
    assert (m.device_len, m.host_len, m.storage_len) == (16, 25, 0)
    c.lock(m.handle)
    ld = c.load(m)
    assert ld.locs.numel() == 41
    got = ld.locs[16:].div(16, rounding_mode="floor").unique().tolist()
    assert same(rows(c, got), orig)
    c.unlock(m.handle)
    c.check_integrity()
    # storage that ends inside the cached tail: the tail is served, nothing fetched
    c.flush()
    play(c, T)
    m = c.match(T + [1])
    assert (m.device_len, m.storage_len) == (21, 0)
    c.close()


# ---- the tree against its rules, on random sequences ----------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_tree_with_tails_keeps_its_invariants(seed):
    import itertools
    import random

    from kvtier.tree import RadixTree

    rng = random.Random(seed)
    ps = 4
    tree = RadixTree(ps)
    ids = itertools.count()
    seqs: list[list[int]] = []
    for _ in range(60):
        base = rng.choice(seqs) if seqs and rng.random() < 0.7 else []
        s = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 9))]
        pages = torch.tensor([next(ids) for _ in range(-(-len(s) // ps))])
        out = tree.insert(s, pages)
        held = set(tree.held_pages("device").tolist())
        # Every page is the tree's, a duplicate, or was dropped with a replaced tail.
        dropped = {int(p) for d in out.dropped.device_pages for p in d}
        assert not dropped & held
        assert set(pages.tolist()) <= held | set(out.duplicates.tolist())
        tree.check_integrity()
        seqs.append(s)
        assert tree.match(s).matched_len == len(s)  # what was just inserted is all cached
        for q in rng.sample(seqs, min(5, len(seqs))):
            q = q + [rng.randrange(3)] if rng.random() < 0.5 else q[: rng.randint(0, len(q))]
            m = tree.match(q)
            got = [t for n in m.path for t in n.tokens][: m.matched_len]
            assert got == q[: m.matched_len]
            # A match ends on a page boundary or exactly at the end of a partial tail.
            assert m.matched_len % ps == 0 or (
                m.node.tail(ps) and m.last_pages == m.node.num_pages(ps)
            )
