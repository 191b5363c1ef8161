"""Encryption at rest: every L3 object sealed with AES-256-GCM before it leaves the process.

``CacheConfig.storage_encryption`` wraps the configured backend in an :class:`EncryptedBackend`.
An object then holds ``nonce (12 bytes) | ciphertext | tag (16 bytes)``; the associated data
binds it to the cache's namespace and its own key, so an object copied under another key, a
flipped byte or another tenant's key never decrypts: each is a counted miss (fault kind
``decrypt``), never served.

Keys. A 32-byte master key comes from ``CacheConfig.storage_key_file`` (32 raw bytes, or 64 hex
characters) or, without one, the ``KVTIER_STORAGE_KEY`` environment variable (64 hex
characters). The key that seals objects is derived per tenant (HKDF-SHA256 over the master key
with ``tenant_salt`` as context), so tenants sharing a store and a master key cannot read each
other's objects. Neither key is ever logged, kept in the configuration, a storage key or a
metric: the configuration holds only the key file's path, and object names carry a one-way
fingerprint of the derived key, so a new key (rotation) finds none of the old objects (they
age out of the store by its eviction) instead of failing to decrypt them.

Nonces are 96 random bits per object (``os.urandom``): at the 2^32 objects per key NIST allows
for random nonces, a repeat has probability below 2^-32.

Reads and writes go through staging buffers of the wrapper's own: the backend never sees the
caller's pages, so there is nothing to fence and no zero-copy.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage.base import StorageBackend, check_lengths

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG
"""Bytes an encrypted object has beyond its payload."""
KEY_ENV = "KVTIER_STORAGE_KEY"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def load_master_key(key_file: str | None) -> bytes:
    """The 32-byte master key from ``key_file`` or ``$KVTIER_STORAGE_KEY``; ``ConfigError``
    naming the source (never the key) when it is missing or malformed."""
    if key_file is not None:
        try:
            raw = Path(key_file).read_bytes()
        except OSError as e:
            raise ConfigError(f"storage_key_file={key_file!r} cannot be read: {e.strerror}") from e
        if len(raw) == 32:
            return raw
        text = raw.decode("ascii", "replace").strip()
        if _HEX64.match(text):
            return bytes.fromhex(text)
        raise ConfigError(
            f"storage_key_file={key_file!r} must hold 32 raw bytes or 64 hex characters "
            f"(it holds {len(raw)} bytes)"
        )
    text = os.environ.get(KEY_ENV, "").strip()
    if not text:
        raise ConfigError(
            f"storage_encryption=True needs a key: storage_key_file or ${KEY_ENV} "
            "(64 hex characters, e.g. from `openssl rand -hex 32`)"
        )
    if not _HEX64.match(text):
        raise ConfigError(f"${KEY_ENV} must be 64 hex characters (32 bytes)")
    return bytes.fromhex(text)


def tenant_key(master: bytes, tenant_salt: str) -> bytes:
    """The AES-256 key of tenant ``tenant_salt`` (HKDF-SHA256 of the master key)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=b"kvtier-l3-encryption-v1",
        info=b"tenant:" + tenant_salt.encode(),
    )
    return hkdf.derive(master)


class EncryptedBackend(StorageBackend):
    """``inner`` with every object sealed by AES-256-GCM under ``key`` (module docstring);
    faults are counted in ``inner``'s counters, which this shares."""

    def __init__(self, inner: StorageBackend, key: bytes, namespace: Namespace) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:
            raise ConfigError(
                "storage_encryption=True needs the cryptography package "
                '(pip install "kvtier[encryption]")'
            ) from e
        if len(key) != 32:
            raise ConfigError(f"an AES-256 key has 32 bytes, not {len(key)}")
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.capabilities = replace(inner.capabilities, zero_copy=False)
        self.errors = inner.errors  # one set of fault counters for the store
        self._logged = inner._logged
        self._err_lock = inner._err_lock
        self._aead = AESGCM(key)
        self._key_id = hashlib.blake2b(key, digest_size=16, person=b"kvtier-key-id").digest()
        self._namespace = namespace.encode()

    # ---- names ----------------------------------------------------------------------------
    def _name(self, key: PageKey) -> PageKey:
        """The object name under this key: same shape as ``key`` (hex, its ``-suffix`` kept),
        different for every encryption key."""
        base, dash, suffix = key.partition("-")
        h = hashlib.blake2b(key=self._key_id, digest_size=max(1, len(base) // 2))
        h.update(base.encode())
        return PageKey(h.hexdigest() + dash + suffix)

    def _aad(self, key: PageKey) -> bytes:
        return b"kvtier-l3|" + self._namespace + b"|" + key.encode()

    # ---- the contract ---------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        return self.inner.batch_exists([self._name(k) for k in keys])

    def touch(self, keys: Sequence[PageKey]) -> int:
        return self.inner.touch([self._name(k) for k in keys])

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        check_lengths(keys, buffers)
        sealed = []
        for key, buf in zip(keys, buffers, strict=True):
            payload = buf.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            nonce = os.urandom(NONCE)
            out = nonce + self._aead.encrypt(nonce, payload, self._aad(key))
            sealed.append(torch.frombuffer(bytearray(out), dtype=torch.uint8))
        return self.inner.batch_set([self._name(k) for k in keys], sealed)

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        from cryptography.exceptions import InvalidTag

        check_lengths(keys, buffers)
        staged = [
            torch.empty(b.numel() * b.element_size() + OVERHEAD, dtype=torch.uint8) for b in buffers
        ]
        got = self.inner.batch_get([self._name(k) for k in keys], staged)
        for i in range(got):
            raw = staged[i].numpy().tobytes()
            try:
                plain = self._aead.decrypt(raw[:NONCE], raw[NONCE:], self._aad(keys[i]))
            except InvalidTag:
                self.fault("decrypt", f"object {keys[i]} does not decrypt under this key")
                return i
            dst = buffers[i].view(torch.uint8).reshape(-1)
            dst.copy_(torch.frombuffer(bytearray(plain), dtype=torch.uint8))
        return got

    def read_fence(self) -> Future[None] | None:
        return None  # the backend only ever holds the wrapper's staging buffers

    def write_fence(self) -> Future[None] | None:
        return None

    def stats(self) -> dict[str, float]:
        return {**self.inner.stats(), "encrypted": 1.0}

    def close(self) -> None:
        self.inner.close()
