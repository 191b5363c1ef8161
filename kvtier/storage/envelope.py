"""The envelope every L3 object travels in: a fixed header, then the payload.

    magic "KVTO" | version u16 | key length u16 | payload length u64 | namespace (32 B) |
    key (48 B) | payload crc32 u32 | header crc32 u32 | payload ...

The header names the deployment (namespace digest) and the key it was written under, so an
object copied, renamed or written by another deployment is never taken for this one's; the
header checksum covers every header field including the payload checksum, so together they
cover header and payload. Reads verify all of it; a mismatch is a miss counted by kind:
``format`` (not an object of this version), ``foreign`` (other namespace or key),
``short_read`` (fewer bytes than the header promises) or ``checksum``.
"""

from __future__ import annotations

import struct
import zlib

from kvtier.errors import RequestError, StorageError

MAGIC = b"KVTO"
VERSION = 2
_HEAD = struct.Struct("<4sHHQ32s48sI")
_FULL = struct.Struct("<4sHHQ32s48sII")
HEADER_BYTES = _FULL.size
"""Bytes an object takes beyond its payload."""


def _field(text: str, size: int, what: str) -> bytes:
    raw = text.encode()
    if len(raw) > size:
        raise RequestError(f"{what} {text!r} is longer than {size} bytes")
    return raw


def pack(namespace: str, key: str, payload_len: int, payload_crc: int) -> bytes:
    """Header bytes for an object whose payload has ``payload_len`` bytes and crc32
    ``payload_crc``. Raises ``RequestError`` naming a namespace over 32 or a key over 48
    bytes."""
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        len(key),
        payload_len,
        _field(namespace, 32, "namespace"),
        _field(key, 48, "key"),
        payload_crc,
    )
    return head + struct.pack("<I", zlib.crc32(head))


def unpack(header: bytes | memoryview, namespace: str, key: str) -> tuple[int, int]:
    """Verify ``header`` for ``key`` in ``namespace``; returns ``(payload_len, payload_crc)``.

    Raises ``StorageError`` with the fault kind (``short_read``, ``format``, ``checksum``,
    ``foreign``); backends count it as a miss.
    """
    if len(header) < HEADER_BYTES:
        raise StorageError("short_read", f"{len(header)}-byte header")
    magic, version, key_len, length, ns, k, payload_crc, head_crc = _FULL.unpack(
        bytes(header[:HEADER_BYTES])
    )
    if magic != MAGIC or version != VERSION:
        raise StorageError("format", f"magic/version {magic!r}/{version}, not {MAGIC!r}/{VERSION}")
    if zlib.crc32(bytes(header[: _HEAD.size])) != head_crc:
        raise StorageError("checksum", "header checksum mismatch")
    stored_ns = ns.rstrip(b"\0").decode(errors="replace")
    if stored_ns != namespace:
        raise StorageError("foreign", f"object of namespace {stored_ns!r}")
    if k[:key_len].decode(errors="replace") != key:
        raise StorageError("foreign", f"object stored under key {k[:key_len]!r}")
    return length, payload_crc


def crc(data: memoryview | bytes) -> int:
    """crc32 of a payload (zlib releases the GIL, so worker threads run in parallel)."""
    return zlib.crc32(data)
