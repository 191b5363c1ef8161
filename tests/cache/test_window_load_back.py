"""Loading a window pool's host copies back to device: only the pages whose host copy carries
window rows get a window envelope, a query whose window reaches the others recomputes, and a
load whose copy fails gives both envelopes of every page it took back.

The host copy of a long request's early pages has no window rows (the engine dropped them once
its queries left them behind, before the backup): ``Node.ckpt`` is false there."""

from __future__ import annotations

import pytest
import torch
from factories import make_llm

from kvtier.demo.oracle import Expected, compare
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset
from kvtier.errors import TransferError

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
PS = 16
WINDOW = 48
"""The first query at a page boundary reads the three pages before it."""
DEVICE_PAGES = 16
"""64 units of arena: 16 fresh pages (anchor and window envelopes of 2 units each), or 32
pages without window rows."""
UNITS = DEVICE_PAGES * 4


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


LONG = tokens(200, seed=1)
"""Twelve whole pages (192 tokens) are cached; only the last three keep their window rows."""
FLAGS = [False] * 9 + [True] * 3
"""The host flags of LONG's pages after its run."""
EARLY = LONG[:100] + [5, 6]
"""A query whose window (pages 3..5 at its resume point, page 6) reaches pages without rows."""
MIDDLE = LONG[:150] + [7, 8]
"""A query of nine cached pages: it resumes at page 6 once pages 3..5 have their rows."""


def make(**cache: object) -> LLM:
    cfg = preset("swa", sliding_window=WINDOW)
    return make_llm(
        cfg, max_running=1, device_pages=DEVICE_PAGES, prefetch_policy="timeout", **cache
    )


@pytest.fixture(scope="module")
def cold() -> dict[str, Expected]:
    """Every prompt alone on an empty cache, every layer's rows kept (no window pool)."""
    llm = make_llm(preset("swa", sliding_window=WINDOW, window_pool=False), max_running=1)
    out = {}
    for name, prompt in (("long", LONG), ("early", EARLY), ("middle", MIDDLE)):
        llm.cache.flush()
        (o,) = llm.generate([prompt], GREEDY)
        assert o.cached_tokens == 0
        out[name] = Expected(list(o.output_ids), o.logits)
    llm.close()
    return out


def run(llm: LLM, prompt: list[int], expected: Expected):  # noqa: ANN201 - a RequestOutput
    """``prompt`` through the engine; its tokens and logits must be the cold run's."""
    (o,) = llm.generate([prompt], GREEDY)
    ok, diff = compare(o.output_ids, o.logits, expected)
    assert ok and diff <= 1e-4, (list(o.output_ids), expected.tokens, diff)
    return o


def cached_long(**cache: object) -> LLM:
    """An engine that ran LONG: its twelve pages have host copies flagged ``FLAGS``."""
    llm = make(**cache)
    llm.generate([LONG], GREEDY)
    llm.cache.drain()
    (node,) = llm.cache.tree.match(LONG).path
    assert node.num_tokens == 192 and node.ckpt.tolist() == FLAGS
    return llm


def tree_state(llm: LLM) -> list[tuple]:
    """Every node: its tokens, copies, flags, lock and pins."""
    out = []
    for n in llm.cache.tree.nodes():
        if n is llm.cache.tree.root:
            continue
        out.append(
            (
                n.id,
                n.num_tokens,
                None if n.device is None else n.device.tolist(),
                None if n.host is None else n.host.tolist(),
                None if n.ckpt is None else n.ckpt.tolist(),
                n.origin,
                n.lock_ref,
                n.device_io,
                n.host_io,
            )
        )
    return out


def pool_state(llm: LLM) -> dict[str, int]:
    pool = llm.cache.device_pool
    return {
        "free_ids": pool.free_ids,
        "free_units": pool.free_units,
        "window_pages": pool.window_pages,
        "leased_pages": pool.leased_pages,
    }


