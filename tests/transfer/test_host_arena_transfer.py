"""Transfers between a unified device pool and a relocatable host arena (``HostArena``): rows
move byte-exact device → host → (host compaction) → device at page sizes 1 and 16 in both host
layouts, window rows only where both sides hold them, and every op leases its host pages so a
compaction never moves a page a copy is using. A hypothesis test compacts at random between
every operation against a model of what each page holds."""

from __future__ import annotations

import pytest
import torch
from factories import DEVICE, randomise
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError, IntegrityError
from kvtier.pools import PoolSpec, UnifiedPool
from kvtier.pools.host_arena import HostArena
from kvtier.transfer import Mover

CUDA = DEVICE.startswith("cuda")
MECHANISMS = ["auto", "kernel", "copy_engine"] if CUDA else ["auto"]
SHAPE, DTYPE = (2, 2, 8), torch.bfloat16


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def specs(ps: int) -> list[PoolSpec]:
    return [
        PoolSpec("kv", 2, SHAPE, DTYPE),
        PoolSpec("swa", 3, SHAPE, DTYPE, kind="window", window=2 * ps),
    ]


def pools(ps: int, layout: str, host_pages: int = 6, compaction: str = "auto"):  # noqa: ANN201
    dev = UnifiedPool(specs(ps), 6, ps, torch.device(DEVICE))
    host = HostArena(specs(ps), host_pages, ps, layout, pin=CUDA, compaction=compaction)
    randomise(dev.arena, 1)
    randomise(host.arena, 2)
    return dev, host


def finish(op) -> None:  # noqa: ANN001
    op.wait()
    op.complete()


def rows(pool: UnifiedPool, name: str, pages: torch.Tensor) -> torch.Tensor:
    return pool.component_words(name, pages)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_roundtrip_through_host_compaction_is_byte_exact(ps, layout, mechanism):
    dev, host = pools(ps, layout, host_pages=8)
    mover = Mover(dev, host, mechanism=mechanism)
    d = dev.alloc_pages(4)
    dev.release_window(t(1, 3))  # pages 1 and 3 lost their window rows on the device
    kv, swa = rows(dev, "kv", d), rows(dev, "swa", t(0, 2))

    # Host pages 0..5; the copy goes to the last four, then the first two are freed and the
    # pages without device window rows give theirs back: holes below and between.
    h = host.alloc_pages(6)
    assert h.tolist() == [0, 1, 2, 3, 4, 5]
    dst = t(2, 3, 4, 5)
    finish(mover.device_to_host(d, dst))
    assert torch.equal(rows(host, "kv", dst), kv)
    assert torch.equal(rows(host, "swa", t(2, 4)), swa)
    host.free_pages(t(0, 1))
    host.release_window(t(3, 5))
    before = {c: host.physical(dst, c).tolist() for c in ("kv", "swa")}
    assert host.compact() > 0
    assert host.relocated > 0
    assert {c: host.physical(dst, c).tolist() for c in ("kv", "swa")} != before
    host.check_integrity()

    # Back to fresh device pages (moved by device compaction too): window rows only where
    # the host copy has them.
    dev.free_pages(d)
    back = dev.alloc_pages(4)
    dev.release_window(back[t(1, 3)])
    finish(mover.host_to_device(dst, back))
    assert torch.equal(rows(dev, "kv", back), kv)
    assert torch.equal(rows(dev, "swa", back[t(0, 2)]), swa)
    assert dev.has_window(back).tolist() == [True, False, True, False]
    assert host.lease_count(dst).tolist() == [0, 0, 0, 0]
    dev.check_integrity()
    host.check_integrity()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_object_pages_read_and_write_through_translation(layout):
    _, host = pools(16, layout)
    p = host.alloc_pages(3)
    data = torch.randn(3, 2, 16, *SHAPE).to(DTYPE)
    host.write_pages("kv", p, data)
    host.free_pages(p[:1])
    host.compact()
    assert torch.equal(host.read_pages("kv", p[1:]), data[1:])
    host.release_window(p[1:2])
    with pytest.raises(IntegrityError, match="page 1 has no 'swa' envelope"):
        host.read_pages("swa", p[1:2])
    assert host.add_window(p[1:2])
    assert host.has_window(p[1:]).tolist() == [True, True]


