"""The unified device pool: envelopes at literal base units, exact ``available`` under
fragmentation, compaction (what moves, byte-exact contents, leases pin), and a property test
against a reference model."""

from __future__ import annotations

import copy

import pytest
import torch
from factories import DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, IntegrityError
from kvtier.pools import PoolSpec, UnifiedPool
from kvtier.transfer.translate import ArenaTranslator, DeviceKV, device_view

ROW = (2, 1, 4)  # 32-byte float32 rows: a 2-token unit is 64 bytes (8 int64 words)
KV = PoolSpec("kv", 3, ROW, torch.float32)
SWA = PoolSpec("swa", 2, ROW, torch.float32, kind="window", window=4)
MODES = ("auto", "eager", "off")


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def make(num_pages: int = 6, compaction: str = "auto", specs=(KV, SWA)) -> UnifiedPool:
    pool = UnifiedPool(list(specs), num_pages, 2, torch.device(DEVICE), compaction=compaction)
    g = torch.Generator().manual_seed(num_pages)
    raw = torch.randint(0, 256, (pool.units * pool.unit_bytes,), generator=g, dtype=torch.uint8)
    pool.arena.view(-1).view(torch.uint8).copy_(raw.to(pool.device))
    return pool


def bases(pool: UnifiedPool, pages: torch.Tensor) -> tuple[list[int], list[int]]:
    return pool.physical(pages).tolist(), pool.physical(pages, "swa").tolist()


def contents(pool: UnifiedPool) -> dict[tuple[int, str], torch.Tensor]:
    """Bytes of every live envelope by (page, component)."""
    out = {}
    live = torch.nonzero(pool._alive).reshape(-1)
    for s in pool.specs:
        for p in live.tolist():
            if int(pool.physical(t(p), s.name)) >= 0:
                out[p, s.name] = pool.component_words(s.name, t(p))
    return out


def assert_exact(pool: UnifiedPool) -> None:
    """``fits()`` is the largest n ``alloc(n)`` serves (checked on copies), and ``available``
    equals it unless pages are leased under a compacting mode (then it bounds it)."""
    n = pool.fits()
    assert copy.deepcopy(pool).alloc_pages(n) is not None
    assert copy.deepcopy(pool).alloc_pages(n + 1) is None
    if pool.allocator.optimistic:
        assert pool.allocator.available >= n
    else:
        assert pool.allocator.available == n


def fragmented(mode: str) -> UnifiedPool:
    """Six full pages (kv at 5i, swa at 5i + 3), then pages 0-4 lose their windows: five
    2-unit holes, none fitting a 3-unit kv envelope."""
    pool = make(6, mode)
    assert pool.alloc_pages(6).tolist() == [0, 1, 2, 3, 4, 5]
    pool.release_window(t(0, 1, 2, 3, 4))
    return pool


def test_envelopes_sit_at_literal_base_units():
    pool = make(4)
    assert (pool.units, pool.logical_pages, pool.page_bytes) == (20, 6, 5 * 64)
    a = pool.alloc_pages(3)
    assert a.tolist() == [0, 1, 2]
    assert bases(pool, a) == ([0, 5, 10], [3, 8, 13])
    assert pool.has_window(a).tolist() == [True, True, True]
    pool.release_window(t(1))
    assert bases(pool, a) == ([0, 5, 10], [3, -1, 13])
    assert pool.has_window(a).tolist() == [True, False, True]
    assert (pool.units_used, pool.bytes_used) == (13, 13 * 64)
    b = pool.alloc_pages(1)  # kv in the released window's hole is too small: kv 15, swa 8
    assert b.tolist() == [3] and bases(pool, b) == ([15], [8])
    pool.free_pages(t(0))
    c = pool.alloc_pages(2)  # kv 0, swa 3; the second page's kv (3 units) fits nowhere → auto
    assert c is None
    pool.check_integrity()
    assert pool.allocator.available == 1
    c = pool.alloc_pages(1)
    assert c.tolist() == [4] and bases(pool, c) == ([0], [3])
    pool.free_pages(t(1, 4))
    assert pool.allocator.used == 2 and pool.free_ids == 4
    pool.check_integrity()


def test_kernel_slots_and_layer_views_follow_base_units():
    pool = make(4)
    a = pool.alloc_pages(2)
    kv = DeviceKV(pool, ArenaTranslator(pool))
    locs = t(2, 3)  # logical page 1, both tokens
    assert kv.slots(locs).tolist() == [10, 11] and kv.slots(locs, "swa").tolist() == [16, 17]
    assert kv.window == SWA
    # Slot base * ps + off of layer l reads unit base + l.
    words = pool.unit_words()
    row = pool.layer(2, "kv")[10].reshape(-1).view(torch.int64)
    assert torch.equal(row.cpu(), words[7, :4].cpu())
    assert torch.equal(pool.layer(1, "swa")[17].cpu(), pool.buffers["swa"][(8 + 1) * 2 + 1].cpu())
    pool.release_window(a[1:])
    with pytest.raises(IntegrityError, match="logical page 1 has no 'swa' envelope"):
        kv.slots(locs, "swa")
    with pytest.raises(IntegrityError, match="physical: page 3 is free"):
        pool.physical(t(3))


