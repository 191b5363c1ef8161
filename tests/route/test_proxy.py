"""The router's HTTP side against stub instances (an ``httpx.MockTransport``): streaming passed
through chunk by chunk, a failure before streaming retried elsewhere, a failure after it ended
with an error event, instances leaving and joining with their health, the prefix choice through
``/tokenize`` and the index, ``/v1/models``, ``/health`` and ``/metrics``. The router runs under
uvicorn on a free port in a thread; waits poll with deadlines."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
msgpack = pytest.importorskip("msgpack")
pytest.importorskip("zmq")  # the prefix test starts event subscribers
import httpx2 as httpx

from kvtier.engine.byte_tokenizer import ByteTokenizer
from kvtier.events.hashing import chain_hashes
from kvtier.route.fleet import Fleet, FleetOptions, tokenize_request
from kvtier.route.instances import Instance, InstanceSpec, parse_instances
from kvtier.route.proxy import Attempts, Opened, RelayResponse, create_app
from kvtier.route.route_metrics import RouteMetrics
from kvtier.route.scorer import Decision, Footprint
from kvtier.server.load_cost import Ahead

TIMEOUT_S = 5.0
A, B = "http://a:8000", "http://b:8000"


def wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Stubs:
    """Stub ``kvtier serve`` instances by base URL: health, models, tokenize and generation,
    each with a mode the test sets."""

    def __init__(self, urls: list[str]) -> None:
        self.healthy = dict.fromkeys(urls, True)
        self.mode = dict.fromkeys(urls, "ok")
        self.model = dict.fromkeys(urls, "tiny")
        self.generated: list[str] = []
        self.release = threading.Event()
        self.card: dict[str, Any] = {"page_size": 4}
        self.tokenized = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        if path == "/health":
            return httpx.Response(200 if self.healthy[base] else 503, json={"status": "x"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": self.model[base], **self.card}]})
        if path == "/tokenize":
            self.tokenized += 1
            body = json.loads(request.content)
            text = body.get("prompt") or json.dumps(body["messages"])
            return httpx.Response(200, json={"tokens": [ord(c) for c in text]})
        mode = self.mode[base]
        if mode == "cancel":
            raise asyncio.CancelledError
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        self.generated.append(base)
        body = json.loads(request.content)
        if not body.get("stream"):
            usage = {"prompt_tokens_details": {"cached_tokens_by_tier": {"host": 8}}}
            return httpx.Response(200, json={"from": base, "usage": usage})
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._chunks(base, mode)
        )

    async def _chunks(self, base: str, mode: str):
        if mode == "empty":  # headers, then the end: no output
            return
        if mode == "dies":
            raise httpx.ReadError("connection reset before the first chunk")
        first = {"from": base, "n": 1, "choices": [{"index": 0, "text": "x"}]}
        yield f"data: {json.dumps(first)}\n\n".encode()
        if mode == "slow":  # the second chunk waits until the client has the first
            await asyncio.to_thread(self.release.wait, TIMEOUT_S)
        if mode == "cut":
            raise httpx.ReadError("connection reset")
        yield b'data: {"n": 2}\n\n'
        if mode == "usage":  # the usage chunk, cut in two
            usage = {"prompt_tokens_details": {"cached_tokens_by_tier": {"host": 8, "storage": 4}}}
            event = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield event[:17]
            yield event[17:]
        yield b"data: [DONE]\n\n"


class Router:
    def __init__(self, stubs: Stubs, specs: list[str], **options: Any) -> None:
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(stubs))
        opts = {"health_interval_s": 0.02, "page_size": 4, **options}
        self.fleet = Fleet(
            [InstanceSpec.parse(s) for s in specs], FleetOptions(**opts), self.client
        )
        app = create_app(self.fleet, self.client)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        wait(lambda: self.server.started, "the router to start")
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT_S)

    def instance(self, url: str):
        return next(i for i in self.fleet.instances if i.name == url)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)


@pytest.fixture
def stubs() -> Stubs:
    return Stubs([A, B])


@pytest.fixture
def router(stubs: Stubs) -> Iterator[Router]:
    r = Router(stubs, [A, B])
    yield r
    r.close()


def _metric(text: str, line_start: str) -> float:
    lines = text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(line_start))


def test_streaming_passes_through_chunk_by_chunk(router: Router, stubs: Stubs) -> None:
    stubs.mode[A] = stubs.mode[B] = "slow"
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    with router.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_raw()
        first = next(chunks)
        assert b'"n": 1' in first and b'"n": 2' not in first  # before the stub sent more
        stubs.release.set()
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n") and b'"n": 2' in rest
    wait(lambda: all(i.in_flight == 0 for i in router.fleet.instances), "in_flight to drop")


def test_a_streamed_answers_usage_is_counted(router: Router, stubs: Stubs) -> None:
    stubs.mode[A] = stubs.mode[B] = "usage"
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    for _ in range(2):
        with router.http.stream("POST", "/v1/completions", json=body) as r:
            assert b"".join(r.iter_raw()).endswith(b"data: [DONE]\n\n")
    wait(lambda: all(i.in_flight == 0 for i in router.fleet.instances), "in_flight to drop")
    metrics = router.http.get("/metrics").text
    assert _metric(metrics, 'kvtier_route_cached_tokens_total{tier="host"}') == 16
    assert _metric(metrics, 'kvtier_route_cached_tokens_total{tier="storage"}') == 8


def test_usage_is_found_in_events_cut_anywhere() -> None:
    from kvtier.route.proxy import StreamScanner

    stream = b'data: {"n": 1}\n\ndata: {"choices": [], "usage": {"x": 1}}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        scan = StreamScanner()
        got = scan.feed(stream[:cut]) + scan.feed(stream[cut:])
        assert got == [{"choices": [], "usage": {"x": 1}}], cut
        assert not scan.output_seen


def test_the_first_output_is_the_first_event_with_a_token() -> None:
    """A chat stream opens with the role alone: its first output is the next event."""
    from kvtier.route.proxy import StreamScanner

    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "token_ids": []}]}\n\n'
    token = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    for cut in range(1, len(token)):
        scan = StreamScanner()
        scan.feed(role + token[:cut])
        assert not scan.output_seen, cut
        scan.feed(token[cut:])
        assert scan.output_seen, cut
    for event in (
        b'data: {"choices": [{"text": "a"}]}\n\n',
        b'data: {"choices": [{"text": "", "token_ids": [7]}]}\n\n',
    ):
        scan = StreamScanner()
        scan.feed(event)
        assert scan.output_seen


def test_a_failure_before_streaming_is_retried_on_another_instance(
    router: Router, stubs: Stubs
) -> None:
    stubs.mode[A] = "down"
    for stream in (False, True):
        r = router.http.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 200
        assert B in r.text
        stubs.mode[A] = "500"  # a 5xx is retried too, and A stays in the pool
    assert router.instance(A).healthy
    metrics = router.http.get("/metrics").text
    assert _metric(metrics, f'kvtier_route_retries_total{{instance="{A}"}}') >= 1
    # every instance failing: the last 5xx is the answer
    stubs.mode[B] = "500"
    r = router.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "boom"


def test_a_stream_that_stops_before_its_first_chunk_goes_on_another_instance(
    router: Router, stubs: Stubs
) -> None:
    for mode in ("empty", "dies"):
        stubs.mode[A] = mode
        for _ in range(2):  # ties go to each instance in turn: one of the two tries A first
            wait(lambda: router.instance(A).healthy, "A to be back")
            r = router.http.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status_code == 200
            events = [e for e in r.text.split("\n\n") if e]
            assert json.loads(events[0].removeprefix("data: "))["from"] == B
            assert events[-1] == "data: [DONE]"
        assert A in stubs.generated
        stubs.generated.clear()
    metrics = router.http.get("/metrics").text
    assert _metric(metrics, f'kvtier_route_retries_total{{instance="{A}"}}') >= 2
    assert _metric(metrics, "kvtier_route_stream_errors_total") == 0
    # no instance left: the client, which has its headers, gets an error event
    stubs.mode[A] = stubs.mode[B] = "empty"
    r = router.http.post("/v1/completions", json={"prompt": "x", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["message"] == "every instance failed this request (2 tried)"
    assert events[-1] == "data: [DONE]"
    assert router.instance(A).in_flight == router.instance(B).in_flight == 0


def test_a_stream_cut_after_it_started_ends_with_an_error_event(
    router: Router, stubs: Stubs
) -> None:
    stubs.mode[A] = stubs.mode[B] = "cut"
    text = router.http.post("/v1/chat/completions", json={"messages": [], "stream": True}).text
    events = [e for e in text.split("\n\n") if e]
    assert '"n": 1' in events[0]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]"
    assert len(stubs.generated) == 1  # streaming had started: no retry
    metrics = router.http.get("/metrics").text
    assert _metric(metrics, "kvtier_route_stream_errors_total") == 1


def test_instances_leave_and_join_with_their_health(router: Router, stubs: Stubs) -> None:
    stubs.healthy[A] = False
    wait(lambda: not router.instance(A).healthy, "A to leave")
    for _ in range(3):
        assert router.http.post("/v1/completions", json={"prompt": "x"}).json()["from"] == B
    stubs.healthy[B] = False
    wait(lambda: not router.instance(B).healthy, "B to leave")
    r = router.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "no healthy instance" in r.json()["error"]["message"]
    assert router.http.get("/health").status_code == 503
    assert router.http.get("/v1/models").json()["data"] == []
    stubs.healthy[A] = True
    wait(lambda: router.instance(A).healthy, "A to join")
    assert router.http.post("/v1/completions", json={"prompt": "x"}).json()["from"] == A
    health = router.http.get("/health").json()
    assert health["status"] == "ok" and [i["healthy"] for i in health["instances"]] == [True, False]
    assert router.http.get("/v1/models").json()["data"] == [{"id": "tiny", "page_size": 4}]


def test_the_instance_holding_the_prompt_is_chosen_and_counted(stubs: Stubs) -> None:
    # event endpoints nobody publishes on: the test feeds the index and the heartbeat itself
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    router = Router(stubs, specs)
    try:
        prompt = "abcdefghijkl"  # three pages of 4 tokens
        hashes = chain_hashes([ord(c) for c in prompt], 4)
        router.fleet.index.stored(B, hashes[:2], "device")
        router.fleet.index.stored(A, hashes[:1], "device")
        for url in (A, B):
            router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
        r = router.http.post("/v1/completions", json={"prompt": prompt})
        assert r.json()["from"] == B
        # the answer says where it went and what was expected: 4 uncached tokens at the
        # default 8000 tokens/s, nothing in flight
        assert (r.headers["x-kvtier-instance"], r.headers["x-kvtier-route"]) == (B, "prefix")
        assert r.headers["x-kvtier-expected-ms"] == "0.500"
        metrics = router.http.get("/metrics").text
        assert _metric(metrics, 'kvtier_route_decisions_total{reason="prefix"}') == 1
        assert _metric(metrics, 'kvtier_route_expected_hit_tokens_total{tier="device"}') == 8
        assert _metric(metrics, 'kvtier_route_cached_tokens_total{tier="host"}') == 8
        assert _metric(metrics, f'kvtier_route_requests_total{{instance="{B}"}}') == 1
        assert _metric(metrics, f'kvtier_route_indexed_pages{{instance="{A}"}}') == 1
        # events gone quiet: load decides
        router.fleet.options = FleetOptions(events_stale_s=1e-9, page_size=4)
        busy = router.instance(B).begin(None)
        r = router.http.post("/v1/completions", json={"prompt": prompt})
        assert r.json()["from"] == A and r.headers["x-kvtier-route"] == "stale_events"
        assert "x-kvtier-expected-ms" not in r.headers  # a choice by load alone
        metrics = router.http.get("/metrics").text
        assert _metric(metrics, 'kvtier_route_decisions_total{reason="stale_events"}') == 1
        router.instance(B).end(busy)
    finally:
        router.close()


def test_a_streaming_request_holds_its_footprint_until_its_stream_ends(stubs: Stubs) -> None:
    """What the request holds on the chosen instance's device (its pages beyond the device
    hit, output included) is counted there while it streams, and dropped with it."""
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    router = Router(stubs, specs)
    try:
        prompt = "abcdefghijkl"  # three pages of 4 tokens, two of them on B's device
        router.fleet.index.stored(B, chain_hashes([ord(c) for c in prompt], 4)[:2], "device")
        for url in (A, B):
            router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
        stubs.mode[A] = stubs.mode[B] = "slow"
        body = {"model": "tiny", "prompt": prompt, "stream": True, "max_tokens": 5}
        with router.http.stream("POST", "/v1/completions", json=body) as r:
            chunks = r.iter_raw()
            first = next(chunks)
            # 12 + 5 - 8 = 9 tokens of its own: 3 pages
            assert [f.footprint for f in router.instance(B).flights] == [Footprint(12, 8)]
            assert (router.instance(A).flights, router.instance(B).in_flight) == ([], 1)
            stubs.release.set()
            assert (first + b"".join(chunks)).endswith(b"data: [DONE]\n\n")
        wait(lambda: router.instance(B).in_flight == 0, "in_flight to drop")
        assert router.instance(B).flights == []
    finally:
        router.close()


def test_a_text_prompt_is_tokenized_as_the_instance_will_encode_it() -> None:
    assert tokenize_request({"prompt": "ab"}, False) == {"prompt": "ab"}
    no_bos = {"prompt": "ab", "add_special_tokens": False}
    assert tokenize_request(no_bos, False) == no_bos
    assert tokenize_request({"prompt": "ab", "add_special_tokens": "no"}, False) == {"prompt": "ab"}
    assert tokenize_request({"prompt": [5, 6]}, False) == [5, 6]
    assert tokenize_request({"messages": [{"role": "user", "content": "x"}]}, True) == {
        "messages": [{"role": "user", "content": "x"}]
    }


@pytest.mark.parametrize("vocab", [512, 3])
def test_text_for_a_byte_tokenizer_is_encoded_without_a_round_trip(stubs: Stubs, vocab) -> None:
    """Instances whose card names the byte tokenizer: the router encodes text as they will
    (BOS or not), with no ``/tokenize``; a card no byte tokenizer can have is not trusted."""
    stubs.card = {"page_size": 4, "tokenizer": "bytes", "vocab_size": vocab}
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    router = Router(stubs, specs)
    try:
        wait(lambda: all(router.instance(u).healthy for u in (A, B)), "both instances")
        prompt = "abcdefghijk"  # with a BOS: three pages of 4 tokens
        ids = ByteTokenizer(512).encode(prompt)
        router.fleet.index.stored(B, chain_hashes(ids, 4)[:3], "device")
        router.fleet.index.stored(A, chain_hashes(list(prompt.encode()), 4)[:2], "device")
        for url in (A, B):
            router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
        got = router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"]
        if vocab == 512:
            assert (got, stubs.tokenized) == (B, 0)
            body = {"prompt": prompt, "add_special_tokens": False}
            assert router.http.post("/v1/completions", json=body).json()["from"] == A
            assert stubs.tokenized == 0
        else:  # asked the instance, whose stub tokenizes without a BOS
            assert router.instance(A).byte_vocab is None and stubs.tokenized == 1
    finally:
        router.close()


def test_a_body_that_is_no_json_object_is_refused(router: Router) -> None:
    r = router.http.post("/v1/completions", content=b"[1]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_a_request_goes_to_an_instance_serving_its_model(stubs: Stubs) -> None:
    """A serves "tiny", B "big": each model's requests go to its own instance whatever the
    load, a request without a model may go to either, and a model nobody serves is a 404
    naming what the fleet serves."""
    stubs.model[B] = "big"
    r = Router(stubs, [A, B])
    try:
        for model, home in (("big", B), ("tiny", A), ("big", B), ("tiny", A)):
            got = r.http.post("/v1/completions", json={"model": model, "prompt": "x"}).json()
            assert got["from"] == home, model
        assert r.http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        bad = r.http.post("/v1/completions", json={"model": "huge", "prompt": "x"})
        assert bad.status_code == 404
        err = bad.json()["error"]
        assert (err["code"], err["param"]) == ("model_not_found", "model")
        assert "'huge'" in err["message"] and "'big', 'tiny'" in err["message"]
        ids = sorted(c["id"] for c in r.http.get("/v1/models").json()["data"])
        assert ids == ["big", "tiny"]
        # B fails: a "big" request has no other instance to go to
        stubs.mode[B] = "500"
        on_a = stubs.generated.count(A)
        failed = r.http.post("/v1/completions", json={"model": "big", "prompt": "x"})
        assert failed.status_code == 500 and stubs.generated.count(A) == on_a
    finally:
        r.close()


def test_a_shared_l3_credits_every_instance_with_the_stored_pages(stubs: Stubs) -> None:
    """A wrote the prompt's first 3 pages to storage; B holds the first on device. On their
    own, A's 12 stored tokens beat B's 4 on device (at 8,000 prefill and 40,000 storage
    tokens/s: 0.8 ms against 1.5 ms); with one L3 shared, B reads A's pages 2 and 3 as well
    and wins (0.7 ms)."""
    prompt = "abcdefghijklmnop"  # four pages of 4 tokens
    hashes = chain_hashes([ord(c) for c in prompt], 4)
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    for shared, home in ((False, A), (True, B)):
        router = Router(stubs, specs, shared_storage=shared)
        try:
            router.fleet.index.stored(A, hashes[:3], "storage")
            router.fleet.index.stored(B, hashes[:1], "device")
            for url in (A, B):
                router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
            got = router.http.post("/v1/completions", json={"prompt": prompt}).json()
            assert got["from"] == home, shared
        finally:
            router.close()


def test_the_bench_records_which_instance_answered_a_stream(router: Router, stubs: Stubs) -> None:
    """``kvtier bench ... --url`` through the router: each record names the instance from the
    streamed answer's headers (no expected time: these stubs send no KV events)."""
    from kvtier.bench.serve import Sample, _Client

    client = _Client(router.url, TIMEOUT_S)
    try:
        got = []
        for turn in range(2):
            s = Sample(conversation=0, turn=turn, status="")
            client.complete({"model": "tiny", "prompt": "hi", "stream": True}, s)
            got.append((s.instance, s.expected_s))
    finally:
        client.close()
    assert sorted(got) == [(A, None), (B, None)]  # idle instances take turns
    assert [i for i, _ in got] == stubs.generated


