"""The FastAPI application: OpenAI-style routes over an ``EngineLoop``.

Every route but ``/health``, ``/metrics`` and ``/version`` needs ``Authorization: Bearer
<key>`` when the server has an API key: probes and scrapers need no credential (those routes
show no prompt or output, only counts).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine.byte_tokenizer import ByteTokenizer
from kvtier.engine.sampling import StopScan, TextStream
from kvtier.server import protocol as P
from kvtier.server.api_errors import APIError, error_body, invalid, server_error, unauthorized
from kvtier.server.chat import ChatTemplate, check_messages
from kvtier.server.engine_loop import EngineLoop, Ticket
from kvtier.server.prometheus import ServerMetrics

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
"""Routes that answer without the API key."""


@dataclass
class ServerState:
    """What the routes share: the engine thread and the served model's facts."""

    loop: EngineLoop
    info: P.ModelInfo
    metrics: ServerMetrics
    tokenizer: Any = None
    """The engine's tokenizer (read-only here: encoding prompts and chat, decoding streamed
    text)."""
    chat_template: ChatTemplate | None = None
    api_key: str | None = None
    seeds: random.Random | None = None
    """Draws the seed of each sampled request that gives none (``--seed``); ``None``: the
    engine draws one at random."""


_Detokenizer = TextStream
"""Streamed text: each chunk's new text (``kvtier.engine.sampling.TextStream``)."""


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        # json's decoder recurses once per nesting level: a deep body must not be a 500
        raise invalid(
            "the request body is nested too deeply to parse", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    return body


async def _disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body is read: the next message
    the server gets is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:
        return "unknown"


class _Choice:
    """One streamed choice: its text so far (held back while it may be the start of a stop
    string) and the offset of its next token's text."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.detok = TextStream(tokenizer)
        self.scan = StopScan(stops) if stops else None
        self.offset = 0

    def text(self, ids: list[int], final: bool = False) -> str | None:
        delta = self.detok.feed(ids, final)
        if self.scan is None or delta is None:
            return delta
        out = self.scan.push(delta)
        return out + self.scan.flush() if final else out


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
        if state.api_key is not None and request.url.path not in OPEN_PATHS:
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

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

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
        if state.info.page_size is not None:
            # the KV events' block_size: what `kvtier route` hashes prompts with
            card["page_size"] = state.info.page_size
        if state.info.device_tokens is not None:
            # a router tells from it whether a request fits beside the ones running there
            card["device_tokens"] = state.info.device_tokens
        if isinstance(state.tokenizer, ByteTokenizer):
            # a router can encode text prompts itself, without a /tokenize round trip
            card["tokenizer"] = "bytes"
            card["vocab_size"] = state.tokenizer.vocab_size
        return {"object": "list", "data": [card]}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        """The served model as SGLang's native API describes it, for routers built on that
        API (SGLang's names a worker's model from it and ``/server_info``)."""
        return {"model_path": state.info.name, "tokenizer_path": None, "is_generation": True}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """The fields of SGLang's ``/server_info`` a router reads: the served model's name."""
        return {
            "served_model_name": state.info.name,
            "model_path": state.info.name,
            "tokenizer_path": None,
            "page_size": state.info.page_size,
            "context_length": state.info.context_tokens,
        }

    def _chat_tokens(body: dict[str, Any], generation_prompt: bool = True) -> list[int]:
        messages = check_messages(body.get("messages"))
        if state.chat_template is None or state.tokenizer is None:
            raise invalid(
                f"the model {state.info.name!r} has no chat template (or no tokenizer): "
                "use /v1/completions, or start the server with --chat-template",
                "messages",
            )
        text = state.chat_template.render(messages, generation_prompt)
        return P.encode_text(state.tokenizer, text, "messages", add_special_tokens=False)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request)
        parsed = P.parse_completion(body, state.info, state.tokenizer, state.seeds)
        return await _generate(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(request)
        P.check_model(body, state.info)
        tokens = _chat_tokens(body)
        return await _generate(request, P.parse_chat(body, state.info, tokens, state.seeds), True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """``prompt`` (text; ``add_special_tokens``, default true) or ``messages`` (rendered
        by the chat template; ``add_generation_prompt``, default true) as token ids."""
        body = await _body(request)
        if body.get("model") is not None:
            P.check_model(body, state.info)
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise invalid(
                    "add_generation_prompt must be true or false", "add_generation_prompt"
                )
            ids = _chat_tokens(body, gen)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise invalid("prompt (text) or messages is required", "prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise invalid("add_special_tokens must be true or false", "add_special_tokens")
            ids = P.encode_text(state.tokenizer, prompt, "prompt", special)
        return {"count": len(ids), "max_model_len": state.info.context_tokens, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """``tokens`` (ids) as the text they decode to."""
        body = await _body(request)
        if body.get("model") is not None:
            P.check_model(body, state.info)
        ids = body.get("tokens")
        vocab = state.info.vocab_size
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and (not vocab or 0 <= t < vocab)
            for t in ids
        ):
            raise invalid(f"tokens must be an array of token ids in [0, {vocab})", "tokens")
        if state.tokenizer is None:
            raise invalid("this model has no tokenizer: there is no text to decode to", "tokens")
        return {"prompt": state.tokenizer.decode(ids)}

    async def _generate(request: Request, parsed: P.Parsed, chat: bool) -> Response:
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        tickets: list[Ticket] = []

        def deliverer(i: int) -> Any:
            def deliver(kind: str, payload: Any) -> None:
                aio.call_soon_threadsafe(events.put_nowait, (i, kind, payload))

            return deliver

        def cancel_all() -> None:
            for t in tickets:
                state.loop.cancel(t)

        try:
            for i, params in enumerate(parsed.params):
                tickets.append(
                    state.loop.submit(
                        parsed.prompt,
                        params,
                        deliverer(i),
                        stream=parsed.stream,
                        prompt_param=parsed.prompt_param,
                    )
                )
        except APIError:
            cancel_all()  # the choices taken already
            raise
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        watch = asyncio.create_task(_disconnected(request))
        try:
            early: list[tuple[int, str, Any]] = []
            accepted = 0
            while accepted < parsed.n:  # every choice admitted before any answer
                event = await _next(events, watch, tickets)
                if event is None:
                    return Response(status_code=499)  # nobody reads it
                if event[1] == "error":
                    cancel_all()
                    raise event[2]
                if event[1] == "accepted":
                    accepted += 1
                else:
                    early.append(event)  # a choice that ran before the last was taken
            if parsed.stream:
                watch.cancel()  # the streaming response watches the connection itself
                gen = _stream(events, early, tickets, parsed, rid, chat)
                return StreamingResponse(gen, media_type="text/event-stream")
            outs: list[Any] = [None] * parsed.n
            pending = list(early)
            while any(o is None for o in outs):
                event = pending.pop(0) if pending else await _next(events, watch, tickets)
                if event is None:
                    return Response(status_code=499)
                i, kind, payload = event
                if kind == "error":
                    cancel_all()
                    raise payload
                if kind == "done":
                    outs[i] = payload
            want = parsed.params[0].logprobs is not None
            body = P.response_body(rid, state.info.name, outs, chat, state.tokenizer, want)
            return JSONResponse(body)
        except asyncio.CancelledError:
            cancel_all()
            raise
        finally:
            watch.cancel()

    async def _next(events: asyncio.Queue, watch: asyncio.Task, tickets: list[Ticket]) -> Any:
        """The next event, or ``None`` when the client went away meanwhile (its requests are
        then cancelled)."""
        get = asyncio.ensure_future(events.get())
        try:
            await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        for t in tickets:
            state.loop.cancel(t)
        return None

    async def _stream(
        events: asyncio.Queue,
        early: list[tuple[int, str, Any]],
        tickets: list[Ticket],
        parsed: P.Parsed,
        rid: str,
        chat: bool,
    ) -> AsyncIterator[str]:
        name, finished = state.info.name, False
        tok = state.tokenizer
        choices = [_Choice(tok, p.stop) for p in parsed.params]
        want_lp = parsed.params[0].logprobs is not None
        outs: list[Any] = [None] * parsed.n
        try:
            if chat:
                for i in range(parsed.n):
                    yield P.sse(P.chunk(rid, name, chat, "", [], role=True, index=i))
            while True:
                i, kind, payload = early.pop(0) if early else await events.get()
                c = choices[i]
                if kind == "tokens":
                    ids, lps = payload
                    lp = P.logprobs_body(tok, lps, chat, c.offset) if want_lp else None
                    if lp is not None and not chat:
                        c.offset += sum(len(t) for t in lp["tokens"])
                    text = c.text(ids)
                    yield P.sse(P.chunk(rid, name, chat, text, ids, index=i, logprobs=lp))
                elif kind == "done":
                    tail = c.text([], final=True)
                    yield P.sse(
                        P.chunk(
                            rid,
                            name,
                            chat,
                            tail,
                            [],
                            payload.finish_reason,
                            index=i,
                            stop_reason=payload.stop_reason,
                        )
                    )
                    outs[i] = payload
                    if all(o is not None for o in outs):
                        if parsed.include_usage:
                            yield P.sse(P.usage_chunk(rid, name, chat, outs))
                        break
                elif kind == "error":
                    for t in tickets:
                        state.loop.cancel(t)
                    yield P.sse(payload.body())
                    break
            finished = True
            yield P.DONE
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                for t in tickets:
                    state.loop.cancel(t)

    return app
