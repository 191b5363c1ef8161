"""The router's subscriber reads what kvtier's own publisher (``kvtier.events.publisher``)
sends: live batches, and the history before it connected through the replay socket."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvtier.events import wire
from kvtier.events.hashing import chain_hashes
from kvtier.events.publisher import ZmqPublisher
from kvtier.parallel.ports import free_port
from kvtier.route.prefix_index import PrefixIndex, PrefixMatch
from kvtier.route.subscriber import EventSubscriber

TIMEOUT_S = 5.0


def test_kvtier_publisher_to_router_index() -> None:
    ev, rp = free_port(), free_port()
    pub = ZmqPublisher(f"tcp://*:{ev}", f"tcp://*:{rp}", heartbeat_s=None)  # "*" binds
    index = PrefixIndex()
    sub = EventSubscriber(
        "i", f"tcp://127.0.0.1:{ev}", index, replay_endpoint=f"tcp://127.0.0.1:{rp}"
    )
    try:
        hashes = chain_hashes(list(range(12)), 4)
        stored = wire.block_stored(hashes, 0, list(range(12)), 4, "device")
        pub.publish(wire.event_batch(0.0, [stored]))  # before the subscriber: replayed
        pub.publish(wire.event_batch(0.0, [wire.block_removed(hashes[2:], "device")]))
        assert pub.wait_sent(TIMEOUT_S)
        sub.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not sub.wait_for(lambda s: s.last_seq >= 2, 0.05):
            assert time.monotonic() < deadline, "the subscriber saw no heartbeat"
            pub.publish(wire.event_batch(0.0, []))
        assert index.match("i", hashes) == PrefixMatch(device=2)
        assert sub.page_size == 4 and sub.gaps == 0
    finally:
        sub.stop()
        pub.close()


def test_heartbeats_keep_an_idle_instance_fresh() -> None:
    """No cache activity at all: the publisher's empty batches reach the router's subscriber,
    which counts them as messages (not stale) and indexes nothing."""
    ev, rp = free_port(), free_port()
    pub = ZmqPublisher(f"tcp://*:{ev}", f"tcp://*:{rp}", heartbeat_s=0.05)
    index = PrefixIndex()
    sub = EventSubscriber(
        "i", f"tcp://127.0.0.1:{ev}", index, replay_endpoint=f"tcp://127.0.0.1:{rp}"
    )
    try:
        sub.start()
        assert sub.stale(10.0)  # nothing yet
        assert sub.wait_for(lambda s: s.applied >= 3, TIMEOUT_S), "no heartbeat arrived"
        assert not sub.stale(10.0)
        assert sub.gaps == 0 and index.pages("i") == 0 and sub.page_size is None
    finally:
        sub.stop()
        pub.close()
