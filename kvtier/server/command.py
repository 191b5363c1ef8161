"""``kvtier serve``: its command-line options and the run (imports the server, the engine and
torch only when it runs, so ``kvtier --help`` stays fast and works without the server extra).

``docs/serving.md`` is the user's guide to these flags."""

from __future__ import annotations

import argparse
import os
import sys

from kvtier.server.options import add_cache_flags

LOG_LEVELS = ("debug", "info", "warning", "error")


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; exit code 2 for a bad option, model or a missing
    server extra (one line on stderr)."""
    from kvtier.errors import KvtierError

    try:
        model = _model(args)
        from kvtier.server.lifecycle import EngineSpec, Server, build_engine, configure_logging
        from kvtier.server.options import cache_kwargs_from_args, size_request_from_args

        configure_logging(args.log_level)
        spec = EngineSpec(
            model=model,
            cache=cache_kwargs_from_args(args),
            sizes=size_request_from_args(args),
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            max_running=args.max_running,
            max_prefill_tokens=args.max_prefill_tokens,
            max_model_len=args.max_model_len,
        )
        engine = build_engine(spec)
        try:
            server = Server(
                engine.llm,
                served_model_name=args.served_model_name or model.rstrip("/\\"),
                chat_template=engine.chat_template,
                api_key=args.api_key,
                max_queue=args.max_queue,
                host=args.host,
                port=args.port,
                degraded_window_s=args.degraded_window_s,
                log_level=args.log_level,
                context_tokens=engine.context_tokens,
                seed=args.seed,
                access_log=args.access_log,
            )
        except BaseException:
            engine.llm.close()
            raise
        import logging

        log = logging.getLogger("kvtier.server")
        for line in engine.summary:
            log.info("%s", line)
    except KvtierError as e:
        # a bad option or model is the user's to fix: one line, no traceback
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(
            f"kvtier serve: {e}; install the server extra: pip install 'kvtier[server]'",
            file=sys.stderr,
        )
        return 2
    try:
        server.run()
    except KvtierError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    return 0


def _model(args: argparse.Namespace) -> str:
    from kvtier.errors import ConfigError

    given = [m for m in (args.model, args.model_flag) if m is not None]
    if not given:
        raise ConfigError(
            "MODEL is required: a preset (tiny, small, ...) or a checkpoint directory"
        )
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError(f"two models given: {given[0]!r} and --model {given[1]!r}")
    return given[0]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand: the model, the server's options, the pool sizes and the
    cache's options."""
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs the server extra)",
        description="OpenAI-compatible HTTP server over the reference engine and the tiered "
        "KV cache: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /version, /health, /metrics. Sizes its pools from free memory unless "
        "told otherwise and logs what it chose.",
    )
    s.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a model preset (tiny, small, tiny-mtp, mla, dsa, dsa-compressed, hybrid, swa: "
        "random weights, a built-in byte tokenizer and chat template) or a local checkpoint "
        "directory (config.json, *.safetensors, tokenizer.json)",
    )
    s.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
    m = s.add_argument_group("model")
    m.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="weights and KV element type (default: auto, the checkpoint's; presets: float32)",
    )
    m.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json or a directory holding it, or 'byte' for the built-in byte "
        "tokenizer (default: the checkpoint's; presets: byte)",
    )
    m.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template file, or the template text itself (default: the "
        "checkpoint's; presets: a built-in one)",
    )
    m.add_argument(
        "--max-model-len",
        type=_int,
        metavar="N",
        help="tokens one request may hold, prompt and output (default: the model's context "
        "length, within the device pool)",
    )
    m.add_argument(
        "--served-model-name", metavar="NAME", help="the model name requests use (default: MODEL)"
    )
    m.add_argument(
        "--seed",
        type=_int,
        metavar="N",
        help="sampled requests without a seed get one drawn from this seed, so a restarted "
        "server answers the same requests alike (default: random)",
    )
    h = s.add_argument_group("server")
    h.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address to listen on (default: 127.0.0.1; the --host-* flags size the host "
        "memory tier)",
    )
    h.add_argument(
        "--port", type=_int, default=8000, metavar="N", help="port (default: 8000; 0: any free)"
    )
    h.add_argument(
        "--api-key",
        default=os.environ.get("KVTIER_API_KEY"),
        metavar="KEY",
        help="bearer token requests must send (default: $KVTIER_API_KEY, else none); "
        "/health, /metrics and /version stay open",
    )
    h.add_argument(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=_int,
        default=16,
        metavar="N",
        help="requests decoded together (default: 16)",
    )
    h.add_argument(
        "--max-prefill-tokens",
        type=_int,
        default=4096,
        metavar="N",
        help="prompt tokens one step computes (default: 4096)",
    )
    h.add_argument(
        "--max-queue",
        type=_int,
        default=256,
        metavar="N",
        help="requests waiting for the engine before new ones get 429 (default: 256)",
    )
    h.add_argument(
        "--degraded-window-s",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="/health says degraded for this long after a storage fault (default: 30)",
    )
    h.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="of kvtier's and the HTTP server's logs (default: info)",
    )
    h.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log every HTTP request",
    )
    add_cache_flags(s)
    s.set_defaults(func=serve)
