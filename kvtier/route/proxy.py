"""The router's FastAPI application: OpenAI generation routes passed through to the chosen
instance, plus ``/v1/models``, ``/health`` and ``/metrics``.

A request that fails on an instance before any of its output reached the client (no
connection, a 5xx, a stream that broke before its first chunk) goes to the next instance the
fleet chooses, until every healthy instance was tried: a request that has not started
streaming is never lost. A stream that breaks after it started ends with an error event in
OpenAI's shape and ``data: [DONE]``. 4xx answers are the client's and are passed back as is.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx2 as httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.route.fleet import Fleet
from kvtier.route.instances import Flight, Instance
from kvtier.route.prefix_index import TIERS
from kvtier.route.route_metrics import RouteMetrics
from kvtier.route.scorer import Decision
from kvtier.server.api_errors import error_body

log = logging.getLogger("kvtier.route")

FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")
"""Request headers an instance sees (the API key is the instances' to check)."""

DONE = b"data: [DONE]\n\n"


def _error(
    status: int,
    message: str,
    type_: str = "server_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, "server_error")).encode() + b"\n\n"


def create_app(fleet: Fleet, client: Any, metrics: RouteMetrics | None = None) -> FastAPI:
    """The router over ``fleet``, talking to instances through ``client`` (an
    ``httpx.AsyncClient``, owned by the caller). The fleet starts and stops with the app."""
    metrics = metrics if metrics is not None else RouteMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await fleet.start()
        try:
            yield
        finally:
            await fleet.stop()

    app = FastAPI(title="kvtier route", lifespan=lifespan)
    app.state.fleet = fleet
    app.state.metrics = metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        now = [
            {
                "url": i.name,
                "healthy": i.healthy,
                "in_flight": i.in_flight,
                "events": None
                if i.subscriber is None
                else {
                    "stale": i.subscriber.stale(fleet.options.events_stale_s),
                    "last_seq": i.subscriber.last_seq,
                    "pages": fleet.index.pages(i.name),
                },
            }
            for i in fleet.instances
        ]
        ok = any(i.healthy for i in fleet.instances)
        body = {"status": "ok" if ok else "unavailable", "instances": now}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(fleet), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards: dict[str, dict] = {}
        for inst in fleet.healthy():
            for card in inst.models:
                cards.setdefault(str(card.get("id")), card)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _forward(request, "/v1/chat/completions", chat=True)

    async def _forward(request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        healthy = fleet.healthy()
        if healthy and not any(i.serves(model) for i in healthy):
            served = sorted({str(c.get("id")) for i in healthy for c in i.models})
            return _error(
                404,
                f"the model {model!r} does not exist; this fleet serves "
                + (", ".join(map(repr, served)) or "no model"),
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        stream = body.get("stream") is True
        tried: list[Instance] = []
        failure: Response | None = None
        while True:
            picked = await fleet.decide(body, chat, tried)
            if picked is None:
                break
            inst, decision = picked
            tried.append(inst)
            metrics.decisions.labels(decision.reason).inc()
            if decision.match is not None:
                size = inst.page_size_or(fleet.options.page_size)
                for tier in TIERS:
                    metrics.expected_hits.labels(tier).inc(getattr(decision.match, tier) * size)
            metrics.requests.labels(inst.name).inc()
            send = _stream if stream else _once
            answer, failure = await send(inst, decision, f"{inst.name}{path}", raw, headers)
            if answer is not None:
                answer.headers.update(route_headers(inst, decision))
                return answer
            metrics.retries.labels(inst.name).inc()
        if failure is not None:
            return failure
        if tried:
            return _error(502, f"every instance failed this request ({len(tried)} tried)")
        return _error(503, "no healthy instance to send the request to")

    async def _once(
        inst: Instance, decision: Decision, url: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[Response | None, Response | None]:
        """``(answer, None)``, or ``(None, what to answer if no other instance can)``."""
        flight = inst.begin(decision.footprint, decision.prefill_s)
        try:
            r = await client.post(url, content=raw, headers=headers)
        except httpx.HTTPError as e:
            fleet.leave(inst, f"request failed: {e!r}")
            return None, None
        finally:
            inst.end(flight)
        out = Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code >= 500:
            return None, out
        if r.status_code == 200:
            with contextlib.suppress(ValueError):
                metrics.count_usage(r.json())
        return out, None

    async def _stream(
        inst: Instance, decision: Decision, url: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[Response | None, Response | None]:
        flight = inst.begin(decision.footprint, decision.prefill_s)
        resp = None
        try:
            resp = await client.send(
                client.build_request("POST", url, content=raw, headers=headers), stream=True
            )
            if resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                out = Response(
                    content, resp.status_code, media_type=resp.headers.get("content-type")
                )
                inst.end(flight)
                return (None, out) if resp.status_code >= 500 else (out, None)
            chunks = resp.aiter_raw()
            first = await anext(chunks, b"")
        except httpx.HTTPError as e:
            if resp is not None:
                await resp.aclose()
            inst.end(flight)
            fleet.leave(inst, f"request failed before streaming: {e!r}")
            return None, None
        if not first:  # ended before any output: nothing was streamed, another may serve it
            await resp.aclose()
            inst.end(flight)
            return None, None
        relay = _relay(inst, flight, resp, chunks, first)
        return StreamingResponse(relay, media_type="text/event-stream"), None

    async def _relay(
        inst: Instance, flight: Flight, resp: Any, chunks: AsyncIterator[bytes], first: bytes
    ) -> AsyncIterator[bytes]:
        """The instance's bytes as they come; an error event when they stop short. The usage
        chunk (a stream that reports one) is counted as a JSON answer's usage is; the first
        output is the flight's (``Instance.first_output``)."""
        tail = first[-len(DONE) :]
        scan = StreamScanner()
        try:
            for body in scan.feed(first):
                metrics.count_usage(body)
            if scan.output_seen:
                inst.first_output(flight)
            yield first
            try:
                async for chunk in chunks:
                    tail = (tail + chunk)[-len(DONE) :]
                    for body in scan.feed(chunk):
                        metrics.count_usage(body)
                    if flight.first is None and scan.output_seen:
                        inst.first_output(flight)
                    yield chunk
                problem = None if tail == DONE else "the instance ended the stream early"
            except httpx.HTTPError as e:
                problem = f"the instance failed mid-stream: {e!r}"
            if problem is not None:
                metrics.stream_errors.labels(inst.name).inc()
                log.warning("%s: %s", inst.name, problem)
                lead = b"" if tail.endswith(b"\n\n") else b"\n\n"
                yield lead + _sse_error(problem) + DONE
        finally:
            inst.end(flight)
            await resp.aclose()

    return app


def route_headers(inst: Instance, decision: Decision) -> dict[str, str]:
    """What an answer says about its routing: ``x-kvtier-instance`` (the instance's URL),
    ``x-kvtier-route`` (the reason) and, for a choice by expected time, ``x-kvtier-expected-ms``
    (that time), so that a client can join what it measured with what was predicted."""
    headers = {"x-kvtier-instance": inst.name, "x-kvtier-route": decision.reason}
    if decision.expected_s is not None:
        headers["x-kvtier-expected-ms"] = f"{decision.expected_s * 1e3:.3f}"
    return headers


class StreamScanner:
    """What the router reads from a stream's server-sent events as their bytes pass (events
    may be cut anywhere between chunks): the events that carry ``usage``, and whether an event
    carried output yet (``output_seen``). Only events that may hold either are parsed."""

    def __init__(self) -> None:
        self._pending = b""
        self.output_seen = False
        """Some event had a choice with text, content or token ids (a chat stream's first
        event, the role alone, has none)."""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The JSON objects of the events ``chunk`` completes that hold a ``usage`` key."""
        self._pending += chunk
        found: list[dict[str, Any]] = []
        while (end := self._pending.find(b"\n\n")) >= 0:
            event, self._pending = self._pending[:end], self._pending[end + 2 :]
            usage = b'"usage"' in event
            if not usage and self.output_seen:
                continue
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                with contextlib.suppress(ValueError):
                    body = json.loads(line[5:])
                    if not isinstance(body, dict):
                        continue
                    if usage and "usage" in body:
                        found.append(body)
                    self.output_seen = self.output_seen or _has_output(body)
        return found


def _has_output(body: dict[str, Any]) -> bool:
    choices = body.get("choices")
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if c.get("text") or content or c.get("token_ids"):
            return True
    return False