def test_a_load_under_pressure_binds_window_rows_only_where_the_host_copy_has_them(
    cold: dict[str, Expected],
) -> None:
    llm = cached_long(compaction="eager")
    cache, pool = llm.cache, llm.cache.device_pool
    for seed in (2, 3, 4):  # three other requests take the device pool
        llm.generate([tokens(70, seed=seed)], GREEDY)
    cache.drain()
    (node,) = cache.tree.match(LONG).path
    assert node.device is None and node.host is not None

    m = cache.match(LONG[:-1])
    assert (m.device_len, m.host_len) == (0, 192)
    before = cache.stats()
    cache.lock(m.handle)
    ld = cache.load(m)
    after = cache.stats()
    assert (ld.device_tokens, ld.host_tokens, ld.locs.numel()) == (0, 192, 192)
    # the load evicted the first two other requests (four pages each) and moved the last
    # one's pages down over their holes
    moved = {k: after[k] - before[k] for k in ("evicted_device_pages", "device_pages_relocated")}
    assert moved == {"evicted_device_pages": 8, "device_pages_relocated": 4}
    (node,) = m.handle.locked.path
    got = pool.has_window(node.device).tolist()
    assert got == FLAGS, f"loaded pages with a window envelope {got}, host flags {FLAGS}"
    (last,) = [n for n in cache.tree.nodes() if n is not node and n.device is not None]
    assert pool.has_window(last.device).tolist() == [False, True, True, True]
    # LONG's twelve anchor and three window envelopes, the last request's four and three, of
    # two units each
    assert pool.free_units == UNITS - (12 + 3) * 2 - (4 + 3) * 2, "envelopes of rows not loaded"
    cache.unlock(m.handle)

    # EARLY's resume point (page 6) reads pages 3..5, loaded without rows: it recomputes
    assert cache.tree.match(EARLY[:-1]).device_len == 96
    m = cache.match(EARLY[:-1])
    assert (m.device_len, m.host_len) == (0, 0), "a hit over loaded pages without window rows"
    o = run(llm, EARLY, cold["early"])
    assert o.cached_tokens == 0
    # its recompute handed its rows of pages 3..5 to the cached pages: MIDDLE (nine pages)
    # resumes at page 6 and no later (page 8's window needs pages 6 and 7, which lack rows)
    device = torch.cat([n.device for n in cache.tree.match(LONG).path])
    assert pool.has_window(device).tolist() == [False] * 3 + [True] * 3 + FLAGS[6:]
    o = run(llm, MIDDLE, cold["middle"])
    assert o.cached_tokens == 96
    o = run(llm, LONG, cold["long"])
    assert o.cached_tokens == 192
    llm.close()


def test_a_load_that_fits_in_part_resumes_only_where_its_window_rows_are(
    cold: dict[str, Expected],
) -> None:
    llm = cached_long()
    cache, pool = llm.cache, llm.cache.device_pool
    cache.flush(host=False)
    held = cache.alloc(6 * PS)  # the engine's: 24 of the 64 units, ten fresh pages fit
    m = cache.match(LONG[:-1])
    cache.lock(m.handle)
    ld = cache.load(m)
    path = m.handle.locked.path
    assert [(n.num_tokens, n.on_device) for n in path] == [(160, True), (32, False)]
    got = pool.has_window(path[0].device).tolist()
    assert got == FLAGS[:10], f"loaded pages with a window envelope {got}, host flags {FLAGS}"
    # resuming at page 10 reads pages 7..9, and 7 and 8 have no rows: nothing is served
    assert (ld.host_tokens, ld.locs.numel()) == (0, 0), "a hit over pages without window rows"
    cache.unlock(m.handle)
    cache.free(held)
    o = run(llm, LONG, cold["long"])
    assert o.cached_tokens == 192
    llm.close()


@pytest.mark.parametrize(("held_pages", "fits"), [(0, 12), (6, 10)], ids=["whole", "in-part"])
def test_a_failed_load_gives_back_both_envelopes_and_leaves_the_tree_as_it_was(
    cold: dict[str, Expected], monkeypatch: pytest.MonkeyPatch, held_pages: int, fits: int
) -> None:
    llm = cached_long()
    cache, pool = llm.cache, llm.cache.device_pool
    cache.flush(host=False)
    held = cache.alloc(held_pages * PS)  # the engine's: LONG's twelve pages fit, or ten
    m = cache.match(LONG[:-1])
    cache.lock(m.handle)
    pools, tree = pool_state(llm), tree_state(llm)
    path = list(m.handle.locked.path)
    loads_before = cache.stats().get("load_bytes", 0)
    seen = []

    def refuse(host: torch.Tensor, device: torch.Tensor, **kw: object) -> None:
        # the device pages are taken and their window envelopes bound when the copy is asked
        seen.append((device.numel(), pool.has_window(device).tolist(), pool.free_ids))
        raise TransferError("the copy engine refused the batch")

    with monkeypatch.context() as mp:
        mp.setattr(cache.controller.mover, "host_to_device", refuse)
        with pytest.raises(TransferError, match="refused the batch"):
            cache.load(m)
    assert seen == [(fits, FLAGS[:fits], pools["free_ids"] - fits)]
    assert pool_state(llm) == pools, "device pages or envelopes of the failed load kept"
    assert tree_state(llm) == tree, "the failed load changed the tree"
    assert m.handle.locked.path == path
    assert all(n.device is None and (n.device_io, n.host_io) == (0, 0) for n in path)
    assert not cache.controller.loads.flights and not cache.in_flight()
    assert cache.stats().get("load_bytes", 0) == loads_before
    cache.check_integrity()

    ld = cache.load(m)  # the retry
    assert (ld.host_tokens, ld.locs.numel()) == ((192, 192) if fits == 12 else (0, 0))
    node = m.handle.locked.path[0]
    assert pool.has_window(node.device).tolist() == FLAGS[:fits]
    cache.unlock(m.handle)
    cache.free(held)
    o = run(llm, LONG, cold["long"])
    assert o.cached_tokens == 192
    llm.close()
