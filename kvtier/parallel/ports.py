"""TCP ports for servers this process is about to start on 127.0.0.1.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range, the
same range every outgoing connection draws from; between the probe that found it free and the
server's own bind, a client connection (of any process on the host) may take it, and a second
probe may be handed the same port again. ``free_port`` therefore picks below the ephemeral range
where the range can be read, and never returns a port twice in one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
"""No port below this is handed out (well-known and registered services sit lower)."""
_ATTEMPTS = 1000

_lock = threading.Lock()
_handed_out: set[int] = set()


def _ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        low, _high = _RANGE_FILE.read_text().split()
        return int(low)
    except (OSError, ValueError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, that this process has not been given before.

    Raises ``RuntimeError`` when no such port is found.
    """
    start = _ephemeral_start()
    with _lock:
        for _ in range(_ATTEMPTS):
            if start is not None and start > _LOWEST + 1000:
                port = random.randrange(_LOWEST, start)
            else:
                port = _kernel_port()
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 after {_ATTEMPTS} attempts")
