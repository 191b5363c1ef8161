"""``kvtier bench serve``: concurrent multi-turn clients against ``kvtier serve`` over loopback.

Each client holds one conversation: its first prompt is a system prefix every client shares
plus a user turn of its own; each next prompt is the previous prompt, the reply's token ids
and a new user turn. Requests stream (SSE, greedy, ``ignore_eos`` so every reply has
``max_tokens`` tokens); TTFT is the time from sending a request to the first chunk that
carries a token. A request is classified by the tier that served most of its cached prefix
(``usage.prompt_tokens_details.cached_tokens_by_tier``; ``none`` when nothing was cached).

With ``url`` the benchmark drives a running server under the model name it reports at
``/v1/models`` (or ``model``, which must be one of them); a server it cannot ask, or that
serves no such model, is a ``ConfigError`` before any request. Without ``url`` the server runs
in this process on 127.0.0.1 (a free port) with a device pool
and a host pool far smaller than the clients' working set and a file L3 in a temporary
directory, so pages keep moving between device, host and storage. The run is bounded twice:
every client stops after ``turns`` turns or once ``duration_s`` passed, whichever is first.

The result (JSON): the configuration, TTFT percentiles and counts per serving tier, tokens/s
and requests/s, the share of prompt tokens served from each tier (and recomputed), and errors
by HTTP status (``connection`` for a transport failure) with the first error's message. A prompt token no tier served counts as
recomputed; ``prefill_tokens`` is what the engine computed by prefill (``recomputed_tokens``
of ``usage``), which also counts what a preempted request computed again. There is no peer run: a serving
benchmark's figures are compared across commits and configurations, per tier.

``workload`` ``multiturn`` and ``longdoc`` run ``bench multiturn``'s workloads (its generators,
``closed_loop`` sizing them as ``MultiTurnConfig`` does) over HTTP instead: a closed loop of
``concurrency`` keep-alive connections, each starting the next ready turn as soon as its request
finished (``run_closed_loop``), every request of the workload run once, no time limit. Per run
(``configs[name]``, keys ``LOOP_KEYS``): ``bench multiturn``'s per-configuration figures
as a client sees them: wall time, requests/s, input and output tokens/s, TTFT p50/p90/p99 (from
sending a request to the first chunk that carries a token), prompt tokens served per tier and
recomputed from ``usage``, one record per request, whether served + recomputed = prompt for
every request (``tokens_add_up``: a preempted request computes more, and ``usage`` does not say
it was preempted, so more counts as adding up; ``recomputed_again`` sums the excess) and
whether its outputs equal the first run's (greedy). With ``url`` that is one run, ``server``;
without, one in-process server per configuration of ``closed_loop.configs`` (``device``,
``host``, ``host+file``, ``file-prepopulated``, ``mooncake``: ``bench multiturn``'s caches, the
prepopulated L3 filled by an untimed server of its own or the ``host+file`` run's), each over
the same model, started as the chat workload's server is. There is no bound: the rates it
needs are measured inside an engine, not over HTTP.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench import multiturn as mt
from kvtier.bench.helpers import Progress, logger
from kvtier.bench.multiturn import MultiTurnConfig, Turn
from kvtier.errors import ConfigError
from kvtier.types import TIERS

CLASSES = (*TIERS, "none")
"""What a request's prefix can have been served by."""
SHARES = (*TIERS, "recomputed")
"""Where a prompt token came from."""
WORKLOADS = ("chat", *mt.WORKLOADS)
"""``chat`` (the conversations of the module docstring), then ``bench multiturn``'s."""
REMOTE = "server"
"""The name of the one run against ``url``."""
REMOTE_VOCAB = 256
"""Token ids of the prompts sent to a remote server are below this (its vocabulary is unknown
here; every model has this many ids)."""
PROMPT_FORMATS = ("ids", "text")
"""How ``multiturn``/``longdoc`` prompts are sent (``ServeBenchConfig.prompt_format``)."""
TEXT_IDS = (32, 127)
"""Token ids of text prompts: printable ASCII, each one byte and one character."""
LOOP_KEYS = (
    "cache",
    "wall_s",
    "requests",
    "num_requests",
    "requests_ok",
    "requests_per_s",
    "input_tokens",
    "output_tokens",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_s",
    "tokens",
    "first_round_tokens",
    "tokens_add_up",
    "recomputed_again",
    "speedup",
    "outputs_match",
    "mismatched_requests",
    "errors_by_status",
    "first_error",
    "server_stats",
)
"""Keys of every ``configs[name]`` of a ``multiturn``/``longdoc`` result (``cache`` and
``server_stats`` are ``None`` against ``url``)."""
LOOP_REQUEST_KEYS = (
    "conversation",
    "round",
    "status",
    "prompt_tokens",
    "output_tokens",
    "ttft_s",
    "cached_device",
    "cached_host",
    "cached_storage",
    "recomputed",
    "instance",
    "expected_s",
    "sent_s",
    "finished_s",
)
"""Keys of every record in ``configs[name]["requests"]`` (``bench multiturn``'s, as ``usage``
gives them, and the HTTP ``status``; behind ``kvtier route``, the instance that answered and
the router's expected time, from its ``x-kvtier-*`` headers, else ``None``; ``sent_s`` and
``finished_s``: when it was sent and when its answer ended, in seconds from the run's start,
so that a run's records show which requests overlapped)."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """The workload and the in-process server's cache."""

    workload: str = "chat"
    """``chat`` (the conversations below), ``multiturn`` or ``longdoc`` (``bench multiturn``'s
    workloads, which ``closed_loop`` describes; the chat fields are not used then)."""
    closed_loop: MultiTurnConfig | None = None
    """``multiturn``/``longdoc``: the workload, ``concurrency``, ``seed`` and, for in-process
    servers, the configurations (``configs``) and their cache sizes, as ``bench multiturn``
    takes them; its ``workload`` must be this one's, its ``model``, ``dtype``, ``device`` and
    ``decode_steps`` are not used (this config's ``model`` and ``device`` are), nor are its
    configurations and sizes with ``url``. ``None``: its defaults."""
    clients: int = 4
    """Concurrent clients (threads), one conversation each."""
    conversations: int = 3
    """Conversations each client takes turns in, round-robin: a conversation's history goes
    down the tiers while its client serves the others."""
    turns: int = 6
    """Turns per conversation at most."""
    duration_s: float = 60.0
    """No client starts a request after this many seconds."""
    model: str | None = None
    """Model preset or checkpoint directory of the in-process server (``None``: ``tiny``); with
    ``url``, the served model name to request (``None``: the one ``/v1/models`` lists)."""
    url: str | None = None
    """A running server to connect to instead (``http://HOST:PORT``); it must take token-id
    prompts."""
    api_key: str | None = None
    """Bearer key sent with every request (a server started with ``--api-key``)."""
    system_tokens: int = 32
    """Length of the system prefix every conversation shares."""
    user_tokens: tuple[int, int] = (8, 24)
    """Range of a user turn's length."""
    max_tokens: int = 8
    """Tokens generated per request."""
    page_size: int = 16
    """Tokens per page (in-process server)."""
    device_pages: int = 32
    """Device pool pages (in-process server): below the clients' working set."""
    host_pages: int = 64
    """Host pool pages (in-process server): below it too, so pages go on to storage."""
    max_running: int = 4
    """Requests the in-process engine decodes together (fewer than ``clients``: waiting
    requests' prefixes get evicted meanwhile)."""
    device: str | None = None
    """Torch device of the in-process server (``None``: CUDA when available)."""
    seed: int = 0
    """Seed of the user turns (``chat``)."""
    timeout_s: float = 120.0
    """Socket timeout of one request."""
    prompt_format: str = "ids"
    """``multiturn``/``longdoc``: ``ids`` sends each prompt as token ids; ``text`` as a string
    (with ``add_special_tokens: false``) for fronts that route on text, the workload drawn in
    printable ASCII (``TEXT_IDS``) and each turn's history grown by the answer's text as
    streamed. It needs a server whose tokenizer gives each byte one id (the presets' byte
    tokenizer): a request whose ``usage`` counts other than its bytes fails, naming it."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError(
                f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        if self.closed_loop is not None:
            if not isinstance(self.closed_loop, MultiTurnConfig):
                raise ConfigError(
                    f"closed_loop must be a MultiTurnConfig, got {type(self.closed_loop).__name__}"
                )
            if self.closed_loop.workload != self.workload:
                raise ConfigError(
                    f"closed_loop describes the {self.closed_loop.workload!r} workload but "
                    f"workload is {self.workload!r}"
                )
        for name in (
            "clients",
            "conversations",
            "turns",
            "system_tokens",
            "max_tokens",
            "max_running",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not (isinstance(self.duration_s, int | float) and self.duration_s > 0):
            raise ConfigError(f"duration_s must be a positive number, got {self.duration_s!r}")
        lo, hi = self.user_tokens
        if not 1 <= lo <= hi:
            raise ConfigError(f"user_tokens must be a range 1 <= lo <= hi, got {self.user_tokens}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a non-empty string or None, got {self.model!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("api_key must be a non-empty string or None")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError(
                f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got "
                f"{self.prompt_format!r}"
            )
        if self.prompt_format == "text" and self.workload == "chat":
            raise ConfigError("prompt_format='text' is for the multiturn and longdoc workloads")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConfigError(f"url must be http://HOST:PORT, got {self.url!r}")

    def loop_config(self) -> MultiTurnConfig:
        """``closed_loop``, or ``bench multiturn``'s defaults for ``workload``."""
        return self.closed_loop or MultiTurnConfig(workload=self.workload)


