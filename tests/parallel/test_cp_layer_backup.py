"""Per-layer backups under context parallelism, ranks as threads (``LocalWorld``): each rank
copies its own shard layer by layer into host pages reserved on the owners' lanes, the copy
becomes visible to ``match`` at the same poll on every rank (also when the ranks see their
copies land at different polls), and a failed forward frees its reservation on every rank at
the same poll."""

from __future__ import annotations

import pytest
from factories import SPEC
from test_cp_cache import TOKENS, _config, _owners_hold, _serve, _write

from kvtier import TieredCache
from kvtier.parallel.group import LocalWorld
from kvtier.parallel.layout import CPLayout

PAGES = len(TOKENS) // 4
POLLS = 12


def _forward(cache: TieredCache, ok: bool = True):  # noqa: ANN202
    """Admit TOKENS cold and run a 'forward' with a per-layer backup: each layer's rows are
    written, then reported; returns the handle, the pages and the host pages used before."""
    m = cache.match(TOKENS)
    cache.lock(m.handle)
    locs = cache.alloc(len(TOKENS), at=0)
    before = cache.host_pool.allocator.used
    layered = cache.backup_layers([(TOKENS, locs, 0, len(TOKENS))])
    assert layered is not None
    assert cache.host_pool.allocator.used > before  # reserved before the forward
    _write(cache, locs, 0)  # every layer, then each is reported as it would finish
    for j in range(cache.specs[0].num_layers):
        layered.layer_done(j)
    cache.end_backup_layers(layered, ok=ok)
    return m.handle, locs, before


def _hosted(cache: TieredCache) -> int:
    """Tokens of TOKENS whose host copy ``match`` can see (a host hit once the device copy
    goes)."""
    n = 0
    for node in cache.tree.match(TOKENS).path:
        if not node.on_host:
            break
        n += node.num_tokens
    return n


def _run(tmp_path, cp: int, pattern: str, delays: int) -> list[tuple]:
    def rank(g) -> tuple:
        cfg = _config(
            tmp_path,
            cp,
            g.rank,
            cp_pattern=pattern,
            backup_timing="per_layer",
            test_completion_polls=delays,
            test_completion_seed=7,
        )
        layout = CPLayout(cp, g.rank, pattern)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            mover = cache.controller.mover
            late = []
            real = mover.device_to_host
            mover.device_to_host = lambda d, h, *a, **k: late.append(d) or real(d, h, *a, **k)
            handle, locs, _ = _forward(cache)
            cache.finish(TOKENS, locs, 0, handle)
            seen = []  # host_len after each poll: the same on every rank
            for _ in range(POLLS):
                cache.poll()
                seen.append(_hosted(cache))
            assert seen[-1] == len(TOKENS), seen
            cache.drain()
            st = cache.stats()
            assert not late  # nothing was copied at insert: the forward copied it all
            assert st["layer_backup_pages"] == PAGES
            assert st["host_backup_pages"] == layout.rank_pages(PAGES)  # this rank's shard
            _owners_hold(cache, layout)
            cache.flush(host=False)  # the device copies go: the host copies serve the bytes
            checked = _serve(cache, "host")
            assert checked == layout.rank_pages(PAGES) * 4
            return tuple(seen)

    return LocalWorld(cp, timeout=30).run(rank)


@pytest.mark.parametrize(("cp", "pattern"), [(2, "round_robin"), (4, "zigzag")])
@pytest.mark.parametrize("delays", [0, 4])
def test_per_layer_copies_are_exact_on_owners_and_visible_at_the_same_poll(
    tmp_path, cp, pattern, delays
):
    seen = _run(tmp_path, cp, pattern, delays)
    assert all(s == seen[0] for s in seen), seen


def test_completion_delays_hold_visibility_back(tmp_path):
    """With delays the copy is not visible at the first polls (the test above compares
    something), and the ranks still agree."""
    seen = _run(tmp_path, 4, "zigzag", 4)
    assert seen[0][0] == 0 and all(s == seen[0] for s in seen), seen


@pytest.mark.parametrize("cp", [2, 4])
def test_a_failed_forward_releases_on_every_rank_at_the_same_poll(tmp_path, cp):
    def rank(g) -> tuple:
        cfg = _config(tmp_path, cp, g.rank, backup_timing="per_layer", test_completion_polls=4)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            handle, locs, before = _forward(cache, ok=False)
            cache.unlock(handle)
            cache.free(locs)
            used = []
            for _ in range(POLLS):
                cache.poll()
                used.append(cache.host_pool.allocator.used)
            assert used[-1] == before, (used, before)
            assert cache.match(TOKENS).cached_len == 0
            cache.check_integrity()
            return tuple(used)

    used = LocalWorld(cp, timeout=30).run(rank)
    assert all(u == used[0] for u in used), used


@pytest.mark.parametrize("cp", [2, 4])
def test_a_duplicate_forward_releases_on_every_rank_at_the_same_poll(tmp_path, cp):
    """Two forwards of the same tokens reserve before either is inserted: the second's pages
    are duplicates at insert and its reservation is freed, at the same poll everywhere."""

    def rank(g) -> tuple:
        cfg = _config(tmp_path, cp, g.rank, backup_timing="per_layer", test_completion_polls=4)
        with TieredCache(cfg, [SPEC], group=g) as cache:
            first, locs1, before = _forward(cache)
            second, locs2, _ = _forward(cache)
            cache.finish(TOKENS, locs1, 0, first)
            cache.finish(TOKENS, locs2, 0, second)  # frees its duplicates
            used = []
            for _ in range(POLLS):
                cache.poll()
                used.append(cache.host_pool.allocator.used)
            cache.drain()
            # one copy's pages stay (the allocator counts every lane: the same on every rank)
            assert used[-1] == before + PAGES and used[0] == before + 2 * PAGES, (used, before)
            assert _hosted(cache) == len(TOKENS)
            cache.check_integrity()
            return tuple(used)

    used = LocalWorld(cp, timeout=30).run(rank)
    assert all(u == used[0] for u in used), used
