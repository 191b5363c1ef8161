"""Routers compared over the same ``kvtier serve`` instances.

For each front, a fresh fleet (so that every cache starts empty): ``--instances`` ``kvtier serve
tiny`` processes on the CPU with small device pools, a host tier, a shared local Mooncake store
(same tenant salt) and KV events; the front over them; then the same closed-loop multi-turn
workload through the front with ``kvtier bench multiturn --url``. Collected per
front: prompt tokens served per tier (device, host, storage) and recomputed, TTFT p50/p90,
requests/s, and, from the instances' ``/metrics``, the requests each one answered.

Fronts (``--fronts``, comma-separated):

- ``prefix``: ``kvtier route`` with every instance's KV event and replay endpoints;
- ``least_loaded``: ``kvtier route`` without ``events=``: the fewest requests in flight wins;
- ``round_robin``: a minimal proxy run by this script (``compare.py proxy``), streams passed
  through chunk by chunk;
- ``sglang``: SGLang's router (``sglang_router.launch_router --policy cache_aware``) from its
  own venv (``--sglang-python``). It routes on request text, so the bench sends text prompts
  (``--prompt-format text``, the default: printable ASCII, which the instances' byte tokenizer
  encodes one id a byte); with ``--prompt-format ids`` it refuses every request and the
  answer is kept in the results instead of a run.

Usage::

    . .venv/bin/activate
    python results/route/compare.py                       # writes results/route/compare.json
    python results/route/compare.py --fronts prefix,round_robin --clients 24 --rounds 6
    python results/route/compare.py --no-mooncake         # device and host tiers only
    python results/route/compare.py --repeat 3            # 3 runs a front, interleaved, pooled

Progress lines go to stderr; every process started is stopped at the end, also on failure
(each runs in its own process group, which is killed).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pooled import pool  # this folder's (run as a script)
from prometheus_client.parser import text_string_to_metric_families

from kvtier.parallel.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEADLINE_S = 90.0
TIERS = ("device", "host", "storage")
FRONTS = ("prefix", "round_robin", "least_loaded", "sglang")


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(cond: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {deadline_s:.0f} s waiting for {what}")


@dataclass
class Proc:
    """A child process in its own process group, with its output in ``log``."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    events: str = ""
    replay: str = ""

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH`` (what was there is
    kept: packages installed outside a venv stay importable)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def start(name: str, cmd: list[str], logdir: Path, cpus: set[int] | None = None) -> Proc:
    """``cmd`` in its own process group, on ``cpus`` when given (else on this process's)."""
    path = logdir / f"{name}.log"
    env = child_env()
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with path.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=out, start_new_session=True, preexec_fn=pin
        )
    return Proc(name, proc, path)


def cpu_sets(instances: int, per_instance: int) -> tuple[list[set[int]], set[int]]:
    """``--pin``: ``per_instance`` CPUs of its own for each instance, and the CPUs left for
    everything else (this process, the store, the front and the bench)."""
    cpus = sorted(os.sched_getaffinity(0))
    need = instances * per_instance + 2
    if len(cpus) < need:
        raise SystemExit(
            f"--pin needs {need} CPUs ({instances} instances x {per_instance}, 2 for the "
            f"rest), this process has {len(cpus)}"
        )
    k = per_instance
    return [set(cpus[i * k : (i + 1) * k]) for i in range(instances)], set(cpus[instances * k :])


