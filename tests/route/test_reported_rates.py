"""The router prices each instance with the rates its ``/health`` reports: read from the JSON
(``fleet.reported_rates``), and reported by a real ``kvtier serve``."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.route.fleet import reported_rates
from kvtier.route.scorer import Rates
from kvtier.server.load_cost import Ahead

DEFAULTS = Rates(8000.0, 200000.0, 40000.0, 0.05, 0.05)


def test_reported_rates_replace_the_defaults_they_name() -> None:
    got = reported_rates(
        {"status": "ok", "rates": {"prefill_tokens_per_s": 500, "host_tokens_per_s": 9e4}},
        DEFAULTS,
    )
    assert got == Rates(500.0, 90000.0, 40000.0, 0.05)
    got = reported_rates({"rates": {"request_cost_s": 0.012, "request_duration_s": 0.3}}, DEFAULTS)
    assert got == Rates(8000.0, 200000.0, 40000.0, 0.012, 0.3)
    got = reported_rates({"rates": {"decode_cost_s": 0.002}}, DEFAULTS)
    assert got == Rates(8000.0, 200000.0, 40000.0, 0.05, 0.05, decode_cost_s=0.002)


@pytest.mark.parametrize(
    "health",
    [
        {"status": "ok"},
        {"rates": None},
        {"rates": {"prefill_tokens_per_s": 0.0}},
        {"rates": {"prefill_tokens_per_s": "fast"}},
        {"rates": {"host_tokens_per_s": True}},
        {"rates": {"storage_tokens_per_s": float("nan")}},
        {"rates": {"request_cost_s": -0.01}},
        {"rates": {"request_duration_s": float("inf")}},
        {"rates": {"decode_cost_s": -0.001}},
        ["not", "a", "dict"],
    ],
)
def test_no_rates_or_a_bad_one_keep_the_defaults(health: object) -> None:
    assert reported_rates(health, DEFAULTS) is None


def router_rates(url: str) -> Rates | None:
    """The rates a router's health check of the instance at ``url`` reads."""
    import httpx2 as httpx

    from kvtier.route.fleet import Fleet, FleetOptions
    from kvtier.route.instances import InstanceSpec

    async def join() -> Rates | None:
        async with httpx.AsyncClient() as client:
            fleet = Fleet([InstanceSpec(url)], FleetOptions(page_size=16), client)
            await fleet.check_health()
            return fleet.instances[0].rates

    return asyncio.run(join())


def test_a_kvtier_server_reports_its_measured_rates() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx2 as httpx
    from server_harness import cache_config, start

    server = start(cache=cache_config(page_size=8))
    try:
        h = httpx.get(f"{server.url}/health").json()
        rates = h["rates"]
        assert set(rates) == {"prefill_tokens_per_s", "host_tokens_per_s"}
        assert all(v > 0 for v in rates.values())

        got = router_rates(server.url)
        assert got is not None
        assert got.prefill_tokens_per_s == rates["prefill_tokens_per_s"]
        assert got.host_tokens_per_s == rates["host_tokens_per_s"]
    finally:
        server.stop()


def test_a_kvtier_server_reports_the_request_cost_it_fitted() -> None:
    """Sixteen requests handed over while the engine is held arrive with 0..15 ahead of
    them; one runs at a time, so each waits for those before it to decode their 16 tokens
    (far longer than the requests took to arrive one after another) and the fitted cost per
    request ahead before its prefill is positive (none was running when they arrived: there
    is no cost of a running one); each decodes after its first token, so its duration is
    positive too.
    The router reads both."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import threading

    from server_harness import cache_config, engine_held, http, start, wait_until

    server = start(cache=cache_config(page_size=8), max_running=1)
    url = f"{server.url}/v1/completions"
    try:
        fresh = http().get(f"{server.url}/health").json()["rates"]
        assert "request_cost_s" not in fresh and "request_duration_s" not in fresh
        codes: list[int] = []

        def send(i: int) -> None:
            body = {"model": "tiny", "prompt": [i + 1] * 24, "max_tokens": 16, "temperature": 0}
            codes.append(http().post(url, json=body).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
        with engine_held(server):
            for t in threads:
                t.start()
            wait_until(lambda: server.loop.queue_depth()["queued"] == 16, "16 queued requests")
        for t in threads:
            t.join()
        assert codes == [200] * 16

        def fitted() -> dict | None:
            rates = http().get(f"{server.url}/health").json()["rates"]
            return rates if "request_cost_s" in rates else None

        rates = wait_until(fitted, "the fitted request cost on /health")
        assert rates["request_cost_s"] > 0 and rates["request_duration_s"] > 0
        # all sixteen arrived before any ran: every request ahead was before its prefill
        assert "decode_cost_s" not in rates

        got = router_rates(server.url)
        assert got is not None
        assert (got.request_cost_s, got.request_duration_s) == (
            rates["request_cost_s"],
            rates["request_duration_s"],
        )
    finally:
        server.stop()


def test_the_wait_for_the_engine_counts_in_a_requests_excess() -> None:
    """The engine takes new requests between steps, so a request that arrives during one
    waits for it, and that wait is the first thing the requests ahead cost it. Here the
    engine is held for a while after the request arrived: its sample's excess (and the time
    its own prefill was predicted to take, part of its hold) covers that while."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import threading
    import time

    from server_harness import cache_config, engine_held, http, start, wait_until

    server = start(cache=cache_config(page_size=8))
    url = f"{server.url}/v1/completions"
    try:
        body = {"model": "tiny", "prompt": [3] * 24, "max_tokens": 2, "temperature": 0}
        codes: list[int] = []
        sender = threading.Thread(
            target=lambda: codes.append(http().post(url, json=body).status_code)
        )
        with engine_held(server):
            sender.start()
            wait_until(lambda: server.loop.queue_depth()["queued"] == 1, "the request queued")
            held_from = time.perf_counter()
            time.sleep(0.3)  # the wait under test, not a synchronisation
            held_s = time.perf_counter() - held_from
        sender.join()
        assert codes == [200]
        samples = list(server.loop._load_cost._samples)
        assert len(samples) == 1
        ahead, excess_s, hold_s = samples[0]
        assert ahead == Ahead()
        assert excess_s + hold_s >= held_s
    finally:
        server.stop()
