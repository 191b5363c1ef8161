"""One exception hierarchy: what kvtier raises on purpose is a ``KvtierError`` subclass naming
the thing at fault, and storage faults stay inside the backend as counted misses."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest
import torch

import kvtier.engine
import kvtier.pools
import kvtier.storage
from kvtier.errors import (
    ConfigError,
    IntegrityError,
    KvtierError,
    RequestError,
    StorageError,
)
from kvtier.keys import Namespace, PageKey
from kvtier.metrics import Metrics
from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.pools.allocator import PageAllocator
from kvtier.storage import envelope
from kvtier.storage.base import StorageBackend, flat_cpu_bytes
from kvtier.storage.file import FileBackend
from kvtier.storage.file_io import CorruptObject, read_object
from kvtier.types import DIRECTIONS, TIERS, check_direction, check_tier

NS = Namespace("ns0")
KEY = PageKey("ab01")


def _modules(package: object) -> list[str]:
    path = package.__path__  # type: ignore[attr-defined]
    prefix = package.__name__ + "."  # type: ignore[attr-defined]
    return [m.name for m in pkgutil.walk_packages(path, prefix)]


OWN = [
    *_modules(kvtier.storage),
    *_modules(kvtier.pools),
    *_modules(kvtier.engine),
    "kvtier.keys",
    "kvtier.paging",
    "kvtier.metrics",
    "kvtier.cache.resume",
    "kvtier.types",
]


@pytest.mark.parametrize("name", OWN)
def test_every_exception_class_is_a_kvtier_error(name: str) -> None:
    try:
        mod = importlib.import_module(name)
    except ImportError as e:  # optional extras (mooncake) need their package
        pytest.skip(f"{name}: {e}")
    for attr, obj in vars(mod).items():
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
            assert issubclass(obj, KvtierError), f"{name}.{attr}"


@pytest.fixture
def be(tmp_path: Path) -> FileBackend:
    return FileBackend(tmp_path, NS, budget_bytes=1 << 20)


def _stored(be: FileBackend) -> tuple[torch.Tensor, Path]:
    data = torch.arange(16, dtype=torch.float32)
    assert be.batch_set([KEY], [data]) == 1
    return data, Path(be.dir) / KEY[:2] / KEY


@pytest.mark.parametrize("key", ["", ".hidden", "a/b"])
def test_file_backend_bad_key_is_a_request_error_naming_it(be: FileBackend, key: str) -> None:
    with pytest.raises(RequestError, match=f"invalid storage key {key!r}") as info:
        be.batch_set([PageKey(key)], [torch.zeros(4)])
    assert isinstance(info.value, ValueError)
    assert be.errors == {}


def test_mismatched_lengths_and_buffers_are_request_errors(be: FileBackend) -> None:
    with pytest.raises(RequestError, match="2 keys but 1 buffers"):
        be.batch_get([KEY, PageKey("cd02")], [torch.zeros(4)])
    with pytest.raises(RequestError, match=r"contiguous CPU tensors, got cpu stride=\(2,\)"):
        flat_cpu_bytes(torch.zeros(8)[::2])


def test_envelope_garbage_raises_storage_error_with_kind() -> None:
    head = envelope.pack(NS, KEY, 64, 0)
    with pytest.raises(StorageError, match="^format: magic/version b'XXXX'") as info:
        envelope.unpack(b"XXXX" + head[4:], NS, KEY)
    assert (info.value.kind, info.value.detail[:13]) == ("format", "magic/version")
    bad = bytearray(head)
    bad[9] ^= 0xFF  # payload length, covered by the header checksum
    with pytest.raises(StorageError, match="^checksum: header checksum mismatch$") as info:
        envelope.unpack(bytes(bad), NS, KEY)
    assert info.value.kind == "checksum"
    with pytest.raises(StorageError, match="^foreign: object stored under key b'ab01'$"):
        envelope.unpack(head, NS, PageKey("ab02"))
    with pytest.raises(StorageError, match="^short_read: 10-byte header$"):
        envelope.unpack(head[:10], NS, KEY)


def test_envelope_key_too_long_is_a_request_error() -> None:
    with pytest.raises(RequestError, match="key 'x{49}' is longer than 48 bytes"):
        envelope.pack(NS, "x" * 49, 0, 0)


def test_corrupt_header_is_checksum_inside_and_a_counted_miss_at_batch_get(
    be: FileBackend,
) -> None:
    data, path = _stored(be)
    raw = bytearray(path.read_bytes())
    raw[9] ^= 0xFF
    path.write_bytes(bytes(raw))
    dest = torch.empty_like(data)
    with pytest.raises(CorruptObject, match="^checksum: header checksum mismatch$") as info:
        read_object(
            str(path), NS, KEY, envelope.expected_prefix(NS, KEY, dest.nbytes), flat_cpu_bytes(dest)
        )
    assert isinstance(info.value, StorageError) and info.value.kind == "checksum"

    assert be.batch_get([KEY], [dest]) == 0
    assert be.errors == {"checksum": 1}
    assert not path.exists() and be.keys() == []


def test_wrong_buffer_size_is_a_miss_that_keeps_the_object(be: FileBackend) -> None:
    _, path = _stored(be)
    small = torch.empty(8, dtype=torch.float32)
    with pytest.raises(StorageError, match="stored payload is 64 bytes, buffer 32") as info:
        read_object(
            str(path),
            NS,
            KEY,
            envelope.expected_prefix(NS, KEY, small.nbytes),
            flat_cpu_bytes(small),
        )
    assert not isinstance(info.value, CorruptObject)
    assert be.batch_get([KEY], [small]) == 0
    assert be.errors == {"checksum": 1}
    assert path.exists()


def test_storage_error_pickles_with_kind_and_detail() -> None:
    e = pickle.loads(pickle.dumps(StorageError("timeout", "get took over 5 s")))
    assert (type(e), e.kind, e.detail, str(e)) == (
        StorageError,
        "timeout",
        "get took over 5 s",
        "timeout: get took over 5 s",
    )
    assert isinstance(e, OSError) and isinstance(e, KvtierError)


def test_metrics_unknown_names_and_labels_are_integrity_errors() -> None:
    m = Metrics()
    with pytest.raises(IntegrityError, match="metric 'device_hit_tokenz' is not a counter"):
        m.inc("device_hit_tokenz")
    with pytest.raises(IntegrityError, match=r"metric 'hit_pages' with labels \('host',\)"):
        m.inc("hit_pages", 1, ("host",))
    with pytest.raises(IntegrityError, match="label tier='hots' is not one of device, host"):
        m.inc("hit_pages", 1, ("hots", "kv"))
    m.inc("hit_pages", 2, ("host", "kv"))
    assert m.snapshot()["hit_pages"] == {"host/kv": 2}


def test_tier_and_direction_checks() -> None:
    assert [check_tier(t) for t in ("device", "host", "storage")] == list(TIERS)
    assert [check_direction(d) for d in ("d2h", "h2d")] == list(DIRECTIONS)
    assert (DevicePool.tier, HostPool.tier, StorageBackend.tier) == TIERS
    with pytest.raises(IntegrityError, match="^node 7 tier='Host' is not one of device, host"):
        check_tier("Host", "node 7 tier")
    with pytest.raises(IntegrityError, match="^direction='h2s' is not one of d2h, h2d$"):
        check_direction("h2s")


def test_allocator_negative_count_is_a_request_error_naming_the_pool() -> None:
    with pytest.raises(RequestError, match="^host: cannot allocate -1 pages$"):
        PageAllocator(4, name="host").alloc(-1)


def test_missing_mooncake_binary_is_a_config_error() -> None:
    from kvtier.storage.mooncake_local import _binary

    with pytest.raises(ConfigError, match="no_such_binary not found in the mooncake package"):
        _binary("no_such_binary")


def test_model_batch_that_does_not_add_up_is_a_request_error() -> None:
    from kvtier.engine import CausalLM, SeqSlots
    from kvtier.engine.model_config import ModelConfig

    model = CausalLM(ModelConfig(num_layers=1))
    locs = torch.arange(3)
    with pytest.raises(RequestError, match="num_new add up to 3, not the 4 input tokens"):
        model.check_batch(torch.zeros(4, dtype=torch.int64), [SeqSlots(3, locs, locs)])


def test_unknown_pool_component_is_a_request_error_naming_the_pool() -> None:
    spec = PoolSpec("kv", 1, (2, 1, 4), torch.float32)
    dev = DevicePool([spec], 2, 4, torch.device("cpu"))
    host = HostPool([spec], 2, 4)
    with pytest.raises(RequestError, match=r"^device pool has no component 'kc' \(it holds kv\)$"):
        dev.layer(0, "kc")
    with pytest.raises(RequestError, match="^host pool has no component 'kc'"):
        host.read_pages("kc", torch.tensor([0]))
    assert dev.layer(0).shape == (8, 2, 1, 4)
