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
"""

from __future__ import annotations

import gc
import http.client
import json
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench.helpers import Progress
from kvtier.errors import ConfigError
from kvtier.types import TIERS

CLASSES = (*TIERS, "none")
"""What a request's prefix can have been served by."""
SHARES = (*TIERS, "recomputed")
"""Where a prompt token came from."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """The workload and the in-process server's cache."""

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
    """Seed of the user turns."""
    timeout_s: float = 120.0
    """Socket timeout of one request."""

    def __post_init__(self) -> None:
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
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConfigError(f"url must be http://HOST:PORT, got {self.url!r}")


@dataclass(slots=True)
class Sample:
    """One request's outcome."""

    conversation: int
    turn: int
    status: str
    """``200``, another HTTP status, ``500`` for a server error chunk in a 200 stream,
    ``connection`` (a transport failure) or ``incomplete`` (a stream without its usage)."""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    served_by: str = "none"
    reply: list[int] = field(default_factory=list)
    error: str = ""
    """What the server said about a failed request (its error message, shortened)."""


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
        names = [str(card["id"]) for card in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{url}/v1/models answered no model list: {error_message(body)}"
        ) from None
    if wanted is not None:
        if wanted not in names:
            raise ConfigError(
                f"--model {wanted!r} is not served by {url}; it serves {', '.join(names) or 'none'}"
            )
        return wanted
    if len(names) != 1:
        raise ConfigError(
            f"{url} serves {len(names)} models ({', '.join(names)}): name one with --model"
        )
    return names[0]


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


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy streaming completion of exactly ``max_tokens`` tokens, usage included."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


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


def _start_server(cfg: ServeBenchConfig, storage_dir: str) -> Any:
    from kvtier.config import CacheConfig
    from kvtier.server.lifecycle import Server, build_llm

    cache = CacheConfig(
        page_size=cfg.page_size,
        device_pages=cfg.device_pages,
        host_pages=cfg.host_pages,
        device=cfg.device,
        storage="file",
        storage_dir=storage_dir,
    )
    model = cfg.model or "tiny"
    llm = build_llm(model, cache, max_running=cfg.max_running)
    return Server(llm, served_model_name=model, max_queue=max(256, 2 * cfg.clients)).start()


def _wait_health(url: str, deadline_s: float = 60.0) -> None:
    parts = urlsplit(url)
    end = time.monotonic() + deadline_s
    pause = threading.Event()
    while True:
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
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
    return 256  # a remote model's vocabulary is unknown here; every model has this many ids


def bench_serve(cfg: ServeBenchConfig, quiet: bool = False) -> dict[str, Any]:
    """Run the workload (see the module docstring) and return its JSON result. Progress goes
    to stderr (``quiet``: none)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-") as tmp:
        server = None if cfg.url else _start_server(cfg, tmp)
        url = cfg.url or server.url
        if server is not None:
            # As ``kvtier serve`` does before it listens; given back after the run, so that a
            # caller's later garbage is collected as before.
            from kvtier.server.lifecycle import freeze_startup_objects

            frozen = freeze_startup_objects()
        try:
            _wait_health(url)
            if cfg.url:
                cfg = replace(cfg, model=served_model(url, cfg.model, cfg.api_key, cfg.timeout_s))
            else:
                cfg = replace(cfg, model=cfg.model or "tiny")
            vocab = _vocab(server)
            progress = Progress(
                "serve", cfg.clients * cfg.conversations * cfg.turns, shown=not quiet
            )
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
        finally:
            if server is not None:
                server.stop()
                gc.unfreeze()
    return result


def _tier_stats(llm: Any) -> dict[str, Any]:
    """The engine's own hit and transfer counters, next to what the clients saw."""
    st = llm.stats()
    keys = (
        "device_hit_tokens",
        "host_hit_tokens",
        "storage_hit_tokens",
        "recomputed_tokens",
        "device_pages_total",
        "host_pages_total",
    )
    return {k: st[k] for k in keys if k in st}
