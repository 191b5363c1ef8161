"""Valid partial tails under context parallelism, ranks as threads (``LocalWorld``): the last,
partial page of a request has an owner like any page; every rank caches it with its valid
length; a request extending it gets a tail copy made on the owner's lane; host and storage
restores move the padded page and are byte-exact; tail objects written at CP 2 restore at
CP 1 and CP 4 (their keys do not depend on the CP size)."""

from __future__ import annotations

import pytest
import torch
from factories import PS, SPEC, cache_config

from kvtier import CacheConfig, TieredCache
from kvtier.parallel.group import LocalWorld, SoloGroup
from kvtier.parallel.layout import CPLayout

T = list(range(100, 122))  # 22 tokens: 5 whole pages of 4 and a tail of 2
T2 = T + list(range(500, 505))  # 27 tokens: the tail grows to a whole page and a tail of 3


def _config(tmp_path, cp: int, rank: int, **kw) -> CacheConfig:
    base = dict(device_pages=12, host_pages=16, device=None, prefetch_policy="timeout")
    return cache_config(
        tmp_path, debug_checks=True, **{**base, "cp_size": cp, "cp_rank": rank, **kw}
    )


def _value(pos: torch.Tensor) -> torch.Tensor:
    """The bytes a token's KV row holds in these tests: a function of its position only."""
    v = pos.to(torch.float32)[:, None, None, None]
    return v + torch.arange(8, dtype=torch.float32).view(2, 1, 4) / 8


def _owned(cache: TieredCache, locs: torch.Tensor, start: int):
    """The slots of ``locs`` (positions ``start ..``) this rank holds, and their positions."""
    pos = torch.arange(start, start + locs.numel())
    mask = cache.kv_buffers.owned(locs)
    return (locs, pos) if mask is None else (locs[mask], pos[mask])


def _write(cache: TieredCache, locs: torch.Tensor, start: int) -> None:
    """Write positions ``start ..`` at logical ``locs`` (the slots this rank holds)."""
    kv = cache.kv_buffers
    locs, pos = _owned(cache, locs, start)
    for layer in range(SPEC.num_layers):
        buf = kv.layer(layer)
        buf[kv.slots(locs).to(buf.device)] = (_value(pos) + layer).to(buf.device)


def _check(cache: TieredCache, locs: torch.Tensor, start: int = 0) -> int:
    """Assert the slots this rank holds of ``locs`` (positions ``start ..``) hold their bytes;
    returns how many slots were checked."""
    kv = cache.kv_buffers
    locs, pos = _owned(cache, locs, start)
    for layer in range(SPEC.num_layers):
        buf = kv.layer(layer)
        got = buf[kv.slots(locs).to(buf.device)].cpu()
        assert torch.equal(got, _value(pos) + layer), f"layer {layer}"
    return locs.numel()


