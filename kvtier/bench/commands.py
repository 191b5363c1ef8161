"""``kvtier bench <name>``: one sub-command per benchmark, each with its own described flags.

Every run prints its JSON result on stdout (``--json PATH`` also writes it) and exits 0; a
benchmark whose own check failed exits 1 (``serve``: any request that failed), a bad option 2
with one line on stderr. Nothing here imports torch or a benchmark at module level: a benchmark
is imported when it runs, so ``kvtier bench --help`` answers at once.

The flag value types (``positive_int``, ...) are the command line's: ``kvtier.cli`` uses them for
its own commands too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kvtier.bench import load_or_recompute, multiturn

DEVICE_HELP = "torch device (default: cuda when there is one, else cpu)"


def positive_int(text: str) -> int:
    """A flag value that must be an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def non_negative_int(text: str) -> int:
    """A flag value that must be an integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    """A flag value that must be a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """A flag value that must be a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return v


Run = Callable[[argparse.Namespace], dict[str, Any]]


def _tree(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.tree import bench_tree
    from kvtier.bench.tree_peer import bench_tree_sides

    sides = bench_tree_sides(peer_python=a.peer_python, rounds=a.rounds)
    return {"bench": "tree", "scenarios": sides, "flat_table": bench_tree()}


def _transfer(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.pool_sets import FAMILIES
    from kvtier.bench.transfer import bench_transfer

    def run(family: str | None) -> dict[str, Any]:
        return bench_transfer(
            device=a.device,
            page_size=a.page_size,
            host_layout=a.host_layout,
            family=family,
            num_pages=a.num_pages,
            staging_mib=a.staging_mib,
            target_mib=a.target_mib,
            host_pages=a.host_pages,
            repeats=a.repeats,
            kv_codec=a.kv_codec,
        )

    if a.family == "all":
        return {"bench": "transfer", "families": {f: run(f) for f in FAMILIES}}
    return run(a.family)


def _storage(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.storage import bench_storage

    return bench_storage(
        directory=a.dir,
        backend=a.backend,
        url=a.url,
        peer_python=a.peer_python,
        encryption=a.encryption,
    )


def _ttft(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.ttft import bench_ttft

    return bench_ttft(prompt_tokens=a.prompt_tokens, device=a.device, host_layout=a.host_layout)


def _step(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.step import bench_step

    return bench_step()


def _backup(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.backup_timing import run

    return run(model=a.model, batch=a.batch, prompt_tokens=a.prompt_tokens, page_size=a.page_size)


def _window(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.window_memory import run

    return run(context=a.prompt_tokens, window=a.window, page_size=a.page_size, device=a.device)


def _compute(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.compute import bench_compute

    return bench_compute(
        prompt_tokens=a.prompt_tokens,
        batch=a.batch,
        decode_context=a.context,
        page_size=a.page_size,
        device=a.device,
    )


_SERVE_CHAT_ONLY = ("conversations", "turns", "duration_s")
"""``bench serve`` flags of the chat workload alone."""
_SERVE_LOOP_ONLY = (
    "concurrency",
    "rounds",
    "new_tokens",
    "ready_policy",
    "documents",
    "document_tokens",
    "question_tokens",
)
"""``bench serve`` flags of the multiturn and longdoc workloads alone."""
_SERVE_IN_PROCESS_LOOP = (
    "configs",
    "device_tokens",
    "host_tokens",
    "small_host_tokens",
    "max_prefill_tokens",
    "storage_dir",
)
"""``bench serve`` flags sizing the in-process servers of the multiturn and longdoc workloads."""


def _serve(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.serve import ServeBenchConfig, bench_serve
    from kvtier.errors import ConfigError

    def given(*names: str) -> dict[str, Any]:
        return {n: getattr(a, n) for n in names if getattr(a, n) is not None}

    def flags(names: dict[str, Any]) -> str:
        return ", ".join("--" + n.replace("_", "-") for n in names)

    chat = a.workload == "chat"
    wrong = given(*(_SERVE_LOOP_ONLY + _SERVE_IN_PROCESS_LOOP if chat else _SERVE_CHAT_ONLY))
    if wrong:
        other = "multiturn and longdoc" if chat else "chat"
        raise ConfigError(f"{flags(wrong)}: for --workload {other}, not {a.workload}")
    wrong = given(*_SERVE_IN_PROCESS_LOOP) if a.url else {}
    if wrong:
        raise ConfigError(f"{flags(wrong)}: for the in-process servers, not with --url")
    common = {"workload": a.workload, "model": a.model, "url": a.url, "api_key": a.api_key}
    common["device"] = a.device
    common["prompt_format"] = a.prompt_format
    if chat:
        out = given("output_tokens")
        cfg = ServeBenchConfig(
            **common,
            **given("clients", "conversations", "turns", "duration_s", "system_tokens", "seed"),
            **({"max_tokens": out["output_tokens"]} if out else {}),
            page_size=a.page_size,
        )
    else:
        from kvtier.bench.multiturn import MultiTurnConfig

        loop = given(
            "clients", "system_tokens", "output_tokens", "seed", *_SERVE_LOOP_ONLY,
            *_SERVE_IN_PROCESS_LOOP,
        )  # fmt: skip
        if "configs" in loop:
            loop["configs"] = tuple(c.strip() for c in loop["configs"].split(",") if c.strip())
        cfg = ServeBenchConfig(
            **common,
            closed_loop=MultiTurnConfig(workload=a.workload, page_size=a.page_size, **loop),
        )
    return bench_serve(cfg)


def serve_failure(result: dict[str, Any]) -> str | None:
    """Why a ``bench serve`` result is a failed run (a request failed, or none ran), or
    ``None``."""
    n, ok = result["requests"], result["requests_ok"]
    if not n:
        return "no request was sent"
    why = []
    if ok != n:
        by = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors_by_status"].items()))
        first = result.get("first_error") or {}
        what = (
            f"; first: {first.get('status')} {first.get('message', '')}".rstrip() if first else ""
        )
        why.append(f"{n - ok} of {n} requests failed ({by}){what}")
    if "configs" in result:  # multiturn, longdoc: the checks bench multiturn makes
        checks = multiturn.failure(result)
        if checks:
            why.append(checks)
    return "; ".join(why) or None


def _run(a: argparse.Namespace) -> int:
    """Run ``a.bench_run``, print its JSON (and write ``--json``); exit 2 for a bad option,
    1 when a served run failed (``serve_failure``: ``bench serve``, ``bench multiturn --url``),
    else 0."""
    from kvtier.errors import ConfigError

    try:
        result = a.bench_run(a)
    except ConfigError as e:
        # a bad option or an unreachable server is the user's to fix: one line, no traceback
        print(f"kvtier bench {a.bench}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    served = a.bench == "serve" or getattr(a, "url", None) is not None
    failure = serve_failure(result) if served else None
    if failure:
        print(f"kvtier bench {a.bench}: {failure}", file=sys.stderr)
        return 1
    return 0


_MULTITURN_IN_PROCESS = (
    "dtype", "device_tokens", "host_tokens", "host_bytes", "small_host_tokens", "kv_codec",
    "configs", "mooncake_url", "storage_dir", "page_size", "max_prefill_tokens", "device",
    "logit_tolerance", "judge_max", "plot",
)  # fmt: skip
"""``bench multiturn`` flags of its in-process engines, refused with ``--url``."""
_MULTITURN_URL = ("api_key", "prompt_format")
"""``bench multiturn`` flags of ``--url`` alone."""


def _multiturn(a: argparse.Namespace) -> int:
    """``bench multiturn``: in-process engines (``multiturn.run``), or with ``--url`` the same
    closed loop over HTTP (``bench serve``'s), its result and exit status as ``bench serve``
    gives them. A flag of the other mode (one not at its default) is refused, naming it."""

    other = _MULTITURN_IN_PROCESS if a.url is not None else _MULTITURN_URL
    given = [n for n in other if getattr(a, n) != a.multiturn_defaults[n]]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        where = "the in-process engines, not with --url" if a.url is not None else "--url"
        print(f"kvtier bench multiturn: {flags}: for {where}", file=sys.stderr)
        return 2
    if a.url is None:
        return multiturn.run(a)
    a.bench_run = _multiturn_over_http
    return _run(a)


def _multiturn_over_http(a: argparse.Namespace) -> dict[str, Any]:
    from kvtier.bench.serve import ServeBenchConfig, bench_serve

    loop = multiturn.config_from_args(a)
    cfg = ServeBenchConfig(
        workload=loop.workload,
        closed_loop=loop,
        model=a.model,
        url=a.url,
        api_key=a.api_key,
        prompt_format=a.prompt_format,
    )
    return bench_serve(cfg)


def _http_flags(p: argparse.ArgumentParser, key_scope: str, format_scope: str) -> None:
    """``--api-key`` and ``--prompt-format`` of the benchmarks that send requests to a server,
    their help led by the flag's scope."""
    p.add_argument("--api-key", default=None, help=f"{key_scope}bearer key the server expects")
    p.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help=f"{format_scope}prompts as token ids, or as text (printable ASCII, for fronts "
        "that route on text; needs a byte-level tokenizer such as the presets') (default ids)",
    )


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """``kvtier bench <name>``: the benchmarks and their flags."""
    b = sub.add_parser(
        "bench",
        help="benchmarks; each prints JSON with its ratio to a peer or limit",
        description="Benchmarks. Each measures a kvtier path against a peer or a limit run in "
        "the same process and prints the figures and their ratio as JSON. "
        "`kvtier bench NAME --help` lists a benchmark's flags.",
    )
    names = b.add_subparsers(dest="bench", required=True, metavar="NAME")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")

    def bench(name: str, run: Run, help: str, description: str) -> argparse.ArgumentParser:
        p = names.add_parser(name, parents=[common], help=help, description=description)
        p.set_defaults(bench_run=run, func=_run)
        return p

    def device(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default=None, help=DEVICE_HELP)

    def page_size(p: argparse.ArgumentParser, default: int = 16) -> None:
        p.add_argument("--page-size", type=positive_int, default=default, help="tokens per KV page")

    def peer_python(p: argparse.ArgumentParser, peer: str) -> None:
        p.add_argument(
            "--peer-python",
            metavar="PATH",
            default=None,
            help=f"an interpreter where sglang imports: adds SGLang's {peer} as a peer, run in "
            "its own process",
        )

    def host_layout(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--host-layout",
            choices=("page_first", "layer_first"),
            default="page_first",
            help="host pool layout (default page_first)",
        )

    p = bench(
        "tree",
        _tree,
        "radix tree match/insert/lock/evict costs against a flat hash table",
        "Radix tree operation costs (match, insert, lock, evict) on conversations sharing "
        "system prompts, against a flat hash table of page prefixes run in the same process "
        "and, with --peer-python, SGLang's RadixCache in its own.",
    )
    peer_python(p, "RadixCache")
    p.add_argument("--rounds", type=positive_int, default=3, help="A/B rounds per scenario")

    p = bench(
        "transfer",
        _transfer,
        "scattered device <-> host page copies against one contiguous copy",
        "Scattered device <-> host page transfers through the transfer layer against one "
        "contiguous copy of the same bytes, for one pool or a model family's pool set.",
    )
    device(p)
    page_size(p)
    host_layout(p)
    p.add_argument(
        "--family",
        default=None,
        help="a model family's pool set (dense, mla, dsa, dsa-compressed, hybrid, swa) or "
        "'all'; default one GQA pool",
    )
    p.add_argument("--num-pages", type=positive_int, default=512, help="pages moved per copy")
    p.add_argument(
        "--target-mib",
        type=positive_int,
        default=None,
        help="move about this many MiB per copy (overrides --num-pages)",
    )
    p.add_argument(
        "--staging-mib",
        type=positive_int,
        default=None,
        help="device staging memory per staged copy, MiB (default 256)",
    )
    p.add_argument(
        "--host-pages",
        choices=("churned", "random"),
        default="churned",
        help="host pages as a host tier hands them out after churn, or random ones",
    )
    p.add_argument(
        "--kv-codec",
        choices=("none", "fp8_e4m3", "int8"),  # CacheConfig's KV_CODECS (help imports no torch)
        default="none",
        help="also time copies into a host pool holding the KV coded (fp8_e4m3, int8), "
        "against the uncoded copies of the same run",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed repeats of every copy (best and median reported)",
    )

    p = bench(
        "storage",
        _storage,
        "L3 backend throughput against the same storage used plainly",
        "L3 backend throughput against the same storage used plainly: the file backend "
        "against plain file I/O of the same bytes on the same directory (and, with "
        "--peer-python, SGLang's HiCacheFile); Mooncake against its raw client.",
    )
    p.add_argument(
        "--backend", choices=("file", "mooncake"), default="file", help="which L3 backend"
    )
    p.add_argument(
        "--dir", default=None, help="file: directory to benchmark in (default: a temp one)"
    )
    p.add_argument(
        "--url",
        default=None,
        help="mooncake: storage_url of a running cluster (default: start a local one)",
    )
    p.add_argument(
        "--encryption",
        action="store_true",
        help="file: also the backend sealed by storage_encryption (AES-256-GCM, a random key)",
    )
    peer_python(p, "HiCacheFile (file backend)")

    p = bench(
        "ttft",
        _ttft,
        "time to first token of a long prompt, cold and restored from each tier",
        "Time to first token of one long prompt on a Llama-8B-sized dense model: cold prefill, "
        "device hit, host restore (with and without per-layer overlap) and storage restore, "
        "against the link's copy time of the same bytes.",
    )
    p.add_argument(
        "--prompt-tokens", type=positive_int, default=32768, help="prompt length (tokens)"
    )
    device(p)
    host_layout(p)

    bench(
        "step",
        _step,
        "CPU time the cache costs a scheduler per step, 1000 requests in flight",
        "CPU time of every cache call the engine's scheduler makes per step with 1000 requests "
        "in flight (no model), next to the scheduler's whole step time in the same run.",
    )

    p = bench(
        "backup",
        _backup,
        "per-layer device -> host backups against backups at insert",
        "The same decode workload with device -> host backups at insert and per layer during "
        "the forward, interleaved: decode and prefill step times and the time until a "
        "finished request's pages have host copies.",
    )
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--batch", type=positive_int, default=8, help="requests decoded together")
    p.add_argument(
        "--prompt-tokens", type=positive_int, default=2048, help="prompt length (tokens)"
    )
    page_size(p)

    p = bench(
        "window",
        _window,
        "device memory of a sliding-window model with and without a window pool",
        "Device memory of the swa family for one long request with a window pool against "
        "keeping every layer's K/V for every token, next to the ratio the window math "
        "predicts.",
    )
    p.add_argument(
        "--prompt-tokens", type=positive_int, default=8192, help="context length (tokens)"
    )
    p.add_argument("--window", type=positive_int, default=512, help="sliding window (positions)")
    page_size(p)
    device(p)

    p = bench(
        "compute",
        _compute,
        "the engine's prefill and decode rates against the device's matmul and copy rates",
        "Cold prefill and decode steps of the reference engine on a Llama-8B-sized model "
        "against the device's own limits measured in the same run (matmul TFLOP/s, copy "
        "GB/s).",
    )
    p.add_argument(
        "--prompt-tokens", type=positive_int, default=32768, help="prefill length (tokens)"
    )
    p.add_argument("--batch", type=positive_int, default=32, help="requests decoded together")
    p.add_argument(
        "--context", type=positive_int, default=2048, help="context of the decoding requests"
    )
    page_size(p)
    device(p)

    p = bench(
        "serve",
        _serve,
        "concurrent multi-turn streaming clients against kvtier serve",
        "Concurrent multi-turn streaming clients against kvtier serve: TTFT per serving tier, "
        "throughput and the share of prompt tokens each tier served. Without --url a server "
        "runs in this process with small pools and a file L3. --workload multiturn or longdoc "
        "runs bench multiturn's closed-loop workloads over HTTP instead, without --url on one "
        "in-process server per cache configuration (--configs), and exits 1 also when a "
        "configuration's greedy outputs differ from the first's. Exits 1 when any request "
        "failed, naming the first error.",
    )
    mt = multiturn.MultiTurnConfig.__dataclass_fields__

    def loop_opt(flag: str, help: str) -> None:
        default = mt[flag[2:].replace("-", "_")].default
        p.add_argument(flag, type=positive_int, default=None, help=f"{help} (default {default})")

    p.add_argument(
        "--workload",
        choices=("chat", *multiturn.WORKLOADS),
        default="chat",
        help="chat (conversations per client, bounded by --duration-s), or bench multiturn's "
        "multiturn or longdoc in a closed loop of --concurrency requests (default chat)",
    )
    p.add_argument(
        "--url",
        default=None,
        help="a running kvtier serve, http://HOST:PORT (default: start one in this process)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="in-process server: model preset or checkpoint (default tiny); with --url: the "
        "served model name (default: the one the server lists at /v1/models)",
    )
    _http_flags(p, "", "multiturn, longdoc: ")
    p.add_argument(
        "--clients",
        type=positive_int,
        default=None,
        help=f"chat: concurrent clients (default 4); multiturn: clients, one conversation each "
        f"(default {mt['clients'].default})",
    )
    p.add_argument(
        "--conversations",
        type=positive_int,
        default=None,
        help="chat: conversations each client takes turns in (default 3)",
    )
    p.add_argument(
        "--turns", type=positive_int, default=None, help="chat: turns per conversation (default 6)"
    )
    p.add_argument(
        "--duration-s",
        type=positive_float,
        default=None,
        help="chat: no request starts after this many seconds (default 60)",
    )
    p.add_argument(
        "--system-tokens",
        type=positive_int,
        default=None,
        help=f"shared system prompt, tokens (default: chat 32, multiturn "
        f"{mt['system_tokens'].default})",
    )
    p.add_argument(
        "--output-tokens",
        type=positive_int,
        default=None,
        help=f"tokens generated per request (default: chat 8, multiturn and longdoc "
        f"{mt['output_tokens'].default})",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=None, help="seed of the prompts (default 0)"
    )
    loop_opt("--concurrency", "multiturn, longdoc: requests in flight at most")
    loop_opt("--rounds", "multiturn: turns per client; longdoc: questions per document")
    loop_opt("--new-tokens", "multiturn: user tokens per turn")
    p.add_argument(
        "--ready-policy",
        choices=multiturn.READY_POLICIES,
        default=None,
        help="multiturn: which ready turn starts next (default random)",
    )
    loop_opt("--documents", "longdoc: documents")
    loop_opt("--document-tokens", "longdoc: tokens per document")
    loop_opt("--question-tokens", "longdoc: tokens per question")
    p.add_argument(
        "--configs",
        default=None,
        help=f"multiturn, longdoc: comma-separated cache configurations of the in-process "
        f"servers, one server each, of {', '.join(multiturn.CONFIGS[:-1])} (default "
        f"{','.join(multiturn.DEFAULT_CONFIGS)}; the first is the reference)",
    )
    loop_opt("--device-tokens", "multiturn, longdoc: in-process device pool, tokens")
    p.add_argument(
        "--host-tokens",
        type=positive_int,
        default=None,
        help="multiturn, longdoc: in-process 'host' host tier, tokens (default: the working set)",
    )
    p.add_argument(
        "--small-host-tokens",
        type=positive_int,
        default=None,
        help="multiturn, longdoc: in-process host tier of the configurations with L3, tokens "
        "(default: --device-tokens)",
    )
    loop_opt("--max-prefill-tokens", "multiturn, longdoc: in-process prefill tokens per step")
    p.add_argument(
        "--storage-dir",
        default=None,
        help="multiturn, longdoc: where the in-process file L3 directories go (default: a "
        "temp one)",
    )
    page_size(p)
    device(p)
    p = names.add_parser(
        "multiturn", parents=[common], help=multiturn.HELP, description=multiturn.DESCRIPTION
    )
    multiturn.add_arguments(p)
    p.add_argument(
        "--url",
        default=None,
        help="run the workload against a running server or router (http://HOST:PORT: kvtier "
        "serve, kvtier route, ...) over HTTP, as bench serve --workload does, instead of "
        "in-process engines; --model is then the served model name (default: the one "
        "/v1/models lists); the engines' flags (--configs, --device-tokens, ...) are refused",
    )
    _http_flags(p, "--url: ", "--url: ")
    modes = _MULTITURN_IN_PROCESS + _MULTITURN_URL
    p.set_defaults(func=_multiturn, multiturn_defaults={n: p.get_default(n) for n in modes})
    load_or_recompute.add_arguments(
        names.add_parser(
            "load-or-recompute",
            parents=[common],
            help=load_or_recompute.HELP,
            description=load_or_recompute.__doc__.split("\n\n")[0].replace("``", ""),
        )
    )