@dataclass(slots=True)
class Sample:
    """One request's outcome."""

    conversation: int
    turn: int
    status: str
    """``200``, another HTTP status, ``500`` for a server error chunk in a 200 stream,
    ``connection`` (a transport failure), ``incomplete`` (a stream without its usage) or
    ``unreadable`` (a stream the client could not parse)."""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    served_by: str = "none"
    reply: list[int] = field(default_factory=list)
    reply_text: str = ""
    """The answer's text as streamed (``choices[].text`` joined)."""
    error: str = ""
    """What the server said about a failed request (its error message, shortened)."""
    instance: str | None = None
    """The instance that answered, where a ``kvtier route`` in between says
    (``x-kvtier-instance``)."""
    expected_s: float | None = None
    """The router's expected time for the request where it chose by it
    (``x-kvtier-expected-ms``)."""
    sent_s: float | None = None
    """When it was sent, in seconds from the run's start (HTTP closed loop only)."""
    finished_s: float | None = None
    """When its answer ended (or it failed), as ``sent_s``."""


def served_by(by_tier: dict[str, int]) -> str:
    """The tier that served most of a cached prefix (the faster tier on a tie); ``none``."""
    best = max(TIERS, key=lambda t: by_tier.get(t, 0))
    return best if by_tier.get(best, 0) > 0 else "none"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class _Client:
    """One keep-alive connection and the streaming request over it."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        parts = urlsplit(url)
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
        self._headers = {"Content-Type": "application/json"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def complete(self, body: dict[str, Any], sample: Sample) -> None:
        """Send ``body`` streaming; fill ``sample`` from the SSE chunks."""
        start = time.perf_counter()
        try:
            self._conn.request(
                "POST",
                "/v1/completions",
                body=json.dumps(body),
                headers=self._headers,
            )
            resp = self._conn.getresponse()
            sample.instance = resp.getheader("x-kvtier-instance")
            expected = resp.getheader("x-kvtier-expected-ms")
            sample.expected_s = float(expected) / 1e3 if expected is not None else None
            if resp.status != 200:
                sample.error = error_message(resp.read())
                sample.status = str(resp.status)
                return
            self._read_stream(resp, start, sample)
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()  # reconnects on the next request
            sample.status = "connection"
            sample.error = f"{type(e).__name__}: {e}"

    def _read_stream(self, resp: http.client.HTTPResponse, start: float, s: Sample) -> None:
        status = "200"
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                resp.read()  # the chunked body's end: the connection is reused
                break
            obj = json.loads(data)
            if "error" in obj:
                status = "500" if obj["error"].get("type") == "server_error" else "error"
                s.error = error_message(data)
                continue
            for choice in obj.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and s.ttft_s is None:
                    s.ttft_s = time.perf_counter() - start
                s.reply.extend(ids)
                s.reply_text += choice.get("text") or ""
            usage = obj.get("usage")
            if usage:
                details = usage["prompt_tokens_details"]
                s.prompt_tokens = usage["prompt_tokens"]
                s.completion_tokens = usage["completion_tokens"]
                s.by_tier = {t: details["cached_tokens_by_tier"][t] for t in TIERS}
                s.recomputed = details["recomputed_tokens"]
                s.served_by = served_by(s.by_tier)
        s.status = status if s.prompt_tokens or status != "200" else "incomplete"

    def close(self) -> None:
        self._conn.close()


def error_message(body: bytes, limit: int = 200) -> str:
    """The message of an error answer (OpenAI's ``{"error": {"message": ...}}``, else the body
    itself), shortened to ``limit`` characters."""
    text = body.decode(errors="replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            text = err["message"]
        elif isinstance(obj, dict) and isinstance(obj.get("detail"), str):
            text = obj["detail"]
    except ValueError:
        pass
    return text if len(text) <= limit else text[: limit - 3] + "..."


def served_model(url: str, wanted: str | None, api_key: str | None, timeout_s: float) -> str:
    """The model name to request from the server at ``url``: ``wanted`` if ``/v1/models`` lists
    it, else the one model it lists. ``ConfigError`` (naming what to pass) when the server
    does not answer, answers an error, lists several models and none was ``wanted``, or does not
    list ``wanted``."""
    return str(model_card(url, wanted, api_key, timeout_s)["id"])


def model_card(
    url: str, wanted: str | None, api_key: str | None, timeout_s: float
) -> dict[str, Any]:
    """The ``/v1/models`` card of the model ``served_model`` picks (its ``max_model_len``, where
    the server gives one, is the context a request may use); the same ``ConfigError``s."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    try:
        conn.request("GET", "/v1/models", headers=headers)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise ConfigError(f"{url}/v1/models: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        hint = " (does the server expect --api-key?)" if resp.status == 401 else ""
        raise ConfigError(f"{url}/v1/models answered {resp.status}: {error_message(body)}{hint}")
    try:
        cards = {str(card["id"]): card for card in json.loads(body)["data"]}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{url}/v1/models answered no model list: {error_message(body)}"
        ) from None
    names = list(cards)
    if wanted is not None:
        if wanted not in names:
            raise ConfigError(
                f"--model {wanted!r} is not served by {url}; it serves {', '.join(names) or 'none'}"
            )
        return cards[wanted]
    if len(names) != 1:
        raise ConfigError(
            f"{url} serves {len(names)} models ({', '.join(names)}): name one with --model"
        )
    return cards[names[0]]


