"""Mooncake writes: how a batch is cut into put calls (the next group leaves when the call in
flight ended or the group is full), what a fault in the middle leaves stored, headers packed in
place, and the priority the store calls run at."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import mooncake_harness
import numpy as np
import pytest
import torch
from mooncake_harness import MooncakeCluster

from kvtier.errors import ConfigError, RequestError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.mooncake import FIRST_PUT_BYTES, MooncakeBackend
from kvtier.storage.mooncake_buffers import GROUP_KEYS, PUT_GROUP_BYTES
from kvtier.storage.mooncake_url import parse_storage_url

pytestmark = pytest.mark.mooncake

mooncake_cluster = mooncake_harness.mooncake_cluster
NS = Namespace("d" * 32)


def keys(n: int) -> list[PageKey]:
    return [PageKey(f"{i:032x}") for i in range(n)]


class RecordingStore:
    """A real client that records each put call's (names, sizes) and can answer the
    ``fail_call``-th put (0-based) with ``no_space`` for every object instead of running it."""

    def __init__(self, calls: list[tuple[list[str], list[list[int]]]], fail_call: int) -> None:
        self._real = mooncake_harness.MooncakeDistributedStore()
        self._calls, self._fail = calls, fail_call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def batch_put_from_multi_buffers(self, names: Any, ptrs: Any, sizes: Any) -> Any:
        self._calls.append((list(names), [list(s) for s in sizes]))
        if len(self._calls) - 1 == self._fail:
            return [-200] * len(names)
        return self._real.batch_put_from_multi_buffers(names, ptrs, sizes)


def recording_backend(
    cluster: MooncakeCluster, fail_call: int = -1, **opts: object
) -> tuple[MooncakeBackend, list[tuple[list[str], list[list[int]]]]]:
    calls: list[tuple[list[str], list[list[int]]]] = []
    b = MooncakeBackend(cluster.url(**opts), NS, store_cls=lambda: RecordingStore(calls, fail_call))
    assert b.stats()["healthy"] == 1.0
    return b, calls


def test_pack_into_writes_the_packed_header_in_place() -> None:
    slots = np.full(3 * envelope.HEADER_BYTES, 7, np.uint8)
    h = envelope.HEADER_BYTES
    envelope.pack_into(slots[h : 2 * h], NS, "k" * 48, 12345, 0xDEADBEEF)
    assert slots[h : 2 * h].tobytes() == envelope.pack(NS, "k" * 48, 12345, 0xDEADBEEF)
    assert (slots[:h] == 7).all() and (slots[2 * h :] == 7).all()
    assert envelope.unpack(slots[h : 2 * h].tobytes(), NS, "k" * 48) == (12345, 0xDEADBEEF)
    with pytest.raises(RequestError, match="key"):
        envelope.pack_into(slots, NS, "k" * 49, 1, 1)
    with pytest.raises(RequestError, match="namespace"):
        envelope.pack_into(slots, "n" * 33, "k", 1, 1)


def test_url_poll_nice() -> None:
    assert parse_storage_url("mooncake://h:1").poll_nice == 10
    assert parse_storage_url("mooncake://h:1?poll_nice=0").poll_nice == 0
    for bad in ("20", "-1", "x"):
        with pytest.raises(ConfigError, match="poll_nice"):
            parse_storage_url(f"mooncake://h:1?poll_nice={bad}")


def test_groups_follow_the_link_and_the_caps(mooncake_cluster: MooncakeCluster) -> None:
    # A 1 MiB bounce half: 256 KiB payloads outside registered memory fill a group at four.
    b, calls = recording_backend(mooncake_cluster, bounce="1MB")
    page = 256 << 10
    n = 48
    pool = torch.zeros(n // 2, page, dtype=torch.uint8)
    b.register_buffers([pool])
    pool.copy_(torch.randint(0, 256, (n // 2, page), dtype=torch.uint8))
    outside = list(torch.randint(0, 256, (n // 2, page), dtype=torch.uint8))
    src = [t for pair in zip(pool, outside, strict=True) for t in pair]  # alternating
    assert b.batch_set(keys(n), src) == n
    sent = [name for names, _ in calls for name in names]
    assert sent == [b.store_key(k) for k in keys(n)]  # each object once, in order
    assert len(calls) > 1
    index = {b.store_key(k): i for i, k in enumerate(keys(n))}
    for names, sizes in calls:
        assert len(names) <= GROUP_KEYS
        assert all(s[0] == envelope.HEADER_BYTES for s in sizes)
        assert sum(s[1] for s in sizes) <= PUT_GROUP_BYTES
        assert sum(index[name] % 2 for name in names) <= 4  # bounced: at most one half
    # The first call waited for FIRST_PUT_BYTES of staged payload, or for a full group.
    first = sum(s[1] for s in calls[0][1])
    assert first >= FIRST_PUT_BYTES or sum(index[m] % 2 for m in calls[0][0]) == 4
    out = [torch.empty(page, dtype=torch.uint8) for _ in range(n)]
    assert b.batch_get(keys(n), out) == n
    assert all(torch.equal(o, s) for o, s in zip(out, src, strict=True))
    assert b.stats()["bytes_bounced"] == (n // 2 + n) * page  # half the writes, every read
    assert b.stats()["bytes_put"] == n * page and not b.errors
    b.close()


def test_calls_are_sized_to_the_timeout(
    mooncake_cluster: MooncakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 1 MiB per second of the 2 s timeout a call carries at most 2 MiB.
    monkeypatch.setattr("kvtier.storage.mooncake.PUT_BYTES_PER_TIMEOUT_S", 1 << 20)
    b, calls = recording_backend(mooncake_cluster, timeout_s=2)
    page = 512 << 10
    pool = torch.randint(0, 256, (16, page), dtype=torch.uint8)
    b.register_buffers([pool])
    assert b.batch_set(keys(16), list(pool)) == 16
    assert [n for names, _ in calls for n in names] == [b.store_key(k) for k in keys(16)]
    assert all(sum(s[1] for s in sizes) <= 2 << 20 for _, sizes in calls)
    assert len(calls) >= 4
    b.close()


def test_a_fault_in_the_middle_stores_the_leading_run(mooncake_cluster: MooncakeCluster) -> None:
    b, calls = recording_backend(mooncake_cluster, fail_call=1, bounce="1MB")
    page = 512 << 10
    src = list(torch.randint(0, 256, (12, page), dtype=torch.uint8))  # two a group (bounced)
    got = b.batch_set(keys(12), src)
    assert len(calls) == 2  # nothing is sent after the failed call
    assert got == len(calls[0][0]) == 2
    assert b.errors == {"no_space": 1}
    assert b.batch_exists(keys(12)) == 2
    assert b.stats()["bytes_put"] == 2 * page
    b.close()


def _nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("poll_nice", [0, 3])
def test_only_the_data_workers_run_below_the_process(
    mooncake_cluster: MooncakeCluster, poll_nice: int
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    earlier = {int(t) for t in os.listdir("/proc/self/task")}  # other tests' threads too
    b = MooncakeBackend(mooncake_cluster.url(poll_nice=poll_nice), NS)
    data = list(torch.randint(0, 256, (4, 4096), dtype=torch.uint8))
    assert b.batch_set(keys(4), data) == 4
    assert b.batch_get(keys(4), [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]) == 4
    workers = {
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith("kvtier-mooncake-data") and t.native_id not in earlier
    }
    assert workers
    started = {int(t) for t in os.listdir("/proc/self/task")} - earlier
    assert started > workers  # the client's own threads too
    niced = {t for t in started if _nice(t) != base}
    # The client's transport and RPC threads, started on the meta worker, stay at the
    # process's priority: a lowered transport would slow the transfers themselves.
    assert niced == (workers if poll_nice else set())
    assert all(_nice(t) == min(19, base + poll_nice) for t in workers)
    b.close()