def healthy(p: Proc, path: str = "/health") -> bool:
    p.alive()
    try:
        return httpx.get(f"{p.url}{path}", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@dataclass
class Settings:
    instances: int
    device_pages: int
    host_pages: int
    page_size: int
    mooncake: bool
    shared_storage: bool
    clients: int
    rounds: int
    system_tokens: int
    new_tokens: int
    output_tokens: int
    concurrency: int
    prompt_format: str
    sglang_python: str
    logdir: Path
    route_args: list[str] = field(default_factory=list)
    """Extra ``kvtier route`` flags (the prefix front only)."""
    instance_cpus: list[set[int]] | None = None
    """``--pin``: the CPUs of each instance (``None``: not pinned)."""
    bench_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bench_args = [
            "--workload", "multiturn", "--clients", str(self.clients),
            "--rounds", str(self.rounds), "--system-tokens", str(self.system_tokens),
            "--new-tokens", str(self.new_tokens), "--output-tokens", str(self.output_tokens),
            "--concurrency", str(self.concurrency), "--seed", "0",
            "--prompt-format", self.prompt_format,
        ]  # fmt: skip


def serve(i: int, s: Settings, storage_url: str | None, tag: str) -> Proc:
    port, ev, rp = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "tiny", "--port", str(port)]
    cmd += ["--device", "cpu", "--page-size", str(s.page_size)]
    cmd += ["--device-pages", str(s.device_pages), "--host-pages", str(s.host_pages)]
    if storage_url:
        cmd += ["--storage", "mooncake", "--storage-url", storage_url, "--tenant-salt", "fleet"]
    cmd += ["--log-level", "warning", "--seed", "0"]
    cmd += ["--kv-events", f"tcp://*:{ev}", "--kv-events-replay", f"tcp://*:{rp}"]
    cmd += ["--kv-events-instance", f"instance-{i}"]
    cpus = s.instance_cpus[i] if s.instance_cpus else None
    p = start(f"{tag}-serve-{i}", cmd, s.logdir, cpus)
    p.url = f"http://127.0.0.1:{port}"
    p.events, p.replay = f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"
    return p


def fleet(s: Settings, stack: ExitStack, tag: str) -> list[Proc]:
    """A fresh Mooncake store (when asked) and ``s.instances`` fresh instances, healthy."""
    storage_url = None
    if s.mooncake:
        from kvtier.storage.mooncake_local import LocalMooncake

        (s.logdir / f"{tag}-mooncake").mkdir()
        store = LocalMooncake(256 << 20, log_dir=str(s.logdir / f"{tag}-mooncake"))
        store.start()
        stack.callback(store.stop)
        storage_url = store.url()
    procs = [serve(i, s, storage_url, tag) for i in range(s.instances)]
    for p in procs:
        stack.callback(p.stop)
    for p in procs:
        wait_until(lambda p=p: healthy(p), f"{p.name} /health")
    return procs


def front_prefix(s: Settings, procs: list[Proc], stack: ExitStack, events: bool) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "kvtier.cli", "route", "--port", str(port)]
    cmd += ["--log-level", "warning"]
    if events:
        cmd += s.route_args
    if events and s.mooncake and s.shared_storage:
        cmd += ["--shared-storage"]  # the instances share one Mooncake store
    for p in procs:
        cmd += ["--instance", f"{p.url},events={p.events},replay={p.replay}" if events else p.url]
    r = start("route" if events else "route-least-loaded", cmd, s.logdir)
    r.url = f"http://127.0.0.1:{port}"
    stack.callback(r.stop)
    wait_until(lambda: healthy(r), "kvtier route /health")

    def ready() -> bool:
        h = httpx.get(f"{r.url}/health", timeout=5).json()
        insts = h["instances"]
        if len(insts) != len(procs) or not all(i.get("healthy", True) for i in insts):
            return False
        return not events or all(
            i["events"] is not None and not i["events"]["stale"] for i in insts
        )

    wait_until(ready, "every instance healthy (and its event stream fresh) at the router")
    return r


def front_round_robin(s: Settings, procs: list[Proc], stack: ExitStack) -> Proc:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "proxy", "--port", str(port)]
    for p in procs:
        cmd += ["--upstream", p.url]
    r = start("round-robin", cmd, s.logdir)
    r.url = f"http://127.0.0.1:{port}"
    stack.callback(r.stop)
    wait_until(lambda: healthy(r, "/v1/models"), "round-robin proxy")
    return r