def test_the_router_prices_an_instance_by_what_it_measured_on_its_streams(stubs: Stubs) -> None:
    """A streamed answer chosen by expected time is a sample of what the requests ahead cost
    on its instance (a JSON answer, with no first output to time, is not); once the router
    has measured the cost there, that price replaces its default."""
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    router = Router(stubs, specs)
    try:
        prompt = "abcdefghijkl"  # three pages of 4 tokens, two of them on B's device
        router.fleet.index.stored(B, chain_hashes([ord(c) for c in prompt], 4)[:2], "device")
        for url in (A, B):
            router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
        b = router.instance(B)
        stubs.mode[B] = "slow"
        with router.http.stream(
            "POST", "/v1/completions", json={"prompt": prompt, "stream": True}
        ) as r:
            assert r.headers["x-kvtier-instance"] == B
            chunks = r.iter_raw()
            next(chunks)
            # its first output is timed as it passes, not when the stream goes on
            assert b.flights[0].first is not None
            stubs.release.set()
            b"".join(chunks)
        stubs.mode[B] = "ok"
        wait(lambda: b.in_flight == 0, "the stream to end")
        assert len(b.observed) == 1 and b.observed._samples[0][0] == Ahead()  # none ahead
        assert router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"] == B
        assert len(b.observed) == 1
        # One request in flight on B. At the default 50 ms a request ahead, A (12 uncached
        # tokens, 1.5 ms) is the faster; B measured requests ahead costing nothing.
        busy = b.begin(None)
        assert router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"] == A
        for ahead in (0, 1) * 8:
            b.observed.observe(Ahead(prefilling=ahead), 0.001, 0.01)
        assert router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"] == B
        b.end(busy)
    finally:
        router.close()


