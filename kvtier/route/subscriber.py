"""The KV-event subscriber of one instance: a thread that reads the instance's ZMQ stream and
applies it to the router's ``PrefixIndex``.

The wire format is vLLM's: a PUB socket sends multipart ``[topic, seq, payload]`` with ``seq``
an 8-byte big-endian counter and ``payload`` msgpack ``[ts, events, data_parallel_rank]``;
events are ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium]``, ``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared", ...]``. A batch
with no events is a heartbeat: it only keeps the stream fresh.

A gap in ``seq`` (including events published before this subscriber connected) is filled from
the replay socket (a ROUTER): the subscriber sends ``[b"", start_seq]`` from a DEALER and reads
``[b"", seq, payload]`` frames until an empty payload ends the replay. When the replay does not
reach back to the gap (no replay socket, a timeout, a buffer that starts later), removals may
have been lost, so the instance's pages are forgotten: an index that under-reports only costs a
worse choice, one that over-reports sends requests to pages that are gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.route.prefix_index import PrefixIndex, tier_of

log = logging.getLogger("kvtier.route")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end marker's sequence number (its payload is empty)."""


class EventSubscriber:
    """Subscribes to one instance's KV events (``start``/``stop``); thread-safe readers:
    ``last_event_at``, ``page_size``, ``last_seq``, ``gaps``."""

    def __init__(
        self,
        instance: str,
        endpoint: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        replay_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance = instance
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self._index = index
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()
        self.last_event_at: float | None = None
        """``clock()`` when the last message (events or heartbeat) arrived."""
        self.last_seq = -1
        """The last sequence number applied (``-1``: none yet)."""
        self.page_size: int | None = None
        """``block_size`` of the last ``BlockStored``: the instance's page size."""
        self.gaps = 0
        """Gaps the replay could not fill (each one forgot the instance's pages)."""
        self.applied = 0
        """Messages applied, live or replayed."""

    def start(self) -> None:
        import zmq  # the events extra; imported here so that the proxy runs without it

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._thread = threading.Thread(
            target=self._run, args=(sub,), name=f"kvtier-route-events-{self.instance}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wait_for(self, predicate: Callable[[EventSubscriber], bool], timeout_s: float) -> bool:
        """Block until ``predicate(self)`` holds after some message was applied, or the
        timeout passed; returns whether it holds (tests and start-up use this)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def stale(self, limit_s: float) -> bool:
        """No message arrived within ``limit_s`` seconds (or none ever did)."""
        at = self.last_event_at
        return at is None or self._clock() - at > limit_s

    # the thread

    def _run(self, sub: Any) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    log.warning(
                        "%s: KV event message of %d frames ignored", self.instance, len(frames)
                    )
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq <= self.last_seq:
                    continue  # already applied by a replay
                if seq > self.last_seq + 1:
                    self._fill_gap(seq)
                    if seq <= self.last_seq:
                        continue
                self._apply(seq, payload)
        except Exception:
            log.exception("%s: the KV event subscriber stopped", self.instance)
        finally:
            sub.close(0)

    def _fill_gap(self, upto: int) -> None:
        """Replay ``[last_seq + 1, upto)``; forget the instance's pages when that fails."""
        start = self.last_seq + 1
        first = self._replay(start, upto) if self.replay_endpoint else None
        if first is None or first > start:
            had_state = self.last_seq >= 0
            if had_state:
                self.gaps += 1
                self._index.clear(self.instance)
                log.warning(
                    "%s: KV events %d..%d lost (replay %s); its cached pages are forgotten",
                    self.instance,
                    start,
                    upto - 1,
                    "unavailable" if first is None else f"starts at {first}",
                )
            # a fresh subscriber takes what history there is: nothing applied before it
            # can have been undone unseen

    def _replay(self, start: int, upto: int) -> int | None:
        """Apply replayed messages from ``start`` (stopping before ``upto`` is not needed:
        later ones are skipped live); the first replayed seq, or ``None`` on failure."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        first: int | None = None
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                while frames and frames[0] == b"":
                    frames.pop(0)  # the REQ-style envelope delimiter
                if len(frames) != 2:
                    return first
                seq_bytes, payload = frames
                if not payload or seq_bytes == END_SEQ:
                    return first
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if first is None:
                    first = seq
                if seq > self.last_seq:
                    self._apply(seq, payload)
            log.warning("%s: KV event replay timed out", self.instance)
            return None
        finally:
            sock.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        import msgpack

        try:
            _, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            for event in events:
                self._apply_event(event)
        except (ValueError, TypeError, IndexError) as e:
            log.warning("%s: KV event batch %d ignored: %s", self.instance, seq, e)
        with self._changed:
            self.last_seq = seq
            self.last_event_at = self._clock()
            self.applied += 1
            self._changed.notify_all()

    def _apply_event(self, event: list[Any]) -> None:
        kind = event[0]
        if kind == "BlockStored":
            hashes, block_size = event[1], event[4]
            medium = event[6] if len(event) > 6 else None
            self._index.stored(self.instance, hashes, tier_of(medium))
            if isinstance(block_size, int) and block_size > 0:
                self.page_size = block_size
        elif kind == "BlockRemoved":
            medium = event[2] if len(event) > 2 else None
            self._index.removed(self.instance, event[1], tier_of(medium))
        elif kind == "AllBlocksCleared":
            self._index.clear(self.instance)
        else:
            log.debug("%s: KV event %r ignored", self.instance, kind)
