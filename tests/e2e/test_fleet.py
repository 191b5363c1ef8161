"""A fleet behind ``kvtier route``: a Mooncake master, three ``kvtier serve tiny`` processes
sharing it as their storage tier (same tenant salt), each publishing KV events, and the router
over them, all on 127.0.0.1 and started and stopped here.

Multi-turn conversations (greedy, token-id prompts, non-streamed) go through the router, one
turn at a time, the conversations of a turn side by side. Checked, exactly where it can be:

- every output equals the same workload's output on one cold engine in this process (every
  prompt computed, nothing cached): routing and reuse never change a token;
- the hit tokens per tier the router counted equal the sum of what the instances count on
  their ``/metrics`` and of what the answers' ``usage`` said;
- the instance holding most conversations is SIGKILLed between two turns: the next request
  the router sends it fails to connect and is retried elsewhere (no answer is lost), and each
  of its conversations continues on another instance with pages read from the shared storage.

Which instance holds a conversation is read from the instances' own KV events (the replay
socket), not from the router: the pages of a conversation's last prompt are on the device or
host tier of the instance that computed it and of no other.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
import httpx2 as httpx
from mooncake_harness import MooncakeCluster, mooncake_cluster  # noqa: F401 - fixture
from prometheus_client.parser import text_string_to_metric_families
from server_harness import wait_until

from kvtier.config import CacheConfig
from kvtier.engine import SamplingParams
from kvtier.events.hashing import chain_hashes
from kvtier.events.wire import END_SEQ
from kvtier.parallel.ports import free_port
from kvtier.server.lifecycle import build_llm
from kvtier.types import TIERS

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4
INSTANCES = 3
CONVERSATIONS = 6
TURNS = 4
KILL_AFTER = 1
"""The victim dies once this turn (0-based) has been answered."""
MAX_TOKENS = 4
SYSTEM = [(11 * i + 5) % 509 for i in range(16)]
"""Every conversation starts with these 4 pages."""
DEVICE_PAGES = 40
"""An instance's device pool: 160 tokens, while the six conversations grow to ~500."""
DEADLINE_S = 60.0
"""Start-up of each process, and every wait on a condition."""


def user_turn(conv: int, turn: int) -> list[int]:
    """The user's tokens of ``conv``'s turn ``turn`` (longer at the first turn)."""
    rng = random.Random(1000 * conv + turn)
    return [rng.randrange(1, 512) for _ in range(24 if turn == 0 else 12)]


def next_prompts(prompts: list[list[int]], outputs: list[list[int]], turn: int) -> list[list[int]]:
    """Each conversation's prompt at ``turn``: the last prompt, its answer and the new user
    turn (the first turn: the system prefix and the user turn)."""
    if turn == 0:
        return [SYSTEM + user_turn(c, 0) for c in range(CONVERSATIONS)]
    return [
        p + o + user_turn(c, turn) for c, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def oracle() -> list[list[list[int]]]:
    """``outputs[turn][conv]`` of the workload on one cold engine: each turn's prompts run
    together, admitted in one step (none sees another's pages), the cache flushed in between,
    so no token is ever cached."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    cfg = CacheConfig(page_size=PAGE, device_pages=CONVERSATIONS * 32, device="cpu")
    llm = build_llm("tiny", cfg, max_running=CONVERSATIONS, max_prefill_tokens=4096)
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    expected = []
    try:
        for turn in range(TURNS):
            prompts = next_prompts(prompts, outputs, turn)
            outs = llm.generate(prompts, greedy)
            assert [o.cached_tokens for o in outs] == [0] * CONVERSATIONS
            outputs = [list(o.output_ids) for o in outs]
            expected.append(outputs)
            llm.cache.flush(host=True)
    finally:
        llm.close()
    return expected


@dataclass
class Proc:
    url: str
    proc: subprocess.Popen
    log: Path
    events: str = ""
    replay: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(cmd: list[str], log: Path, url: str) -> Proc:
    """Start ``kvtier ...`` with its logs in ``log``; returns once ``url``/health is 200."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", *cmd], env=env, stdout=out, stderr=out
        )
    p = Proc(url, proc, log)

    def ready() -> bool:
        assert proc.poll() is None, f"{cmd[0]} exited:\n{log.read_text()}"
        try:
            return httpx.get(f"{url}/health", timeout=DEADLINE_S).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, f"{url}/health", DEADLINE_S)
    return p


