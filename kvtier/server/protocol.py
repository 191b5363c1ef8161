"""Request validation and response bodies of the OpenAI-style API.

Requests are parsed by hand from the JSON body rather than through schema models so that every
refusal is a 400 in OpenAI's error shape naming the field; sampling values are checked by the
engine's own ``SamplingParams``. ``docs/openai.md`` lists every OpenAI parameter and what the
server does with it. Beyond OpenAI's fields: ``top_k``, ``ignore_eos``, ``stop_token_ids``, and
``token_ids`` (the generated ids) and ``stop_reason`` in every choice.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.engine import RequestOutput, SamplingParams
from kvtier.engine.sampling import TokenLogprob, logit_bias_pairs
from kvtier.errors import RequestError
from kvtier.server.api_errors import APIError, invalid, unsupported
from kvtier.types import TIERS

_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
)
MAX_N = 16
"""Choices one request may ask for."""
MAX_LOGPROBS = 20
"""Alternatives per token ``logprobs``/``top_logprobs`` may ask for."""
MAX_STOPS = 16
"""Stop strings one request may give."""
_SEED_RANGE = 1 << 63


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    """``--served-model-name``: the only ``model`` requests may name."""
    context_tokens: int
    """Prompt + generated tokens one request may hold (``--max-model-len``, the model's
    context length and the device pool, whichever is least)."""
    vocab_size: int = 0
    """Token ids are ``[0, vocab_size)`` (``/detokenize`` checks them; 0: unchecked)."""
    page_size: int | None = None
    """Tokens per tree page of the cache (``TieredCache.tree_page_tokens``: the ``block_size``
    of its KV events), shown on the model card so that a router hashes prompts in the same
    pages; ``None``: not shown."""
    device_tokens: int | None = None
    """Tokens the device pool holds, shown on the model card so that a router can tell
    whether a request fits beside those running (a request waits until it does); ``None``:
    not shown."""


@dataclass(frozen=True)
class Parsed:
    """A validated generation request."""

    prompt: list[int]
    """The prompt's token ids (a text prompt encoded by the server's tokenizer)."""
    params: tuple[SamplingParams, ...]
    """One per choice (``n``); choice ``i`` samples with ``seed + i`` when a seed is given."""
    stream: bool
    include_usage: bool
    prompt_param: str
    """The field an invalid prompt is reported under."""
    chat_logprobs: bool = False
    """Chat: log-probabilities in the chat format (``logprobs: true``)."""

    @property
    def n(self) -> int:
        return len(self.params)


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


def _unset(value: Any, *allowed: Any) -> bool:
    return value is None or any(value == a and type(value) is type(a) for a in allowed)


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """400 for the OpenAI parameters this server does not implement (``docs/openai.md``)."""
    n = body.get("n", 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise unsupported(
            "best_of", " (ranking several completions by log-probability): use n to get them all"
        )
    if not chat:
        if body.get("echo") not in (None, False):
            raise unsupported("echo", ": the prompt's text and log-probabilities are not returned")
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix", " (fill in the middle)")
        return
    if not _unset(body.get("tools"), []) or not _unset(body.get("functions"), []):
        param = "tools" if body.get("tools") else "functions"
        raise unsupported(param, " (tool calls)")
    # with no tools there is nothing to call: "auto" and "none" both mean plain text
    if not _unset(body.get("tool_choice"), "none", "auto") or not _unset(
        body.get("function_call"), "none", "auto"
    ):
        param = "tool_choice" if body.get("tool_choice") is not None else "function_call"
        raise unsupported(param, " (tool calls)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise unsupported("response_format", " beyond {'type': 'text'} (no constrained decoding)")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise unsupported("modalities", " beyond ['text']")
    for name, why in (
        ("audio", " (text only)"),
        ("prediction", " (predicted outputs)"),
        ("web_search_options", " (no web search)"),
        ("reasoning_effort", " (not a reasoning model)"),
    ):
        if body.get(name) is not None:
            raise unsupported(name, why)


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


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise invalid(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None or stop == "":
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or an array of strings", "stop")
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[int | None, bool]:
    """(alternatives per token or ``None``: no log-probabilities, chat format)."""
    if not chat:
        return _int_field(body, "logprobs", 0, MAX_LOGPROBS, None), False
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise invalid(f"logprobs must be true or false, got {want!r}", "logprobs")
    top = _int_field(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    if top is not None and not want:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if want else None, bool(want)


def _params(
    body: dict[str, Any],
    max_key: str,
    default_max: int,
    chat: bool,
    seeds: random.Random | None,
) -> tuple[tuple[SamplingParams, ...], bool]:
    """One ``SamplingParams`` per choice; their ``RequestError`` becomes a 400 naming the field
    (the engine's messages start with the field's name)."""
    kw: dict[str, Any] = {"temperature": 1.0, "max_tokens": default_max}
    for name in _SAMPLING_FIELDS[1:]:
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get(max_key) is not None:
        kw["max_tokens"] = body[max_key]
    stops = body.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("stop_token_ids must be an array of token ids", "stop_token_ids")
        kw["stop_token_ids"] = tuple(stops)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("logit_bias must be an object of token id: bias", "logit_bias")
        try:
            kw["logit_bias"] = logit_bias_pairs(bias)
        except RequestError as e:
            raise invalid(str(e), "logit_bias") from None
    kw["stop"] = _stops(body)
    kw["logprobs"], chat_logprobs = _logprobs(body, chat)
    n = _int_field(body, "n", 1, MAX_N, 1)
    if kw.get("seed") is None and seeds is not None and kw["temperature"] != 0:
        kw["seed"] = seeds.randrange(_SEED_RANGE)  # --seed: reproducible across restarts
    try:
        first = SamplingParams(**kw)
    except RequestError as e:
        field = str(e).split()[0]
        raise invalid(
            str(e).replace("max_tokens", max_key, 1), _param_name(field, max_key)
        ) from None
    params = [first]
    for i in range(1, n):
        seed = None if first.seed is None else (first.seed + i) % _SEED_RANGE
        params.append(replace(first, seed=seed))
    return tuple(params), chat_logprobs


def _param_name(field: str, max_key: str) -> str | None:
    if field == "max_tokens":
        return max_key
    known = (*_SAMPLING_FIELDS, "stop_token_ids", "stop", "logit_bias", "logprobs")
    return field if field in known else None


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
            raise invalid(
                f"one prompt per request, got {len(p)} prompts (n asks for several "
                "completions of one prompt)",
                "prompt",
            )
    raise invalid("prompt must be a string or a non-empty array of integer token ids", "prompt")


def encode_text(
    tokenizer: Any, text: str, param: str, add_special_tokens: bool = True
) -> list[int]:
    """``text``'s ids; a 400 naming ``param`` when the model has no tokenizer."""
    if tokenizer is None:
        raise invalid(
            "this model has no tokenizer (its directory has no tokenizer.json): send token ids, "
            "or start the server with --tokenizer",
            param,
        )
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _check_length(prompt: list[int], params: SamplingParams, info: ModelInfo, param: str) -> None:
    """The request fits the served context, and the tokens its parameters name are in the
    vocabulary."""
    bad = [t for t, _ in params.logit_bias if info.vocab_size and t >= info.vocab_size]
    if bad:
        raise invalid(
            f"logit_bias token {bad[0]} is outside the vocabulary [0, {info.vocab_size})",
            "logit_bias",
        )
    total = len(prompt) + params.max_tokens
    if total > info.context_tokens:
        raise invalid(
            f"the prompt's {len(prompt)} tokens + max_tokens={params.max_tokens} exceed the "
            f"context of {info.context_tokens} tokens this server serves",
            param,
            "context_length_exceeded",
        )