def test_a_page_a_copy_uses_never_moves():
    dev, host = pools(16, "page_first")
    mover = Mover(dev, host)
    d = dev.alloc_pages(2)
    host.alloc_pages(1)
    h = host.alloc_pages(2)
    host.free_pages(t(0))
    kv_before = host.physical(h, "kv").tolist()
    op = mover.device_to_host(d, h)  # on CPU the copy is done and its leases are gone
    if not CUDA:
        host.lease(h)  # what an op in flight holds
    assert host.lease_count(h).tolist() == [1, 1]
    host.compact()
    assert host.physical(h, "kv").tolist() == kv_before  # leased: left where they are
    with pytest.raises(IntegrityError, match="leased"):
        host.free_pages(h[:1])
    with pytest.raises(IntegrityError, match="leased"):
        host.release_window(h[:1])
    if CUDA:
        finish(op)
    else:
        host.unlease(h)
    host.compact()
    assert host.physical(h, "kv").tolist() != kv_before  # free to move once released


def test_host_arena_needs_a_window_component():
    with pytest.raises(ConfigError, match="window component"):
        HostArena([PoolSpec("kv", 2, SHAPE, DTYPE)], 4, 16)


def test_pages_without_window_rows_leave_room_for_more_pages():
    _, host = pools(16, "page_first", host_pages=4)
    full = host.alloc_pages(4)
    assert host.alloc_pages(1) is None
    host.release_window(full)  # anchors only: 4 * 2 units of 4 * 5 free up 12
    more = host.alloc_pages(2)  # 2 pages of 5 units
    assert more is not None and more.tolist() == [4, 5]
    host.check_integrity()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "drop_window", "add_window", "write", "compact"]),
        st.integers(0, 10**6),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, layout=st.sampled_from(["page_first", "layer_first"]), ps=st.sampled_from([1, 4]))
def test_random_compactions_between_operations_keep_every_byte(ops, layout, ps):
    """A model (``want``: page → component → bytes) against the arena, with a compaction
    after every operation (eager arena: each allocation compacts as well)."""
    dev, host = pools(ps, layout, host_pages=5, compaction="eager")
    mover = Mover(dev, host)
    d = dev.alloc_pages(2)
    want: dict[int, dict[str, torch.Tensor]] = {}
    for op, r in ops:
        live = sorted(want)
        if op == "alloc":
            got = host.alloc_pages(1 + r % 2)
            if got is not None:
                for p in got.tolist():
                    want[p] = {c: rows(host, c, t(p)) for c in ("kv", "swa")}
        elif op == "free" and live:
            p = live[r % len(live)]
            host.free_pages(t(p))
            del want[p]
        elif op == "drop_window" and live:
            p = live[r % len(live)]
            if "swa" in want[p]:
                host.release_window(t(p))
                del want[p]["swa"]
        elif op == "add_window" and live:
            p = live[r % len(live)]
            if "swa" not in want[p] and host.add_window(t(p)):
                want[p]["swa"] = rows(host, "swa", t(p))  # stale rows, but stable from now on
        elif op == "write" and live:
            p = live[r % len(live)]
            randomise(dev.arena, r)
            finish(mover.device_to_host(d[:1], t(p)))
            want[p]["kv"] = rows(dev, "kv", d[:1])
            if "swa" in want[p]:
                want[p]["swa"] = rows(dev, "swa", d[:1])
        host.compact()
        host.check_integrity()
        for p, comps in want.items():
            for c, b in comps.items():
                assert torch.equal(rows(host, c, t(p)), b), f"page {p} {c} after {op}"
            assert bool(host.has_window(t(p))) == ("swa" in comps)
