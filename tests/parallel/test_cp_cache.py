"""The cache under context parallelism, ranks as threads (``LocalWorld``): every page keeps its
owner through device, host and storage; each rank moves only its shard; completions agree;
objects written at one CP size restore at another."""

from __future__ import annotations

import pytest
import torch
from factories import PS, SPEC, cache_config

from kvtier import CacheConfig, TieredCache
from kvtier.errors import ConfigError, IntegrityError, RequestError
from kvtier.parallel.group import LocalWorld, SoloGroup
from kvtier.parallel.layout import CPLayout
from kvtier.pools import PoolSpec

TOKENS = list(range(100, 140))  # 10 pages


def _config(tmp_path, cp: int, rank: int, **kw) -> CacheConfig:
    # device=None (CUDA when present) and the default prefetch policy: as these tests always ran
    base = dict(device_pages=12, device=None, prefetch_policy="timeout", debug_checks=True)
    return cache_config(tmp_path, **{**base, "cp_size": cp, "cp_rank": rank, **kw})


def _value(pos: torch.Tensor) -> torch.Tensor:
    """The bytes a token's KV row holds in this test: a function of its position only."""
    v = pos.to(torch.float32)[:, None, None, None]
    return v + torch.arange(8, dtype=torch.float32).view(2, 1, 4) / 8


def _write(cache: TieredCache, locs: torch.Tensor, start: int) -> None:
    """Write positions ``start ..`` at logical ``locs``: only the slots this rank holds."""
    kv = cache.kv_buffers
    owned = kv.owned(locs)
    pos = torch.arange(start, start + locs.numel())
    if owned is not None:
        locs, pos = locs[owned], pos[owned]
    for layer in range(SPEC.num_layers):
        buf = kv.layer(layer)
        buf[kv.slots(locs).to(buf.device)] = (_value(pos) + layer).to(buf.device)


def _check(cache: TieredCache, locs: torch.Tensor) -> int:
    """Assert the slots this rank holds of ``locs`` (positions 0 ..) hold their bytes; returns
    how many slots were checked."""
    kv = cache.kv_buffers
    owned = kv.owned(locs)
    pos = torch.arange(locs.numel())
    if owned is not None:
        locs, pos = locs[owned], pos[owned]
    for layer in range(SPEC.num_layers):
        buf = kv.layer(layer)
        got = buf[kv.slots(locs).to(buf.device)].cpu()
        assert torch.equal(got, _value(pos) + layer), f"layer {layer}"
    return locs.numel()


def _serve(cache: TieredCache, expect: str) -> int:
    """Admit TOKENS: match, (prefetch), lock, load; check the restored bytes; finish."""
    m = cache.match(TOKENS)
    if expect == "storage":
        assert m.storage_len == len(TOKENS) and m.cached_len == 0
        op = cache.prefetch(m)
        cache.drain()
        assert cache.prefetch_ready(op)
        cache.finish_prefetch(op)
        m = cache.match(TOKENS, probe_storage=False)
        expect = "host"
    assert (m.device_len if expect == "device" else m.host_len) == len(TOKENS), m
    cache.lock(m.handle)
    ld = cache.load(m)
    assert ld.locs.numel() == len(TOKENS)
    checked = _check(cache, ld.locs)
    cache.finish(TOKENS, ld.locs, ld.locs.numel(), m.handle)
    cache.drain()
    cache.check_integrity()
    return checked


