"""The TTFT benchmark runs every scenario and every restore gives the cold run's first token."""

from __future__ import annotations

from kvtier.bench.ttft import bench_ttft


def test_bench_ttft_tiny_cpu():
    r = bench_ttft(
        prompt_tokens=200,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        dtype="float32",
        repeats=1,
        device="cpu",
        debug_checks=True,  # every poll of every engine checks the cache's integrity
    )
    s = r["scenarios"]
    assert s["cold"]["recomputed"] == 200 and s["cold"]["cached_device"] == 0
    assert s["device_hit"]["cached_device"] == 192
    assert s["host_restore"]["cached_host"] == s["host_restore_overlap"]["cached_host"] == 192
    assert s["storage_restore"]["cached_storage"] == 192
    assert r["same_first_token"] and r["overlap_ratio"] > 0
    # the storage directory holds at least the 12 restored pages' objects
    assert r["storage_read_raw"]["bytes"] >= 12 * 16 * 2 * 2 * 2 * 16 * 4
    assert r["storage_ratio"] > 0
    assert r["reference_token"] == s["device_hit"]["token"] and r["reference_matches"]
