"""``kvtier serve``: its command-line options and the run (imports the server itself only when
it runs, so ``kvtier --help`` works without the server extra)."""

from __future__ import annotations

import argparse
import os
import sys


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; exit code 2 for a bad option, model or a missing
    server extra (one line on stderr)."""
    from kvtier.errors import KvtierError

    try:
        from kvtier.server.lifecycle import Server, build_llm, load_chat_template
        from kvtier.server.options import cache_config_from_args

        cache_config = cache_config_from_args(args)
        template = load_chat_template(args.model)
        llm = build_llm(
            args.model,
            cache_config,
            max_running=args.max_running,
            max_prefill_tokens=args.max_prefill_tokens,
        )
        server = Server(
            llm,
            served_model_name=args.served_model_name or args.model.rstrip("/\\"),
            chat_template=template,
            api_key=args.api_key,
            max_queue=args.max_queue,
            host=args.host,
            port=args.port,
            degraded_window_s=args.degraded_window_s,
            log_level=args.log_level,
        )
    except KvtierError as e:
        # a bad option or model is the user's to fix: one line, no traceback
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"kvtier serve: {e}; install the server extra: pip install 'kvtier[server]'")
        return 2
    try:
        server.run()
    except KvtierError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    return 0


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand: the model, the server's options and every ``CacheConfig``
    field as a flag."""
    from kvtier.server.options import add_cache_config_args

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs the server extra)",
        description="OpenAI-compatible HTTP server over the reference engine and the tiered "
        "cache: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    s.add_argument("model", help="model preset (tiny, small, ...) or HF checkpoint directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    s.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY"),
        help="bearer token /v1/* requests must send (default $KVTIER_API_KEY; none: open). "
        "/health and /metrics stay open",
    )
    s.add_argument("--served-model-name", default=None, help="the model name (default MODEL)")
    s.add_argument("--max-running", type=int, default=16, help="requests decoded together")
    s.add_argument(
        "--max-prefill-tokens", type=int, default=4096, help="prompt tokens one step prefills"
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for the engine before new ones get 429",
    )
    s.add_argument(
        "--degraded-window-s",
        type=float,
        default=30.0,
        help="/health says degraded for this long after a storage fault",
    )
    s.add_argument("--log-level", default="warning", help="uvicorn's log level")
    add_cache_config_args(s)
    s.set_defaults(func=serve)