def _owners_hold(cache: TieredCache, layout: CPLayout) -> None:
    """Every node's device and host pages sit on the lanes of the pages' sequence owners."""
    for node in cache.tree.nodes():
        if node.parent is None:
            continue
        first = (node.depth_tokens() - len(node.tokens)) // PS
        owners = layout.owners(first, first + len(node.tokens) // PS)
        for pages in (node.device, node.host):
            if pages is not None:
                assert (pages % layout.cp_size).tolist() == owners


def _first_run(tmp_path, cp: int, pattern: str) -> list[list[int]]:
    def rank(g) -> list[int]:
        cfg = _config(tmp_path, cp, g.rank, cp_pattern=pattern)
        layout = CPLayout(cp, g.rank, pattern)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            m = cache.match(TOKENS)
            cache.lock(m.handle)
            cache.load(m)
            locs = cache.alloc(len(TOKENS), at=0)
            assert (locs[::PS] // PS % cp).tolist() == layout.owners(0, 10)
            _write(cache, locs, 0)
            cache.finish(TOKENS, locs, 0, m.handle)
            cache.drain()
            _owners_hold(cache, layout)
            counts = [_serve(cache, "device")]
            cache.flush(host=False)
            counts.append(_serve(cache, "host"))
            _owners_hold(cache, layout)
            cache.flush(host=True)
            counts.append(_serve(cache, "storage"))
            _owners_hold(cache, layout)
            st = cache.stats()
            assert st["host_backup_pages"] == layout.rank_pages(10)  # this rank's shard, once
            return counts

    return LocalWorld(cp, timeout=20).run(rank)


@pytest.mark.parametrize(("cp", "pattern"), [(2, "round_robin"), (4, "zigzag"), (3, "zigzag")])
def test_every_tier_keeps_pages_on_their_owners(tmp_path, cp, pattern):
    counts = _first_run(tmp_path, cp, pattern)
    layout = CPLayout(cp, 0, pattern)
    # Each rank checked exactly the slots it owns, at every tier.
    for r, c in enumerate(counts):
        assert c == [layout.rank_pages(10, r) * PS] * 3


@pytest.mark.parametrize("later", [1, 4])
def test_storage_written_at_cp2_restores_at_another_size(tmp_path, later):
    _first_run(tmp_path, 2, "round_robin")

    def rank(g) -> int:
        cfg = _config(tmp_path, later, g.rank, cp_pattern="zigzag")
        with TieredCache(cfg, [SPEC], group=g if later > 1 else None) as cache:
            return _serve(cache, "storage")

    if later == 1:
        assert rank(SoloGroup()) == len(TOKENS)
    else:
        got = LocalWorld(later, timeout=20).run(rank)
        assert sum(got) == len(TOKENS)


def test_zero_owned_rank_still_agrees(tmp_path):
    """A 1-page prompt at CP=2: rank 1 owns nothing of it, moves nothing, and still sees the
    same tree and visibility as rank 0."""
    toks = TOKENS[:PS]

    def rank(g) -> tuple:
        with TieredCache(_config(tmp_path, 2, g.rank), [SPEC], group=g) as cache:
            m = cache.match(toks)
            cache.lock(m.handle)
            cache.load(m)
            locs = cache.alloc(PS, at=0)
            _write(cache, locs, 0)
            cache.finish(toks, locs, 0, m.handle)
            cache.drain()
            cache.flush(host=False)
            m = cache.match(toks)
            host_len = m.host_len
            # the load: rank 1 copies nothing, its ack is born done; both see it complete
            cache.lock(m.handle)
            ld = cache.load(m)
            cache.finish(toks, ld.locs, ld.locs.numel(), m.handle)
            cache.drain()
            assert not cache.in_flight()
            st = cache.stats()
            return (
                host_len,
                cache.match(toks).device_len,
                st["host_backup_pages"],
                st.get("storage_backup_pages", 0),
                st["load_bytes"] // cache.device_pool.page_bytes,
                st["host_bytes_used"] // cache.host_pool.page_bytes,  # this rank's pool
            )

    assert LocalWorld(2, timeout=20).run(rank) == [(PS, PS, 1, 1, 1, 1), (PS, PS, 0, 0, 0, 0)]


def test_plain_allocation_is_refused_under_cp(tmp_path):
    """A plain allocation would place pages on arbitrary ranks (the seeds' ``load_cp`` bug):
    the cache refuses it and the allocator refuses a lane-blind request."""

    def rank(g) -> None:
        with TieredCache(_config(tmp_path, 2, g.rank), [SPEC], group=g) as cache:
            with pytest.raises(RequestError, match="under context parallelism .* pass at="):
                cache.alloc(8)
            with pytest.raises(IntegrityError, match="plain allocation of 2 pages ignores"):
                cache.device_pool.allocator.alloc(2)
            # a host copy on the wrong lane is refused at the transfer boundary
            with pytest.raises(IntegrityError, match=f"rank {g.rank}: logical page"):
                cache.controller.mover.device_to_host(
                    torch.tensor([g.rank]), torch.tensor([1 - g.rank])
                )

    LocalWorld(2, timeout=20).run(rank)


def test_eviction_progress_counts_the_short_lane(tmp_path):
    """Device eviction under CP counts freed pages of the lane that is short, not logical
    pages: with lane 0 full, the least recently used leaves hold only lane-1 pages, and
    dropping them is no progress; the cache goes on to a lane-0 page, so the allocation
    succeeds (a count of logical pages would stop after the first leaf and fail)."""

    def rank(g) -> tuple:
        cfg = _config(tmp_path, 2, g.rank, device_pages=2, storage=None, enable_host=False)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            alloc = cache.device_pool.allocator

            def insert(toks: list[int]) -> None:
                m = cache.match(toks)
                cache.lock(m.handle)
                ld = cache.load(m)
                n = ld.locs.numel()
                locs = torch.cat([ld.locs, cache.alloc(len(toks) - n, at=n)])
                cache.finish(toks, locs, n, m.handle)

            insert([1] * PS + [2] * PS)  # sequence pages 0 (lane 0) and 1 (lane 1)
            insert([1] * PS + [3] * PS)  # shares page 0; its page 1 takes lane 1's last page
            leaves = sorted(
                (int(n.device[0]) % 2) for n in cache.tree.nodes() if n.parent and not n.children
            )
            held = cache.alloc(PS, at=0)  # the engine holds lane 0's other page
            full = (alloc.available_in(0), alloc.available_in(1))
            evicted_before = cache.stats().get("evicted_device_pages", 0)
            page = cache.alloc(PS, at=0)  # lane 0: only the shared root-side page can give it
            cache.free(page)
            cache.free(held)
            cache.check_integrity()
            return leaves, full, cache.stats()["evicted_device_pages"] - evicted_before

    # Both lane-1 leaves went (2 pages that did not help), then the lane-0 page (1 that did).
    assert LocalWorld(2, timeout=20).run(rank) == [([1, 1], (0, 0), 3)] * 2


def test_misconfigured_groups_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match="cp_size=2 needs the CP group"):
        TieredCache(_config(tmp_path, 2, 0), [SPEC])
    with pytest.raises(ConfigError, match="cp_rank=1 must lie in"):
        _config(tmp_path, 1, 1)
    with pytest.raises(ConfigError, match="cp_pattern='spiral' is not one of"):
        _config(tmp_path, 2, 0, cp_pattern="spiral")
    state = PoolSpec("state", num_layers=1, row_shape=(4,), dtype=torch.float32, kind="state")

    def rank(g) -> None:
        with pytest.raises(ConfigError, match=r"cp_size=2 with the state pool\(s\) \['state'\]"):
            TieredCache(_config(tmp_path, 2, g.rank), [SPEC, state], group=g)

    LocalWorld(2, timeout=5).run(rank)

    def mismatched(g) -> None:
        cfg = _config(tmp_path, 2, g.rank, device_pages=12 + g.rank)
        with pytest.raises(ConfigError, match="started caches of different shapes"):
            TieredCache(cfg, [SPEC], group=g)

    LocalWorld(2, timeout=5).run(mismatched)


def test_a_host_hit_under_device_pressure_loads_by_evicting(tmp_path):
    """The load-back quota counts evictable device cache (seed 004): with every device page
    of both lanes held by unlocked cached pages, a host hit is still loaded whole, on its
    owners' lanes, by evicting them, instead of being skipped as if the pool were full."""

    def rank(g) -> tuple[int, int, int]:
        cfg = _config(tmp_path, 2, g.rank, device_pages=3, host_pages=12, storage=None)
        layout = CPLayout(2, g.rank)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            hit = TOKENS[:16]  # 4 pages: 2 per lane
            m = cache.match(hit)
            cache.lock(m.handle)
            cache.load(m)
            locs = cache.alloc(len(hit), at=0)
            _write(cache, locs, 0)
            cache.finish(hit, locs, 0, m.handle)
            cache.drain()
            cache.flush(host=False)  # ``hit`` is on host only now
            for i in range(3):  # fill both lanes with other, unlocked cached pages
                toks = [900 + i] * (2 * PS)
                m = cache.match(toks)
                cache.lock(m.handle)
                cache.load(m)
                cache.finish(toks, cache.alloc(2 * PS, at=0), 0, m.handle)
            cache.drain()  # their backups landed: nothing pins them
            alloc = cache.device_pool.allocator
            full = alloc.available_in(0) + alloc.available_in(1)
            m = cache.match(hit)
            cache.lock(m.handle)
            ld = cache.load(m)
            checked = _check(cache, ld.locs)
            _owners_hold(cache, layout)
            cache.finish(hit, ld.locs, ld.locs.numel(), m.handle)
            cache.check_integrity()
            return full, ld.locs.numel(), checked

    assert LocalWorld(2, timeout=20).run(rank) == [(0, 16, 8), (0, 16, 8)]