@pytest.mark.parametrize("mode", MODES)
def test_available_is_exact_when_fragmented(mode):
    pool = fragmented(mode)
    assert pool.free_units == 10
    assert pool.allocator.available == {"auto": 2, "eager": 2, "off": 0}[mode]
    assert_exact(pool)
    pool.lease(t(1, 2, 3, 4))  # their kv envelopes pin four of the 2-unit holes
    assert pool.fits() == {"auto": 1, "eager": 1, "off": 0}[mode]
    # leased under a compacting mode, ``available`` is the bound free units allow
    assert pool.allocator.available == {"auto": 2, "eager": 2, "off": 0}[mode]
    assert pool.allocator.optimistic == (mode != "off")
    assert_exact(pool)
    assert pool.alloc_pages(2) is None and pool.free_ids == 4
    got = pool.alloc_pages(1)
    if mode == "off":
        assert got is None
    else:  # page 5's kv slides to 23 and its swa to 3; the new page takes kv 26, swa 8
        assert got.tolist() == [6]
        assert bases(pool, t(1, 2, 3, 4, 5, 6)) == (
            [5, 10, 15, 20, 23, 26],
            [-1, -1, -1, -1, 3, 8],
        )
    pool.check_integrity()


def test_compaction_moves_exactly_the_expected_envelopes_byte_exact():
    pool = fragmented("off")
    before = contents(pool)
    assert pool.compact() == 6  # kv of pages 1-5, swa of page 5
    pages = t(0, 1, 2, 3, 4, 5)
    assert bases(pool, pages) == ([0, 3, 6, 9, 12, 15], [-1, -1, -1, -1, -1, 18])
    assert contents(pool).keys() == before.keys()
    for key, data in before.items():
        assert torch.equal(contents(pool)[key], data), key
    assert pool.compact() == 0  # a compacted layout is a fixed point
    assert pool.allocator.available == 2  # "off" never compacts by itself; this was explicit
    pool.check_integrity()


def test_leased_envelopes_never_move():
    pool = fragmented("auto")
    before = contents(pool)
    pool.lease(t(1, 2, 3, 4))
    pool.lease(t(2))
    assert pool.compact() == 2  # page 5: kv 25 → 23, swa 28 → 3
    assert bases(pool, t(0, 1, 2, 3, 4, 5)) == ([0, 5, 10, 15, 20, 23], [-1] * 5 + [3])
    for key, data in before.items():
        assert torch.equal(contents(pool)[key], data), key
    assert pool.lease_count(t(1, 2, 5)).tolist() == [1, 2, 0] and pool.leased_pages == 4
    with pytest.raises(IntegrityError, match="free: page 2 is leased"):
        pool.free_pages(t(0, 2))
    assert pool.free_ids == 4  # nothing freed: the batch is validated first
    pool.unlease(t(1, 2, 2, 3, 4))
    with pytest.raises(IntegrityError, match="unlease of page 1, which holds no lease"):
        pool.unlease(t(1))
    assert pool.compact() == 4 and pool.leased_pages == 0
    pool.check_integrity()


def test_misuse_raises_naming_the_page_or_option():
    with pytest.raises(ConfigError, match="compaction='lazy' is not one of auto, eager, off"):
        UnifiedPool([KV], 2, 2, torch.device("cpu"), compaction="lazy")
    idx = PoolSpec("idx", 3, (5,), torch.uint8, kind="sidecar")
    with pytest.raises(ConfigError, match=r"same bytes; got \{'kv': 64, 'idx': 10\}"):
        UnifiedPool([KV, idx], 2, 2, torch.device("cpu"))
    with pytest.raises(ConfigError, match="one lane, got lanes=2"):
        UnifiedPool([KV], 2, 2, torch.device("cpu"), lanes=2)
    pool = make(2)
    a = pool.alloc_pages(1)
    pool.release_window(a)
    with pytest.raises(IntegrityError, match="release_window: page 0 has no window envelope"):
        pool.release_window(a)
    with pytest.raises(IntegrityError, match="free: page 1 is free"):
        pool.free_pages(t(0, 1))
    with pytest.raises(IntegrityError, match="free: page 0 given twice"):
        pool.free_pages(t(0, 0))
    with pytest.raises(IntegrityError, match="owner 1 outside 1 lane"):
        pool.allocator.alloc_owned([0, 1])
    with pytest.raises(ConfigError, match="translator=ArenaTranslator: a unified device pool"):
        device_view(ArenaTranslator(pool), pool, None)
    translator, _ = device_view(None, pool, None)
    assert isinstance(translator, ArenaTranslator)
    pool.check_integrity()


