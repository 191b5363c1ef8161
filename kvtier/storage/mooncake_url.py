"""``storage_url`` of the Mooncake L3 backend: ``MooncakeSettings`` and ``parse_storage_url``.

The URL::

    mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata&protocol=tcp&segment=0
        &local_buffer=16MB&bounce=64MB&timeout_s=2&local_host=127.0.0.1&rdma_devices=&poll_nice=10

or the path of a JSON file holding one object with the same keys plus ``"master": "HOST:PORT"``.
Only the master is required. ``metadata``: transfer metadata server (default: the master's
built-in one, ``http://MASTER_HOST:8080/metadata``). ``protocol``: ``tcp`` or ``rdma`` (with
comma-separated ``rdma_devices``). ``segment``: memory this process contributes to the pool;
the default 0 keeps objects in storage nodes only, so they outlive this process. ``local_buffer``:
the client's transfer buffer. ``bounce``: registered staging memory for buffers outside the
registered host pool (grown for larger objects). ``timeout_s``: bound on one store call.
``local_host``: the address peers reach this process at. ``poll_nice``: how many nice steps
below the process the threads running store calls sit (0 to 19; the client busy-polls its
calling thread for a whole transfer, see ``kvtier.storage.mooncake_buffers``; 0: the process's
priority). Sizes take K/M/G/T suffixes (powers of 1024). A malformed string raises ``ConfigError`` naming ``storage_url`` and the bad part.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.parse
from dataclasses import dataclass

from kvtier.errors import ConfigError

_OPTIONS = ("metadata", "protocol", "rdma_devices", "segment", "local_buffer", "bounce")
_OPTIONS += ("timeout_s", "local_host", "poll_nice")
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


@dataclass(frozen=True)
class MooncakeSettings:
    """A parsed ``storage_url``."""

    master: str
    metadata: str
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment: int = 0
    local_buffer: int = 16 << 20
    bounce: int = 64 << 20
    timeout_s: float = 2.0
    local_host: str = "127.0.0.1"
    poll_nice: int = 10

    def setup_args(self, segment: int | None = None) -> tuple[str, str, int, int, str, str, str]:
        """Positional arguments of ``MooncakeDistributedStore.setup`` (0.3.x order), optionally
        contributing ``segment`` bytes instead of ``self.segment``."""
        seg = self.segment if segment is None else segment
        s = self
        return (s.local_host, s.metadata, seg, s.local_buffer, s.protocol, s.rdma_devices, s.master)


def parse_storage_url(spec: str) -> MooncakeSettings:
    """Parse a ``mooncake://`` URL or a JSON file path; raises ``ConfigError``."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"storage_url={spec!r}: {what}")

    if spec.startswith("mooncake://"):
        parts = urllib.parse.urlsplit(spec)
        if parts.path not in ("", "/") or parts.fragment:
            raise bad(f"unexpected path {parts.path!r}; options go after '?'")
        master, opts = parts.netloc, {}
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if name in opts:
                raise bad(f"option {name!r} given twice")
            opts[name] = value
    else:
        try:
            with open(spec) as f:
                raw = json.load(f)
        except OSError as e:
            raise bad(f"neither a mooncake:// URL nor a readable JSON file ({e.strerror})") from e
        except ValueError as e:
            raise bad(f"invalid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise bad("the JSON file must hold an object")
        opts = {str(k): str(v) for k, v in raw.items()}
        master = opts.pop("master", "")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"master {master!r} is not HOST:PORT")
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise bad(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(_OPTIONS)}")

    def size(name: str, default: int) -> int:
        text = opts.get(name, str(default)).strip().upper()
        m = re.fullmatch(r"(\d+)\s*([KMGT]?)(I?B)?", text)
        if not m:
            raise bad(f"{name}={opts[name]!r} is not a size such as 64MB")
        return int(m.group(1)) << _UNITS[m.group(2)]

    protocol = opts.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise bad(f"protocol={protocol!r} is not tcp or rdma")
    try:
        timeout_s = float(opts.get("timeout_s", 2.0))
    except ValueError:
        timeout_s = -1.0
    if not 0 < timeout_s < float("inf"):
        raise bad(f"timeout_s={opts['timeout_s']!r} is not a positive number of seconds")
    nice = opts.get("poll_nice", "10").strip()
    if not nice.isdigit() or int(nice) > 19:
        raise bad(f"poll_nice={opts['poll_nice']!r} is not a nice step from 0 to 19")
    loopback = host in ("127.0.0.1", "localhost", "::1")
    return MooncakeSettings(
        master=master,
        metadata=opts.get("metadata") or f"http://{host}:8080/metadata",
        protocol=protocol,
        rdma_devices=opts.get("rdma_devices", ""),
        segment=size("segment", 0),
        local_buffer=size("local_buffer", 16 << 20),
        bounce=max(size("bounce", 64 << 20), 1 << 20),
        timeout_s=timeout_s,
        local_host=opts.get("local_host") or ("127.0.0.1" if loopback else socket.getfqdn()),
        poll_nice=int(nice),
    )
