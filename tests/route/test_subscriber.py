"""``EventSubscriber`` against a plain ZMQ PUB socket and a replay ROUTER written here in the
wire format (``[topic, seq, msgpack([ts, events, dp_rank])]``): events reach the index, a gap
is filled from the replay, a gap nobody can fill forgets the instance's pages. No sleeps: the
test publishes heartbeats until the subscriber has seen one, and waits on its condition."""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from kvtier.route.prefix_index import PrefixIndex, PrefixMatch
from kvtier.route.subscriber import END_SEQ, EventSubscriber

TIMEOUT_S = 5.0


def stored(hashes: list[int], medium: str, block_size: int = 16) -> list:
    return ["BlockStored", hashes, None, [], block_size, None, medium]


class Publisher:
    """A PUB socket and, optionally, a replay ROUTER serving every message published."""

    def __init__(self, replay: bool) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sent: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._thread = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self.sent):
                if seq >= first:
                    self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", END_SEQ, b""])

    def publish(self, events: list, live: bool = True) -> int:
        """Publish one batch (``live=False``: only into the replay buffer: a lost message)."""
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time(), events, 0])
        self.sent.append((seq, payload))
        if live:
            self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        return seq

    def until_seen(self, sub: EventSubscriber) -> int:
        """Publish heartbeats until the subscriber applied one (ZMQ drops what a PUB sends
        before the SUB's connection is up); the last heartbeat's seq."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            seq = self.publish([])
            if sub.wait_for(lambda s, seq=seq: s.last_seq >= seq, 0.05):
                return seq
        raise AssertionError("the subscriber saw no heartbeat")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TIMEOUT_S)
            self.router.close(0)
        self.pub.close(0)


@pytest.fixture
def replaying():
    p = Publisher(replay=True)
    yield p
    p.close()


def test_history_and_a_gap_are_replayed_into_the_index(replaying: Publisher) -> None:
    index = PrefixIndex()
    # published before the subscriber exists: only the replay can bring them
    replaying.publish([stored([1, 2, 3], "device")])
    replaying.publish([stored([1, 2], "host")])
    replaying.publish([["BlockRemoved", [3], "device"]])
    sub = EventSubscriber("i", replaying.endpoint, index, replay_endpoint=replaying.replay_endpoint)
    sub.start()
    try:
        replaying.until_seen(sub)
        assert index.match("i", [1, 2, 3]) == PrefixMatch(device=2)
        assert index.tiers("i", 1) == {"device", "host"}
        assert sub.page_size == 16 and sub.gaps == 0
        # a message lost on the way: the next one reveals the gap, the replay fills it
        replaying.publish([stored([1, 2, 3, 4], "storage", 16)], live=False)
        last = replaying.publish([])
        assert sub.wait_for(lambda s: s.last_seq >= last, TIMEOUT_S)
        assert index.tiers("i", 4) == {"storage"}
        assert index.match("i", [1, 2, 3, 4]) == PrefixMatch(device=2, storage=2)
        assert sub.gaps == 0 and not sub.stale(60.0)
        cleared = replaying.publish([["AllBlocksCleared"]])
        assert sub.wait_for(lambda s: s.last_seq >= cleared, TIMEOUT_S)
        assert index.pages("i") == 0
    finally:
        sub.stop()


def test_a_gap_without_replay_forgets_the_instance() -> None:
    pub = Publisher(replay=False)
    index = PrefixIndex()
    index.stored("other", [1], "device")
    sub = EventSubscriber("i", pub.endpoint, index)
    sub.start()
    try:
        pub.until_seen(sub)
        seq = pub.publish([stored([1, 2], "device", 8)])
        assert sub.wait_for(lambda s: s.last_seq >= seq, TIMEOUT_S)
        assert index.match("i", [1, 2]) == PrefixMatch(device=2) and sub.page_size == 8
        pub.publish([["BlockRemoved", [2], "device"]], live=False)  # lost for good
        seq = pub.publish([])
        assert sub.wait_for(lambda s: s.last_seq >= seq, TIMEOUT_S)
        assert sub.gaps == 1 and index.pages("i") == 0
        assert index.pages("other") == 1
    finally:
        sub.stop()
        pub.close()


def test_staleness_follows_the_clock() -> None:
    now = [100.0]
    sub = EventSubscriber("i", "tcp://127.0.0.1:1", PrefixIndex(), clock=lambda: now[0])
    assert sub.stale(10.0)  # nothing ever arrived
    sub._apply(0, msgpack.packb([0.0, [], 0]))
    assert not sub.stale(10.0)
    now[0] += 10.5
    assert sub.stale(10.0)
