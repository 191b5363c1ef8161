"""Command line: ``kvtier demo | serve | bench {tree,transfer,storage,ttft,step,backup,window,compute,
serve} | plot``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvtier.config import BACKUP_TIMINGS
from kvtier.server.command import add_serve_command


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


def _bench(args: argparse.Namespace) -> int:
    if args.which == "tree":
        from kvtier.bench.tree import bench_tree
        from kvtier.bench.tree_peer import bench_tree_sides

        sides = bench_tree_sides(peer_python=args.peer_python, rounds=args.rounds)
        result = {"bench": "tree", "scenarios": sides, "flat_table": bench_tree()}
    elif args.which == "transfer":
        from kvtier.bench.pool_sets import FAMILIES
        from kvtier.bench.transfer import bench_transfer

        def run(family: str | None) -> dict:
            return bench_transfer(
                device=args.device,
                page_size=args.page_size,
                host_layout=args.host_layout,
                family=family,
                num_pages=args.num_pages,
                staging_mib=args.staging_mib,
                target_mib=args.target_mib,
                host_pages=args.host_pages,
                repeats=args.repeats,
            )

        if args.family == "all":
            result = {"bench": "transfer", "families": {f: run(f) for f in FAMILIES}}
        else:
            result = run(args.family)
    elif args.which == "step":
        from kvtier.bench.step import bench_step

        result = bench_step()
    elif args.which == "backup":
        from kvtier.bench.backup_timing import run as bench_backup

        result = bench_backup(
            model=args.model or "small",
            batch=args.batch or 8,
            prompt_tokens=args.prompt_tokens if args.prompt_tokens != 32768 else 2048,
            page_size=args.page_size,
        )
    elif args.which == "serve":
        from kvtier.bench.serve import ServeBenchConfig, bench_serve
        from kvtier.errors import ConfigError

        try:
            cfg = ServeBenchConfig(
                clients=args.clients,
                conversations=args.conversations,
                turns=args.turns,
                duration_s=args.duration_s,
                model=args.model or "tiny",
                url=args.url,
                api_key=args.api_key,
                page_size=args.page_size,
                device=args.device,
            )
            result = bench_serve(cfg)
        except ConfigError as e:
            print(f"kvtier bench serve: {e}", file=sys.stderr)
            return 2
    elif args.which == "window":
        from kvtier.bench.window_memory import run as bench_window

        result = bench_window(
            context=args.prompt_tokens if args.prompt_tokens != 32768 else 8192,
            window=args.window,
            page_size=args.page_size,
            device=args.device,
        )
    elif args.which == "compute":
        from kvtier.bench.compute import bench_compute

        result = bench_compute(
            prompt_tokens=args.prompt_tokens,
            batch=args.batch or 32,
            decode_context=args.context,
            page_size=args.page_size,
            device=args.device,
        )
    elif args.which == "ttft":
        from kvtier.bench.ttft import bench_ttft

        result = bench_ttft(
            prompt_tokens=args.prompt_tokens,
            device=args.device,
            host_layout=args.host_layout,
        )
    else:
        from kvtier.bench.storage import bench_storage

        result = bench_storage(
            directory=args.dir, backend=args.backend, url=args.url, peer_python=args.peer_python
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    # a server answering 5xx under load failed the benchmark, whatever its figures
    return 1 if args.which == "serve" and result["errors_5xx"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo", help="multi-turn shared-prefix chat through every tier, with an oracle"
    )
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument("--model", default="tiny", help="model preset or HF checkpoint directory")
    d.add_argument("--storage-dir", default="kvtier-data/demo", help="L3 directory (wiped first)")
    d.add_argument("--conversations", type=_positive, default=8)
    d.add_argument("--turns", type=_positive, default=4)
    d.add_argument("--max-tokens", type=_positive, default=12)
    d.add_argument("--device-pages", type=_positive, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--cp", type=_positive, default=1, help="context-parallel ranks (local gloo processes)"
    )
    d.add_argument(
        "--speculative-tokens",
        type=_non_negative,
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

    add_serve_command(sub)

    b = sub.add_parser("bench", help="benchmarks; print JSON with ratios to a peer run")
    b.add_argument(
        "which",
        choices=(
            "tree",
            "transfer",
            "storage",
            "ttft",
            "step",
            "backup",
            "window",
            "compute",
            "serve",
        ),
    )
    b.add_argument(
        "--window", type=_positive, default=512, help="window: sliding window (positions)"
    )
    b.add_argument(
        "--model",
        default=None,
        help="backup: model preset (default small); serve: preset or checkpoint (default tiny)",
    )
    b.add_argument("--clients", type=_positive, default=4, help="serve: concurrent clients")
    b.add_argument(
        "--conversations",
        type=_positive,
        default=3,
        help="serve: conversations each client takes turns in",
    )
    b.add_argument("--turns", type=_positive, default=6, help="serve: turns per conversation")
    b.add_argument(
        "--duration-s",
        type=_positive_float,
        default=60.0,
        help="serve: no request starts after this many seconds",
    )
    b.add_argument(
        "--batch",
        type=_positive,
        default=None,
        help="backup, compute: requests decoded together (default 8, compute 32)",
    )
    b.add_argument(
        "--context",
        type=_positive,
        default=2048,
        help="compute: context of the decoding requests (tokens)",
    )
    b.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    b.add_argument(
        "--device", default=None, help="transfer, compute: torch device (default: cuda if any)"
    )
    b.add_argument(
        "--page-size",
        type=_positive,
        default=16,
        help="transfer, compute, serve: tokens per page",
    )
    b.add_argument(
        "--peer-python",
        metavar="PATH",
        default=None,
        help="tree, storage: an interpreter where sglang imports; adds SGLang's RadixCache "
        "(tree) or HiCacheFile (storage, file) as the peer, run in its own process",
    )
    b.add_argument("--rounds", type=_positive, default=3, help="tree: A/B rounds per scenario")
    b.add_argument(
        "--repeats",
        type=_positive,
        default=5,
        help="transfer: timed repeats of every copy (best and median reported)",
    )
    b.add_argument(
        "--host-layout",
        choices=("page_first", "layer_first"),
        default="page_first",
        help="transfer, ttft: host pool layout",
    )
    b.add_argument(
        "--family",
        default=None,
        help="transfer: a model family's pool set (dense, mla, dsa, dsa-compressed, hybrid, swa) "
        "or 'all'; default one GQA pool",
    )
    b.add_argument(
        "--num-pages", type=_positive, default=512, help="transfer: pages moved per copy"
    )
    b.add_argument(
        "--staging-mib",
        type=_positive,
        default=None,
        help="transfer: device staging memory per staged copy, MiB (default 256)",
    )
    b.add_argument(
        "--target-mib",
        type=_positive,
        default=None,
        help="transfer: move about this many MiB per copy (overrides --num-pages)",
    )
    b.add_argument(
        "--host-pages",
        choices=("churned", "random"),
        default="churned",
        help="transfer: host pages as a host tier hands them out after churn, or random ones",
    )
    b.add_argument("--dir", default=None, help="storage: directory to benchmark in")
    b.add_argument(
        "--prompt-tokens",
        type=_positive,
        default=32768,
        help="ttft, compute: prompt length (tokens)",
    )
    b.add_argument(
        "--backend", choices=("file", "mooncake"), default="file", help="storage: which L3 backend"
    )
    b.add_argument(
        "--url",
        default=None,
        help="storage, mooncake: storage_url of a cluster (default: start a local one); "
        "serve: a running kvtier serve, http://HOST:PORT (default: start one in-process)",
    )
    b.add_argument("--api-key", default=None, help="serve: bearer key the server at --url expects")
    b.set_defaults(func=_bench)

    pl = sub.add_parser(
        "plot", help="SVG chart of bench transfer, storage or compute results, or one ttft or tree"
    )
    pl.add_argument("out", help="SVG file to write")
    pl.add_argument("results", nargs="+", help="bench JSON files")
    pl.set_defaults(func=_plot)
    return p


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