def serve(i: int, storage_url: str, tmp: Path) -> Proc:
    port, ev, rp = free_port(), free_port(), free_port()
    cmd = ["serve", "tiny", "--port", str(port), "--device", "cpu", "--page-size", str(PAGE)]
    cmd += ["--device-pages", str(DEVICE_PAGES), "--host-pages", "512"]
    cmd += ["--storage", "mooncake", "--storage-url", storage_url, "--tenant-salt", "fleet"]
    cmd += ["--prefetch-policy", "wait_complete", "--log-level", "warning"]
    cmd += ["--kv-events", f"tcp://*:{ev}", "--kv-events-replay", f"tcp://*:{rp}"]
    cmd += ["--kv-events-instance", f"instance-{i}"]
    p = spawn(cmd, tmp / f"serve-{i}.log", f"http://127.0.0.1:{port}")
    p.events, p.replay = f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"
    return p


def resident(replay: str) -> dict[str, set[int]]:
    """Per tier, the page hashes an instance's whole event history says it holds (read from
    its replay socket from seq 0, as a DEALER)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    tiers: dict[str, set[int]] = {t: set() for t in TIERS}
    try:
        sock.connect(replay)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert sock.poll(int(DEADLINE_S * 1000)), f"{replay}: the replay stopped"
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return tiers
            for ev in msgpack.unpackb(payload, raw=False)[1]:
                if ev[0] == "AllBlocksCleared":
                    for s in tiers.values():
                        s.clear()
                elif ev[0] == "BlockStored":
                    assert ev[4] == PAGE  # block_size: the tree page
                    tiers[ev[6]].update(ev[1])
                elif ev[0] == "BlockRemoved":
                    tiers[ev[2]].difference_update(ev[1])
    finally:
        sock.close()


def owners(prompts: list[list[int]], live: list[Proc]) -> dict[int, str] | None:
    """``{conversation: URL}`` of the one instance whose events put the last page of each
    prompt on its device or host tier; ``None`` while some has no owner yet. A second owner
    fails: an instance holds only the conversations it computed."""
    held = {p.url: resident(p.replay) for p in live}
    owner = {}
    for c, prompt in enumerate(prompts):
        last = chain_hashes(prompt, PAGE)[-1]
        found = [u for u, t in held.items() if last in t["device"] | t["host"]]
        assert len(found) <= 1, (c, found)
        if not found:
            return None
        owner[c] = found[0]
    return owner


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def instance_hits(url: str) -> dict[str, int]:
    m = scrape(url)
    return {t: int(m[("kvtier_cached_tokens_total", (("cache_source", t),))]) for t in TIERS}


@pytest.fixture
def fleet(mooncake_cluster: MooncakeCluster, tmp_path: Path) -> Iterator[tuple[list[Proc], Proc]]:  # noqa: F811
    """Three instances and the router over them. The router checks health once a minute, so
    an instance that dies is found by the request that fails on it, not by a timer."""
    url = mooncake_cluster.url(timeout_s=5)
    with ExitStack() as stack, ThreadPoolExecutor(INSTANCES) as pool:
        futures = [pool.submit(serve, i, url, tmp_path) for i in range(INSTANCES)]
        instances, failed = [], None
        for f in futures:  # every one that started is stopped, whichever failed
            try:
                instances.append(f.result())
                stack.callback(instances[-1].stop)
            except Exception as e:
                failed = e
        if failed is not None:
            raise failed
        port = free_port()
        cmd = ["route", "--port", str(port), "--health-interval-s", "60"]
        cmd += ["--log-level", "warning", "--shared-storage"]  # one Mooncake store for all
        for p in instances:
            cmd += ["--instance", f"{p.url},events={p.events},replay={p.replay}"]
        router = spawn(cmd, tmp_path / "route.log", f"http://127.0.0.1:{port}")
        stack.callback(router.stop)
        yield instances, router


def ask(router: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(
        f"{router}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=DEADLINE_S,
    )
    assert r.status_code == 200, r.text  # no request is lost
    return r.json()


def test_a_fleet_behind_the_router_answers_as_one_cold_engine(
    fleet: tuple[list[Proc], Proc],
) -> None:
    started = time.monotonic()
    instances, router = fleet
    expected = oracle()

    # Idle instances' heartbeats make their streams fresh before any request; the router
    # learned the page size from the model cards.
    def fresh() -> bool:
        h = httpx.get(f"{router.url}/health", timeout=DEADLINE_S).json()
        return all(i["events"] is not None and not i["events"]["stale"] for i in h["instances"])

    wait_until(fresh, "every instance's event stream to be fresh", DEADLINE_S)
    cards = httpx.get(f"{router.url}/v1/models", timeout=DEADLINE_S).json()["data"]
    assert [c["page_size"] for c in cards] == [PAGE]

    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    answers: list[dict[str, Any]] = []
    victim: Proc | None = None
    victim_hits: dict[str, int] = {}
    moved: list[int] = []
    live = list(instances)
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        for turn in range(TURNS):
            prompts = next_prompts(prompts, outputs, turn)
            first: dict[int, dict[str, Any]] = {}
            if turn == KILL_AFTER + 1:
                # alone, so that nothing else is in flight: the router prices the victim,
                # which holds the conversation, cheapest, and finds it dead by connecting
                first[moved[0]] = ask(router.url, prompts[moved[0]])
            rest = [c for c in range(CONVERSATIONS) if c not in first]
            sent = pool.map(ask, [router.url] * len(rest), [prompts[c] for c in rest])
            got = dict(zip(rest, sent, strict=True))
            got |= first
            turn_answers = [got[c] for c in range(CONVERSATIONS)]
            answers += turn_answers
            outputs = [a["choices"][0]["token_ids"] for a in turn_answers]
            assert outputs == expected[turn], f"turn {turn}"
            if turn == KILL_AFTER + 1:
                # The victim's conversations went on elsewhere with their prefixes cached:
                # the system prefix at least, and each with pages the victim wrote to the
                # shared storage (the victim computed their last turn: no live instance did).
                details = [turn_answers[c]["usage"]["prompt_tokens_details"] for c in moved]
                assert all(d["cached_tokens"] >= len(SYSTEM) for d in details), details
                assert all(d["cached_tokens_by_tier"]["storage"] > 0 for d in details), details
            if turn != KILL_AFTER:
                continue
            # Who holds each conversation, from the instances' own events (an answer can
            # leave before the step's batch of events is published: wait for them).
            owner = wait_until(
                lambda ps=prompts: owners(ps, live), "one owner per conversation", DEADLINE_S
            )
            victim = max(live, key=lambda p: sum(o == p.url for o in owner.values()))
            moved = [c for c in range(CONVERSATIONS) if owner[c] == victim.url]
            # Its writes to storage landed (its storage events say so) before it dies.
            need = {h for c in moved for h in chain_hashes(prompts[c], PAGE)}
            wait_until(
                lambda v=victim, need=need: need <= resident(v.replay)["storage"],
                "the victim's storage writes",
                DEADLINE_S,
            )
            victim_hits = instance_hits(victim.url)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=DEADLINE_S)
            live.remove(victim)

    assert victim is not None and moved
    # The router's counts: one retry, on the victim; every answer's usage counted.
    m = scrape(router.url)
    retries = {
        dict(k[1])["instance"]: v for k, v in m.items() if k[0] == "kvtier_route_retries_total"
    }
    assert retries == {victim.url: 1.0}
    assert sum(v for k, v in m.items() if k[0] == "kvtier_route_stream_errors_total") == 0
    assert m[("kvtier_route_decisions_total", (("reason", "prefix"),))] > 0
    routed = {t: int(m[("kvtier_route_cached_tokens_total", (("tier", t),))]) for t in TIERS}
    reported = {
        t: sum(a["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"][t] for a in answers)
        for t in TIERS
    }
    counted = dict(victim_hits)
    for p in live:
        for t, n in instance_hits(p.url).items():
            counted[t] += n
    assert routed == reported == counted
    assert routed["storage"] > 0 and routed["device"] > 0
    elapsed = time.monotonic() - started
    print(f"fleet: {len(answers)} answers, hits {routed}, moved {moved}, {elapsed:.1f} s")
