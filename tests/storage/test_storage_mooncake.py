"""Mooncake L3 backend against a local cluster: roundtrips, prefix lookups, envelope checks,
master outages and sharing between processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mooncake_harness
import pytest
import torch
from mooncake_harness import MooncakeCluster

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.mooncake import MooncakeBackend
from kvtier.storage.mooncake_url import parse_storage_url

pytestmark = pytest.mark.mooncake

mooncake_cluster = mooncake_harness.mooncake_cluster
NS_A = Namespace("a" * 32)
NS_B = Namespace("b" * 32)


def keys(n: int) -> list[PageKey]:
    return [PageKey(f"{i:032x}") for i in range(n)]


def pattern(n: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g))


def backend(cluster: MooncakeCluster, ns: Namespace = NS_A, **opts: object) -> MooncakeBackend:
    b = MooncakeBackend(cluster.url(**opts), ns)
    assert b.stats()["healthy"] == 1.0
    return b


def wait_healthy(b: MooncakeBackend, limit_s: float) -> float:
    t0 = time.monotonic()
    while b.stats()["healthy"] != 1.0:
        assert time.monotonic() - t0 < limit_s, f"not healthy again: {b.stats()}"
        b.batch_exists(keys(1))
        time.sleep(0.02)
    return time.monotonic() - t0


def test_url_parsing(tmp_path: Path) -> None:
    s = parse_storage_url(
        "mooncake://10.0.0.1:50051?metadata=http://10.0.0.2:8080/metadata&protocol=rdma"
        "&rdma_devices=mlx5_0,mlx5_1&segment=1GB&local_buffer=32MiB&timeout_s=0.5"
        "&local_host=10.0.0.3"
    )
    assert (s.master, s.metadata, s.protocol) == (
        "10.0.0.1:50051",
        "http://10.0.0.2:8080/metadata",
        "rdma",
    )
    assert (s.rdma_devices, s.segment, s.local_buffer) == ("mlx5_0,mlx5_1", 1 << 30, 32 << 20)
    assert (s.timeout_s, s.local_host) == (0.5, "10.0.0.3")
    d = parse_storage_url("mooncake://127.0.0.1:1234")
    assert (d.metadata, d.protocol, d.segment, d.local_host) == (
        "http://127.0.0.1:8080/metadata",
        "tcp",
        0,
        "127.0.0.1",
    )
    conf = tmp_path / "mc.json"
    conf.write_text(json.dumps({"master": "127.0.0.1:1234", "segment": "64MB", "timeout_s": 3}))
    j = parse_storage_url(str(conf))
    assert (j.master, j.segment, j.timeout_s) == ("127.0.0.1:1234", 64 << 20, 3.0)
    for bad, part in [
        ("mooncake://host", "HOST:PORT"),
        ("mooncake://h:1?segment=lots", "segment"),
        ("mooncake://h:1?protocol=udp", "protocol"),
        ("mooncake://h:1?timeout_s=-1", "timeout_s"),
        ("mooncake://h:1?colour=red", "colour"),
        ("mooncake://h:1?segment=1&segment=2", "twice"),
        (str(tmp_path / "missing.json"), "JSON"),
    ]:
        with pytest.raises(ConfigError, match=part) as e:
            parse_storage_url(bad)
        assert "storage_url" in str(e.value)
    with pytest.raises(ConfigError, match="storage_url"):
        MooncakeBackend.from_config(CacheConfig(), NS_A)


def test_roundtrip_zero_copy_and_bounce(mooncake_cluster: MooncakeCluster) -> None:
    b = backend(mooncake_cluster)
    assert b.capabilities.page_spans and b.capabilities.zero_copy
    assert b.capabilities.shared_across_hosts and not b.capabilities.persistent
    pool = torch.zeros(8 << 20, dtype=torch.uint8)
    b.register_buffers([pool])
    b.register_buffers([pool])  # registering again is a no-op
    page = 1 << 20
    src_pool = pool[: 4 * page].view(torch.bfloat16).view(4, -1)
    src_pool.copy_(torch.randn(4, page // 2).to(torch.bfloat16))
    outside = [torch.randn(3000, dtype=torch.float32), torch.randn(777).to(torch.bfloat16)]
    big = pattern(1, 80 << 20, seed=5)[0]  # larger than the bounce arena: grows it
    src = [*src_pool, *outside, big]
    ks = keys(len(src))
    assert b.batch_set(ks, src) == len(src)
    assert b.batch_set(ks[:2], src[:2]) == 2  # already stored
    dst_pool = pool[4 * page :].view(torch.bfloat16).view(4, -1)
    dst = [
        *dst_pool,
        torch.empty_like(outside[0]),
        torch.empty_like(outside[1]),
        torch.empty_like(big),
    ]
    assert b.batch_get(ks, dst) == len(src)
    for s, d in zip(src, dst, strict=True):
        assert s.dtype == d.dtype and torch.equal(s.view(torch.uint8), d.view(torch.uint8))
    st = b.stats()
    outside_bytes = sum(t.numel() * t.element_size() for t in [*outside, big])
    assert st["bytes_bounced"] == 2 * outside_bytes  # pool pages went straight through
    assert st["bytes_got"] == sum(t.numel() * t.element_size() for t in src)
    assert not b.errors
    b.close()
    assert b.batch_exists(ks) == 0 and b.stats()["healthy"] == 0.0


def test_exists_prefix_and_miss(mooncake_cluster: MooncakeCluster) -> None:
    b = backend(mooncake_cluster)
    ks, data = keys(5), pattern(5, 4096, seed=1)
    assert b.batch_set([ks[0], ks[1], ks[3]], [data[0], data[1], data[3]]) == 3
    assert b.batch_exists(ks) == 2
    assert b.batch_exists(ks[3:]) == 1
    assert b.batch_exists([ks[2], ks[0]]) == 0
    assert b.batch_exists([]) == 0
    out = [torch.empty(4096, dtype=torch.uint8) for _ in ks]
    assert b.batch_get(ks, out) == 2
    assert torch.equal(out[0], data[0]) and torch.equal(out[1], data[1])
    assert not b.errors  # a miss is not a fault
    b.close()


def _raw_object(ns: str, key: str, payload: bytes, crc: int | None = None) -> bytes:
    c = envelope.digest(payload) if crc is None else crc
    return envelope.pack(ns, key, len(payload), c) + payload


def test_envelope_foreign_checksum_short(mooncake_cluster: MooncakeCluster) -> None:
    a, b = backend(mooncake_cluster, NS_A), backend(mooncake_cluster, NS_B)
    raw = mooncake_cluster.raw_client()
    (k,), (data,) = keys(1), pattern(1, 4096, seed=2)
    assert a.batch_set([k], [data]) == 1
    stolen = raw.get(a.store_key(k))
    assert stolen == _raw_object(NS_A, k, data.numpy().tobytes())
    assert raw.put(b.store_key(k), stolen) == 0  # A's object where B looks for k
    assert b.batch_exists([k]) == 1
    out = torch.empty(4096, dtype=torch.uint8)
    assert b.batch_get([k], [out]) == 0
    assert b.errors["foreign"] == 1
    assert b.batch_exists([k]) == 0  # removed
    assert a.batch_get([k], [out]) == 1 and torch.equal(out, data)

    payload = data.numpy().tobytes()
    forged = {
        "checksum": _raw_object(NS_B, k, payload, crc=envelope.digest(payload) ^ 1),
        "short_read": _raw_object(NS_B, k, payload)[:-100],
        "format": b"\0" * len(_raw_object(NS_B, k, payload)),
    }
    for kind, blob in forged.items():
        assert raw.put(b.store_key(k), blob) == 0
        assert b.batch_get([k], [out]) == 0, kind
        assert b.errors[kind] == 1, (kind, dict(b.errors))
        assert b.batch_exists([k]) == 0, kind
    assert raw.put(b.store_key(k), _raw_object(NS_B, k, payload + b"x")) == 0
    assert b.batch_get([k], [out]) == 0 and b.errors["checksum"] == 2  # larger than the buffer
    assert b.stats()["healthy"] == 1.0
    a.close()
    b.close()


def test_master_kill_and_restart(mooncake_cluster: MooncakeCluster) -> None:
    b = backend(mooncake_cluster, timeout_s=1)
    ks, data = keys(4), pattern(4, 1 << 16, seed=3)
    out = [torch.empty_like(d) for d in data]
    assert b.batch_set(ks, data) == 4
    mooncake_cluster.kill_master()
    t0 = time.monotonic()
    assert b.batch_exists(ks) == 0
    assert b.batch_get(ks, out) == 0
    assert b.batch_set(ks, data) == 0
    assert time.monotonic() - t0 < 1.5
    st = b.stats()
    assert st["healthy"] == 0.0 and st["outages"] == 1.0 and st["skipped"] >= 2
    assert b.errors["unreachable"] + b.errors["timeout"] >= 1
    mooncake_cluster.start_master()
    wait_healthy(b, limit_s=12)
    assert b.stats()["reconnects"] == 1.0
    assert b.batch_exists(ks) == 0  # the restarted master starts empty
    assert b.batch_set(ks, data) == 4
    assert b.batch_get(ks, out) == 4
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))
    b.close()


def test_hung_master_times_out_and_recovers(mooncake_cluster: MooncakeCluster) -> None:
    b = backend(mooncake_cluster, timeout_s=0.5)
    ks, data = keys(2), pattern(2, 4096, seed=4)
    out = [torch.empty_like(d) for d in data]
    assert b.batch_set(ks, data) == 2
    unread = keys(4)[2:]  # never read before the second pause: no location the client knows
    assert b.batch_set(unread, data) == 2
    mooncake_cluster.pause_master()
    t0 = time.monotonic()
    assert b.batch_exists(ks) == 0
    assert time.monotonic() - t0 < 1.0
    assert b.errors["timeout"] == 1 and b.stats()["healthy"] == 0.0
    assert b.batch_get(ks, out) == 0  # answered at once while unhealthy
    mooncake_cluster.resume_master()
    wait_healthy(b, limit_s=5)
    assert b.batch_get(ks, out) == 2

    # A read to a hung master returns within its timeout; an abandoned call is fenced until it
    # ends. Now and then (about one run in ten) the client answers this read despite the paused
    # master, so both outcomes are accepted here; test_mooncake_hang.py pins the timeout path.
    mooncake_cluster.pause_master()
    t0 = time.monotonic()
    got = b.batch_get(unread, out)
    assert time.monotonic() - t0 < 1.0
    assert got in (0, 2)
    fence = b.read_fence()
    assert (fence is not None and not fence.done()) == (got == 0)
    mooncake_cluster.resume_master()
    if fence is not None:
        fence.result(timeout=60)
    assert b.read_fence() is None
    assert b.errors["timeout"] == (2 if got == 0 else 1)
    wait_healthy(b, limit_s=5)
    assert b.stats()["outages"] == (2.0 if got == 0 else 1.0)
    b.close()


def test_start_unhealthy_then_connect(mooncake_cluster: MooncakeCluster) -> None:
    mooncake_cluster.kill_master()
    b = MooncakeBackend(mooncake_cluster.url(timeout_s=1), NS_A)
    assert b.stats()["healthy"] == 0.0
    assert b.batch_exists(keys(1)) == 0 and b.batch_set(keys(1), pattern(1, 64, 0)) == 0
    mooncake_cluster.start_master()
    wait_healthy(b, limit_s=12)
    assert b.stats()["reconnects"] == 0.0  # a first connection, not a reconnection
    assert b.batch_set(keys(1), pattern(1, 64, 0)) == 1
    b.close()


_CHILD = """
import sys, torch
from kvtier.keys import Namespace, PageKey
from kvtier.storage.mooncake import MooncakeBackend
b = MooncakeBackend(sys.argv[1], Namespace("a" * 32))
ks = [PageKey(f"{i:032x}") for i in range(6)]
g = torch.Generator().manual_seed(10)
data = list(torch.randint(0, 256, (6, 50000), dtype=torch.uint8, generator=g))
out = [torch.empty_like(d) for d in data]
assert b.batch_get(ks[:3], out[:3]) == 3, dict(b.errors)
assert all(torch.equal(o, d) for o, d in zip(out[:3], data[:3]))
assert b.batch_set(ks[3:], data[3:]) == 3, dict(b.errors)
b.close()
print("child ok")
"""


def test_two_processes_share_objects(mooncake_cluster: MooncakeCluster) -> None:
    b = backend(mooncake_cluster)
    ks, data = keys(6), pattern(6, 50000, seed=10)
    assert b.batch_set(ks[:3], data[:3]) == 3
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, mooncake_cluster.url()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0 and "child ok" in child.stdout, child.stderr[-3000:]
    # The child has exited; what it wrote lives on in the storage node.
    out = [torch.empty_like(d) for d in data]
    assert b.batch_exists(ks) == 6
    assert b.batch_get(ks, out) == 6
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))
    b.close()
