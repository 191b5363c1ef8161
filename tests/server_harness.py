"""Helpers of the server tests: a real server (uvicorn on a thread, a free port on 127.0.0.1),
readiness and conditions awaited under a deadline, a gate that holds the engine thread between
two steps, and the engine's cold run of a prompt to compare outputs with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import httpx2 as httpx
import openai

from kvtier.config import CacheConfig
from kvtier.engine import SamplingParams
from kvtier.server.engine_loop import engine_state
from kvtier.server.lifecycle import Server, build_llm, load_chat_template

BASE = CacheConfig(page_size=4, device_pages=128, device="cpu", debug_checks=True)
DEADLINE_S = 20.0


def cache_config(**kw: Any) -> CacheConfig:
    return replace(BASE, **kw)


def start(
    model: str = "tiny",
    cache: CacheConfig | None = None,
    *,
    max_running: int = 16,
    served: str = "tiny",
    **server_kw: Any,
) -> Server:
    """A started server, ready (``/health`` answered) when this returns."""
    llm = build_llm(model, cache or BASE, max_running=max_running)
    server = Server(
        llm, served_model_name=served, chat_template=load_chat_template(model, llm), **server_kw
    ).start()
    wait_ready(server.url)
    return server


def wait_until(cond: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    """``cond()``'s first truthy value; fails after ``deadline_s``. A short pause between
    tries only spaces them out: correctness rests on the condition, not on the pause."""
    end = time.monotonic() + deadline_s
    pause = threading.Event()
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        pause.wait(0.01)


def wait_ready(url: str) -> dict:
    def ready() -> dict | None:
        try:
            r = _HTTP.get(f"{url}/health")
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    return wait_until(ready, f"{url}/health")


_HTTP = httpx.Client(timeout=DEADLINE_S)
"""One client for raw requests: building one per request costs a TLS context each time."""


def http() -> httpx.Client:
    return _HTTP


def client(server: Server, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, http_client=_HTTP
    )


def state(server: Server) -> dict:
    """``engine_state`` run on the engine thread (integrity checked there)."""
    return server.loop.call(engine_state).result(timeout=DEADLINE_S)


def idle(server: Server) -> dict:
    """The engine state once no request is unfinished and nothing is in flight."""

    def done() -> dict | None:
        s = state(server)
        return s if not (s["waiting"] or s["running"] or s["in_flight"]) else None

    return wait_until(done, "the engine to go idle")


@contextmanager
def engine_held(server: Server) -> Iterator[None]:
    """Hold the engine thread between two steps for the block's duration: commands queue up
    and nothing is computed."""
    entered, release = threading.Event(), threading.Event()

    def hold(_llm: Any) -> None:
        entered.set()
        release.wait(DEADLINE_S)

    fut = server.loop.call(hold)
    assert entered.wait(DEADLINE_S), "the engine thread never ran the hold"
    try:
        yield
    finally:
        release.set()
        fut.result(timeout=DEADLINE_S)


def cold(prompt: Any, params: SamplingParams, model: str = "tiny", cache: CacheConfig = BASE):
    """The engine's output for ``prompt`` alone, on a fresh cache."""
    llm = build_llm(model, cache)
    try:
        return llm.generate([prompt], params)[0]
    finally:
        llm.close()


def metric(server: Server, name: str) -> float:
    """A sample's value in ``/metrics`` (``name`` with its labels, as exposed)."""
    text = _HTTP.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
