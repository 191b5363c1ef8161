"""Building and running a server: the engine from a preset or checkpoint directory, the engine
thread, uvicorn on a socket bound up front.

In-process (tests, benchmarks)::

    server = Server(llm, served_model_name="tiny").start()   # port 0: a free port
    ... requests to server.url ...
    server.loop.call(engine_state).result()                 # runs on the engine thread
    server.stop()                                           # storage writes land, L3 closed

The socket listens before ``start`` returns, so a client may connect at once; ``/health``
answers ``ok`` once the engine thread runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.server.frozen_startup import freeze_startup_objects
from kvtier.server.sizing import (
    PoolPlan,
    SizeRequest,
    available_host_bytes,
    format_bytes,
    plan_pools,
    workspace_bytes,
)

log = logging.getLogger("kvtier.server")

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` choices: ``auto`` keeps the checkpoint's (a preset's float32)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``org/name``: how a Hugging Face Hub model id looks."""


def check_model_argument(model: str) -> bool:
    """Whether ``model`` is a checkpoint directory (else a preset name). Raises
    ``ConfigError`` saying what to do for a file, a hub id, a missing directory or an unknown
    name."""
    from kvtier.engine.families import preset_names

    if os.path.isdir(model):
        return True
    if os.path.exists(model):
        raise ConfigError(
            f"MODEL {model}: it is a file: pass the checkpoint directory holding config.json"
        )
    if _HUB_ID.fullmatch(model):
        local = model.split("/")[-1]
        raise ConfigError(
            f"MODEL {model!r} looks like a Hugging Face Hub id, and kvtier serve does not "
            f"download: fetch it into a local directory first, e.g. `huggingface-cli download "
            f"{model} --local-dir ./{local}`, then `kvtier serve ./{local}`"
        )
    if "/" in model or os.sep in model:
        raise ConfigError(f"MODEL {model}: no such checkpoint directory")
    if model not in preset_names():
        raise ConfigError(
            f"MODEL {model!r} is neither a checkpoint directory nor a model preset; "
            f"known presets: {', '.join(preset_names())}"
        )
    return False


def _build_model(model: str, is_dir: bool, dtype: str | None) -> Any:
    """The model module on the CPU: a checkpoint's weights, or a preset's seeded ones."""
    if dtype not in (None, *DTYPES):
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dt = None if dtype in (None, "auto") else dtype
    if is_dir:
        from kvtier.engine.weights import load_model

        return load_model(model, dtype=dt)
    from kvtier.engine.families import build_model, preset

    return build_model(preset(model, **({"dtype": dt} if dt else {})))


def load_tokenizer_for(model: str, is_dir: bool, vocab_size: int, option: str | None) -> Any:
    """The tokenizer: ``option`` (``--tokenizer``: ``byte`` for the built-in byte
    tokenizer, or a directory holding ``tokenizer.json``, or that file), else a checkpoint's
    ``tokenizer.json``, else for a preset the byte tokenizer. ``None`` for a checkpoint
    without one (logged as a warning: text and chat are refused)."""
    from kvtier.engine.byte_tokenizer import ByteTokenizer
    from kvtier.engine.weights import Tokenizer, load_tokenizer

    if option == "byte" or (option is None and not is_dir):
        return ByteTokenizer(vocab_size)
    if option is not None:
        path = Path(option)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer {option}: no tokenizer.json there (or 'byte')")
        try:
            return Tokenizer(file)
        except ImportError:
            raise ConfigError("--tokenizer needs the tokenizers package") from None
        except Exception as e:  # noqa: BLE001 - the tokenizers package raises its own types
            raise ConfigError(f"--tokenizer {file}: not a readable tokenizer ({e})") from None
    tok = load_tokenizer(model)
    if tok is None:
        log.warning(
            "%s has no tokenizer.json: text prompts and chat requests will be refused (400); "
            "send token ids, or give --tokenizer DIR (or --tokenizer byte)",
            model,
        )
    return tok


def chat_template_for(model: str, is_dir: bool, tokenizer: Any, option: str | None) -> Any:
    """The chat template: ``option`` (``--chat-template``: a Jinja file or the template
    itself), else a checkpoint's, else the byte tokenizer's built-in one. ``None`` when there
    is none (logged: chat requests are refused)."""
    from kvtier.engine.byte_tokenizer import ByteTokenizer
    from kvtier.server.chat import ChatTemplate

    shipped = ChatTemplate.load(model) if is_dir else None
    if option is not None:
        if isinstance(tokenizer, ByteTokenizer):
            bos, eos = tokenizer.bos_token, tokenizer.eos_token
        else:
            bos, eos = (shipped.bos_token, shipped.eos_token) if shipped else ("", "")
        return ChatTemplate.from_option(option, bos, eos)
    if shipped is not None:
        return shipped
    if isinstance(tokenizer, ByteTokenizer):
        return ChatTemplate.builtin()
    if tokenizer is not None:
        log.warning(
            "%s has no chat template: /v1/chat/completions will be refused (400); give "
            "--chat-template FILE",
            model,
        )
    return None


