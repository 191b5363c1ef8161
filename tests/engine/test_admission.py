"""Admission under pool pressure: every ``generate`` finishes within a step budget with the
outputs of cold runs, hits are counted once per admitted request, and waiting requests retry
their storage fetch when host room frees up."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workloads import MODEL, Workload, chat_workload, cold, replay, run

from kvtier.config import PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig
from kvtier.engine import LLM, SamplingParams

workloads = st.builds(
    lambda ps, sys_len, convs, turns, mt, seed: chat_workload(ps, sys_len, convs, turns, mt, seed),
    st.sampled_from([1, 2, 5, 7, 16]),
    st.integers(0, 120),
    st.integers(2, 4),
    st.integers(1, 2),
    st.integers(1, 6),
    st.integers(0, 2**16),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    w=workloads,
    slack=st.integers(0, 3),
    write_policy=st.sampled_from(WRITE_POLICIES),
    prefetch_policy=st.sampled_from(PREFETCH_POLICIES),
    host_ratio=st.sampled_from([1.0, 2.0, 4.0]),
    max_running=st.integers(1, 4),
)
def test_tiny_pools_always_finish_with_cold_outputs(
    tmp_path_factory, w, slack, write_policy, prefetch_policy, host_ratio, max_running
) -> None:
    """Random multi-turn workloads over a device pool just large enough for the longest
    request, file L3, and a fresh process (empty device and host tiers) replaying every turn."""
    d = tmp_path_factory.mktemp("l3")
    cfg = CacheConfig(
        page_size=w.page_size,
        device_pages=-(-w.longest() // w.page_size) + slack,
        device="cpu",
        storage="file",
        storage_dir=str(d),
        write_policy=write_policy,
        prefetch_policy=prefetch_policy,
        host_ratio=host_ratio,
        debug_checks=True,
    )
    live = LLM(MODEL, cfg, max_running=max_running)
    record = replay(live, w, len(w.turns) - 1)
    live.close()
    again = LLM(MODEL, cfg, max_running=max_running)
    record_again = replay(again, w, len(w.turns))
    again.close()
    assert record_again[: len(record)] == record
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    prompts = [p for ps, _ in record_again for p in ps]
    outputs = [o for _, os in record_again for o in os]
    assert outputs == cold(prompts, params)


def test_stored_history_behind_a_full_device_pool(tmp_path: Path) -> None:
    """Four conversations sharing a 200-token prefix, replayed from L3 with a pool that holds
    one request: fetches that finish behind a blocked head of the queue are consumed, so the
    head gets their pages (this spun for ever at page sizes 1, 5 and 7)."""
    for ps in (1, 5, 7):
        rng = random.Random(ps)
        system = [rng.randrange(128) for _ in range(200)]
        msgs = [[[rng.randrange(128) for _ in range(30)] for _ in range(4)] for _ in range(3)]
        w = Workload(ps, system, msgs, 6)
        cfg = CacheConfig(
            page_size=ps,
            device_pages=-(-w.longest() // ps),
            device="cpu",
            storage="file",
            storage_dir=str(tmp_path / f"ps{ps}"),
            prefetch_policy="best_effort",
            host_ratio=1.0,
        )
        live = LLM(MODEL, cfg)
        record = replay(live, w, 2)
        live.close()
        again = LLM(MODEL, cfg)
        record_again = replay(again, w, 3)
        assert record_again[:2] == record
        stats = again.stats()
        assert stats["storage_hit_tokens"] > 0
        again.close()


def test_hits_are_counted_once_per_admitted_request(tmp_path: Path) -> None:
    """Admissions that fail and are retried (pool too small for all) count nothing; the
    counters equal the per-request ``cached_*`` sums."""
    rng = random.Random(7)
    shared = [rng.randrange(128) for _ in range(64)]
    prompts = [shared + [rng.randrange(128) for _ in range(40)] for _ in range(6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cfg = CacheConfig(
        page_size=4,
        device_pages=30,
        device="cpu",
        storage="file",
        storage_dir=str(tmp_path),
        prefetch_policy="wait_complete",
    )
    llm = LLM(MODEL, cfg, max_running=4)
    outs = run(llm, prompts, params) + run(llm, prompts, params)
    llm.close()
    again = LLM(MODEL, cfg, max_running=4)
    outs += run(again, prompts, params)
    s1, s2 = llm.stats(), again.stats()
    for tier in ("device", "host", "storage"):
        assert s1[f"{tier}_hit_tokens"] == sum(getattr(o, f"cached_{tier}") for o in outs[:12])
        assert s2[f"{tier}_hit_tokens"] == sum(getattr(o, f"cached_{tier}") for o in outs[12:])
    assert s1["recomputed_tokens"] == sum(o.recomputed for o in outs[:12])
    assert s2["storage_hit_tokens"] > 0 and sum(o.cached_device for o in outs[6:12]) > 0
    again.close()


def test_a_burst_retries_its_fetches_as_host_room_frees(tmp_path: Path) -> None:
    """Eight stored prompts sent at once to a fresh engine whose host tier holds two of them:
    the fetches that found no room at submission are retried, so every request resumes from
    storage instead of recomputing."""
    rng = random.Random(11)
    prompts = [[rng.randrange(128) for _ in range(60)] for _ in range(8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    base = dict(
        page_size=4,
        device_pages=40,
        device="cpu",
        storage="file",
        storage_dir=str(tmp_path),
        prefetch_policy="wait_complete",
    )
    live = LLM(MODEL, CacheConfig(**base, host_pages=200))
    expected = [o.output_ids for o in run(live, prompts, params)]
    live.close()
    burst = LLM(MODEL, CacheConfig(**base, host_pages=32), max_running=2)
    outs = run(burst, prompts, params)
    assert [o.output_ids for o in outs] == expected
    stored = (len(prompts[0]) - 1) // 4 * 4
    assert [o.cached_storage for o in outs] == [stored] * len(prompts)
    assert burst.stats()["storage_hit_tokens"] == stored * len(prompts)
    burst.close()


class _StubCache:
    """What ``Scheduler._try_prefetch`` and ``_wait_for_host`` read of the cache: each
    ``prefetch`` answers the next of ``fetches`` (``None``: no host room)."""

    page_size = 4

    def __init__(self, fetches: list[object | None], in_flight: bool = False) -> None:
        self.config = CacheConfig(page_size=4, prefetch_policy="wait_complete")
        self.fetches = fetches
        self.transfers = in_flight

    def match(self, tokens: object) -> object:
        return type("M", (), {"storage_len": 8})()

    def prefetch(self, m: object) -> object | None:
        return self.fetches.pop(0)

    def in_flight(self) -> bool:
        return self.transfers


def test_only_fruitless_fetch_tries_count_and_transfers_in_flight_keep_a_request_waiting():
    from kvtier.engine.request import Request
    from kvtier.engine.scheduler import MAX_PREFETCH_TRIES, Scheduler

    got = object()  # a fetch that took pages
    fetches = [None] * MAX_PREFETCH_TRIES + [got] + [None] * MAX_PREFETCH_TRIES + [None]
    cache = _StubCache(fetches)
    sched = Scheduler(cache, max_running=1, max_prefill_tokens=64)  # type: ignore[arg-type]
    req = Request(0, [1, 2, 3], SamplingParams(), arrival=0.0, generator=None)
    sched.running.append(req)  # something runs: room can still free
    tries = []
    for _ in range(2 * MAX_PREFETCH_TRIES + 2):
        req.prefetch = None
        sched._try_prefetch(req)
        tries.append(req.prefetch_tries)
    # Four fruitless tries, one that took pages (the count starts again), four more, one more.
    assert tries == [1, 2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert not sched._wait_for_host(req)  # five fruitless tries in a row: recompute
    req.prefetch_tries = 1
    assert sched._wait_for_host(req)
    sched.running.clear()
    assert not sched._wait_for_host(req)  # nothing runs, fetches or lands: room cannot free
    cache.transfers = True
    assert sched._wait_for_host(req)  # backups in flight pin host pages until they land