def test_allocator_interface_for_the_controller():
    pool = make(4, specs=(KV,))  # kv only: 12 units, 4 logical pages of 3 units
    alloc = pool.allocator
    assert (alloc.num_pages, alloc.available, alloc.lanes) == (4, 4, 1)
    assert alloc.fit([0, 0, 0, 0, 0]) == 4 and alloc.shortfall([0] * 5) == {0: 1}
    assert alloc.alloc_owned([0, 0]).tolist() == [0, 1]
    assert alloc.fit_like(t(7, 8, 9)) == 2 and alloc.available_in(0) == 2
    assert alloc.shortfall([0, 0]) == {}
    alloc.free(t(0))
    assert alloc.alloc(4) is None and alloc.alloc(2).tolist() == [2, 3]
    assert pool.physical(t(1, 2, 3)).tolist() == [3, 0, 6]
    with pytest.raises(IntegrityError, match="page 2 has no window envelope"):
        pool.release_window(t(2))
    alloc.check_integrity()


# ---- property test ------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "release", "lease", "unlease", "compact"]),
        st.integers(0, 3),
        st.integers(0, 2**16),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(MODES), ops=OPS)
def test_random_workloads_keep_contents_and_integrity(mode, ops):
    """Against a model of which pages are live, which hold windows and leases, and the bytes
    of each envelope: every operation keeps them, ``available`` exact and integrity intact."""
    pool = make(4, mode)
    live: dict[int, dict[str, torch.Tensor]] = {}
    leases: dict[int, int] = {}
    for op, k, seed in ops:
        ids = sorted(live)
        pick = [ids[(seed + i) % len(ids)] for i in range(min(k, len(ids)))] if ids else []
        pick = sorted(set(pick))
        if op == "alloc":
            n = pool.fits()
            assert pool.allocator.available >= n
            got = pool.alloc_pages(min(k, n))
            assert got is not None and got.numel() == min(k, n)
            for p in got.tolist():
                live[p] = contents_of(pool, p)
        elif op == "free":
            pick = [p for p in pick if not leases.get(p)]
            pool.free_pages(torch.tensor(pick, dtype=torch.int64))
            for p in pick:
                del live[p]
        elif op == "release":
            pick = [p for p in pick if "swa" in live[p] and not leases.get(p)]
            pool.release_window(torch.tensor(pick, dtype=torch.int64))
            for p in pick:
                del live[p]["swa"]
        elif op == "lease":
            pool.lease(torch.tensor(pick, dtype=torch.int64))
            for p in pick:
                leases[p] = leases.get(p, 0) + 1
        elif op == "unlease":
            pick = [p for p in pick if leases.get(p)]
            pool.unlease(torch.tensor(pick, dtype=torch.int64))
            for p in pick:
                leases[p] -= 1
        else:
            pinned = {p: bases(pool, t(p)) for p, c in leases.items() if c}
            pool.compact()
            assert {p: bases(pool, t(p)) for p in pinned} == pinned
        pool.check_integrity()
        assert sorted(torch.nonzero(pool._alive).reshape(-1).tolist()) == sorted(live)
        for p, comps in live.items():
            assert contents_of(pool, p).keys() == comps.keys()
            for name, data in comps.items():
                assert torch.equal(pool.component_words(name, t(p)), data), (p, name)
        assert_exact(pool)


def contents_of(pool: UnifiedPool, page: int) -> dict[str, torch.Tensor]:
    return {
        s.name: pool.component_words(s.name, t(page))
        for s in pool.specs
        if int(pool.physical(t(page), s.name)) >= 0
    }


def test_move_window_hands_envelopes_over_without_copying():
    pool = make(4)
    a = pool.alloc_pages(3)  # kv 0, 5, 10; swa 3, 8, 13
    pool.release_window(t(0, 2))
    rows = pool.component_words("swa", t(1))
    pool.move_window(t(1), t(2))
    assert bases(pool, a) == ([0, 5, 10], [-1, -1, 8])
    assert torch.equal(pool.component_words("swa", t(2)), rows)
    assert (pool.window_pages, pool.units_used, pool.bytes_total) == (1, 11, 20 * 64)
    with pytest.raises(IntegrityError, match="move_window: source page 1 has no window"):
        pool.move_window(t(1), t(0))
    with pytest.raises(IntegrityError, match="a page on both sides"):
        pool.move_window(t(2), t(2))
    b = pool.alloc_pages(1)  # page 3: kv 13 (over the released window), swa 3
    assert bases(pool, b) == ([13], [3])
    with pytest.raises(IntegrityError, match="move_window: page 2 already has one"):
        pool.move_window(b, t(2))
    pool.free_pages(b)
    pool.lease(t(0))
    with pytest.raises(IntegrityError, match="move_window: page 0 is leased"):
        pool.move_window(t(2), t(0))
    pool.unlease(t(0))
    pool.move_window(t(2), t(0))
    assert bases(pool, a) == ([0, 5, 10], [8, -1, -1])
    pool.check_integrity()


def test_compaction_counters():
    pool = fragmented("off")
    assert (pool.compactions, pool.relocated) == (0, 0)
    assert pool.compact() == 6 and pool.compact() == 0
    assert (pool.compactions, pool.relocated) == (1, 5)  # pages 1-5; page 5 moved two