def build_llm(
    model: str,
    cache_config: CacheConfig,
    *,
    max_running: int = 16,
    max_prefill_tokens: int = 4096,
    dtype: str | None = None,
    tokenizer: str | None = None,
) -> Any:
    """An ``LLM`` for ``model`` (a checkpoint directory or a preset name; anything else
    raises ``ConfigError`` naming it) with ``cache_config`` as given, and its tokenizer
    (``load_tokenizer_for``)."""
    from kvtier.engine import LLM

    is_dir = check_model_argument(model)
    module = _build_model(model, is_dir, dtype)
    tok = load_tokenizer_for(model, is_dir, module.config.vocab_size, tokenizer)
    return LLM(
        module,
        cache_config,
        max_running=max_running,
        max_prefill_tokens=max_prefill_tokens,
        tokenizer=tok,
    )


def load_chat_template(model: str, llm: Any = None) -> Any:
    """The chat template ``kvtier serve`` would use for ``model`` (``chat_template_for``)
    with ``llm``'s tokenizer (a preset's byte tokenizer when ``llm`` is not given)."""
    is_dir = check_model_argument(model)
    if llm is not None:
        tok = llm.tokenizer
    elif is_dir:
        from kvtier.engine.weights import load_tokenizer

        tok = load_tokenizer(model)
    else:
        from kvtier.engine.byte_tokenizer import ByteTokenizer
        from kvtier.engine.families import preset

        tok = ByteTokenizer(preset(model).vocab_size)
    return chat_template_for(model, is_dir, tok, None)


@dataclass(frozen=True)
class EngineSpec:
    """What ``kvtier serve`` builds the engine from (its flags, parsed)."""

    model: str
    """A preset name or a checkpoint directory."""
    cache: dict[str, Any] = field(default_factory=dict)
    """``CacheConfig`` fields the cache flags gave (sizes aside)."""
    sizes: SizeRequest = field(default_factory=SizeRequest)
    """The sizing flags."""
    dtype: str | None = None
    """``--dtype`` (``None``/``auto``: the checkpoint's)."""
    tokenizer: str | None = None
    """``--tokenizer``."""
    chat_template: str | None = None
    """``--chat-template``."""
    max_running: int = 16
    """``--max-running``."""
    max_prefill_tokens: int = 4096
    """``--max-prefill-tokens``."""
    max_model_len: int | None = None
    """``--max-model-len``: the context one request may use (``None``: the model's, within
    the device pool)."""


@dataclass(frozen=True)
class Engine:
    """A built engine and what start-up found out about it."""

    llm: Any
    """The ``LLM``."""
    chat_template: Any
    """Its ``ChatTemplate`` or ``None``."""
    plan: PoolPlan
    """How its pools were sized."""
    context_tokens: int
    """The context length served."""
    summary: list[str]
    """The start-up summary's lines (``startup_summary``)."""


def _weights_bytes(module: Any) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def build_engine(spec: EngineSpec) -> Engine:
    """The model, its tokenizer and chat template, and a cache sized by ``spec.sizes``
    (``kvtier.server.sizing.plan_pools``): on CUDA the weights go to the device first and
    the device pool takes its share of what is then free. Raises ``ConfigError``."""
    import torch

    from kvtier.config import resolve_device
    from kvtier.engine import LLM
    from kvtier.pools.spec import tree_page_size

    is_dir = check_model_argument(spec.model)
    base = CacheConfig(**spec.cache)  # a bad cache flag fails before the weights load
    module = _build_model(spec.model, is_dir, spec.dtype)
    cfg = module.config
    tok = load_tokenizer_for(spec.model, is_dir, cfg.vocab_size, spec.tokenizer)
    template = chat_template_for(spec.model, is_dir, tok, spec.chat_template)
    device = resolve_device(base.device)
    free = None
    if device.type == "cuda":
        module = module.to(device)
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
    specs = module.pool_specs()
    page_tokens = tree_page_size(base.page_size, specs)
    page_bytes = sum(s.page_bytes(page_tokens) for s in specs)
    workspace = workspace_bytes(cfg, spec.max_prefill_tokens, spec.max_running)
    plan = plan_pools(
        spec.sizes,
        page_bytes=page_bytes,
        page_tokens=page_tokens,
        cuda=device.type == "cuda",
        free_bytes=free,
        workspace=workspace if device.type == "cuda" else 0,
        host_tier=base.enable_host,
        host_available=available_host_bytes(),
    )
    cache = replace(
        base,
        device_pages=plan.device_pages,
        host_pages=plan.host_pages,
        host_bytes=plan.host_bytes,
        **({"host_ratio": plan.host_ratio} if plan.host_ratio is not None else {}),
    )
    llm = LLM(
        module,
        cache,
        max_running=spec.max_running,
        max_prefill_tokens=spec.max_prefill_tokens,
        tokenizer=tok,
    )
    try:
        context = context_length(llm, spec.max_model_len)
        summary = startup_summary(spec, llm, plan, _weights_bytes(module), context, template)
    except BaseException:
        llm.close()
        raise
    return Engine(llm, template, plan, context, summary)


