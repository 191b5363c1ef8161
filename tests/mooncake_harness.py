"""A local Mooncake cluster for tests: ``MooncakeCluster`` and the ``mooncake_cluster`` fixture.

Tests that use the fixture skip (with the import error as the reason) only when
``mooncake.store`` cannot be imported; any other start-up failure is an error.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.storage.mooncake_local import LocalMooncake

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as e:  # also raised when libibverbs1 is missing
    MooncakeDistributedStore = None
    IMPORT_ERROR: str | None = f"mooncake.store cannot be imported: {e}"
else:
    IMPORT_ERROR = None


def _state(stat: Path) -> str | None:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # a thread that just ended
        return None


class MooncakeCluster(LocalMooncake):
    """``LocalMooncake`` plus test controls: pausing the master (a hung rather than dead
    master) and raw store clients for forging objects. Raw clients close at ``stop``."""

    def __init__(self, log_dir: str | os.PathLike[str], segment_bytes: int = 256 << 20) -> None:
        super().__init__(segment_bytes=segment_bytes, log_dir=os.fspath(log_dir))
        self._raw: list[Any] = []

    def restart_master(self) -> None:
        """Kill the master and start a fresh one on the same ports (it starts empty)."""
        self.kill_master()
        self.start_master()

    def pause_master(self) -> None:
        """SIGSTOP the master: its sockets stay open but nothing answers. Returns once the
        kernel reports it stopped (a loaded host may let it answer one more request between
        the signal and the stop)."""
        assert self.master is not None
        self.master.send_signal(signal.SIGSTOP)
        self._await_state(stopped=True)

    def resume_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGCONT)
        self._await_state(stopped=False)

    def _await_state(self, stopped: bool, deadline_s: float = 10.0) -> None:
        """Wait until ``/proc`` shows every thread of the master stopped (``T``) or none;
        where there is no ``/proc`` the signal alone has to do."""
        tasks = Path(f"/proc/{self.master.pid}/task")
        end = time.monotonic() + deadline_s
        while tasks.is_dir():
            # a thread's state is the field after its parenthesised command name
            states = {_state(t / "stat") for t in tasks.iterdir()} - {None}
            if states and all((st == "T") == stopped for st in states):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"master did not {'stop' if stopped else 'resume'}: {states}")
            os.sched_yield()

    def raw_client(self) -> Any:
        """A plain ``MooncakeDistributedStore`` connected to this cluster (no segment)."""
        store = MooncakeDistributedStore()
        rc = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{self.http_port}/metadata",
            0,
            16 << 20,
            "tcp",
            "",
            f"127.0.0.1:{self.rpc_port}",
        )
        assert rc == 0, f"raw client setup returned {rc}; logs in {self.log_dir}"
        self._raw.append(store)
        return store

    def stop(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.resume_master()
        for store in self._raw:
            store.close()
        self._raw.clear()
        super().stop()


@pytest.fixture
def mooncake_cluster(tmp_path: Path) -> Iterator[MooncakeCluster]:
    """A running cluster (master + one 256 MiB storage node), logs under ``tmp_path``."""
    if IMPORT_ERROR is not None:
        pytest.skip(IMPORT_ERROR)
    log_dir = tmp_path / "mooncake-logs"
    log_dir.mkdir()
    with MooncakeCluster(log_dir) as cluster:
        yield cluster
