"""The scheduler-step benchmark keeps its requests running and accounts every cache call."""

from __future__ import annotations

from kvtier.bench.step import bench_step


def test_bench_step_tiny():
    r = bench_step(
        concurrency=20,
        steps=48,
        system_tokens=32,
        user_tokens=16,
        output_tokens=8,
        debug_checks=True,  # every poll checks the cache's integrity
    )
    assert r["mean_running"] > 15
    assert r["calls"]["poll"] == 48 and r["calls"]["finish"] > 0
    assert r["us_per_call"].keys() == r["calls"].keys()
    assert all(v > 0 for v in r["us_per_call"].values())
    assert 0 < r["cache_share_of_step"] <= 1
    full = r["under_eviction"]
    assert full["device_pages"] < r["device_pages"] and full["mean_running"] > 15
    assert full["evicted_pages"]["device"] > r["evicted_pages"]["device"]
    assert 0 < full["cache_share_of_step"] <= 1