def context_length(llm: Any, max_model_len: int | None) -> int:
    """The context one request may use: the model's, within the device pool, or
    ``max_model_len`` (``ConfigError`` when that exceeds either)."""
    model_len = llm.model_config.max_position
    pool = llm.cache.kv_buffers
    pool_tokens = pool.num_pages * pool.page_size
    if max_model_len is None:
        if pool_tokens < model_len:
            log.warning(
                "the device pool holds %d tokens, less than the model's context of %d: longer "
                "requests are refused",
                pool_tokens,
                model_len,
            )
        return min(model_len, pool_tokens)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ConfigError(f"--max-model-len must be a positive integer, got {max_model_len!r}")
    if max_model_len > model_len:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's context length {model_len}"
        )
    if max_model_len > pool_tokens:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the {pool_tokens} tokens the device pool "
            "holds: give a larger pool (--device-pages, --mem-fraction) or a shorter length"
        )
    return max_model_len


def _tier_line(name: str, pages: int, page_tokens: int, nbytes: int, why: str) -> str:
    return (
        f"{name} tier: {pages} pages, {pages * page_tokens} tokens, {format_bytes(nbytes)} "
        f"({nbytes} bytes); {why}"
    )


def startup_summary(
    spec: EngineSpec,
    llm: Any,
    plan: PoolPlan,
    weights: int,
    context: int,
    template: Any,
) -> list[str]:
    """The start-up summary's lines: model, dtype, device and weights; the context length;
    each tier's capacity in pages, tokens and bytes (as ``stats()`` reports the pools) and
    how it was sized; the storage backend and its health; tokenizer and chat template."""
    cfg = llm.model_config
    st = llm.stats()
    cache = llm.cache
    page_tokens = cache.page_size
    kind = "checkpoint" if os.path.isdir(spec.model) else "preset, random weights"
    lines = [
        f"model {spec.model} ({kind}), dtype {cfg.dtype}, device {cache.device}, weights "
        f"{format_bytes(weights)}",
        f"context length {context} tokens (model {cfg.max_position}); {page_tokens} tokens "
        f"per page",
        _tier_line(
            "device", st["device_pages_total"], page_tokens, st["device_bytes_total"],
            plan.device_reason,
        ),
    ]  # fmt: skip
    if cache.host_pool is not None:
        lines.append(
            _tier_line(
                "host", st["host_pages_total"], page_tokens, st["host_bytes_total"],
                plan.host_reason,
            )
        )  # fmt: skip
    else:
        lines.append("host tier: none (--no-host-tier)")
    backend = cache.storage
    if backend is None:
        lines.append("storage tier: none (--storage file keeps KV across restarts)")
    else:
        figures = backend.stats()
        health = "healthy" if figures.get("healthy", 1) else "UNHEALTHY (answers are misses)"
        errors = sum(backend.errors.values())
        if "budget_bytes" in figures:
            budget = int(figures["budget_bytes"])
            page_bytes = st["device_bytes_total"] // max(1, st["device_pages_total"])
            tokens = budget // page_bytes * page_tokens if page_bytes else 0
            where = f" at {cache.config.storage_dir}" if cache.config.storage == "file" else ""
            size = (
                f"budget {format_bytes(budget)} ({budget} bytes), about {tokens} tokens; "
                f"{int(figures.get('objects', 0))} objects, "
                f"{format_bytes(figures.get('bytes_used', 0))} used"
            )
        else:
            where, size = "", "capacity set by the store"
        lines.append(
            f"storage tier: {backend.name}{where}: {size}; {health}, {errors} errors so far"
        )
    from kvtier.engine.byte_tokenizer import ByteTokenizer

    tok = llm.tokenizer
    if tok is None:
        tok_name = "none (text and chat refused: token ids only)"
    elif isinstance(tok, ByteTokenizer):
        tok_name = "the built-in byte tokenizer"
    else:
        tok_name = spec.tokenizer or "the checkpoint's tokenizer.json"
    chat = "none (chat refused)" if template is None else template.origin
    lines.append(f"tokenizer: {tok_name}; chat template: {chat}")
    return lines


