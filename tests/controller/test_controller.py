"""The controller: shorter-prefix load-back, slot validation where slots enter, and integrity
(every node's in-flight pins rebuilt from the records) under random schedules."""

from __future__ import annotations

import pytest
import torch
from factories import PS, SPEC, kv_of, make_cache, run_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError, RequestError

SIX_PAGES = list(range(300, 300 + 6 * PS))


def test_a_host_node_that_does_not_fit_loads_its_first_pages(tmp_path) -> None:
    """A 6-page host node with 4 free device pages loads 4 pages, not 0."""
    c = make_cache(tmp_path, storage=None, device_pages=8, host_pages=16)
    first = run_request(c, SIX_PAGES)
    orig = kv_of(c, first["locs"])
    c.drain()
    assert c.controller.evict_device(8) == 6
    held = c.alloc(4 * PS)  # the engine keeps 4 of the 8 device pages
    m = c.match(SIX_PAGES)
    assert (m.device_len, m.host_len) == (0, 6 * PS)
    c.lock(m.handle)
    ld = c.load(m)
    assert (ld.device_tokens, ld.host_tokens) == (0, 4 * PS)
    assert ld.locs.numel() == 4 * PS
    assert torch.equal(kv_of(c, ld.locs), orig[:, : 4 * PS])
    head, tail = m.handle.locked.path
    assert (head.num_pages(PS), head.on_device, tail.num_pages(PS), tail.on_device) == (
        4,
        True,
        2,
        False,
    )
    c.check_integrity()
    c.drain()
    c.record_hits(m.handle)
    assert c.stats()["host_hit_tokens"] == 4 * PS
    c.unlock(m.handle)
    c.free(held)
    c.check_integrity()
    c.close()


def test_misaligned_or_rotated_slots_are_refused_where_they_enter(tmp_path) -> None:
    c = make_cache(tmp_path, storage=None)
    locs = c.alloc(2 * PS)
    tokens = list(range(2 * PS))
    rotated = torch.cat((locs[1:PS], locs[:1], locs[PS:]))
    with pytest.raises(RequestError, match=r"page 0 of the slots \(\[1, 2, 3, 0\]\)"):
        c.insert(tokens, rotated)
    shifted = locs + 1
    with pytest.raises(RequestError, match="not 4 consecutive slots starting at a multiple"):
        c.insert(tokens, shifted)
    c.check_integrity()
    c.finish(tokens, locs, 0, None)
    assert c.match(tokens + [0]).device_len == 2 * PS
    c.check_integrity()
    c.close()


def kv_for(tokens: list[int]) -> torch.Tensor:
    """Deterministic KV rows of ``tokens``: row ``i`` depends on position and token only, so
    every request sharing a prefix writes the same bytes there."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 1e-3 + pos).reshape(1, -1, *([1] * len(SPEC.row_shape)))
    return base.expand(SPEC.num_layers, -1, *SPEC.row_shape).clone()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["request", "request", "evict_device", "evict_host", "poll", "drain"]),
        st.integers(0, 5),
        st.integers(1, 4),
    ),
    min_size=4,
    max_size=24,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=OPS,
    write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    prefetch_policy=st.sampled_from(["wait_complete", "best_effort"]),
    restart_at=st.integers(0, 24),
)
def test_controller_integrity_under_random_schedules(
    tmp_path_factory, ops, write_policy, prefetch_policy, restart_at
) -> None:
    """Random requests over a few shared prefixes (match, prefetch, lock, load, alloc,
    finish), evictions, polls and drains, with a restart onto the same storage: after every
    step each node's pins equal what the in-flight records hold, and restored bytes are the
    bytes first written."""
    d = tmp_path_factory.mktemp("l3")
    kw = dict(
        write_policy=write_policy,
        prefetch_policy=prefetch_policy,
        device_pages=12,
        host_pages=16,
        debug_checks=True,
    )
    c = make_cache(d, **kw)
    prefixes = [list(range(1000 * p, 1000 * p + 4 * PS)) for p in range(3)]
    for step, (op, a, b) in enumerate(ops):
        if step == restart_at:
            c.close()
            c = make_cache(d, **kw)
        if op == "request":
            tokens = prefixes[a % 3][: b * PS] + [7000 + a] * (a % 2) * PS
            m = c.match(tokens)
            if m.storage_len:
                pf = c.prefetch(m)
                c.drain()
                c.finish_prefetch(pf)
                m = c.match(tokens, probe_storage=False)
            c.lock(m.handle)
            ld = c.load(m)
            prefix = ld.locs.numel()
            try:
                new = c.alloc(len(tokens) - prefix)[: len(tokens) - prefix]
            except CapacityError:
                c.unlock(m.handle)
                continue
            rows = kv_for(tokens)
            c.device_pool.anchor[:, new] = rows[:, prefix:].to(c.device)
            locs = torch.cat([ld.locs, new])
            assert torch.equal(kv_of(c, locs[:prefix]), rows[:, :prefix])
            c.finish(tokens, locs, prefix, m.handle)
        elif op == "evict_device":
            c.controller.evict_device(a + 1)
        elif op == "evict_host":
            c.controller.evict_host(a + 1)
        elif op == "poll":
            c.poll()
        else:
            c.drain()
        c.check_integrity()
    c.drain()
    c.check_integrity()
    c.close()
