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
caller's pages, so there is nothing to fence and no zero-copy. The staging buffers are kept
for the next batch (up to ``STAGING_BYTES``) unless the store may still hold them (its read or
write fence is up). Pages are sealed straight into
the staging buffer and opened straight into the caller's page (``encrypt_into`` /
``decrypt_into`` where the ``cryptography`` release has them), on up to ``CIPHER_THREADS``
threads: AES-GCM in OpenSSL runs without the interpreter lock, so a batch's pages are sealed
in parallel, as the file backend's I/O threads write them.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
CIPHER_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that seal and open a batch's pages (a batch of one runs on the calling thread)."""
STAGING_BYTES = 256 << 20
"""Staging buffers kept for reuse at most: fresh memory costs a page fault per 4 KiB on first
touch, about as much as sealing it."""


class _Staging:
    """Staging buffers by size, reused across batches once the store let go of them (taken
    from the cipher threads: locked)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: dict[int, list[torch.Tensor]] = {}
        self.bytes = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            kept = self.free.get(nbytes)
            if kept:
                self.bytes -= nbytes
                return kept.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, bufs: Sequence[torch.Tensor]) -> None:
        with self.lock:
            for b in bufs:
                if self.bytes + b.numel() > self.limit:
                    return
                self.free.setdefault(b.numel(), []).append(b)
                self.bytes += b.numel()


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
        self._into = hasattr(self._aead, "encrypt_into")  # cryptography >= 44
        self._key_id = hashlib.blake2b(key, digest_size=16, person=b"kvtier-key-id").digest()
        self._namespace = namespace.encode()
        self._pool: ThreadPoolExecutor | None = None
        self._staging = _Staging(STAGING_BYTES)

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
        sealed = self._each(len(keys), lambda i: self._seal(keys[i], buffers[i]))
        stored = self.inner.batch_set([self._name(k) for k in keys], sealed)
        if self.inner.write_fence() is None:  # else a put given up on may still read them
            self._staging.give(sealed)
        return stored

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        check_lengths(keys, buffers)
        staged = [self._staging.take(b.numel() * b.element_size() + OVERHEAD) for b in buffers]
        got = self.inner.batch_get([self._name(k) for k in keys], staged)
        opened = self._each(got, lambda i: self._open(keys[i], staged[i], buffers[i]))
        if self.inner.read_fence() is None:  # else a read given up on may still land in them
            self._staging.give(staged)
        for i, ok in enumerate(opened):
            if not ok:  # a prefix is what a batch returns: the first failure ends it
                self.fault("decrypt", f"object {keys[i]} does not decrypt under this key")
                return i
        return got

    # ---- sealing --------------------------------------------------------------------------
    def _seal(self, key: PageKey, buf: torch.Tensor) -> torch.Tensor:
        """``nonce | ciphertext | tag`` of page ``buf`` under ``key``'s associated data."""
        page = buf.contiguous().view(torch.uint8).reshape(-1)
        nonce = os.urandom(NONCE)
        if not self._into:
            out = nonce + self._aead.encrypt(nonce, page.numpy().tobytes(), self._aad(key))
            return torch.frombuffer(bytearray(out), dtype=torch.uint8)
        obj = self._staging.take(page.numel() + OVERHEAD)
        raw = obj.numpy()
        raw[:NONCE] = memoryview(nonce)
        self._aead.encrypt_into(nonce, page.numpy(), self._aad(key), raw[NONCE:])
        return obj

    def _open(self, key: PageKey, obj: torch.Tensor, buf: torch.Tensor) -> bool:
        """Open object ``obj`` into page ``buf``; ``False`` when it does not decrypt (a wrong
        key, another object, a flipped byte), ``buf`` then zeroed or untouched."""
        from cryptography.exceptions import InvalidTag

        raw = obj.numpy()
        nonce = raw[:NONCE].tobytes()
        dst = buf.view(torch.uint8).reshape(-1)
        into = self._into and dst.is_contiguous()
        try:
            if into:
                self._aead.decrypt_into(nonce, raw[NONCE:], self._aad(key), dst.numpy())
                return True
            plain = self._aead.decrypt(nonce, raw[NONCE:].tobytes(), self._aad(key))
        except InvalidTag:
            if into:  # the counter-mode bytes landed before the tag was checked: not kept
                dst.zero_()
            return False
        dst.copy_(torch.frombuffer(bytearray(plain), dtype=torch.uint8))
        return True

    def _each(self, n: int, fn: Callable[[int], object]) -> list:
        """``[fn(0), ..., fn(n - 1)]``, on the cipher threads when there is more than one."""
        if n <= 1 or CIPHER_THREADS == 1:
            return [fn(i) for i in range(n)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(CIPHER_THREADS, thread_name_prefix="kvtier-cipher")
        return list(self._pool.map(fn, range(n)))

    def read_fence(self) -> Future[None] | None:
        return None  # the backend only ever holds the wrapper's staging buffers

    def write_fence(self) -> Future[None] | None:
        return None

    def stats(self) -> dict[str, float]:
        return {**self.inner.stats(), "encrypted": 1.0}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.inner.close()
