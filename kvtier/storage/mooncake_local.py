"""``LocalMooncake``: a Mooncake cluster on 127.0.0.1 run as child processes (tests, benches)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable

from kvtier.errors import ConfigError, StorageError
from kvtier.parallel.ports import free_port


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a child outliving a crashed parent would hold its ports and memory.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    raise ConfigError(f"{name} not found in the mooncake package (pip install 'kvtier[mooncake]')")


class LocalMooncake:
    """A Mooncake cluster on 127.0.0.1 as child processes: ``mooncake_master`` with its HTTP
    metadata server, and one storage node (``mooncake_client``) holding ``segment_bytes``, so
    objects outlive the processes that wrote them. Ports are picked free at construction and
    kept across master restarts; logs go to ``log_dir`` (a new temp dir by default). Children
    are killed by ``stop``/context exit, and by the kernel if this process dies (Linux).
    Readiness is polled (master ``/health``, node segment in ``/metrics``): ``StorageError``
    naming the log directory if a child exits (``unreachable``) or is not ready within
    ``ready_timeout_s`` (``timeout``); ``ConfigError`` if the mooncake binaries are missing."""

    def __init__(
        self,
        segment_bytes: int = 512 << 20,
        log_dir: str | None = None,
        ready_timeout_s: float = 30,
    ) -> None:
        self.segment_bytes = segment_bytes
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvtier-mooncake-")
        self.ready_timeout_s = ready_timeout_s
        self.rpc_port, self.http_port, self.metrics_port, self.node_port = (
            free_port() for _ in range(4)
        )
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None

    def url(self, **options: object) -> str:
        """``storage_url`` of this cluster, with extra ``options`` (e.g. ``timeout_s=1``)."""
        opts = {
            "metadata": f"http://127.0.0.1:{self.http_port}/metadata",
            "local_host": "127.0.0.1",
            **options,
        }
        query = "&".join(f"{k}={v}" for k, v in opts.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?{query}"

    def start(self) -> LocalMooncake:
        """Start the master and the storage node; returns once the node's segment is mounted."""
        try:
            self.start_master()
            self.node = self._spawn(
                "node",
                "mooncake_client",
                f"-master_server_address=127.0.0.1:{self.rpc_port}",
                f"-metadata_server=http://127.0.0.1:{self.http_port}/metadata",
                f"-global_segment_size={self.segment_bytes}",
                "-host=127.0.0.1",
                f"-port={self.node_port}",
                "-protocol=tcp",
            )
            self._wait_mounted()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """(Re)start the master on the same ports; returns once it serves and, when the node
        runs, the node has mounted its segment again (the new master starts empty)."""
        self.master = self._spawn(
            "master",
            "mooncake_master",
            f"-rpc_port={self.rpc_port}",
            "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_port={self.metrics_port}",
            "-metrics_host=127.0.0.1",
        )
        self._wait(lambda: b'"service_ready":true' in self._get("/health"), "master ready")
        if self.node is not None:
            self._wait_mounted()

    def kill_master(self) -> None:
        """SIGKILL the master (the node keeps running) and reap it."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()

    def stop(self) -> None:
        """Kill every child; idempotent."""
        for proc in (self.node, self.master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.node = self.master = None

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, binary: str, *args: str) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as logf:
            return subprocess.Popen(
                [_binary(binary), *args],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def _get(self, path: str) -> bytes:
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{self.metrics_port}{path}"
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.read()
        return b""

    def _wait_mounted(self) -> None:
        def mounted() -> bool:
            m = re.search(rb"^master_total_capacity_bytes (\d+)", self._get("/metrics"), re.M)
            return m is not None and int(m.group(1)) >= self.segment_bytes

        self._wait(mounted, "storage node segment mounted")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready():
            for name, proc in (("master", self.master), ("node", self.node)):
                if proc is not None and proc.poll() is not None:
                    raise StorageError(
                        "unreachable",
                        f"mooncake {name} exited with {proc.returncode}; logs in {self.log_dir}",
                    )
            if time.monotonic() > deadline:
                raise StorageError(
                    "timeout", f"mooncake {what}: not within {self.ready_timeout_s} s"
                )
            time.sleep(0.02)