def _client(
    cfg: ServeBenchConfig,
    url: str,
    idx: int,
    system: list[int],
    vocab: int,
    deadline: float,
    out: list[Sample],
    progress: Progress,
) -> None:
    """Client ``idx``: its conversations' turns, round-robin, until ``turns`` or
    ``deadline``; a conversation whose request failed ends (its next prompt needs the reply,
    so its turns left count as done for the progress line)."""
    rng = random.Random(cfg.seed * 1_000_003 + idx)
    client = _Client(url, cfg.timeout_s, cfg.api_key)
    prompts = [list(system) for _ in range(cfg.conversations)]
    live = set(range(cfg.conversations))
    try:
        for turn in range(cfg.turns):
            for conv in range(cfg.conversations):
                if conv not in live:
                    continue
                if time.monotonic() > deadline:
                    return
                prompt = prompts[conv]
                prompt += [rng.randrange(vocab) for _ in range(rng.randint(*cfg.user_tokens))]
                s = Sample(idx * cfg.conversations + conv, turn, "connection")
                client.complete(request_body(cfg.model or "tiny", prompt, cfg.max_tokens), s)
                out.append(s)
                if s.status == "200":
                    prompt += s.reply
                    progress.step()
                else:
                    live.discard(conv)
                    progress.step(cfg.turns - turn, failed=1)
    finally:
        client.close()


