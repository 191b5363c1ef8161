"""KV events end to end: vLLM's encoding read by a plain msgpack consumer, the ZeroMQ wire
protocol (sequence numbers, replay, end marker), a full queue that drops and counts, and the
per-tier page sets a consumer rebuilds from the events equal to what the tree holds."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from factories import PS, make_cache, run_request  # noqa: E402

from kvtier.events.emitter import EventEmitter  # noqa: E402
from kvtier.events.hashing import chain_hashes  # noqa: E402
from kvtier.events.publisher import ZmqPublisher  # noqa: E402
from kvtier.metrics import Metrics  # noqa: E402
from kvtier.parallel.ports import free_port
from kvtier.tree.node import Node  # noqa: E402

WAIT_MS = 5000
"""How long a test waits for a message before failing (a poll timeout, not a sleep)."""

# vLLM's event structs (``vllm.distributed.kv_events``, array layout), field order after the tag.
VLLM_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode(payload: bytes) -> tuple[float, list[dict], int | None]:
    """A batch as a consumer written against vLLM's schema reads it: a msgpack array
    ``[ts, events, data_parallel_rank]``, each event ``[tag, *fields]``."""
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    out = []
    for ev in events:
        tag, *values = ev
        fields = VLLM_FIELDS[tag]
        assert len(values) == len(fields), ev
        out.append({"type": tag, **dict(zip(fields, values, strict=True))})
    return ts, out, dp_rank


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every ``(seq, payload)`` the replay socket sends from ``start`` on, checking the end
    marker closes the stream."""
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.connect(endpoint)
    try:
        req.send(start.to_bytes(8, "big"))
        got = []
        while True:
            assert req.poll(WAIT_MS), "no reply from the replay socket"
            seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
            # REQ takes a multipart reply per request: the rest arrives on the same socket
            # only for a DEALER, so switch to reading raw frames after the first one.
            req.close(linger=0)
            return got + _rest(endpoint, start, got)
    finally:
        req.close(linger=0)


def _rest(endpoint: str, start: int, first: list) -> list[tuple[int, bytes]]:
    # A DEALER (empty delimiter first) receives the whole stream on one socket.
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert d.poll(WAIT_MS), "the replay stream stopped before its end marker"
            empty, seq, payload = d.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), payload))
        assert got[: len(first)] == first
        return got[len(first) :]
    finally:
        d.close(linger=0)