def _pages_on_owners(cache: TieredCache, layout: CPLayout) -> list[tuple[int, int]]:
    """``(depth, valid tokens)`` of every node, after asserting that its device and host pages,
    the partial last page included, sit on the lanes of their sequence pages' owners."""
    out = []
    for node in cache.tree.nodes():
        if node.parent is None:
            continue
        depth = node.depth_tokens()
        first = (depth - len(node.tokens)) // PS
        owners = layout.owners(first, -(-depth // PS))
        for pages in (node.device, node.host):
            if pages is not None:
                assert (pages % layout.cp_size).tolist() == owners, node
        out.append((depth, len(node.tokens)))
    return sorted(out)


def _first(cache: TieredCache, tokens: list[int]) -> None:
    """A cold request for ``tokens``: every slot of its pages written (the padding too)."""
    m = cache.match(tokens)
    cache.lock(m.handle)
    cache.load(m)
    locs = cache.alloc(len(tokens), at=0)
    _write(cache, locs, 0)
    cache.finish(tokens, locs, 0, m.handle)
    cache.drain()
    cache.check_integrity()


def _restore(cache: TieredCache, tokens: list[int], tier: str) -> tuple[int, int]:
    """Admit ``tokens`` served from ``tier``; check every restored slot this rank holds and
    the whole padded tail page the load moved; returns ``(slots checked, padding checked)``."""
    m = cache.match(tokens + [1])
    if tier == "storage":
        assert (m.cached_len, m.storage_len) == (0, len(tokens)), m
        op = cache.prefetch(m)
        cache.drain()
        assert cache.prefetch_ready(op)
        cache.finish_prefetch(op)
        m = cache.match(tokens + [1], probe_storage=False)
        tier = "host"
    assert (m.device_len if tier == "device" else m.host_len) == len(tokens), m
    cache.lock(m.handle)
    ld = cache.load(m)
    assert ld.locs.numel() == len(tokens)
    checked = _check(cache, ld.locs)
    # The cached tail page came through whole: its padding slots too.
    (tail,) = [n for n in cache.tree.nodes() if n.tail(PS)]
    page = int(tail.device[-1])
    full = len(tokens) - len(tokens) % PS
    pad = _check(cache, torch.arange(page * PS, (page + 1) * PS), full)
    cache.finish(tokens, ld.locs, ld.locs.numel(), m.handle)
    cache.drain()
    cache.check_integrity()
    return checked, pad


@pytest.mark.parametrize(("cp", "pattern"), [(2, "round_robin"), (4, "zigzag")])
def test_a_tail_is_cached_on_its_owner_and_extended_through_a_copy_there(tmp_path, cp, pattern):
    def rank(g) -> tuple:
        layout = CPLayout(cp, g.rank, pattern)
        owner = layout.owner(len(T) // PS)
        with TieredCache(_config(tmp_path, cp, g.rank, cp_pattern=pattern), [SPEC], group=g) as c:
            assert c.engine_pages.tails
            _first(c, T)
            shape = _pages_on_owners(c, layout)
            lengths = (c.match(T + [1]).device_len, c.match(T).device_len)
            assert c.match(T[:-1] + [7]).device_len == len(T) - len(T) % PS

            # Extend: the tail is served as a copy on the owner's lane, appended in place.
            m = c.match(T2)
            c.lock(m.handle)
            ld = c.load(m)
            (old,) = [n for n in c.tree.nodes() if n.tail(PS)]
            tail_page = int(old.device[-1])
            copy = int(ld.locs[-1]) // PS
            assert copy != tail_page and copy % cp == tail_page % cp == owner
            copied = _check(c, ld.locs)
            own = c.alloc(len(T2) - len(T), at=len(T))
            assert int(own[0]) // PS == copy  # the copy's remaining slots come first
            locs = torch.cat((ld.locs, own))
            _write(c, own, len(T))
            c.finish(T2, locs, ld.locs.numel(), m.handle)
            c.drain()
            c.check_integrity()
            assert tail_page not in c.tree.held_pages("device").tolist()  # replaced, freed
            extended = _pages_on_owners(c, layout)
            assert c.match(T2 + [1]).device_len == len(T2)

            # The extended sequence back from every tier, byte-exact on every rank.
            counts = [_restore(c, T2, "device")]
            c.flush(host=False)
            counts.append(_restore(c, T2, "host"))
            _pages_on_owners(c, layout)
            c.flush(host=True)
            counts.append(_restore(c, T2, "storage"))
            _pages_on_owners(c, layout)
            return shape, lengths, extended, copied, counts

    got = LocalWorld(cp, timeout=30).run(rank)
    layout = CPLayout(cp, 0, pattern)
    owner = layout.owner(len(T2) // PS)
    for r, (shape, lengths, extended, copied, counts) in enumerate(got):
        # Every rank's tree holds the tail with its valid length.
        assert shape == [(22, 22)]
        assert lengths == (22, 22)
        assert extended == [(20, 20), (27, 7)]
        assert copied == PS * len(layout.owned(0, 5, r)) + (2 if r == layout.owner(5) else 0)
        slots = PS * len(layout.owned(0, 6, r)) + (3 if r == owner else 0)
        assert counts == [(slots, PS if r == owner else 0)] * 3


def _write_at_cp2(tmp_path) -> None:
    def rank(g) -> None:
        with TieredCache(_config(tmp_path, 2, g.rank), [SPEC], group=g) as c:
            _first(c, T)
            c.flush(host=True)

    LocalWorld(2, timeout=30).run(rank)


@pytest.mark.parametrize("later", [1, 4])
def test_tail_objects_written_at_cp2_restore_at_another_size(tmp_path, later):
    _write_at_cp2(tmp_path)

    def rank(g) -> tuple[int, int]:
        cfg = _config(tmp_path, later, g.rank, cp_pattern="zigzag")
        with TieredCache(cfg, [SPEC], group=g if later > 1 else None) as c:
            # Ends inside the stored tail: only the whole pages before it are found.
            assert c.match(T[:-1] + [7]).storage_len == len(T) - len(T) % PS
            got = _restore(c, T, "storage")
            assert c.match(T + [1]).device_len == len(T)
            return got

    if later == 1:
        assert rank(SoloGroup()) == (len(T), PS)
    else:
        got = LocalWorld(later, timeout=30).run(rank)
        assert sum(c for c, _ in got) == len(T)
        assert sum(p for _, p in got) == PS  # one rank, the owner, holds the padded page