def parse_completion(
    body: dict[str, Any],
    info: ModelInfo,
    tokenizer: Any = None,
    seeds: random.Random | None = None,
) -> Parsed:
    """A ``/v1/completions`` body; raises ``APIError``. A text ``prompt`` is encoded with the
    tokenizer's special tokens (a leading BOS) unless ``add_special_tokens`` is false (vLLM's
    extension). ``seeds`` draws the seed of a sampled request that gives none (``--seed``)."""
    check_model(body, info)
    _refuse_unsupported(body, chat=False)
    stream, usage = _stream(body)
    prompt = _prompt(body)
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise invalid("add_special_tokens must be true or false", "add_special_tokens")
    if isinstance(prompt, str):
        prompt = encode_text(tokenizer, prompt, "prompt", special)
    params, _ = _params(body, "max_tokens", 16, False, seeds)
    _check_length(prompt, params[0], info, "prompt")
    return Parsed(prompt, params, stream, usage, "prompt")


def parse_chat(
    body: dict[str, Any],
    info: ModelInfo,
    tokens: list[int],
    seeds: random.Random | None = None,
) -> Parsed:
    """A ``/v1/chat/completions`` body whose messages rendered to ``tokens``; without a
    length it may generate up to the context's end."""
    _refuse_unsupported(body, chat=True)
    stream, usage = _stream(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = info.context_tokens - len(tokens)
    if room < 1:
        raise invalid(
            f"the messages are {len(tokens)} tokens: no room left in the context of "
            f"{info.context_tokens} tokens this server serves",
            "messages",
            "context_length_exceeded",
        )
    params, chat_logprobs = _params(body, key, room, True, seeds)
    _check_length(tokens, params[0], info, "messages")
    return Parsed(tokens, params, stream, usage, "messages", chat_logprobs)


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` of one request's choices: the prompt counted once, the completion
    tokens of every choice, the cached prefix (split by the tier that served it) of the first
    choice, and the prompt tokens every choice's prefill computed."""
    first = outs[0]
    prompt = len(first.prompt)
    completion = sum(len(o.output_ids) for o in outs)
    by_tier = dict(
        zip(TIERS, (first.cached_device, first.cached_host, first.cached_storage), strict=True)
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": first.cached_tokens,
            "cached_tokens_by_tier": by_tier,
            "recomputed_tokens": sum(o.recomputed for o in outs),
        },
    }


def token_text(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """How a logprobs entry names ``token``: its text and UTF-8 bytes. A token that is only
    part of a character is ``bytes:\\xNN...`` (as OpenAI writes it); without a tokenizer
    ``token_id:N``."""
    if tokenizer is None:
        return f"token_id:{token}", []
    raw = tokenizer.token_bytes(token) if hasattr(tokenizer, "token_bytes") else None
    if raw is None:
        text = tokenizer.decode([token])
        return text, list(text.encode())
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def completion_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """The completions format: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one object
    of token text: logprob per token) and ``text_offset`` (from ``offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = token_text(tokenizer, e.token)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({token_text(tokenizer, t)[0]: lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat format: ``content``, one entry per token with its ``top_logprobs``."""

    def entry(token: int, lp: float) -> dict[str, Any]:
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": raw}

    content = [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def logprobs_body(
    tokenizer: Any, entries: Sequence[TokenLogprob] | None, chat: bool, offset: int = 0
) -> dict[str, Any] | None:
    if entries is None:
        return None
    return (
        chat_logprobs(tokenizer, entries)
        if chat
        else completion_logprobs(tokenizer, entries, offset)
    )


def _choice(
    index: int, out: RequestOutput, text: str, chat: bool, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        token_ids=out.output_ids,
    )
    return choice


def response_body(
    rid: str,
    model: str,
    outs: Sequence[RequestOutput],
    chat: bool,
    tokenizer: Any,
    want_logprobs: bool,
) -> dict[str, Any]:
    """A whole (not streamed) response: one choice per output, in order."""
    choices = [
        _choice(
            i,
            out,
            out.text if out.text is not None else "",
            chat,
            logprobs_body(tokenizer, out.logprobs, chat) if want_logprobs else None,
        )
        for i, out in enumerate(outs)
    ]
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage(outs),
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    token_ids: list[int],
    finish_reason: str | None = None,
    role: bool = False,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``: a text delta (``None``: none) and the ids it
    came from."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["token_ids"] = token_ids
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, model: str, chat: bool, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": now(),
        "model": model,
        "choices": [],
        "usage": usage(outs),
    }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
