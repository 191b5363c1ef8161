"""Request validation and response bodies of the OpenAI-style API.

Requests are parsed by hand from the JSON body rather than through schema models so that every
refusal is a 400 in OpenAI's error shape naming the field; sampling values are checked by the
engine's own ``SamplingParams``. Beyond OpenAI's fields: ``top_k``, ``ignore_eos``,
``stop_token_ids``, and ``token_ids`` (the generated ids) in every choice and chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvtier.engine import RequestOutput, SamplingParams
from kvtier.errors import RequestError
from kvtier.server.api_errors import APIError, invalid, unsupported
from kvtier.types import TIERS

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    """``--served-model-name``: the only ``model`` requests may name."""
    context_tokens: int
    """Prompt + generated tokens one request may hold (context length, device pool)."""


@dataclass(frozen=True)
class Parsed:
    """A validated generation request."""

    prompt: list[int] | str
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str
    """The field an invalid prompt is reported under."""


def check_model(body: dict[str, Any], info: ModelInfo) -> None:
    model = body.get("model")
    if model is None:
        raise invalid("model is required", "model", "missing_required_parameter")
    if model != info.name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {info.name!r}",
            param="model",
            code="model_not_found",
        )


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise invalid(f"n must be 1 (one choice per request), got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and (best_of != 1 or isinstance(best_of, bool)):
        raise invalid(f"best_of must be 1, got {best_of!r}", "best_of")
    if body.get("stop") not in (None, "", []):
        raise unsupported("stop", " (stop strings): use stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise unsupported(name)
    if body.get("logit_bias") not in (None, {}):
        raise unsupported("logit_bias")
    unset: tuple[Any, ...] = (None, False)
    names = ("logprobs", "top_logprobs", "tools", "response_format") if chat else ("echo",)
    for name in names:
        if body.get(name) not in unset:
            raise unsupported(name)
    if not chat:
        if body.get("logprobs") is not None:
            raise unsupported("logprobs")
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise invalid("stream_options must be an object", "stream_options")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options.include_usage must be true or false", "stream_options")
    return stream, usage


def _params(body: dict[str, Any], max_key: str, default_max: int | None) -> SamplingParams:
    """``SamplingParams`` from the body; its ``RequestError`` becomes a 400 naming the field
    (the engine's messages start with the field's name)."""
    kw: dict[str, Any] = {"temperature": 1.0, "max_tokens": default_max}
    for name in _SAMPLING_FIELDS[1:]:
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get(max_key) is not None:
        kw["max_tokens"] = body[max_key]
    if kw["max_tokens"] is None:
        kw["max_tokens"] = 16
    stops = body.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("stop_token_ids must be an array of token ids", "stop_token_ids")
        kw["stop_token_ids"] = tuple(stops)
    try:
        return SamplingParams(**kw)
    except RequestError as e:
        field = str(e).split()[0]
        raise invalid(
            str(e).replace("max_tokens", max_key, 1), _param_name(field, max_key)
        ) from None


def _param_name(field: str, max_key: str) -> str | None:
    if field == "max_tokens":
        return max_key
    return field if field in (*_SAMPLING_FIELDS, "stop_token_ids") else None


def _token_list(value: list[Any]) -> list[int] | None:
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _prompt(body: dict[str, Any]) -> list[int] | str:
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        ids = _token_list(p)
        if ids is not None:
            return ids
        if len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if len(p) == 1 and isinstance(p[0], list) and _token_list(p[0]) is not None:
            return p[0]
        if len(p) > 1 and all(isinstance(x, str | list) for x in p):
            raise invalid(f"one prompt per request (n=1), got {len(p)} prompts", "prompt")
    raise invalid("prompt must be a string or a non-empty array of integer token ids", "prompt")


def parse_completion(body: dict[str, Any], info: ModelInfo) -> Parsed:
    """A ``/v1/completions`` body; raises ``APIError``."""
    check_model(body, info)
    _refuse_unsupported(body, chat=False)
    stream, usage = _stream(body)
    prompt = _prompt(body)
    return Parsed(prompt, _params(body, "max_tokens", 16), stream, usage, "prompt")


def parse_chat(body: dict[str, Any], info: ModelInfo, tokens: list[int]) -> Parsed:
    """A ``/v1/chat/completions`` body whose messages rendered to ``tokens`` (see
    ``chat_tokens``); without a length it may generate up to the context's end."""
    _refuse_unsupported(body, chat=True)
    stream, usage = _stream(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = info.context_tokens - len(tokens)
    if room < 1 and body.get(key) is None:
        raise invalid(
            f"the messages are {len(tokens)} tokens: no room left in the model's context of "
            f"{info.context_tokens} tokens",
            "messages",
            "context_length_exceeded",
        )
    return Parsed(tokens, _params(body, key, max(room, 1)), stream, usage, "messages")


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's ``usage`` with the cached prefix split by the tier that served it."""
    prompt, completion = len(out.prompt), len(out.output_ids)
    by_tier = dict(
        zip(TIERS, (out.cached_device, out.cached_host, out.cached_storage), strict=True)
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": out.cached_tokens,
            "cached_tokens_by_tier": by_tier,
            "recomputed_tokens": out.recomputed,
        },
    }


def completion_body(rid: str, model: str, out: RequestOutput, text: str) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "token_ids": out.output_ids,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage(out),
    }


def chat_body(rid: str, model: str, out: RequestOutput, text: str) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "token_ids": out.output_ids,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage(out),
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    token_ids: list[int],
    finish_reason: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: a text delta (``None``: none) and the ids it came from."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, model: str, chat: bool, out: RequestOutput) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": [],
        "usage": usage(out),
    }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