def replay_all(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    return _rest(endpoint, start, [])


# ---- the publisher ---------------------------------------------------------------------------
def subscriber(port: int) -> zmq.Socket:
    """A SUB socket bound on ``port`` (the publisher connects to it), subscribed to all."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    return sub


def test_live_stream_seqs_are_contiguous_and_replay_returns_the_missed_batches():
    port, rport = free_port(), free_port()
    sub = subscriber(port)
    pub = ZmqPublisher(
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{rport}",
        topic="inst-7",
        buffer_batches=100,
        heartbeat_s=None,  # the seqs below are the published batches' alone
    )
    try:
        # PUB/SUB drops what is sent before the subscription arrives: probe until one lands.
        first = None
        for i in range(100):
            assert pub.publish([float(i), [["AllBlocksCleared"]], None])
            if sub.poll(50):
                first = sub.recv_multipart()
                break
        assert first is not None, "the subscriber never connected"
        topic, seq0, _ = first
        assert topic == b"inst-7" and len(seq0) == 8
        start = int.from_bytes(seq0, "big")
        while sub.poll(0):  # probes sent after the first one that landed
            start = int.from_bytes(sub.recv_multipart()[1], "big")
        for i in range(5):
            assert pub.publish([100.0 + i, [["BlockRemoved", [i], "host"]], None])
        seqs = []
        for _ in range(5):
            assert sub.poll(WAIT_MS)
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            ts, events, _ = decode(payload)
            assert events == [
                {"type": "BlockRemoved", "block_hashes": [seqs[-1] - start - 1], "medium": "host"}
            ]
        assert seqs == list(range(start + 1, start + 6))
        assert pub.wait_sent(5)
        missed = replay_all(f"tcp://127.0.0.1:{rport}", start + 3)
        assert [s for s, _ in missed] == [start + 3, start + 4, start + 5]
        assert [decode(p)[1][0]["block_hashes"] for _, p in missed] == [[2], [3], [4]]
        assert replay_all(f"tcp://127.0.0.1:{rport}", start + 6) == []
        # A REQ client gets the first batch and (vLLM's rule) then the end marker: one reply.
        assert replay(f"tcp://127.0.0.1:{rport}", start + 5)[0][0] == start + 5
    finally:
        pub.close()
        sub.close(linger=0)


def test_a_full_queue_drops_and_counts_without_blocking():
    rport = free_port()
    pub = ZmqPublisher(
        "inproc://kv-full",
        f"tcp://127.0.0.1:{rport}",
        queue_batches=2,
        heartbeat_s=None,
        start=False,
    )
    metrics = Metrics()
    emitter = EventEmitter(Node(id=0, parent=None, buf=b""), PS, pub, metrics)
    try:
        emitter.publish()  # the start-up AllBlocksCleared
        emitter.pending.append(["BlockRemoved", [1], "device"])
        emitter.publish()
        emitter.pending += [["BlockRemoved", [2], "device"], ["BlockRemoved", [3], "host"]]
        t0 = time.monotonic()
        emitter.publish()  # the queue holds 2 batches: dropped, never waited for
        assert time.monotonic() - t0 < 1.0
        assert metrics.snapshot()["kv_events_dropped"] == 2
        assert emitter.pending == []
        pub.start()
        assert pub.wait_sent(5)
        got = replay_all(f"tcp://127.0.0.1:{rport}")
        assert [s for s, _ in got] == [0, 1]
        assert [decode(p)[1] for _, p in got] == [
            [{"type": "AllBlocksCleared"}],
            [{"type": "BlockRemoved", "block_hashes": [1], "medium": "device"}],
        ]
    finally:
        pub.close()


def test_an_idle_publisher_sends_heartbeats_that_replay_keeps():
    port, rport = free_port(), free_port()
    sub = subscriber(port)
    pub = ZmqPublisher(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", topic="idle", heartbeat_s=0.05
    )
    try:
        # Nothing is published: whatever arrives is a heartbeat (the first ones may be sent
        # before the subscription lands, so the first seq seen need not be 0).
        got = []
        for _ in range(3):
            assert sub.poll(WAIT_MS), "no heartbeat from an idle publisher"
            topic, seq, payload = sub.recv_multipart()
            ts, events, dp_rank = decode(payload)
            assert topic == b"idle" and events == [] and dp_rank is None
            assert isinstance(ts, float) and ts > 0
            got.append(int.from_bytes(seq, "big"))
        assert got == list(range(got[0], got[0] + 3))
        assert pub.heartbeats >= got[-1] + 1
        # Heartbeats take seqs, so they are replayed too: a replay has no holes.
        history = replay_all(f"tcp://127.0.0.1:{rport}")
        assert [s for s, _ in history] == list(range(len(history)))
        assert len(history) >= got[-1] + 1
        assert all(decode(p)[1] == [] for _, p in history)
    finally:
        pub.close()
        sub.close(linger=0)


def test_a_heartbeat_period_must_be_positive():
    with pytest.raises(ValueError, match="heartbeat_s"):
        ZmqPublisher("inproc://kv-hb", heartbeat_s=0)


# ---- a cache's events against its tree ----------------------------------------------------
def rebuild(payloads: list[bytes]) -> dict[str, set[int]]:
    """Per-tier page hashes after applying every event in order."""
    tiers: dict[str, set[int]] = {"device": set(), "host": set(), "storage": set()}
    for payload in payloads:
        for ev in decode(payload)[1]:
            if ev["type"] == "AllBlocksCleared":
                for s in tiers.values():
                    s.clear()
            elif ev["type"] == "BlockStored":
                assert ev["block_size"] == PS and len(ev["token_ids"]) == PS * len(
                    ev["block_hashes"]
                )
                parent = ev["parent_block_hash"]
                assert chain_hashes(ev["token_ids"], PS, parent or 0) == ev["block_hashes"]
                tiers[ev["medium"]].update(ev["block_hashes"])
            else:
                tiers[ev["medium"]].difference_update(ev["block_hashes"])
    return tiers


def held(cache) -> dict[str, set[int]]:
    """Per-tier hashes of the whole pages the tree holds, from each node's full prefix."""
    tiers: dict[str, set[int]] = {"device": set(), "host": set(), "storage": set()}
    for node in cache.tree.nodes():
        path, n = [], node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        tokens = [t for p in reversed(path) for t in p.tokens]
        hashes = chain_hashes(tokens, PS)[node.depth // PS :]
        for tier, there in (
            ("device", node.device is not None),
            ("host", node.host is not None),
            ("storage", node.in_storage),
        ):
            if there:
                tiers[tier].update(hashes)
    return tiers


def events_of(cache, endpoint: str) -> dict[str, set[int]]:
    cache.poll()
    assert cache.controller.events is not None
    assert cache.controller.events.sink.wait_sent(5)
    got = replay_all(endpoint)
    assert [s for s, _ in got] == list(range(len(got)))  # contiguous from 0
    return rebuild([p for _, p in got])


A = list(range(100, 117))  # 4 whole pages and a partial tail
B = list(range(100, 108)) + list(range(300, 313))  # shares A's first 2 pages
C = list(range(500, 524))  # 6 pages


def test_rebuilt_tiers_equal_the_tree_through_backups_evictions_storage_and_flush(tmp_path):
    rport = free_port()
    endpoint = f"tcp://127.0.0.1:{rport}"
    c = make_cache(
        tmp_path,
        write_policy="write_through",
        kv_events="inproc://kv-cache",
        kv_events_replay=endpoint,
        kv_events_instance="test",
    )
    try:
        run_request(c, A)
        first = events_of(c, endpoint)
        assert first["device"] == set(chain_hashes(A, PS))
        assert first == held(c)

        run_request(c, B, seed=1)
        c.drain()  # host backups land, storage writes land
        got = events_of(c, endpoint)
        tree = held(c)
        assert tree["host"] and tree["storage"]
        assert got == tree

        run_request(c, C, seed=2)  # 6 more pages: the device tier (8) evicts
        c.drain()
        got, tree = events_of(c, endpoint), held(c)
        assert c.stats()["evicted_device_pages"] > 0
        assert got == tree

        c.controller.evict_host(100)  # host-only copies go, nodes with them
        got, tree = events_of(c, endpoint), held(c)
        assert got["device"] == tree["device"] and got["host"] == tree["host"]
        assert tree["storage"] <= got["storage"]
        stored = got["storage"]

        run_request(c, A, seed=3)  # back from storage / recomputed
        c.drain()
        got, tree = events_of(c, endpoint), held(c)
        assert got["device"] == tree["device"] and got["host"] == tree["host"]
        assert tree["storage"] <= got["storage"]

        c.flush()
        got, tree = events_of(c, endpoint), held(c)
        assert got["device"] == tree["device"] == set()
        assert got["host"] == tree["host"] == set()
        assert stored <= got["storage"]  # storage keeps its objects
        assert c.stats()["kv_events_dropped"] == 0
    finally:
        c.close()
