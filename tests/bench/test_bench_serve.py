"""``kvtier bench serve``: concurrent streaming multi-turn clients; the JSON accounts for every
request and every prompt token, and what the clients saw in ``usage`` is what the engine
counted."""

from __future__ import annotations

import gc
import json

import pytest

# The server extra (pip install -e ".[server]") and the official client the tests drive it with.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from server_harness import start

pytestmark = pytest.mark.slow  # a live server per test

from kvtier.bench.serve import ServeBenchConfig, bench_serve, percentile, served_by
from kvtier.cli import main
from kvtier.errors import ConfigError


def test_percentile_and_serving_tier_are_exact() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([0.0, 10.0], 0.9) == 9.0
    assert served_by({"device": 0, "host": 0, "storage": 0}) == "none"
    assert served_by({"device": 16, "host": 32, "storage": 0}) == "host"
    assert served_by({"device": 16, "host": 16, "storage": 16}) == "device"
    with pytest.raises(ValueError):
        percentile([], 0.5)


def _check(r: dict, requests: int, max_tokens: int) -> None:
    assert r["requests"] == r["requests_ok"] == requests
    assert r["errors_by_status"] == {} and r["errors_5xx"] == 0
    assert sum(r["served_by_counts"].values()) == requests
    tiers = ("device", "host", "storage", "none")
    assert sum(r["ttft_by_tier"][t]["count"] for t in tiers) == requests
    assert r["ttft_by_tier"]["all"]["count"] == requests
    for t in (*tiers, "all"):
        row = r["ttft_by_tier"][t]
        assert row["count"] == r["served_by_counts"].get(t, requests)
        if row["count"]:
            assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
    src = r["prompt_tokens_by_source"]
    assert set(src) == {"device", "host", "storage", "recomputed"}
    assert sum(src.values()) == r["prompt_tokens"] > 0
    assert sum(r["prompt_share"].values()) == pytest.approx(1.0, abs=1e-12)
    assert r["completion_tokens"] == requests * max_tokens
    assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
    # a later turn extends a prompt the server has seen: something of it was cached
    assert r["served_by_counts"]["none"] < requests


def test_bench_serve_in_process_two_clients_two_turns(tmp_path) -> None:
    path = tmp_path / "serve.json"
    argv = ["bench", "serve", "--clients", "2", "--conversations", "2", "--turns", "2"]
    assert main([*argv, "--device", "cpu", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["config"]["clients"] == 2 and r["config"]["turns"] == 2
    assert r["config"]["model"] == "tiny" and r["stopped_by_duration"] is False
    _check(r, requests=2 * 2 * 2, max_tokens=r["config"]["max_tokens"])
    # the engine's own counters saw exactly what the clients read from ``usage``
    st = r["server_stats"]
    for tier in ("device", "host", "storage"):
        assert st[f"{tier}_hit_tokens"] == r["prompt_tokens_by_source"][tier]
    assert (
        st["recomputed_tokens"] == r["prefill_tokens"] >= r["prompt_tokens_by_source"]["recomputed"]
    )
    # start-up objects were frozen for the run, as ``kvtier serve`` does, and given back
    assert st["frozen_startup_objects"] > 10_000 and gc.get_freeze_count() == 0


def test_bench_serve_against_a_running_server() -> None:
    server = start()
    try:
        cfg = ServeBenchConfig(clients=2, conversations=1, turns=2, max_tokens=3, url=server.url)
        r = bench_serve(cfg)
    finally:
        server.stop()
    _check(r, requests=2 * 1 * 2, max_tokens=3)
    assert "server_stats" not in r


def test_bench_serve_sends_the_api_key_a_server_expects() -> None:
    server = start(api_key="sekrit")
    try:
        base = {"clients": 1, "conversations": 1, "turns": 2, "max_tokens": 2, "url": server.url}
        keyed = bench_serve(ServeBenchConfig(**base, api_key="sekrit"))
        # without the key the model list is refused: said before any request is sent
        with pytest.raises(ConfigError, match=r"answered 401: .*expect --api-key"):
            bench_serve(ServeBenchConfig(**base))
    finally:
        server.stop()
    _check(keyed, requests=2, max_tokens=2)


def test_bench_serve_refuses_bad_options() -> None:
    with pytest.raises(ConfigError, match="clients"):
        ServeBenchConfig(clients=0)
    with pytest.raises(ConfigError, match="url"):
        ServeBenchConfig(url="localhost:8000")
    with pytest.raises(ConfigError, match="api_key"):
        ServeBenchConfig(api_key="")
    assert main(["bench", "serve", "--model", "no-such-model", "--device", "cpu"]) == 2
