"""The sliding-window family's window pool: memory, resume points, every tier, compaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import DEVICE, make_llm

from kvtier import TieredCache
from kvtier.config import CacheConfig
from kvtier.demo.oracle import Expected, compare
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset
from kvtier.errors import ConfigError

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
PS = 16


def make(window_pool: bool = True, storage: str | None = None, **cache) -> LLM:
    cfg = preset("swa", sliding_window=48, window_pool=window_pool)
    if storage is None:  # without storage the prefetch policy stays the default
        cache = {"prefetch_policy": "timeout", **cache}
    return make_llm(cfg, storage, max_running=1, **cache)


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_pool_set_of_the_swa_family() -> None:
    llm = make()
    kinds = [(s.name, s.kind, s.num_layers, s.window) for s in llm.cache.specs]
    assert kinds == [("kv", "kv", 2, 0), ("swa", "window", 2, 48)]
    assert llm.cache.window == 48
    llm.close()
    flat = make(window_pool=False)
    assert [(s.name, s.num_layers) for s in flat.cache.specs] == [("kv", 4)]
    assert flat.cache.window == 0
    flat.close()


def test_a_running_request_holds_only_its_window() -> None:
    llm = make(enable_host=False)
    unit = llm.cache.specs[0].page_bytes(PS) // 2  # one layer of one page
    llm.add_request(tokens(600), SamplingParams(max_tokens=3, ignore_eos=True))
    llm.step()  # the prefill: 600 tokens on 38 pages
    st = llm.stats()
    assert st["device_pages_used"] == 38
    # the next query (position 600) reads 553..600: pages 34..37 keep their window rows
    assert st["device_window_pages"] == 4
    assert st["device_bytes_used"] == (38 * 2 + 4 * 2) * unit
    while llm.has_unfinished():
        llm.step()
    llm.close()
    flat = make(window_pool=False, enable_host=False)
    flat.add_request(tokens(600), SamplingParams(max_tokens=3, ignore_eos=True))
    flat.step()
    assert flat.stats()["device_bytes_used"] == 38 * 4 * unit
    flat.close()


def cold(prompts: list[list[int]]) -> list[Expected]:
    """Every prompt alone on an empty cache, every layer's rows kept (no window pool)."""
    llm = make(window_pool=False)
    out = []
    for p in prompts:
        llm.cache.flush()
        (o,) = llm.generate([p], GREEDY)
        assert o.cached_tokens == 0
        out.append(Expected(list(o.output_ids), o.logits))
    llm.close()
    return out


def same(outs, expected: list[Expected]) -> None:
    for o, e in zip(outs, expected, strict=True):
        ok, diff = compare(o.output_ids, o.logits, e)
        assert ok and diff <= 1e-4, (o.output_ids, e.tokens, diff)


