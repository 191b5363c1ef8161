"""Misuse of the cache and engine API is refused with a named error before any state changes,
and one failing request does not take the engine down."""

from __future__ import annotations

import logging

import pytest
import torch
from factories import cache_config, engine_config

from kvtier.cache import TieredCache, slot_checks
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine.request import Request
from kvtier.errors import RequestError
from kvtier.pools.spec import PoolSpec

PS = 4
KV = PoolSpec("kv", 2, (2, 2, 4), torch.float32)
TOKENS = list(range(100, 100 + 3 * PS))


def make() -> TieredCache:
    cfg = cache_config(
        device_pages=12,
        host_pages=None,
        device="cpu",
        model_fingerprint="",
        prefetch_policy="timeout",
    )
    return TieredCache(cfg, [KV])


def snapshot(c: TieredCache) -> tuple:
    """What a refused call must leave as it was."""
    c.check_integrity()
    return (
        c.device_pool.allocator.available,
        c.engine_pages.count,
        c.tree.held_pages("device").tolist(),
        sum(1 for _ in c.tree.nodes()),
    )


def finished_request(c: TieredCache) -> tuple[torch.Tensor, object]:
    m = c.match(TOKENS)
    c.lock(m.handle)
    c.load(m)
    locs = c.alloc(len(TOKENS) + 1)
    handle = m.handle
    c.finish(TOKENS, locs, prefix_len=0, handle=handle)
    return locs, handle


