"""The router's FastAPI application: OpenAI generation routes passed through to the chosen
instance, plus ``/v1/models``, ``/health`` and ``/metrics``.

A request that fails on an instance before any of its output reached the client (no
connection, a 5xx, a stream that broke before its first chunk) goes to the next instance the
fleet chooses, until every healthy instance was tried: a request that has not started
streaming is never lost. A streamed answer starts at the instance's headers, so that the
response start is done while the instance computes; a stream that stops before its first chunk
is then replaced inside the answer by the next instance's (its ``x-kvtier-instance`` header
names the first), and when none is left the answer is an error event. A stream that breaks
after it started ends with an error event in OpenAI's shape and ``data: [DONE]``. 4xx answers
are the client's and are passed back as is.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
        tries = Attempts(fleet, client, metrics, body, chat, path, raw, headers)
        if body.get("stream") is not True:
            return await tries.answer()
        opened = await tries.open()
        if isinstance(opened, Response):
            return opened
        # The answer starts at the instance's headers, not at its first output: the response
        # start is then done while the instance computes, off the time to first token.
        return RelayResponse(
            _relay(opened, tries),
            opened,
            media_type="text/event-stream",
            headers=route_headers(opened.inst, opened.decision),
        )

    async def _relay(opened: Opened, tries: Attempts) -> AsyncIterator[bytes]:
        """The instance's bytes as they come; an error event when they stop short. Until its
        first bytes, the request may still go elsewhere: a stream that ends or fails before
        any is closed and the next instance's is relayed instead (the client has the
        headers, which name the first). The usage chunk (a stream that reports one) is
        counted as a JSON answer's usage is; the first output is the flight's
        (``Instance.first_output``)."""
        current: Opened | None = opened
        try:
            while True:
                chunks = current.resp.aiter_raw()
                try:
                    first = await anext(chunks, b"")
                except httpx.HTTPError as e:
                    first = b""
                    fleet.leave(current.inst, f"request failed before streaming: {e!r}")
                if first:
                    break
                done, current = current, None
                await done.close()
                tries.failed(done.inst)
                got = await tries.open()
                if isinstance(got, Response):
                    yield _sse_error(_message(got)) + DONE
                    return
                current = got
            inst, flight = current.inst, current.flight
            tail = first[-len(DONE) :]
            scan = StreamScanner()
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
            if current is not None:
                await current.close()

    return app


class Attempts:
    """One request's attempts: the instances the fleet chooses for it in turn, each tried
    once, until one answers (``answer``) or opens its stream (``open``)."""

    def __init__(
        self,
        fleet: Fleet,
        client: Any,
        metrics: RouteMetrics,
        body: dict[str, Any],
        chat: bool,
        path: str,
        raw: bytes,
        headers: dict[str, str],
    ) -> None:
        self.fleet, self.client, self.metrics = fleet, client, metrics
        self.body, self.chat, self.path, self.raw, self.headers = body, chat, path, raw, headers
        self.tried: list[Instance] = []
        self.failure: Response | None = None
        """What to answer if no other instance can: the last 5xx."""

    async def _next(self) -> tuple[Instance, Decision] | None:
        picked = await self.fleet.decide(self.body, self.chat, self.tried)
        if picked is None:
            return None
        inst, decision = picked
        self.tried.append(inst)
        self.metrics.decisions.labels(decision.reason).inc()
        if decision.match is not None:
            size = inst.page_size_or(self.fleet.options.page_size)
            for tier in TIERS:
                self.metrics.expected_hits.labels(tier).inc(getattr(decision.match, tier) * size)
        self.metrics.requests.labels(inst.name).inc()
        return picked

    def failed(self, inst: Instance) -> None:
        """``inst`` did not serve the request; the next one may."""
        self.metrics.retries.labels(inst.name).inc()

    def nobody(self) -> Response:
        """The answer when every instance failed: the last 5xx, else 502 (503: none was
        healthy)."""
        if self.failure is not None:
            return self.failure
        if self.tried:
            return _error(502, f"every instance failed this request ({len(self.tried)} tried)")
        return _error(503, "no healthy instance to send the request to")

    async def answer(self) -> Response:
        """The whole answer of the first instance that gives one (not streamed)."""
        while (picked := await self._next()) is not None:
            inst, decision = picked
            got = await self._once(inst, decision)
            if got is not None:
                got.headers.update(route_headers(inst, decision))
                return got
            self.failed(inst)
        return self.nobody()

    async def open(self) -> Opened | Response:
        """The stream of the first instance that answers 200, its body unread; or what to
        answer instead (a 4xx is the client's and is final)."""
        while (picked := await self._next()) is not None:
            inst, decision = picked
            got = await self._open(inst, decision)
            if got is not None:
                return got
            self.failed(inst)
        return self.nobody()

    async def _once(self, inst: Instance, decision: Decision) -> Response | None:
        """Its answer, or ``None`` when it failed (``failure`` keeps a 5xx)."""
        flight = inst.begin(decision.footprint, decision.prefill_s)
        try:
            r = await self.client.post(
                f"{inst.name}{self.path}", content=self.raw, headers=self.headers
            )
        except httpx.HTTPError as e:
            self.fleet.leave(inst, f"request failed: {e!r}")
            return None
        finally:
            inst.end(flight)
        out = Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code >= 500:
            self.failure = out
            return None
        if r.status_code == 200:
            with contextlib.suppress(ValueError):
                self.metrics.count_usage(r.json())
        return out

    async def _open(self, inst: Instance, decision: Decision) -> Opened | Response | None:
        """Its stream (status 200), its other answer (a 4xx), or ``None`` when it failed."""
        flight = inst.begin(decision.footprint, decision.prefill_s)
        req = self.client.build_request(
            "POST", f"{inst.name}{self.path}", content=self.raw, headers=self.headers
        )
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            inst.end(flight)
            self.fleet.leave(inst, f"request failed before streaming: {e!r}")
            return None
        except BaseException:  # cancelled: the client left while a stream replaced another
            inst.end(flight)
            raise
        if resp.status_code == 200:
            return Opened(inst, decision, flight, resp)
        try:
            content = await resp.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await resp.aclose()
            inst.end(flight)
        out = Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
        if resp.status_code >= 500:
            self.failure = out
            return None
        out.headers.update(route_headers(inst, decision))
        return out


@dataclass(slots=True)
class Opened:
    """A request's stream from the instance that took it: status 200, body not yet read."""

    inst: Instance
    decision: Decision
    flight: Flight
    resp: Any
    """The ``httpx`` response."""
    closed: bool = False

    async def close(self) -> None:
        """The request is over on ``inst``: its connection closed, its flight ended (once,
        however often it is called)."""
        if self.closed:
            return
        self.closed = True
        self.inst.end(self.flight)
        await self.resp.aclose()


class RelayResponse(StreamingResponse):
    """A relayed stream that closes the instance's stream it started with even when its
    relay never ran: a client that left before the response started cancels the response
    before it iterates the relay, whose own ``finally`` then never runs (the relay closes the
    streams it opened itself, and this one once it started)."""

    def __init__(self, relay: AsyncIterator[bytes], opened: Opened, **kwargs: Any) -> None:
        super().__init__(relay, **kwargs)
        self.opened = opened

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.opened.close()


def _message(answer: Response) -> str:
    """The error message of an instance's (or the router's) JSON error answer."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return str(json.loads(bytes(answer.body))["error"]["message"])
    return f"the request failed with status {answer.status_code}"


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