@pytest.mark.parametrize("host_compaction", ["off", "eager"])
def test_resume_points_and_every_tier_with_compaction(tmp_path: Path, host_compaction) -> None:
    base = tokens(300, seed=1)
    turn1 = base[:200]
    prompts = [turn1, base[:120] + [5, 6], base, base[:250] + [9]]
    expected = cold(prompts)
    arenas = {"compaction": "eager", "host_compaction": host_compaction}
    llm = make(storage=str(tmp_path / "l3"), **arenas)
    first = [llm.generate([p], GREEDY)[0] for p in prompts]
    same(first, expected)
    # a re-run resumes at the prompt's last whole page before its last token
    again = [llm.generate([p], GREEDY)[0] for p in prompts]
    same(again, expected)
    assert [o.cached_device for o in again] == [(len(p) - 1) // PS * PS for p in prompts]
    st = llm.stats()
    assert st["device_compactions"] > 0 and st["device_pages_relocated"] > 0
    # the cut prompts recomputed cached pages whose rows were gone: they gave them back,
    # and the host copies got them by a window-only backup
    assert st["window_backup_pages"] > 0

    llm.cache.flush(host=False)
    host = [llm.generate([p], GREEDY)[0] for p in prompts]
    same(host, expected)
    # prompts after the first also find what it loaded on device
    assert [o.cached_tokens for o in host] == [(len(p) - 1) // PS * PS for p in prompts]
    assert [o.cached_host for o in host] == [192, 0, 96, 0]
    llm.cache.drain()
    llm.close()

    fresh = make(storage=str(tmp_path / "l3"), **arenas)
    restored = [fresh.generate([p], GREEDY)[0] for p in prompts]
    same(restored, expected)
    assert [o.cached_tokens for o in restored] == [(len(p) - 1) // PS * PS for p in prompts]
    assert sum(o.cached_storage for o in restored) >= 192
    if host_compaction == "eager":
        # fetched pages without window objects gave their rows' room back: the host arena
        # closed those holes while the restores ran, as the device arena did
        st = fresh.stats()
        assert st["device_pages_relocated"] > 0 and st["host_pages_relocated"] > 0, st
    fresh.close()


def test_a_multi_turn_conversation_resumes_at_its_end() -> None:
    llm = make(enable_host=False)
    p1 = tokens(170, seed=3)
    (o1,) = llm.generate([p1], GREEDY)
    p2 = p1 + list(o1.output_ids) + [11, 12, 13]
    (o2,) = llm.generate([p2], GREEDY)
    # the first turn computed 173 tokens: 10 whole pages, whose last window it kept
    assert o2.cached_device == 160
    (e2,) = cold([p2])
    same([o2], [e2])
    llm.close()


def test_unsupported_combinations_fail_naming_the_option() -> None:
    specs = LLM(preset("swa"), CacheConfig(device=DEVICE)).cache.specs
    with pytest.raises(ConfigError, match="per_layer"):
        TieredCache(CacheConfig(device=DEVICE, backup_timing="per_layer"), specs)
    from kvtier.transfer.translate import PermutationTranslator

    with pytest.raises(ConfigError, match="translator"):
        TieredCache(CacheConfig(device=DEVICE), specs, translator=PermutationTranslator())
    with pytest.raises(ConfigError, match="compaction"):
        CacheConfig(compaction="sometimes")


def test_preempted_requests_back_up_and_resume_through_the_window_pool() -> None:
    prompts = [tokens(90, seed=10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, return_logits=True)
    ref = make(window_pool=False, device_pages=64)
    expected = []
    for p in prompts:
        ref.cache.flush()
        (o,) = ref.generate([p], params)
        expected.append(Expected(list(o.output_ids), o.logits))
    ref.close()
    cfg = preset("swa", sliding_window=48)
    llm = make_llm(cfg, max_running=4, device_pages=12, prefetch_policy="timeout")
    outs = llm.generate(prompts, params)
    same(outs, expected)
    # a decode that found no page preempted a request: its pages went to the cache (and to
    # the host with their window rows, by their physical envelopes) and it resumed from there
    assert sum(o.preemptions for o in outs) > 0
    assert llm.stats()["host_backup_pages"] > 0
    llm.close()


def test_buffer_only_host_smaller_than_a_request(tmp_path: Path) -> None:
    base = tokens(300, seed=1)
    prompts = [base[:200], base[:120] + [5, 6], base, base[:250] + [9]]
    expected = cold(prompts)
    opts = dict(storage=str(tmp_path / "l3"), host_mode="buffer_only", host_pages=4)
    llm = make(**opts)
    for _ in range(2):
        same([llm.generate([p], GREEDY)[0] for p in prompts], expected)
    llm.cache.drain()
    assert llm.stats()["host_pages_used"] == 0
    llm.close()
    fresh = make(**opts)
    restored = [fresh.generate([p], GREEDY)[0] for p in prompts]
    same(restored, expected)
    # The host stages 4 pages a round: storage serves the first 64 tokens of the base, or a
    # round more when host room freed before admission (as the previous request's backups
    # land: a matter of timing, seen under CPU load).
    got = [o.cached_storage for o in restored]
    assert got[:2] == [0, 0] and got[3] == 0
    assert got[2] >= 64 and got[2] % 64 == 0
    fresh.close()


def test_allocation_evicts_more_when_the_arena_promised_too_much(monkeypatch) -> None:
    llm = make(enable_host=False, device_pages=16)
    cache, pool = llm.cache, llm.cache.device_pool
    for seed in range(4):  # four cached requests: 8 cached pages, 24 ids free
        llm.generate([tokens(40, seed=20 + seed)], SamplingParams(max_tokens=1))
    alloc = pool.allocator
    assert (alloc.available, alloc.used) == (8, 8)
    # While pages are leased the count is an upper bound (``optimistic``): here it promises
    # two pages compaction could not make, so the first allocation fails and the controller
    # evicts more, then succeeds.
    cls = type(alloc)
    monkeypatch.setattr(cls, "optimistic", property(lambda self: True))
    monkeypatch.setattr(cls, "available", property(lambda self: self.pool.fits() + 2))
    tried = []
    take = pool.alloc_pages
    monkeypatch.setattr(pool, "alloc_pages", lambda n: tried.append(n) or take(n))
    locs = cache.alloc(PS * 10)
    assert locs.numel() == PS * 10 and tried == [10, 10]
    assert cache.stats()["evicted_device_pages"] == 2  # what the promise lacked
    cache.free(locs)
    cache.check_integrity()
    llm.close()
