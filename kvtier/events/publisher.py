"""``ZmqPublisher``: KV event batches over ZeroMQ, as vLLM's ``ZmqEventPublisher`` sends them.

* A PUB socket sends each batch as ``[topic, seq, payload]`` (``kvtier.events.wire``). Like
  vLLM, an endpoint with a wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://`` is bound,
  any other (``tcp://127.0.0.1:5557``) connected to: the consumer binds there.
* A ROUTER replay socket (optional, always bound): a client (REQ, or DEALER sending an empty
  delimiter first) sends an 8-byte big-endian start sequence number and receives every
  buffered batch from it on as ``[seq, payload]``, then the end marker ``[END_SEQ, b""]``
  (``END_SEQ`` is -1 as 8 signed big-endian bytes).
* ``publish`` only puts the batch on a bounded queue: the engine never waits on the network.
  A full queue refuses the batch (the caller counts it); the publisher thread packs, sends and
  keeps the last ``buffer_batches`` batches for replay.
* Heartbeats: when no batch was sent for ``heartbeat_s`` seconds, the thread sends an empty
  batch ``[ts, [], None]``, so that a consumer tells an idle instance from a dead stream (and
  one that connected late learns the current ``seq`` and replays the history before it). A
  heartbeat is a batch like any other: it takes the next ``seq`` and is kept for replay, so a
  replay never has holes.

Only the publisher thread touches the sockets after start-up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from kvtier.errors import ConfigError
from kvtier.events.wire import END_SEQ, event_batch, seq_bytes

log = logging.getLogger(__name__)

_IDLE_S = 0.02
"""How long the thread waits for a batch before looking at the replay socket again."""

HEARTBEAT_S = 2.0
"""Default seconds without a batch before the thread sends an empty one (well under the
router's ``--events-stale-s`` default of 10, so an idle instance never looks stale)."""


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (vLLM's rule) rather than connecting to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """Publishes batches on ``endpoint`` under ``topic``; serves replays on ``replay_endpoint``.

    ``queue_batches`` bounds the batches waiting for the thread, ``buffer_batches`` the ones
    kept for replay. ``heartbeat_s``: seconds without a batch before an empty one is sent
    (``None``: no heartbeats). ``start=False`` leaves the thread stopped until ``start()`` (tests fill
    the queue with it). Raises ``ConfigError`` naming ``option``/``replay_option`` when a
    socket cannot be bound or connected.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        queue_batches: int = 1000,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        heartbeat_s: float | None = HEARTBEAT_S,
        start: bool = True,
        option: str = "kv_events",
        replay_option: str = "kv_events_replay",
    ) -> None:
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive or None, got {heartbeat_s}")
        self.topic = topic.encode()
        self.heartbeat_s = heartbeat_s
        self.heartbeats = 0
        """Empty batches sent because the stream was idle."""
        self._queue: queue.Queue[list] = queue.Queue(maxsize=queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            try:
                (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
            except zmq.ZMQError as e:
                raise ConfigError(f"{option}={endpoint!r}: {e}") from None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                try:
                    self._replay.bind(replay_endpoint)
                except zmq.ZMQError as e:
                    raise ConfigError(f"{replay_option}={replay_endpoint!r}: {e}") from None
        except ConfigError:
            self._close_sockets()
            raise
        self._seq = 0
        self._queued = 0
        self._sent = 0
        self._done = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._started = False
        if start:
            self.start()

    # ---- the engine's side ---------------------------------------------------------------
    def publish(self, batch: list) -> bool:
        """Queue ``batch`` (``kvtier.events.wire.event_batch``) without blocking; ``False``
        when the queue is full or the publisher closed (the batch is dropped)."""
        if self._stop.is_set():
            return False
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            return False
        with self._done:
            self._queued += 1
        return True

    def start(self) -> None:
        """Start the publisher thread (once)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def wait_sent(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every queued batch was sent and buffered;
        returns whether it was."""
        with self._done:
            return self._done.wait_for(lambda: self._sent >= self._queued, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (waiting at most ``timeout`` seconds), stop the thread and
        release the sockets. Idempotent."""
        if self._stop.is_set():
            return
        if self._started:
            self.wait_sent(timeout)
        self._stop.set()
        if self._started:
            self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a send stuck past the timeout
            log.warning("kv events: the publisher thread did not stop; sockets left open")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread ------------------------------------------------------------
    def _run(self) -> None:
        last_sent = time.monotonic()
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                if (
                    self.heartbeat_s is not None
                    and time.monotonic() - last_sent >= self.heartbeat_s
                ):
                    # Counted before the send: a subscriber that has received heartbeat n
                    # must already see ``heartbeats > n`` here.
                    self.heartbeats += 1
                    self._send(event_batch(time.time(), []))
                    last_sent = time.monotonic()
                continue
            self._send(batch)
            last_sent = time.monotonic()
            with self._done:
                self._sent += 1
                self._done.notify_all()

    def _send(self, batch: list) -> None:
        """Pack ``batch``, send it under the next ``seq`` and keep it for replay."""
        try:
            payload = msgpack.packb(batch, use_bin_type=True)
            seq, self._seq = self._seq, self._seq + 1
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
            self._buffer.append((seq, payload))
        except Exception:  # never let one bad batch stop the stream; it is logged
            log.exception("kv events: a batch could not be sent")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq_bytes(seq), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", END_SEQ, b""))  # type: ignore[union-attr]