def test_a_request_ahead_that_streams_is_priced_at_its_measured_decode_cost(
    stubs: Stubs,
) -> None:
    """B holds two of the prompt's three pages on device and has one request in flight. B
    measured a request ahead in its prefill costing 100 ms and one that streams costing
    nothing: while B's request is in its prefill, A (12 uncached tokens, 1.5 ms) is the
    faster; once its first output passed, B is."""
    specs = [f"{u},events=tcp://127.0.0.1:9" for u in (A, B)]
    router = Router(stubs, specs)
    try:
        prompt = "abcdefghijkl"
        router.fleet.index.stored(B, chain_hashes([ord(c) for c in prompt], 4)[:2], "device")
        for url in (A, B):
            router.instance(url).subscriber._apply(0, msgpack.packb([0.0, [], 0]))
        b = router.instance(B)
        for ahead, excess in [(Ahead(), 0.001)] * 8 + [(Ahead(decoding=1), 0.001)] * 4:
            b.observed.observe(ahead, excess, 0.01)
        for _ in range(4):
            b.observed.observe(Ahead(prefilling=1), 0.101, 0.01)
        metrics = router.http.get("/metrics").text
        line = f'kvtier_route_load_seconds{{instance="{B}",term='
        assert _metric(metrics, line + '"prefill"}') == pytest.approx(0.1)
        assert _metric(metrics, line + '"decode"}') == 0.0
        assert _metric(metrics, line + '"duration"}') == pytest.approx(0.01)
        # A measured nothing: the defaults
        assert (
            _metric(metrics, f'kvtier_route_load_seconds{{instance="{A}",term="decode"}}') == 0.05
        )
        busy = b.begin(None)
        assert router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"] == A
        b.first_output(busy)
        assert router.http.post("/v1/completions", json={"prompt": prompt}).json()["from"] == B
        b.end(busy)
    finally:
        router.close()