def request_body(
    model: str, prompt: list[int], max_tokens: int, text: bool = False
) -> dict[str, Any]:
    """A greedy streaming completion of exactly ``max_tokens`` tokens, usage included; with
    ``text`` the prompt goes as the string its ids are the UTF-8 bytes of, encoded without
    special tokens."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": bytes(prompt).decode("utf-8") if text else prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if text:
        body["add_special_tokens"] = False
    return body


def _text_history(turn: Turn, s: Sample) -> list[int] | None:
    """What a text-prompt answer adds to its conversation's history: its text's bytes (as the
    server will encode the next prompt); ``None`` (and ``s`` failed, naming why) when the
    server counted the prompt's tokens otherwise than its bytes."""
    if s.prompt_tokens != len(turn.prompt):
        s.status = "tokenizer"
        s.error = (
            f"the server counted {s.prompt_tokens} tokens in a text prompt of {len(turn.prompt)} "
            "bytes: prompt_format='text' needs a tokenizer that gives each byte one id"
        )
        return None
    return list(s.reply_text.encode("utf-8"))


def summarize(cfg: ServeBenchConfig, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The JSON result of a run (see the module docstring)."""
    ok = [s for s in samples if s.status == "200"]
    ttft: dict[str, dict[str, Any]] = {}
    for cls in (*CLASSES, "all"):
        xs = [s.ttft_s for s in ok if s.ttft_s is not None and cls in (s.served_by, "all")]
        row: dict[str, Any] = {"count": len(xs)}
        if xs:
            row.update(
                {f"p{q}_ms": 1e3 * percentile(xs, q / 100) for q in (50, 90, 99)},
                mean_ms=1e3 * sum(xs) / len(xs),
            )
        ttft[cls] = row
    prompt = sum(s.prompt_tokens for s in ok)
    tokens = {t: sum(s.by_tier.get(t, 0) for s in ok) for t in TIERS}
    tokens["recomputed"] = prompt - sum(tokens.values())
    errors: dict[str, int] = {}
    first_error = None
    for s in samples:
        if s.status != "200":
            errors[s.status] = errors.get(s.status, 0) + 1
            first_error = first_error or {"status": s.status, "message": s.error}
    completion = sum(s.completion_tokens for s in ok)
    return {
        "bench": "serve",
        "config": asdict(cfg),
        "wall_s": wall_s,
        "requests": len(samples),
        "requests_ok": len(ok),
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": completion / wall_s if wall_s else 0.0,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else 0.0,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_by_source": tokens,
        "prefill_tokens": sum(s.recomputed for s in ok),
        "prompt_share": {k: (v / prompt if prompt else 0.0) for k, v in tokens.items()},
        "served_by_counts": {c: sum(1 for s in ok if s.served_by == c) for c in CLASSES},
        "ttft_by_tier": ttft,
        "errors_by_status": errors,
        "errors_5xx": sum(n for k, n in errors.items() if k.startswith("5")),
        "first_error": first_error,
        "stopped_by_duration": not errors
        and len(samples) < cfg.clients * cfg.conversations * cfg.turns,
    }


def _chat_cache(cfg: ServeBenchConfig, storage_dir: str) -> Any:
    """The chat workload's in-process cache: small device and host pools, a file L3."""
    from kvtier.config import CacheConfig

    return CacheConfig(
        page_size=cfg.page_size,
        device_pages=cfg.device_pages,
        host_pages=cfg.host_pages,
        device=cfg.device,
        storage="file",
        storage_dir=storage_dir,
    )


@contextlib.contextmanager
def _in_process(
    model: str, cache: Any, max_running: int, max_queue: int, max_prefill_tokens: int | None = None
) -> Iterator[tuple[Any, int]]:
    """A started server on 127.0.0.1 (a free port) over ``model`` with ``cache``, and how many
    start-up objects were frozen for its run, as ``kvtier serve`` does before it listens; on
    exit the server stops (storage writes land, the engine closes) and they are given back, so
    that a caller's later garbage is collected as before."""
    from kvtier.server.frozen_startup import freeze_startup_objects
    from kvtier.server.lifecycle import Server, build_llm

    kw = {} if max_prefill_tokens is None else {"max_prefill_tokens": max_prefill_tokens}
    llm = build_llm(model, cache, max_running=max_running, **kw)
    server = Server(llm, served_model_name=model, max_queue=max_queue).start()
    frozen = freeze_startup_objects()
    try:
        yield server, frozen
    finally:
        server.stop()
        gc.unfreeze()


def _wait_health(url: str, deadline_s: float = 60.0) -> None:
    parts = urlsplit(url)
    end = time.monotonic() + deadline_s
    pause = threading.Event()
    while True:
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=5)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()  # closed with its answer unread, the socket would reset the server's end
            if resp.status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()
        if time.monotonic() > end:
            raise ConfigError(f"{url}/health did not answer within {deadline_s:.0f} s")
        pause.wait(0.05)  # spaces the probes out; readiness is the answer itself