def front_sglang(s: Settings, procs: list[Proc], stack: ExitStack) -> tuple[Proc, dict[str, Any]]:
    """SGLang's router in cache-aware mode, and what it answers to the bench's requests."""
    port = free_port()
    cmd = [s.sglang_python, "-m", "sglang_router.launch_router", "--policy", "cache_aware"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += ["--worker-urls", *[p.url for p in procs]]
    r = start("sglang-router", cmd, s.logdir)
    r.url = f"http://127.0.0.1:{port}"
    stack.callback(r.stop)
    wait_until(lambda: healthy(r, "/v1/models"), "sglang router /v1/models")
    version = subprocess.run(
        [
            s.sglang_python,
            "-c",
            "import importlib.metadata as m; print(m.version('sglang-router'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    probe: dict[str, Any] = {"version": version}
    probe["models"] = httpx.get(f"{r.url}/v1/models", timeout=10).json()
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    got = httpx.post(f"{r.url}/v1/completions", json=body, timeout=30)
    probe["token_ids_prompt"] = {"status": got.status_code, "body": got.text[:400]}
    text = {**body, "prompt": "hello", "add_special_tokens": False}
    got = httpx.post(f"{r.url}/v1/completions", json=text, timeout=30)
    usage = [json.loads(x[6:]) for x in got.text.splitlines() if '"usage"' in x]
    counted = usage[-1]["usage"]["prompt_tokens"] if usage else None
    # 5: the router passed add_special_tokens on (no BOS), as the text workload needs
    probe["text_prompt"] = {"status": got.status_code, "prompt_tokens_of_hello": counted}
    return r, probe


def bench(s: Settings, url: str, tag: str, model: str | None) -> dict[str, Any]:
    out = s.logdir / f"{tag}-bench.json"
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "multiturn", "--url", url, *s.bench_args]
    cmd += ["--json", str(out)] + (["--model", model] if model else [])
    with (s.logdir / f"{tag}-bench.log").open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=f, env=child_env())
    if not out.exists():
        raise RuntimeError(f"bench at {url} exited {rc.returncode} without a result")
    d = json.loads(out.read_text())
    summ = d["summary"]["server"]
    if not d["requests_ok"]:
        raise RuntimeError(f"every request failed through {url}: {d['first_error']}")
    reqs = d["configs"]["server"]["requests"]
    return {
        "bench_rc": rc.returncode,
        "requests": d["requests"],
        "requests_ok": d["requests_ok"],
        "first_error": d["first_error"],
        "wall_s": summ["wall_s"],
        "requests_per_s": summ["requests_per_s"],
        "ttft_p50_s": summ["ttft_p50_s"],
        "ttft_p90_s": summ["ttft_p90_s"],
        "ttft_p99_s": summ["ttft_p99_s"],
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "served": summ["served"],
        "records": reqs,
    }


def cpu_s(p: Proc) -> float:
    """CPU seconds (user + system) the process has used so far, its threads included."""
    fields = Path(f"/proc/{p.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def instance_counts(procs: list[Proc]) -> list[dict[str, Any]]:
    """Per instance: requests answered, prompt tokens served per tier, the rates its
    ``/health`` reports, its own mean TTFT (from a request's arrival at the server to its
    first token: the part of the client's TTFT no front adds to) and its CPU seconds."""
    rows = []
    for p in procs:
        m = scrape(p.url)
        reqs = sum(v for (n, _), v in m.items() if n == "kvtier_requests_total")
        hits = {
            t: int(m.get(("kvtier_cached_tokens_total", (("cache_source", t),)), 0)) for t in TIERS
        }
        n = m.get(("kvtier_time_to_first_token_seconds_count", ()), 0.0)
        total = m.get(("kvtier_time_to_first_token_seconds_sum", ()), 0.0)
        rates = httpx.get(f"{p.url}/health", timeout=5).json().get("rates")
        rows.append(
            {
                "url": p.url,
                "requests": int(reqs),
                "cached_tokens": hits,
                "rates": rates,
                "server_ttft_mean_s": total / n if n else None,
                "cpu_s": cpu_s(p),
            }
        )
    return rows


def run_front(name: str, s: Settings) -> dict[str, Any]:
    log(f"{name}: starting {s.instances} fresh instances")
    t0 = time.monotonic()
    with ExitStack() as stack:
        procs = fleet(s, stack, name)
        result: dict[str, Any] = {"front": name}
        model = None
        if name == "prefix":
            r = front_prefix(s, procs, stack, events=True)
        elif name == "least_loaded":
            r = front_prefix(s, procs, stack, events=False)
        elif name == "round_robin":
            r = front_round_robin(s, procs, stack)
        else:
            r, probe = front_sglang(s, procs, stack)
            result["sglang_probe"] = probe
            log(f"sglang: probe {json.dumps(probe)[:400]}")
            if s.prompt_format == "ids" and probe["token_ids_prompt"]["status"] != 200:
                result["skipped"] = (
                    "sglang-router refuses /v1/completions with a token-id prompt: "
                    + probe["token_ids_prompt"]["body"]
                )
                log(f"sglang: skipped ({result['skipped'][:160]})")
                return result
            model = str(probe["models"]["data"][0]["id"])
        log(f"{name}: front up at {r.url} after {time.monotonic() - t0:.1f} s; running the bench")
        cpu0 = cpu_s(r)
        result |= bench(s, r.url, name, model)
        result["front_cpu_s"] = cpu_s(r) - cpu0
        result["instances"] = instance_counts(procs)
        if name in ("prefix", "least_loaded"):
            m = scrape(r.url)
            result["route_decisions"] = {
                dict(k[1])["reason"]: int(v)
                for k, v in m.items()
                if k[0] == "kvtier_route_decisions_total"
            }
            load: dict[str, dict[str, float]] = {}
            for (sample, labels), v in m.items():
                if sample == "kvtier_route_load_seconds":
                    d = dict(labels)
                    load.setdefault(d["instance"], {})[d["term"]] = v
            result["route_load_seconds"] = load
        log(
            f"{name}: {result['requests_ok']}/{result['requests']} ok, "
            f"{result['requests_per_s']:.2f} req/s, TTFT p50 {result['ttft_p50_s'] * 1e3:.0f} ms "
            f"p90 {result['ttft_p90_s'] * 1e3:.0f} ms, served {result['served']}, "
            f"per instance {[i['requests'] for i in result['instances']]}, "
            f"front CPU {result['front_cpu_s']:.1f} s, server TTFT means (ms) "
            f"{[round((i['server_ttft_mean_s'] or 0) * 1e3, 1) for i in result['instances']]}"
        )
        log(f"{name}: stopping the fleet")
    return result


def proxy_main(argv: list[str]) -> None:
    """``compare.py proxy --port P --upstream URL ...``: round-robin over the upstreams."""
    ap = argparse.ArgumentParser(prog="compare.py proxy")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", action="append", required=True)
    args = ap.parse_args(argv)
    ups: list[str] = args.upstream
    turn = itertools.cycle(range(len(ups)))
    app = FastAPI()
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256)
    )

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(f"{ups[0]}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        up = ups[next(turn)]
        named = {"x-kvtier-instance": up}  # as kvtier route names it, for the records
        req = client.build_request(
            "POST", f"{up}{path}", content=body, headers={"content-type": "application/json"}
        )
        resp = await client.send(req, stream=True)
        if resp.headers.get("content-type", "").startswith("text/event-stream"):

            async def relay() -> Any:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(
                relay(), resp.status_code, media_type="text/event-stream", headers=named
            )
        data = await resp.aread()
        await resp.aclose()
        try:
            return JSONResponse(json.loads(data), status_code=resp.status_code)
        except ValueError:
            return Response(data, status_code=resp.status_code)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    return out.stdout.decode().strip()


def source_digest() -> str:
    """The SHA-256 (first 12 hex digits) of the ``kvtier`` package's Python files that run,
    paths and contents: which code ran, where a copied tree's git commit may be stale or
    absent (``git_commit``)."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "kvtier").rglob("*.py")):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "proxy":
        proxy_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--fronts", default=",".join(FRONTS), help="comma-separated, of " + ",".join(FRONTS)
    )
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--device-pages", type=int, default=64, help="per instance (16-token pages)")
    ap.add_argument("--host-pages", type=int, default=384, help="per instance")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-mooncake", action="store_true", help="no shared storage tier")
    ap.add_argument(
        "--no-shared-storage",
        action="store_true",
        help="kvtier route without --shared-storage (each instance credited its own writes)",
    )
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="text",
        help="how the bench sends prompts (SGLang's router routes on text and refuses ids)",
    )
    ap.add_argument(
        "--route-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for kvtier route (repeat; e.g. --route-arg=--request-cost-s=0.01)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every front, interleaved (front 1, 2, ..., then again); the JSON adds "
        "each front's figures pooled over its runs' requests",
    )
    ap.add_argument("--sglang-python", default="/tmp/sgr/bin/python")
    ap.add_argument("--json", type=Path, default=HERE / "compare.json")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="run each instance on OMP_NUM_THREADS CPUs of its own, and the front, the bench "
        "and the store on the CPUs left (less noise between runs)",
    )
    ap.add_argument(
        "--logdir",
        type=Path,
        help="where the processes' logs and records go (default: a new temporary directory)",
    )
    args = ap.parse_args()
    fronts = [f for f in args.fronts.split(",") if f]
    bad = [f for f in fronts if f not in FRONTS]
    if bad:
        ap.error(f"--fronts: unknown {bad}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.logdir is not None:
        args.logdir.mkdir(parents=True, exist_ok=True)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="route-compare-"))
    s = Settings(
        instances=args.instances,
        device_pages=args.device_pages,
        host_pages=args.host_pages,
        page_size=args.page_size,
        mooncake=not args.no_mooncake,
        shared_storage=not args.no_shared_storage,
        clients=args.clients,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        prompt_format=args.prompt_format,
        sglang_python=args.sglang_python,
        logdir=logdir,
        route_args=args.route_arg,
    )
    if args.pin:
        per = int(os.environ.get("OMP_NUM_THREADS") or 1)
        s.instance_cpus, rest = cpu_sets(args.instances, per)
        os.sched_setaffinity(0, rest)
        log(f"instances on CPUs {[sorted(c) for c in s.instance_cpus]}, the rest on {sorted(rest)}")
    log(f"logs in {logdir}")
    results = []
    records: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        # a folder per run: the fronts' file names repeat
        run = replace(s, logdir=logdir / f"run{rep + 1}") if args.repeat > 1 else s
        run.logdir.mkdir(exist_ok=True)
        for name in fronts:
            try:
                result = run_front(name, run)
            except Exception as e:  # the other fronts still run; the failure is in the results
                log(f"{name}: FAILED {type(e).__name__}: {e}")
                result = {"front": name, "error": f"{type(e).__name__}: {e}"}
            records.setdefault(name, []).extend(result.pop("records", []))
            results.append(result | ({"run": rep + 1} if args.repeat > 1 else {}))
    doc = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "instance_cpus": [sorted(c) for c in s.instance_cpus] if s.instance_cpus else None,
        "commit": git_commit(),
        "kvtier_source": source_digest(),
        "settings": {
            k: v
            for k, v in vars(s).items()
            if k not in ("logdir", "sglang_python", "instance_cpus")
        },
        "fronts": results,
    }
    if args.repeat > 1:
        doc["pooled"] = {name: pool(rows) for name, rows in records.items() if rows}
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
