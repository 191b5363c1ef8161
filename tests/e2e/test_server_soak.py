"""Soak: concurrent multi-turn clients sharing a system prefix keep a server with tiny device
and host pools busy, so pages are evicted to host and to storage all along and come back from
each tier; midway the server restarts on the same L3 directory. No request may end in a 5xx,
every greedy output must equal a cold run of its prompt token by token, and afterwards no
page is locked, held by the engine or unaccounted for.

Clients re-send a request whose connection failed while the server was restarting (and only
then); everything else that is not a 200 fails the test.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

# The server extra (pip install -e ".[server]") and the HTTP client the clients use.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
import httpx2 as httpx
from server_harness import idle, metric, wait_ready, wait_until

from kvtier.config import CacheConfig
from kvtier.engine import SamplingParams
from kvtier.server.lifecycle import Server, build_llm
from kvtier.types import TIERS

CLIENTS = 4
CONVERSATIONS = 3
"""Conversations each client takes turns in, round-robin."""
REQUESTS = 160
"""Requests per client: 640 in all, the restart after half of them."""
MAX_TOKENS = 6
SYSTEM = [(7 * i + 3) % 251 for i in range(40)]
"""The system prefix every conversation starts with."""
PROMPT_CAP = 150
"""A conversation longer than this starts over from the system prefix."""
DEADLINE_S = 150.0
"""The whole soak, restart included, ends within this."""
PAGE_SIZE = 8
COLD_BATCH = 64
"""Prompts the cold engine runs together."""


def soak_config(storage_dir: str) -> CacheConfig:
    # 24 device pages hold one 192-token context; the clients' 12 conversations of up to
    # PROMPT_CAP tokens make over 200 pages, so the host tier (80 pages) keeps evicting to
    # storage. debug_checks: the cache checks its integrity at every poll.
    return CacheConfig(
        page_size=PAGE_SIZE,
        device_pages=24,
        host_pages=80,
        device="cpu",
        storage="file",
        storage_dir=storage_dir,
        debug_checks=True,
    )


@dataclass
class Record:
    prompt: tuple[int, ...]
    output: list[int]
    by_tier: dict[str, int]
    recomputed: int
    url: str


@dataclass
class Soak:
    url: str
    end: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: list[Record] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    retries: list[tuple[float, str]] = field(default_factory=list)
    """(when, server URL) of every connection failure."""

    def done(self) -> int:
        with self.lock:
            return len(self.records)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


def _body(prompt: list[int], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _once(http: httpx.Client, url: str, prompt: list[int], stream: bool) -> tuple[int, Any]:
    """(status, (output ids, usage)) of one request; raises ``httpx.TransportError``."""
    target = f"{url}/v1/completions"
    if not stream:
        r = http.post(target, json=_body(prompt, False))
        if r.status_code != 200:
            return r.status_code, r.text
        body = r.json()
        return 200, (body["choices"][0]["token_ids"], body["usage"])
    ids: list[int] = []
    usage = None
    with http.stream("POST", target, json=_body(prompt, True)) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return 500, obj  # an error chunk in a 200 stream is the engine's 5xx
            for choice in obj["choices"]:
                ids += choice["token_ids"]
            usage = obj.get("usage") or usage
    if usage is None:
        return 0, "the stream ended without its usage chunk"
    return 200, (ids, usage)


def _send(soak: Soak, http: httpx.Client, prompt: list[int], stream: bool) -> list[int] | None:
    """The request's output, re-sent after connection failures (the restart's gap)."""
    pause = threading.Event()
    while time.monotonic() < soak.end and not soak.failures:
        url = soak.url
        try:
            status, payload = _once(http, url, prompt, stream)
        except httpx.TransportError:
            with soak.lock:
                soak.retries.append((time.monotonic(), url))
            pause.wait(0.02)  # spaces the retries out; the condition is the answer
            continue
        if status != 200:
            soak.fail(f"HTTP {status} for a {len(prompt)}-token prompt: {payload}")
            return None
        ids, usage = payload
        details = usage["prompt_tokens_details"]
        rec = Record(
            tuple(prompt),
            ids,
            dict(details["cached_tokens_by_tier"]),
            details["recomputed_tokens"],
            url,
        )
        # recomputed_tokens also counts what a preempted request computed again
        cached = sum(rec.by_tier.values())
        if not (cached < usage["prompt_tokens"] == len(prompt) <= cached + rec.recomputed):
            soak.fail(f"usage does not add up: {usage}")
        with soak.lock:
            soak.records.append(rec)
        return ids
    soak.fail("the soak's deadline passed" if not soak.failures else "stopped")
    return None


def _client(soak: Soak, idx: int) -> None:
    rng = random.Random(idx)
    convs = [list(SYSTEM) for _ in range(CONVERSATIONS)]
    with httpx.Client(timeout=30.0) as http:
        for n in range(REQUESTS):
            k = n % CONVERSATIONS
            user = [rng.randrange(256) for _ in range(rng.randint(6, 18))]
            if len(convs[k]) + len(user) + MAX_TOKENS > PROMPT_CAP:
                convs[k] = list(SYSTEM)  # a new conversation, on the shared prefix
            prompt = convs[k] + user
            out = _send(soak, http, prompt, stream=(n + idx) % 2 == 0)
            if out is None:
                return
            convs[k] = prompt + out


def _pages(llm: Any) -> dict[str, int]:
    """Pool usage next to what the tree holds (on the engine thread, integrity checked)."""
    cache = llm.cache
    cache.check_integrity()
    st = cache.stats()
    return {
        "device_used": st["device_pages_used"],
        "device_tree": cache.tree.held_pages("device").numel(),
        "host_used": st["host_pages_used"],
        "host_tree": cache.tree.held_pages("host").numel(),
        "engine": st["device_pages_engine"],
    }


def _flush_all(llm: Any) -> dict[str, int]:
    """Evict every cached page from device and host: all of them must be freeable."""
    llm.cache.flush(host=True)
    return _pages(llm)


def _start(cfg: CacheConfig) -> Server:
    server = Server(build_llm("tiny", cfg, max_running=3), served_model_name="tiny").start()
    wait_ready(server.url)
    return server


def test_soak_with_eviction_churn_and_a_restart(tmp_path) -> None:
    began = time.monotonic()
    cfg = soak_config(str(tmp_path / "l3"))
    server = _start(cfg)
    soak = Soak(server.url, time.monotonic() + DEADLINE_S)
    threads = [threading.Thread(target=_client, args=(soak, i)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        half = CLIENTS * REQUESTS // 2
        wait_until(lambda: soak.done() >= half or soak.failures, "half the requests", DEADLINE_S)
        stopping = time.monotonic()
        server.stop()  # open responses finish, storage writes land, the engine closes
        old = server.loop.llm
        first = _pages(old)
        first_url = server.url
        server = _start(cfg)
        soak.url = server.url
        ready = time.monotonic()
        for t in threads:
            t.join(max(0.0, soak.end - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "clients still running at the deadline"
        assert soak.failures == []
        after = idle(server)  # engine_state checks the cache's integrity on the engine thread
        assert after["locked_nodes"] == 0 and after["device_pages_engine"] == 0
        assert after["waiting"] == after["running"] == 0 and not after["in_flight"]
        pages = server.loop.call(_pages).result(timeout=30)
        storage_metric = metric(server, 'kvtier_cached_tokens_total{cache_source="storage"}')
        flushed = server.loop.call(_flush_all).result(timeout=30)
    finally:
        soak.end = 0.0  # clients still running give up at their next request
        server.stop()
    soak_s = time.monotonic() - began

    # no page leaked: every used page is one the tree holds, and all of them are freeable
    for p in (first, pages):
        assert p["engine"] == 0
        assert p["device_used"] == p["device_tree"] and p["host_used"] == p["host_tree"]
    assert set(flushed.values()) == {0}, flushed
    # connection failures only in the restart's gap: to the old server once it was stopping
    assert all(t >= stopping and url == first_url for t, url in soak.retries), soak.retries

    records = soak.records
    assert len(records) == CLIENTS * REQUESTS
    before = [r for r in records if r.url == first_url]
    later = [r for r in records if r.url != first_url]
    assert before and later
    hits = _hits(records)
    # pages came back from every tier on both sides of the restart: the churn went on all along
    for part in (before, later):
        assert all(v > 0 for v in _hits(part).values()), (_hits(before), _hits(later))
    assert storage_metric == sum(r.by_tier["storage"] for r in later)

    # every output is the cold run's, token by token. One engine: prompts go in batches
    # admitted in one step (none sees another's pages) and the cache is flushed in between, so
    # no token of any prompt is cached; the server tests pin batched runs to single ones.
    cold_started = time.monotonic()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    cold_cfg = CacheConfig(page_size=PAGE_SIZE, device_pages=COLD_BATCH * 24, device="cpu")
    llm = build_llm(
        "tiny", cold_cfg, max_running=COLD_BATCH, max_prefill_tokens=COLD_BATCH * PROMPT_CAP
    )
    want: dict[tuple[int, ...], list[int]] = {}
    try:
        prompts = list(dict.fromkeys(r.prompt for r in records))
        for i in range(0, len(prompts), COLD_BATCH):
            batch = prompts[i : i + COLD_BATCH]
            outs = llm.generate([list(p) for p in batch], greedy)
            assert [o.cached_tokens for o in outs] == [0] * len(batch)
            want.update((p, o.output_ids) for p, o in zip(batch, outs, strict=True))
            llm.cache.flush(host=True)
    finally:
        llm.close()
    wrong = [r for r in records if r.output != want[r.prompt]]
    assert not wrong, f"{len(wrong)} outputs differ from their cold runs, e.g. {wrong[0]}"
    print(
        f"soak: {len(records)} requests in {soak_s:.1f} s ({len(later)} after the restart, "
        f"{len(soak.retries)} connection failures in its gap, {ready - stopping:.1f} s), hits {hits}, before the "
        f"restart {_hits(before)}, after {_hits(later)}; cold runs "
        f"{time.monotonic() - cold_started:.1f} s"
    )


def _hits(records: list[Record]) -> dict[str, int]:
    return {tier: sum(r.by_tier[tier] for r in records) for tier in TIERS}
