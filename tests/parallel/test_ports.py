"""``free_port``: ports below the ephemeral range, never the same one twice."""

from __future__ import annotations

import socket

from kvtier.parallel import ports
from kvtier.parallel.ports import free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    got = [free_port() for _ in range(64)]
    assert len(set(got)) == 64
    start = ports._ephemeral_start()
    if start is not None and start > ports._LOWEST + 1000:
        assert all(ports._LOWEST <= p < start for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def _draws(monkeypatch, first: list[int]) -> None:
    """The kernel's draws return ``first`` in order, then ports it picks itself."""
    queue = list(first)
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: None)
    monkeypatch.setattr(ports, "_kernel_port", lambda: queue.pop(0) if queue else _fresh())


def test_a_port_in_use_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        _draws(monkeypatch, [taken])
        assert free_port() != taken


def test_a_port_given_once_is_not_given_again(monkeypatch) -> None:
    port = _fresh()
    _draws(monkeypatch, [port, port])
    assert free_port() == port
    assert free_port() != port


def _fresh() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
