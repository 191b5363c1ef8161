"""The FastAPI application: OpenAI-style routes over an ``EngineLoop``.

``/v1/*`` needs ``Authorization: Bearer <key>`` when the server has an API key; ``/health``
and ``/metrics`` stay open so that probes and scrapers need no credential (they show no
prompt or output, only counts).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server import protocol as P
from kvtier.server.api_errors import APIError, error_body, invalid, server_error, unauthorized
from kvtier.server.chat import ChatTemplate, check_messages
from kvtier.server.engine_loop import EngineLoop, Ticket
from kvtier.server.prometheus import ServerMetrics


@dataclass
class ServerState:
    """What the routes share: the engine thread and the served model's facts."""

    loop: EngineLoop
    info: P.ModelInfo
    metrics: ServerMetrics
    tokenizer: Any = None
    """The engine's tokenizer (read-only here: decoding streamed text, encoding chat)."""
    chat_template: ChatTemplate | None = None
    api_key: str | None = None


class _Detokenizer:
    """Streamed text: each chunk's new text, decoded from a window of the output's last tokens
    rather than the whole output each time (which grows quadratically with its length).

    The window starts at ``start``; ``done`` tokens of the output have been sent. Both decodes
    begin at ``start``, so whatever a tokenizer does at the start of a decode (a dropped
    leading space) is the same in both and cancels, as long as the window's first tokens show
    text. A trailing replacement character (a
    multi-byte character cut between tokens) waits for the next tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.ids, self.start, self.done = tokenizer, [], 0, 0

    def feed(self, ids: list[int], final: bool = False) -> str | None:
        self.ids += ids
        if self.tok is None:
            return None
        sent = self.tok.decode(self.ids[self.start : self.done])
        text = self.tok.decode(self.ids[self.start :])
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(sent) :]
        # The next window starts at tokens that showed text: one that decodes to nothing (a
        # special token) would leave nothing before the next word for its space to cancel.
        self.start, self.done = (self.done if delta else self.start), len(self.ids)
        return delta


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    return body


async def _disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body is read: the next message
    the server gets is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvtier = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        if e.status != 429:
            state.metrics.rejected.labels(str(e.status)).inc()
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(
            error_body(str(e.detail), "invalid_request_error", None, code),
            status_code=e.status_code,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        # logged by Starlette; the client still gets OpenAI's shape
        return _error(server_error(f"internal error: {type(e).__name__}: {e}"))

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if state.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), state.api_key.encode()
            )
            if not ok:
                return _error(unauthorized())
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = state.loop.health()
        return JSONResponse(h, status_code=200 if h["status"] in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        stats = await asyncio.wrap_future(state.loop.call(lambda llm: llm.stats()))
        body = state.metrics.render(stats, state.loop.queue_depth())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.info.name,
            "object": "model",
            "created": 0,
            "owned_by": "kvtier",
            "max_model_len": state.info.context_tokens,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = P.parse_completion(await _body(request), state.info)
        return await _generate(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(request)
        P.check_model(body, state.info)
        messages = check_messages(body.get("messages"))
        if state.chat_template is None or state.tokenizer is None:
            raise invalid(
                f"the model {state.info.name!r} has no chat template (or no tokenizer): "
                "use /v1/completions",
                "messages",
            )
        text = state.chat_template.render(messages)
        tokens = state.tokenizer.encode(text, add_special_tokens=False)
        return await _generate(request, P.parse_chat(body, state.info, tokens), chat=True)

    async def _generate(request: Request, parsed: P.Parsed, chat: bool) -> Response:
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()

        def deliver(kind: str, payload: Any) -> None:
            aio.call_soon_threadsafe(events.put_nowait, (kind, payload))

        ticket = state.loop.submit(
            parsed.prompt,
            parsed.params,
            deliver,
            stream=parsed.stream,
            prompt_param=parsed.prompt_param,
        )
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        watch = asyncio.create_task(_disconnected(request))
        try:
            event = await _next(events, watch, ticket)
            if event is None:
                return Response(status_code=499)  # nobody reads it
            kind, payload = event
            if kind == "error":
                raise payload
            if parsed.stream:
                watch.cancel()  # the streaming response watches the connection itself
                gen = _stream(events, ticket, parsed, rid, chat)
                return StreamingResponse(gen, media_type="text/event-stream")
            event = await _next(events, watch, ticket)
            if event is None:
                return Response(status_code=499)
            kind, payload = event
            if kind == "error":
                raise payload
            text = payload.text if payload.text is not None else ""
            build = P.chat_body if chat else P.completion_body
            return JSONResponse(build(rid, state.info.name, payload, text))
        except asyncio.CancelledError:
            state.loop.cancel(ticket)
            raise
        finally:
            watch.cancel()

    async def _next(events: asyncio.Queue, watch: asyncio.Task, ticket: Ticket) -> Any:
        """The ticket's next event, or ``None`` when the client went away meanwhile (its
        request is then cancelled)."""
        get = asyncio.ensure_future(events.get())
        try:
            await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        state.loop.cancel(ticket)
        return None

    async def _stream(
        events: asyncio.Queue, ticket: Ticket, parsed: P.Parsed, rid: str, chat: bool
    ) -> AsyncIterator[str]:
        name, finished = state.info.name, False
        detok = _Detokenizer(state.tokenizer)
        try:
            if chat:
                yield P.sse(P.chunk(rid, name, chat, "", [], role=True))
            while True:
                kind, payload = await events.get()
                if kind == "tokens":
                    yield P.sse(P.chunk(rid, name, chat, detok.feed(payload), payload))
                elif kind == "done":
                    tail = detok.feed([], final=True)
                    yield P.sse(P.chunk(rid, name, chat, tail, [], payload.finish_reason))
                    if parsed.include_usage:
                        yield P.sse(P.usage_chunk(rid, name, chat, payload))
                    break
                elif kind == "error":
                    yield P.sse(payload.body())
                    break
            finished = True
            yield P.DONE
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                state.loop.cancel(ticket)

    return app