def test_second_finish_with_the_same_slots_is_refused() -> None:
    c = make()
    locs, handle = finished_request(c)
    before = snapshot(c)
    with pytest.raises(RequestError, match="not locked"):
        c.finish(TOKENS, locs, prefix_len=0, handle=handle)
    with pytest.raises(RequestError, match=r"device page\(s\) \[0, 1, 2, 3\]"):
        c.finish(TOKENS, locs, prefix_len=0, handle=None)
    assert snapshot(c) == before
    # The pages stay the tree's: a fresh allocation never hands them out again.
    fresh = c.alloc(8 * PS)
    assert not set((fresh // PS).tolist()) & {0, 1, 2}


def test_free_of_cached_or_free_slots_is_refused() -> None:
    c = make()
    locs, _ = finished_request(c)
    before = snapshot(c)
    with pytest.raises(RequestError, match=r"free: device page\(s\) \[0, 1, 2\]"):
        c.free(locs[: 3 * PS])
    with pytest.raises(RequestError, match=r"free: device page\(s\) \[11\]"):
        c.free(torch.tensor([44]))
    assert snapshot(c) == before


def test_finish_with_a_wrong_prefix_len_is_refused() -> None:
    c = make()
    finished_request(c)
    m = c.match(TOKENS + [7] * PS)
    c.lock(m.handle)
    ld = c.load(m)
    assert ld.locs.numel() == 3 * PS
    own = c.alloc(PS)
    locs = torch.cat((ld.locs, own))
    before = snapshot(c)
    for wrong in (0, PS, 4 * PS):
        with pytest.raises(RequestError, match=f"prefix_len={wrong} but load"):
            c.finish(TOKENS + [7] * PS, locs, prefix_len=wrong, handle=m.handle)
    assert snapshot(c) == before
    c.finish(TOKENS + [7] * PS, locs, prefix_len=3 * PS, handle=m.handle)
    assert c.engine_pages.count == 0
    c.check_integrity()


def test_insert_outside_the_pool_or_of_foreign_pages_is_refused() -> None:
    c = make()
    before = snapshot(c)
    with pytest.raises(RequestError, match=r"slot 48 lies outside the device pool \[0, 48\)"):
        c.insert(TOKENS[:PS], torch.arange(48, 48 + PS))
    with pytest.raises(RequestError, match="device page 2 .* neither the engine's"):
        c.insert(TOKENS[:PS], torch.arange(8, 8 + PS))  # never allocated
    assert snapshot(c) == before


def test_a_closed_cache_and_engine_refuse_calls() -> None:
    c = make()
    c.close()
    for call in (
        lambda: c.match(TOKENS),
        lambda: c.alloc(PS),
        lambda: c.insert(TOKENS, torch.arange(len(TOKENS))),
        lambda: c.poll(),
    ):
        with pytest.raises(RequestError, match="after close"):
            call()
    llm = LLM(ModelConfig(num_layers=1), CacheConfig(page_size=PS, device="cpu"))
    llm.close()
    with pytest.raises(RequestError, match=r"LLM.generate\(\) after close"):
        llm.generate([[1, 2, 3]])


def test_a_request_failing_in_a_step_ends_alone(monkeypatch, caplog) -> None:
    model = ModelConfig(num_layers=1, max_position=256)
    cfg = engine_config(page_size=PS, device="cpu", prefetch_policy="timeout")
    prompts = [[i + 1] * (5 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6)
    expected = [o.output_ids for o in LLM(model, cfg).generate(prompts, params)]

    llm = LLM(model, cfg)
    record = Request.record_logits

    def failing_record(req, row):  # inside the sampling of one item of a batch
        if req.id == 1 and req.num_output == 2:
            raise ValueError("sampler broke")
        return record(req, row)

    monkeypatch.setattr(Request, "record_logits", failing_record)
    outs = llm.generate(prompts, params)
    monkeypatch.setattr(Request, "record_logits", record)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[1].error == "ValueError: sampler broke" and len(outs[1].output_ids) == 2
    assert [outs[i].output_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]

    forward = llm.runner.forward

    def failing_forward(work, *rest, **options):
        if any(w.req.id == 5 for w in work):  # the second prompt of the next batch
            raise RuntimeError("kernel fault")
        return forward(work, *rest, **options)

    monkeypatch.setattr(llm.runner, "forward", failing_forward)
    assert llm.stats()["split_forwards"] == 0
    with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
        outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[1].error == "RuntimeError: kernel fault"
    # the one batched forward holding request 5 (the prefill of all four), said and counted
    assert llm.stats()["split_forwards"] == 1
    assert "a forward of 4 requests failed, running them one at a time: RuntimeError" in (
        caplog.text
    )
    assert [outs[i].output_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    monkeypatch.setattr(llm.runner, "forward", forward)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert llm.cache.engine_pages.count == 0
    llm.cache.check_integrity()


def test_a_failing_poll_is_raised_as_itself_not_as_a_failed_forward(monkeypatch) -> None:
    model = ModelConfig(num_layers=1, max_position=256)
    llm = LLM(model, CacheConfig(page_size=PS, device_pages=64, device="cpu"))
    for p in ([1] * 7, [2] * 9):
        llm.add_request(p, SamplingParams(max_tokens=3))
    forwards: list[int] = []
    forward = llm.runner.forward

    def counting_forward(work, *rest):
        forwards.append(len(work))
        return forward(work, *rest)

    def broken_poll() -> None:
        raise RuntimeError("poll broke")

    monkeypatch.setattr(llm.runner, "forward", counting_forward)
    monkeypatch.setattr(llm.cache, "poll", broken_poll)
    with pytest.raises(RuntimeError, match="poll broke"):
        llm.step()
    assert forwards == [2]  # one forward of the batch: not re-run item by item
    monkeypatch.undo()
    while llm.has_unfinished():  # the engine goes on once polls work again
        llm.step()
    llm.cache.drain()
    llm.cache.check_integrity()


def test_free_takes_each_page_once_in_any_slot_order() -> None:
    c = make()
    a, b = c.alloc(2 * PS), c.alloc(PS)  # pages 0-1 and 2
    slots = torch.cat((b[:2], a[PS:], a[:1], b[2:], a[1:PS])).numpy()
    assert slot_checks.distinct_pages(slots, PS).tolist() == [0, 1, 2]
    before = c.device_pool.allocator.available
    c.free(torch.cat((b, a[PS:], a[:PS], b[:1])))  # page 2 named twice, apart
    assert c.device_pool.allocator.available == before + 3
    assert c.engine_pages.count == 0
    c.check_integrity()
