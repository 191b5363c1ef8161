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
import gc
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.server")


def build_llm(
    model: str, cache_config: CacheConfig, *, max_running: int = 16, max_prefill_tokens: int = 4096
) -> Any:
    """An ``LLM`` for ``model``: a checkpoint directory (its tokenizer loaded when it has
    ``tokenizer.json``) or a preset name; anything else raises ``ConfigError`` naming it."""
    from kvtier.engine import LLM
    from kvtier.engine.families import build_model, preset, preset_names

    limits = {"max_running": max_running, "max_prefill_tokens": max_prefill_tokens}
    if os.path.isdir(model):
        return LLM(model, cache_config, **limits)
    if os.path.exists(model) or "/" in model or os.sep in model:
        hint = " (it is a file: pass the directory holding config.json)"
        raise ConfigError(
            f"MODEL {model}: no such checkpoint directory" + (hint if os.path.exists(model) else "")
        )
    if model not in preset_names():
        raise ConfigError(
            f"MODEL {model!r} is neither a checkpoint directory nor a model preset; "
            f"known presets: {', '.join(preset_names())}"
        )
    return LLM(build_model(preset(model)), cache_config, **limits)


def load_chat_template(model: str) -> Any:
    """The chat template of a checkpoint directory (``None`` for presets or without one)."""
    from kvtier.server.chat import ChatTemplate

    return ChatTemplate.load(model) if Path(model).is_dir() else None


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
    ) -> None:
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
        info = ModelInfo(
            served_model_name,
            min(llm.model_config.max_position, pool.num_pages * pool.page_size),
        )
        self.state = ServerState(self.loop, info, metrics, llm.tokenizer, chat_template, api_key)
        self.app = create_app(self.state)
        self.host, self.port = host, port
        self._log_level = log_level
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
        log.warning(
            "kvtier serve: listening on %s (%d start-up objects kept out of garbage collection)",
            self.url,
            frozen,
        )
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


def freeze_startup_objects() -> int:
    """Collect, then move every object alive now (modules, weights, pools) out of the cyclic
    garbage collector's reach for the rest of the process; returns how many. Its full
    collections otherwise walk them all: in ``kvtier bench step`` one took 150-160 ms against
    19-22 ms with them frozen, a pause that lands inside some decode step. Objects made later
    are collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