def test_a_stream_cancelled_while_it_opens_ends_its_flight(stubs: Stubs) -> None:
    """The client leaving while the router opens a stream (inside an answer, when a stream
    that stopped early is replaced) cancels the open: the instance's flight ends with it,
    or the router would price that instance as busy for good."""
    fleet = Fleet(
        [InstanceSpec.parse(A)],
        FleetOptions(page_size=4),
        httpx.AsyncClient(transport=httpx.MockTransport(stubs)),
    )
    inst = fleet.instances[0]
    inst.healthy, inst.models = True, [{"id": "tiny"}]
    stubs.mode[A] = "cancel"
    body = {"prompt": "x", "stream": True}
    tries = Attempts(
        fleet, fleet._client, RouteMetrics(), body, False, "/v1/completions", b"{}", {}
    )
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(tries.open())
    assert inst.in_flight == 0 and inst.flights == []


def test_a_relay_that_never_ran_still_closes_the_stream_it_was_given() -> None:
    """A client gone before the response started: the response is cancelled before it
    iterates its relay, and the instance's stream and flight end all the same."""
    closed: list[str] = []

    class Resp:
        async def aclose(self) -> None:
            closed.append("stream")

    inst = Instance(parse_instances([A])[0])
    opened = Opened(inst, Decision(A, "prefix"), inst.begin(None), Resp())
    started: list[bool] = []

    async def relay():
        started.append(True)
        yield b"data: [DONE]\n\n"

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)

    response = RelayResponse(relay(), opened, media_type="text/event-stream")
    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    assert started == [] and closed == ["stream"] and inst.in_flight == 0
    asyncio.run(opened.close())  # once only
    assert closed == ["stream"]
