"""Encryption at rest (``storage_encryption``): objects are sealed with AES-256-GCM, byte-exact
through a cache's storage restore, unreadable as plaintext on disk; a tampered or moved object
is a counted miss, another tenant's or a rotated key reads nothing, the key is never stored or
shown, and a missing key fails at start naming where it was looked for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from factories import SPEC, cache_config, kv_of, run_request

from kvtier import TieredCache
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage.base import StorageBackend
from kvtier.storage.encrypted import KEY_ENV, OVERHEAD, EncryptedBackend, tenant_key

pytest.importorskip("cryptography")

MASTER = bytes(range(32))
KEY_HEX = MASTER.hex()
NS = Namespace("ns-test")


class Plain(StorageBackend):
    """An in-memory store of raw bytes (no checksums of its own), so AES-GCM alone guards."""

    name = "plain"

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, bytes] = {}

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def batch_set(self, keys, buffers) -> int:  # noqa: ANN001
        for k, b in zip(keys, buffers, strict=True):
            self.objects.setdefault(k, b.numpy().tobytes())
        return len(keys)

    def batch_get(self, keys, buffers) -> int:  # noqa: ANN001
        for i, (k, b) in enumerate(zip(keys, buffers, strict=True)):
            raw = self.objects.get(k)
            if raw is None or len(raw) != b.numel():
                return i
            b.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return len(keys)


def sealed(store: Plain, salt: str = "") -> EncryptedBackend:
    return EncryptedBackend(store, tenant_key(MASTER, salt), NS)


def page(seed: int, n: int = 256) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


KEYS = [PageKey("ab" * 16), PageKey("cd" * 16), PageKey("ab" * 16 + "-state")]


def test_roundtrip_is_byte_exact_and_the_store_never_sees_the_payload():
    store = Plain()
    enc = sealed(store)
    data = [page(i) for i in range(3)]
    assert enc.batch_set(KEYS, data) == 3
    assert not set(store.objects) & set(KEYS)  # names carry the key's fingerprint
    for raw, d in zip(store.objects.values(), data, strict=True):
        assert len(raw) == d.numel() + OVERHEAD
        assert d.numpy().tobytes()[:32] not in raw
    out = [torch.empty(256, dtype=torch.uint8) for _ in range(3)]
    assert enc.batch_exists(KEYS) == 3
    assert enc.batch_get(KEYS, out) == 3
    assert all(torch.equal(o, d) for o, d in zip(out, data, strict=True))


def test_a_tampered_or_moved_object_is_a_counted_miss():
    store = Plain()
    enc = sealed(store)
    enc.batch_set(KEYS[:2], [page(1), page(2)])
    n0, n1 = (enc._name(k) for k in KEYS[:2])  # noqa: SLF001
    flipped = bytearray(store.objects[n1])
    flipped[40] ^= 1
    store.objects[n1] = bytes(flipped)
    out = [torch.empty(256, dtype=torch.uint8) for _ in range(2)]
    assert enc.batch_get(KEYS[:2], out) == 1  # the first page, then the miss
    assert store.errors["decrypt"] == 1
    store.objects[n1] = store.objects[n0]  # page 0's object under page 1's name
    assert enc.batch_get(KEYS[1:2], out[1:]) == 0
    assert store.errors["decrypt"] == 2


def test_two_writes_of_one_payload_never_share_a_nonce():
    a, b = Plain(), Plain()
    sealed(a).batch_set(KEYS[:1], [page(7)])
    sealed(b).batch_set(KEYS[:1], [page(7)])
    (ra,), (rb,) = a.objects.values(), b.objects.values()
    assert ra[:12] != rb[:12] and ra[12:] != rb[12:]


def test_another_tenant_or_a_rotated_key_reads_nothing():
    store = Plain()
    sealed(store, "tenant-a").batch_set(KEYS[:2], [page(1), page(2)])
    assert sealed(store, "tenant-a").batch_exists(KEYS[:2]) == 2
    assert sealed(store, "tenant-b").batch_exists(KEYS[:2]) == 0
    rotated = EncryptedBackend(store, tenant_key(bytes(32), "tenant-a"), NS)
    assert rotated.batch_exists(KEYS[:2]) == 0
    assert store.errors["decrypt"] == 0  # not even tried: the names differ


def test_a_cache_restores_encrypted_objects_byte_exact(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY_HEX)
    cfg = cache_config(tmp_path / "l3", storage_encryption=True, tenant_salt="t1")
    c = TieredCache(cfg, [SPEC])
    tokens = list(range(40, 72))
    first = run_request(c, tokens)
    want = kv_of(c, first["locs"])
    c.drain()
    c.close()
    blob = b"".join(p.read_bytes() for p in (tmp_path / "l3").rglob("*") if p.is_file())
    assert want.numpy().tobytes()[:64] not in blob
    c = TieredCache(cfg, [SPEC])
    m = c.match(tokens)
    assert m.storage_len == len(tokens)
    pf = c.prefetch(m)
    pf.future.result()
    c.finish_prefetch(pf)
    m = c.match(tokens)
    c.lock(m.handle)
    assert torch.equal(kv_of(c, c.load(m).locs), want)
    c.unlock(m.handle)
    assert c.stats()["storage_errors"].get("decrypt", 0) == 0
    c.close()
    monkeypatch.setenv(KEY_ENV, "11" * 32)  # another key: a miss, never garbage
    c = TieredCache(cfg, [SPEC])
    assert c.match(tokens).storage_len == 0
    c.close()


def test_the_key_is_required_and_never_shown(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match="storage_key_file or \\$KVTIER_STORAGE_KEY"):
        TieredCache(cache_config(tmp_path / "l3", storage_encryption=True), [SPEC])
    bad = tmp_path / "key"
    bad.write_text("not a key")
    with pytest.raises(ConfigError, match="storage_key_file=.* must hold 32 raw bytes"):
        TieredCache(
            cache_config(tmp_path / "l3", storage_encryption=True, storage_key_file=str(bad)),
            [SPEC],
        )
    good = tmp_path / "key.hex"
    good.write_text(KEY_HEX + "\n")
    cfg = cache_config(tmp_path / "l3", storage_encryption=True, storage_key_file=str(good))
    c = TieredCache(cfg, [SPEC])
    shown = repr(cfg) + repr(c.stats()) + str(cfg.storage_key_file)
    assert KEY_HEX not in shown and KEY_HEX[:16] not in shown
    c.close()
    with pytest.raises(ConfigError, match="needs a storage backend"):
        cache_config(None, storage_encryption=True)
