"""CPU time the cache costs a scheduler, per step, with many requests in flight.

The engine's own scheduler drives a ``TieredCache`` with ``concurrency`` requests (shared
system prompt, distinct user turns, output lengths spread up to ``output_tokens``), no model:
every step decodes one token per running request, finished requests leave and new ones arrive.
Every public call into the cache is timed (a ``TieredCache`` subclass that wraps its public
methods, ``TIMED``); the result is kvtier's CPU time per step and per request-step, next to the
scheduler's total step time measured in the same run (the peer), and each method's mean time
per call (``us_per_call``), which says where a change of the per-step figure lies.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kvtier.cache import TieredCache
from kvtier.config import CacheConfig
from kvtier.engine.request import Request
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler
from kvtier.pools.spec import PoolSpec

TIMED = (
    "match",
    "lock",
    "unlock",
    "load",
    "alloc",
    "free",
    "insert",
    "finish",
    "poll",
    "prefetch",
    "prefetch_ready",
    "wait_prefetch",
    "finish_prefetch",
    "record_hits",
    "record_prefill",
    "drain",
)
"""The public ``TieredCache`` calls that are timed (every one a scheduler makes)."""


class _TimedCache(TieredCache):
    """A ``TieredCache`` that adds up the wall time of its own public calls (``TIMED``): the
    scheduler drives a real cache, the timing wraps only its public methods."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0
        self.calls: Counter[str] = Counter()
        self.call_seconds: Counter[str] = Counter()


def _timed(name: str) -> Callable[..., Any]:
    method = getattr(TieredCache, name)

    def timed(self: _TimedCache, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            self.calls[name] += 1
            self.call_seconds[name] += dt

    timed.__name__ = name
    timed.__doc__ = method.__doc__
    return timed


for _name in TIMED:
    setattr(_TimedCache, _name, _timed(_name))


FULL_POOL_FACTOR = 1.05
"""Device pages per page the running requests need, in the ``under_eviction`` run."""


def bench_step(
    concurrency: int = 1000,
    steps: int = 200,
    system_tokens: int = 512,
    user_tokens: int = 256,
    output_tokens: int = 64,
    page_size: int = 16,
    seed: int = 0,
    debug_checks: bool = False,
) -> dict:
    """Per-step cache CPU time at ``concurrency`` running requests (see the module docstring).

    ``debug_checks`` builds the caches with ``CacheConfig.debug_checks`` (every poll checks
    the cache's integrity, inside the timed calls: for tests, not for figures).

    The top-level figures come from a device pool twice what the running requests need (the
    cache grows without evicting); ``under_eviction`` repeats the run with a device pool of
    ``FULL_POOL_FACTOR`` times that need and a host pool twice the device pool, so finished
    requests' pages are evicted from both tiers every few steps, as in a full serving cache.
    """
    args = (concurrency, steps, system_tokens, user_tokens, output_tokens, page_size, seed)
    args += (debug_checks,)
    out = _run(2.0, 1.0, *args)
    full = _run(FULL_POOL_FACTOR, 2.0, *args)
    out["under_eviction"] = {k: v for k, v in full.items() if k not in ("bench", "concurrency")}
    return out


def _run(
    pool_factor: float,
    host_ratio: float,
    concurrency: int,
    steps: int,
    system_tokens: int,
    user_tokens: int,
    output_tokens: int,
    page_size: int,
    seed: int,
    debug_checks: bool,
) -> dict:
    per_req = (system_tokens + user_tokens + output_tokens) // page_size + 2
    spec = PoolSpec("kv", 1, (2, 1, 8), torch.float16)
    cfg = CacheConfig(
        page_size=page_size,
        device_pages=int(per_req * concurrency * pool_factor),
        host_ratio=host_ratio,
        device="cpu",
        debug_checks=debug_checks,
    )
    cache = _TimedCache(cfg, [spec])
    sched = Scheduler(cache, concurrency, 1 << 30)
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(system_tokens)]
    ids = iter(range(1 << 30))

    def arrive(n: int) -> None:
        # Output lengths spread over [1, output_tokens] so requests finish, and new ones
        # arrive, at every step rather than in waves.
        for _ in range(n):
            prompt = system + [rng.randrange(32000) for _ in range(user_tokens)]
            params = SamplingParams(max_tokens=rng.randint(1, output_tokens), ignore_eos=True)
            sched.add(Request(next(ids), prompt, params, time.perf_counter(), None))

    arrive(concurrency)
    step_s, cache_s, running = [], [], []
    for i in range(steps):
        before = cache.seconds
        t0 = time.perf_counter()
        cache.poll()
        work = sched.schedule()
        finished = sched.update(work, [[rng.randrange(32000)] for _ in work])
        arrive(len(finished))
        step_s.append(time.perf_counter() - t0)
        cache_s.append(cache.seconds - before)
        running.append(len(sched.running))
        if i % 50 == 0:
            print(f"[bench step] step {i}: {len(sched.running)} running", file=sys.stderr)
    warm = slice(steps // 4, None)  # skip the admission wave
    kv = cache_s[warm]
    out = {
        "bench": "step",
        "concurrency": concurrency,
        "device_pages": cfg.device_pages,
        "steps": steps,
        "mean_running": statistics.mean(running[warm]),
        "cache_ms_per_step": {
            "mean": 1e3 * statistics.mean(kv),
            "p50": 1e3 * statistics.median(kv),
            "p99": 1e3 * sorted(kv)[int(0.99 * (len(kv) - 1))],
        },
        "cache_us_per_request_step": 1e6 * statistics.mean(kv) / statistics.mean(running[warm]),
        "scheduler_ms_per_step": 1e3 * statistics.mean(step_s[warm]),
        "cache_share_of_step": sum(kv) / sum(step_s[warm]),
        "calls": dict(cache.calls),
        # Over the whole run: which call a regression of the per-step figure is in.
        "us_per_call": {k: 1e6 * cache.call_seconds[k] / n for k, n in cache.calls.items()},
        "evicted_pages": {t: cache.stats()[f"evicted_{t}_pages"] for t in ("device", "host")},
    }
    cache.check_integrity()
    cache.close()
    return out