def _vocab(server: Any) -> int:
    if server is not None:
        return server.loop.call(lambda llm: llm.model_config.vocab_size).result(timeout=60)
    return REMOTE_VOCAB


def bench_serve(cfg: ServeBenchConfig, quiet: bool = False) -> dict[str, Any]:
    """Run the workload (see the module docstring) and return its JSON result. Progress goes
    to stderr (``quiet``: none). ``multiturn``/``longdoc``: ``ConfigError`` for a request that
    cannot fit the device pool or the server's context, before any request."""
    if cfg.workload != "chat":
        return _bench_closed_loop(cfg, quiet)
    with contextlib.ExitStack() as stack:
        server = frozen = None
        if not cfg.url:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-"))
            model = cfg.model or "tiny"
            server, frozen = stack.enter_context(
                _in_process(
                    model, _chat_cache(cfg, tmp), cfg.max_running, max(256, 2 * cfg.clients)
                )
            )
        url = cfg.url or server.url
        _wait_health(url)
        if cfg.url:
            cfg = replace(cfg, model=served_model(url, cfg.model, cfg.api_key, cfg.timeout_s))
        else:
            cfg = replace(cfg, model=cfg.model or "tiny")
        vocab = _vocab(server)
        progress = Progress("serve", cfg.clients * cfg.conversations * cfg.turns, shown=not quiet)
        rng = random.Random(cfg.seed)
        system = [rng.randrange(vocab) for _ in range(cfg.system_tokens)]
        per_client: list[list[Sample]] = [[] for _ in range(cfg.clients)]
        start = time.perf_counter()
        deadline = time.monotonic() + cfg.duration_s
        threads = [
            threading.Thread(
                target=_client,
                args=(cfg, url, i, system, vocab, deadline, per_client[i], progress),
                name=f"bench-client-{i}",
            )
            for i in range(cfg.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        progress.close()
        wall = time.perf_counter() - start
        samples = [s for part in per_client for s in part]
        result = summarize(cfg, samples, wall)
        if server is not None:
            result["server_stats"] = server.loop.call(_tier_stats).result(timeout=60)
            result["server_stats"]["frozen_startup_objects"] = frozen
    return result


_CHAT_STATS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "recomputed_tokens",
    "device_pages_total",
    "host_pages_total",
)


def _tier_stats(llm: Any, keys: tuple[str, ...] = _CHAT_STATS) -> dict[str, Any]:
    """The engine's own hit and transfer counters (``keys``), next to what the clients saw."""
    st = llm.stats()
    return {k: st[k] for k in keys if k in st}


# ---- multiturn and longdoc over HTTP ----------------------------------------------------


def _loop_stats(llm: Any) -> dict[str, Any]:
    """``bench multiturn``'s engine counters and the pool sizes."""
    return _tier_stats(llm, (*mt.STATS_KEYS, *_CHAT_STATS))


def run_closed_loop(
    url: str,
    model: str,
    workload: mt.Workload,
    loop: MultiTurnConfig,
    api_key: str | None,
    timeout_s: float,
    progress: Progress,
    text: bool = False,
) -> tuple[list[tuple[Turn, Sample]], float]:
    """``workload`` against the server at ``url`` with at most ``loop.concurrency`` requests in
    flight, one keep-alive connection per slot (a thread each): a slot starts a ready turn
    (``loop.ready_policy``; ``longdoc`` keeps its order) as soon as its previous request
    finished, and the turns a finished request makes ready (``workload.after``) join the queue.
    A failed ``multiturn`` request ends its conversation (its next turn needs the answer; its
    turns left count as failed for ``progress``); a failed ``longdoc`` question still counts
    for the warm-up. ``text``: prompts go as text (``ServeBenchConfig.prompt_format``) and an
    answer adds its text's bytes to the history. Returns every request sent with its sample,
    in finishing order, and the wall time."""
    cond = threading.Condition()
    ready = workload.initial()
    flying = 0
    done: list[tuple[Turn, Sample]] = []
    pick = random.Random(loop.seed + 1)  # as bench multiturn pops its ready queue
    ordered = workload.ordered or loop.ready_policy == "fifo"
    longdoc = isinstance(workload, mt.LongDocWorkload)

    def slot() -> None:
        nonlocal flying
        client = _Client(url, timeout_s, api_key)
        try:
            while True:
                with cond:
                    while not ready and flying:
                        cond.wait()
                    if not ready:  # nothing ready and nothing in flight: the workload is done
                        return
                    turn = ready.pop(0 if ordered else pick.randrange(len(ready)))
                    flying += 1
                s = Sample(turn.conversation, turn.round, "connection")
                s.sent_s = time.perf_counter() - t0
                try:
                    body = request_body(model, turn.prompt, workload.output_tokens, text)
                    client.complete(body, s)
                except Exception as e:  # noqa: BLE001 - an unparsable answer fails this request only
                    client.close()
                    s.status, s.error = "unreadable", f"{type(e).__name__}: {e}"[:200]
                s.finished_s = time.perf_counter() - t0
                history = s.reply
                if text and s.status == "200":
                    history = _text_history(turn, s)
                with cond:
                    flying -= 1
                    done.append((turn, s))
                    if s.status == "200" and history is not None:
                        ready.extend(workload.after(turn, history))
                    elif longdoc:
                        ready.extend(workload.after(turn, []))
                    cond.notify_all()
                if s.status == "200":
                    progress.step()
                else:
                    left = 1 if longdoc else workload.rounds - turn.round
                    progress.step(left, failed=1)
        finally:
            client.close()

    slots = [
        threading.Thread(target=slot, name=f"bench-slot-{i}")
        for i in range(min(loop.concurrency, workload.num_requests))
    ]
    t0 = time.perf_counter()
    for t in slots:
        t.start()
    for t in slots:
        t.join()
    return done, time.perf_counter() - t0


def _loop_record(turn: Turn, s: Sample) -> dict[str, Any]:
    return {
        "conversation": turn.conversation,
        "round": turn.round,
        "status": s.status,
        "prompt_tokens": len(turn.prompt),
        "output_tokens": len(s.reply),
        "ttft_s": s.ttft_s,
        "cached_device": s.by_tier.get("device", 0),
        "cached_host": s.by_tier.get("host", 0),
        "cached_storage": s.by_tier.get("storage", 0),
        "recomputed": s.recomputed,
        "instance": s.instance,
        "expected_s": s.expected_s,
        "sent_s": s.sent_s,
        "finished_s": s.finished_s,
    }


def _tokens(recs: list[dict[str, Any]]) -> dict[str, int]:
    return {
        **{t: sum(r[f"cached_{t}"] for r in recs) for t in TIERS},
        "recomputed": sum(r["recomputed"] for r in recs),
        "prompt": sum(r["prompt_tokens"] for r in recs),
    }


def _excess(r: dict[str, Any]) -> int:
    """Served + recomputed - prompt tokens of a record (> 0: computed again after a
    preemption)."""
    return sum(r[f"cached_{t}"] for t in TIERS) + r["recomputed"] - r["prompt_tokens"]


def loop_result(
    done: list[tuple[Turn, Sample]], wall_s: float
) -> tuple[dict[str, Any], dict[tuple[int, int], list[int]]]:
    """One run's figures (module docstring; ``cache``, ``server_stats`` and the comparisons
    filled in by the caller) and the output ids of every request that succeeded, by
    ``(conversation, round)``."""
    recs = sorted(
        (_loop_record(t, s) for t, s in done), key=lambda r: (r["round"], r["conversation"])
    )
    ok = [r for r in recs if r["status"] == "200"]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    n_in = sum(r["prompt_tokens"] for r in ok)
    n_out = sum(r["output_tokens"] for r in ok)
    usage_prompt = {(t.conversation, t.round): s.prompt_tokens for t, s in done}
    errors: dict[str, int] = {}
    first_error = None
    for _, s in done:
        if s.status != "200":
            errors[s.status] = errors.get(s.status, 0) + 1
            first_error = first_error or {"status": s.status, "message": s.error}
    res: dict[str, Any] = {
        "cache": None,
        "wall_s": wall_s,
        "requests": recs,
        "num_requests": len(recs),
        "requests_ok": len(ok),
        "requests_per_s": len(ok) / wall_s,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tokens_per_s": n_in / wall_s,
        "output_tokens_per_s": n_out / wall_s,
        "ttft_s": {
            **{f"p{q}": percentile(ttfts, q / 100) if ttfts else None for q in (50, 90, 99)},
            "mean": sum(ttfts) / len(ttfts) if ttfts else None,
        },
        "tokens": _tokens(ok),
        "first_round_tokens": _tokens([r for r in ok if r["round"] == 0]),
        "tokens_add_up": all(
            _excess(r) >= 0 and usage_prompt[r["conversation"], r["round"]] == r["prompt_tokens"]
            for r in ok
        ),
        "recomputed_again": sum(max(0, _excess(r)) for r in ok),
        "speedup": None,
        "outputs_match": None,
        "mismatched_requests": None,
        "errors_by_status": errors,
        "first_error": first_error,
        "server_stats": None,
    }
    outputs = {(t.conversation, t.round): s.reply for t, s in done if s.status == "200"}
    return res, outputs


def _check_context(url: str, model: str, api_key: str | None, longest: int, timeout: float) -> str:
    """The model to request (``served_model``); ``ConfigError`` when the server's context
    (``max_model_len``, where its card gives one) cannot hold the workload's longest request."""
    card = model_card(url, model, api_key, timeout)
    context = card.get("max_model_len")
    if isinstance(context, int) and longest > context:
        raise ConfigError(
            f"the workload's longest request has {longest} tokens (prompt + output tokens) but "
            f"{url} serves a context of {context} tokens"
        )
    return str(card["id"])


def _bench_closed_loop(cfg: ServeBenchConfig, quiet: bool) -> dict[str, Any]:
    loop = cfg.loop_config()
    log: Callable[[str], None] = (lambda msg: None) if quiet else logger("serve")
    probe = mt.make_workload(loop, 2)  # sizes only: ids come from the served vocabulary
    longest = probe.max_prompt + probe.output_tokens
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    workload: mt.Workload | None = None  # drawn once, over the served model's vocabulary
    text = cfg.prompt_format == "text"

    def draw(vocab: int) -> mt.Workload:
        return (
            mt.make_workload(loop, TEXT_IDS[1], TEXT_IDS[0])
            if text
            else mt.make_workload(loop, vocab)
        )

    def measure(name: str, url: str, model: str, workload: mt.Workload, shown: bool = True) -> None:
        bar = Progress(name, probe.num_requests, shown=shown and not quiet)
        try:
            done, wall = run_closed_loop(
                url, model, workload, loop, cfg.api_key, cfg.timeout_s, bar, text
            )
        finally:
            bar.close()
        results[name], outputs[name] = loop_result(done, wall)

    if cfg.url:
        _wait_health(cfg.url)
        model = _check_context(cfg.url, cfg.model, cfg.api_key, longest, cfg.timeout_s)
        workload = draw(REMOTE_VOCAB)
        measure(REMOTE, cfg.url, model, workload)
        device = None
    else:
        from kvtier.config import resolve_device

        if longest + 2 * loop.page_size > loop.device_tokens:
            raise ConfigError(
                f"device_tokens={loop.device_tokens} cannot hold one request of up to "
                f"{longest} tokens (prompt + output_tokens) and a padding page"
            )
        dev = resolve_device(cfg.device)
        device = str(dev)
        model = cfg.model or "tiny"
        salt = f"bench-serve-{uuid.uuid4().hex}"
        queue = max(256, 2 * loop.concurrency)

        def serve(cache: Any) -> Any:
            _release(dev)
            return _in_process(model, cache, loop.concurrency, queue, loop.max_prefill_tokens)

        def prepare(server: Any) -> mt.Workload:
            nonlocal workload
            _wait_health(server.url)
            _check_context(server.url, model, None, longest, cfg.timeout_s)
            if workload is None:
                workload = draw(_vocab(server))
            return workload

        with tempfile.TemporaryDirectory(
            prefix="kvtier-bench-serve-", dir=loop.storage_dir
        ) as root:

            def mkdir(name: str) -> str:
                return tempfile.mkdtemp(prefix=f"{name.replace('+', '-')}-", dir=root)

            filled: str | None = None
            for name in loop.run_configs():
                directory = None
                if name == "host+file":
                    directory = mkdir(name)
                elif name == "file-prepopulated":
                    if filled is None:  # filled by an untimed server of its own, same workload
                        filled = mkdir("fill")
                        log("file-prepopulated: filling its L3 with the workload (untimed)")
                        fill = mt.cache_config(
                            "host+file", loop, dev, probe.working_set, filled, salt
                        )
                        with serve(fill) as (server, _):
                            measure("fill", server.url, model, prepare(server), shown=False)
                        del results["fill"], outputs["fill"]
                    directory = filled
                cache = mt.cache_config(name, loop, dev, probe.working_set, directory, salt)
                with serve(cache) as (server, frozen):
                    measure(name, server.url, model, prepare(server))
                    server.loop.call(lambda llm: llm.check_integrity()).result(timeout=60)
                    stats = server.loop.call(_loop_stats).result(timeout=60)
                stats["frozen_startup_objects"] = frozen
                res = results[name]
                res["server_stats"] = stats
                res["cache"] = {
                    "device_tokens": stats["device_pages_total"] * loop.page_size,
                    "host_tokens": stats["host_pages_total"] * loop.page_size,
                    "storage": cache.storage,
                }
                if name == "host+file":
                    filled = directory
                tk = res["tokens"]
                log(
                    f"{name}: {res['wall_s']:.2f} s, TTFT p50 "
                    f"{(res['ttft_s']['p50'] or 0) * 1e3:.1f} ms, tokens device {tk['device']} "
                    f"host {tk['host']} storage {tk['storage']} recomputed {tk['recomputed']}"
                )
        _release(dev)
    return loop_summary(cfg, loop, workload, results, outputs, model, device)


def _release(dev: Any) -> None:
    """On CUDA, give back the pools of servers already stopped before the next allocates its
    own (``decode_stall.release_pools``)."""
    if dev.type == "cuda":
        from kvtier.bench.decode_stall import release_pools

        release_pools()


def loop_summary(
    cfg: ServeBenchConfig,
    loop: MultiTurnConfig,
    workload: mt.Workload,
    results: dict[str, dict[str, Any]],
    outputs: dict[str, dict[tuple[int, int], list[int]]],
    model: str,
    device: str | None,
) -> dict[str, Any]:
    """The result of a ``multiturn``/``longdoc`` run: every run compared with the first, and
    the requests of all of them counted together (what ``serve_failure`` reads)."""
    names = list(results)
    ref = names[0]
    for name, res in results.items():
        res["speedup"] = results[ref]["wall_s"] / res["wall_s"]
        res["mismatched_requests"] = mt.mismatches(outputs[ref], outputs[name])
        res["outputs_match"] = res["mismatched_requests"] == 0
    described = mt.workload_json(loop, workload)
    if cfg.url:  # the remote server's cache is its own
        for key in ("device_tokens", "working_set_over_device", "max_prefill_tokens"):
            described.pop(key)
    described["configs"] = names
    errors: dict[str, int] = {}
    for res in results.values():
        for status, n in res["errors_by_status"].items():
            errors[status] = errors.get(status, 0) + n
    first = next((r["first_error"] for r in results.values() if r["first_error"]), None)
    return {
        "bench": "serve",
        "config": asdict(cfg),
        "workload": described,
        "url": cfg.url,
        "model": model,
        "device": device,
        "configs": results,
        "summary": {
            name: {
                "wall_s": r["wall_s"],
                "speedup": r["speedup"],
                "requests_per_s": r["requests_per_s"],
                "ttft_p50_s": r["ttft_s"]["p50"],
                "ttft_p90_s": r["ttft_s"]["p90"],
                "ttft_p99_s": r["ttft_s"]["p99"],
                "served": {t: r["tokens"][t] for t in SHARES},
            }
            for name, r in results.items()
        },
        "outputs_match": all(r["outputs_match"] for r in results.values()),
        "tokens_add_up": all(r["tokens_add_up"] for r in results.values()),
        "reference_config": ref,
        "requests": sum(r["num_requests"] for r in results.values()),
        "requests_ok": sum(r["requests_ok"] for r in results.values()),
        "errors_by_status": errors,
        "first_error": first,
    }