def configure_logging(level: str) -> None:
    """kvtier's own loggers at ``level``. They print through the root logger's handlers when
    it has some (``kvtier``'s command line sets one up), else through one of their own on
    stderr."""
    logger = logging.getLogger("kvtier")
    logger.setLevel(level.upper())
    if logging.getLogger().handlers or any(isinstance(h, _StderrHandler) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (not the stream it was when
    the handler was made, which a caller may have replaced and closed since)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


class Server:
    """An OpenAI-style server over ``llm``, which it owns from ``start`` on (the engine thread
    is the only one that touches it; ``stop`` closes it)."""

    def __init__(
        self,
        llm: Any,
        *,
        served_model_name: str,
        chat_template: Any = None,
        api_key: str | None = None,
        max_queue: int = 256,
        host: str = "127.0.0.1",
        port: int = 0,
        degraded_window_s: float = 30.0,
        log_level: str = "warning",
        context_tokens: int | None = None,
        seed: int | None = None,
        access_log: bool = False,
    ) -> None:
        """``context_tokens``: the context one request may use (``None``: the model's,
        within the device pool; ``build_engine`` works it out with ``--max-model-len``).
        ``seed``: sampled requests that give no seed get one drawn from a generator of this
        seed, so a restarted server answers the same requests the same way. ``log_level`` and
        ``access_log``: uvicorn's (kvtier's own loggers: ``configure_logging``)."""
        from kvtier.server.app import ServerState, create_app
        from kvtier.server.engine_loop import EngineLoop
        from kvtier.server.prometheus import ServerMetrics
        from kvtier.server.protocol import ModelInfo

        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"max_queue must be a positive integer, got {max_queue!r}")
        if api_key is not None and not api_key:
            raise ConfigError("api_key must be a non-empty string or None")
        metrics = ServerMetrics()
        self.loop = EngineLoop(
            llm, max_queue=max_queue, metrics=metrics, degraded_window_s=degraded_window_s
        )
        pool = llm.cache.kv_buffers
        pool_tokens = pool.num_pages * pool.page_size
        if context_tokens is None:
            context_tokens = min(llm.model_config.max_position, pool_tokens)
        info = ModelInfo(
            served_model_name,
            context_tokens,
            llm.model_config.vocab_size,
            page_size=llm.cache.tree_page_tokens,
            device_tokens=pool_tokens,
        )
        seeds = random.Random(seed) if seed is not None else None
        self.state = ServerState(
            self.loop, info, metrics, llm.tokenizer, chat_template, api_key, seeds
        )
        self.app = create_app(self.state)
        self.host, self.port = host, port
        self._log_level = log_level
        self._access_log = access_log
        self._sock: socket.socket | None = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {e}") from None
        sock.listen(128)
        self.port = sock.getsockname()[1]
        return sock

    def _make_uvicorn(self) -> Any:
        import uvicorn

        class _Uvicorn(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                """SIGINT/SIGTERM start the graceful shutdown. Unlike uvicorn's own handler
                this one does not raise the signal again once serving stopped: the engine
                still has to close (pending storage writes land), then the process exits 0."""
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                sigs = (signal.SIGINT, signal.SIGTERM)
                original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

        config = uvicorn.Config(
            self.app,
            log_level=self._log_level,
            access_log=self._access_log,
            lifespan="off",
            timeout_graceful_shutdown=10,
        )
        return _Uvicorn(config)

    def start(self) -> Server:
        """Listen and serve on background threads; returns at once (see the module doc)."""
        self._sock = self._bind()
        self.loop.start()
        self._uvicorn = self._make_uvicorn()
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, name="kvtier-http"
        )
        self._thread.start()
        return self

    def run(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM, then stop (``kvtier serve``)."""
        self._sock = self._bind()
        self.loop.start()
        self._uvicorn = self._make_uvicorn()
        frozen = freeze_startup_objects()
        log.debug("%d start-up objects kept out of garbage collection", frozen)
        log.info("listening on %s", self.url)
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self._close()

    def stop(self) -> None:
        """Stop accepting, let open responses finish, stop the engine thread (unfinished
        requests end, pending storage writes land) and close the engine."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self._close()

    def _close(self) -> None:
        self.loop.stop()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
