"""Encrypted L3 objects under the storage fault cases, on the file backend and on Mooncake: a
flipped ciphertext byte or two objects swapped, each re-wrapped in a valid envelope (so the
store's own checksum passes and only AES-GCM can tell), a truncated object, and objects of
another key (absent under this key's names, or planted under them) are all counted misses; the
caller's buffer keeps none of their bytes and the intact objects still read back."""

from __future__ import annotations

from pathlib import Path

import mooncake_harness
import pytest
import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.encrypted import OVERHEAD, EncryptedBackend, tenant_key
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend

pytest.importorskip("cryptography")

mooncake_cluster = mooncake_harness.mooncake_cluster
MASTER = bytes(range(32))
NS = Namespace("ns-faults")
PAGE = 4096
KEYS = [PageKey(f"{i:02x}" * 16) for i in range(4)]


def pages() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (PAGE,), generator=g, dtype=torch.uint8) for _ in KEYS]


def zeros() -> list[torch.Tensor]:
    return [torch.zeros(PAGE, dtype=torch.uint8) for _ in KEYS]


class FileStore:
    """Raw access to a file backend's objects (payload = the sealed object)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inner = FileBackend(root, NS, budget_bytes=1 << 24)

    def path(self, name: str) -> Path:
        return Path(self.inner.dir) / name[:2] / name

    def payload(self, name: str) -> bytes:
        return self.path(name).read_bytes()[HEADER_BYTES:]

    def put(self, name: str, payload: bytes) -> None:
        """``payload`` under ``name`` in a valid envelope (same size as what was there)."""
        header = envelope.pack(str(NS), name, len(payload), envelope.digest(payload))
        self.path(name).parent.mkdir(parents=True, exist_ok=True)
        self.path(name).write_bytes(header + payload)

    def truncate(self, name: str) -> None:
        p = self.path(name)
        p.write_bytes(p.read_bytes()[:-100])

    def reopen(self) -> None:
        """A backend over the same directory: it indexes files planted under new names."""
        self.inner.close()
        self.inner = FileBackend(self.root, NS, budget_bytes=1 << 24)

    def close(self) -> None:
        self.inner.close()


class MooncakeStore:
    """Raw access to a Mooncake backend's objects through the cluster's own client."""

    def __init__(self, cluster: mooncake_harness.MooncakeCluster) -> None:
        from kvtier.storage.mooncake import MooncakeBackend

        self.inner = MooncakeBackend(cluster.url(), NS)
        self.raw = cluster.raw_client()

    def payload(self, name: str) -> bytes:
        return self.raw.get(self.inner.store_key(name))[HEADER_BYTES:]

    def put(self, name: str, payload: bytes) -> None:
        header = envelope.pack(str(NS), name, len(payload), envelope.digest(payload))
        self._replace(name, header + payload)

    def truncate(self, name: str) -> None:
        self._replace(name, self.raw.get(self.inner.store_key(name))[:-100])

    def reopen(self) -> None:
        """Nothing to do: the store answers for what is in it."""

    def _replace(self, name: str, blob: bytes) -> None:
        key = self.inner.store_key(name)
        self.raw.remove(key, True)  # forced (a get holds a lease); a put never overwrites
        assert self.raw.put(key, blob) == 0

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(params=["file", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request, tmp_path: Path):
    if request.param == "file":
        s = FileStore(tmp_path)
    else:
        s = MooncakeStore(request.getfixturevalue("mooncake_cluster"))
    yield s
    s.close()


def sealed(store, salt: str = "") -> EncryptedBackend:
    return EncryptedBackend(store.inner, tenant_key(MASTER, salt), NS)


def test_a_flipped_ciphertext_byte_in_a_valid_envelope_is_a_decrypt_miss(store) -> None:
    b, data = sealed(store), pages()
    assert b.batch_set(KEYS, data) == 4
    name = b._name(KEYS[1])
    raw = bytearray(store.payload(name))
    raw[OVERHEAD + 100] ^= 0x01  # the ciphertext: the store's checksum is redone, it passes
    store.put(name, bytes(raw))
    out = zeros()
    assert b.batch_get(KEYS, out) == 1
    assert b.errors["decrypt"] == 1 and torch.equal(out[0], data[0])
    assert b.batch_get(KEYS[2:], out[2:]) == 2 and torch.equal(out[3], data[3])


def test_two_objects_swapped_are_decrypt_misses(store) -> None:
    b, data = sealed(store), pages()
    assert b.batch_set(KEYS, data) == 4
    n0, n1 = b._name(KEYS[0]), b._name(KEYS[1])
    p0, p1 = store.payload(n0), store.payload(n1)
    store.put(n0, p1)
    store.put(n1, p0)
    out = zeros()
    assert b.batch_get(KEYS[:1], out[:1]) == 0
    assert b.batch_get(KEYS[1:2], out[1:2]) == 0
    assert b.errors["decrypt"] == 2
    assert torch.count_nonzero(out[1]) == 0  # not the other object's plaintext
    assert b.batch_get(KEYS[2:], out[2:]) == 2 and torch.equal(out[2], data[2])


def test_a_truncated_object_is_a_miss(store) -> None:
    b, data = sealed(store), pages()
    assert b.batch_set(KEYS, data) == 4
    store.truncate(b._name(KEYS[0]))
    out = zeros()
    assert b.batch_get(KEYS, out) == 0
    assert sum(b.errors.values()) == 1  # the store's own check (short read) or the tag
    assert b.batch_get(KEYS[1:], out[1:]) == 3 and torch.equal(out[1], data[1])


def test_another_keys_objects_are_absent_and_planted_ones_do_not_decrypt(store) -> None:
    mine, theirs, data = sealed(store), sealed(store, salt="other tenant"), pages()
    assert theirs.batch_set(KEYS, data) == 4
    assert mine.batch_exists(KEYS) == 0  # other names: nothing to read
    out = zeros()
    assert mine.batch_get(KEYS, out) == 0 and not mine.errors
    # their object planted under my name
    store.put(mine._name(KEYS[0]), store.payload(theirs._name(KEYS[0])))
    store.reopen()
    mine, theirs = sealed(store), sealed(store, salt="other tenant")
    assert mine.batch_exists(KEYS[:1]) == 1
    assert mine.batch_get(KEYS[:1], out[:1]) == 0
    assert mine.errors["decrypt"] == 1
    assert torch.count_nonzero(out[0]) == 0  # not their plaintext
    assert theirs.batch_get(KEYS, out) == 4 and torch.equal(out[0], data[0])
