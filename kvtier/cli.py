"""Command line: ``kvtier demo | serve | route | bench NAME | plot`` (also ``python -m kvtier``).

``--help`` and ``--version`` answer without importing torch: this module imports only
``argparse`` and the benchmarks' torch-free flag definitions (``kvtier.bench.commands``); a
command imports what it runs when it runs. The ``serve`` flags are built only when the command
is ``serve`` (they come from the server's option module, which describes every cache option).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvtier.bench.commands import add_bench_command, non_negative_int, positive_int
from kvtier.route.route_command import add_route_command

BACKUP_TIMINGS = ("at_insert", "per_layer")
"""``CacheConfig.backup_timing``'s choices, written out so that the demo's flags need no torch
(``kvtier.config`` imports it); a test pins them equal."""


def _demo(args: argparse.Namespace) -> int:
    from kvtier.errors import KvtierError

    try:
        return _run_demo(args)
    except KvtierError as e:
        # a bad --model or checkpoint is the user's to fix: one line, no traceback
        print(f"kvtier demo: {e}", file=sys.stderr)
        return 2


def _run_demo(args: argparse.Namespace) -> int:
    from kvtier.demo import run as demo
    from kvtier.demo.table import format_table

    if args.restart_phase:
        demo.restart_main(args.restart_phase)
        return 0
    cfg = demo.DemoConfig(
        model=args.model,
        storage_dir=args.storage_dir,
        conversations=args.conversations,
        turns=args.turns,
        max_tokens=args.max_tokens,
        device_pages=args.device_pages,
        seed=args.seed,
        cp=args.cp,
        speculative_tokens=args.speculative_tokens,
        backup_timing=args.backup_timing,
    )
    summary = demo.run_demo(cfg)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary))
    return 0 if summary["oracle"]["mismatches"] == 0 else 1


def _plot(args: argparse.Namespace) -> int:
    from kvtier.bench.plot import plot

    try:
        plot(args.out, args.results)
    except (OSError, ValueError, KeyError) as e:
        print(f"kvtier plot: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


def version() -> str:
    """The installed package's version (``kvtier.__version__``)."""
    import kvtier

    return kvtier.__version__


def build_parser(serve: bool = True) -> argparse.ArgumentParser:
    """The ``kvtier`` parser. ``serve=False`` leaves the ``serve`` command's flags out (its
    entry in the command list stays): what every other command's parse needs, without the
    modules the serve flags come from."""
    p = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV cache for LLM inference: device, host and storage tiers under "
        "one radix tree, with a reference engine, an OpenAI-compatible server and benchmarks.",
    )
    p.add_argument("--version", action="version", version=f"kvtier {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="multi-turn shared-prefix chat through every tier, with an oracle",
        description="A multi-turn chat workload sharing a system prompt, with a device pool "
        "far smaller than its working set, so that pages move through every tier; every "
        "output is checked against a cold run (tokens and logits). Then a fresh process "
        "serves the last turns from the storage tier alone and is checked the same way.",
    )
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--model", default="tiny", help="model preset or HF checkpoint directory")
    d.add_argument(
        "--storage-dir",
        default="kvtier-data/demo",
        help="L3 directory (wiped first; only one the demo created)",
    )
    d.add_argument(
        "--conversations", type=positive_int, default=8, help="conversations run side by side"
    )
    d.add_argument("--turns", type=positive_int, default=4, help="turns per conversation")
    d.add_argument(
        "--max-tokens", type=positive_int, default=12, help="tokens generated per turn (greedy)"
    )
    d.add_argument(
        "--device-pages",
        type=positive_int,
        default=64,
        help="device pool pages of 16 tokens (far below the working set on purpose)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts' random tokens")
    d.add_argument(
        "--cp", type=positive_int, default=1, help="context-parallel ranks (local gloo processes)"
    )
    d.add_argument(
        "--speculative-tokens",
        type=non_negative_int,
        default=0,
        help="draft tokens a greedy decode step proposes with the model's draft head "
        "(0: off; needs a model with one, e.g. tiny-mtp)",
    )
    d.add_argument(
        "--backup-timing",
        choices=BACKUP_TIMINGS,
        default="at_insert",
        help="when device pages are copied to host: at insert, or per layer during the forward",
    )
    d.add_argument("--restart-phase", metavar="WORK_FILE", help=argparse.SUPPRESS)
    d.set_defaults(func=_demo)

    if serve:
        from kvtier.server.command import add_serve_command

        add_serve_command(sub)
    else:
        sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the server extra)")

    add_route_command(sub)

    add_bench_command(sub)

    pl = sub.add_parser(
        "plot",
        help="SVG chart of bench results",
        description="An SVG chart of bench transfer, storage or compute results (several "
        "files side by side), or of one ttft or tree result.",
    )
    pl.add_argument("out", help="SVG file to write")
    pl.add_argument("results", nargs="+", help="bench JSON files")
    pl.set_defaults(func=_plot)
    return p


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is no option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser(serve=_command(argv) == "serve").parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
