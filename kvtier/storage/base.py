"""The contract every L3 backend implements.

Objects are opaque byte blobs named by ``PageKey``. Backends never raise on a storage fault
(timeout, unreachable server, short read, checksum mismatch, full disk, permission error): they
count it under a kind in ``errors``, log the first occurrence of each kind, and report the
operation as not done. The caller then treats the page as a miss or a dropped backup.
Internally a fault travels as ``kvtier.errors.StorageError`` up to the backend's public method,
which counts it with ``fault``. Arguments no call could accept (mismatched lengths, buffers
that are not contiguous CPU tensors, malformed keys) raise ``RequestError``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvtier.errors import RequestError
from kvtier.keys import PageKey
from kvtier.types import Tier

log = logging.getLogger("kvtier.storage")


@dataclass(frozen=True)
class StorageCapabilities:
    """What a backend can do; kvtier gates features on these, never on backend names."""

    page_spans: bool = False
    """One object may hold several consecutive host pages (span-mode L3)."""
    zero_copy: bool = False
    """Reads land directly in the caller's (host pool) buffers without an extra copy."""
    persistent: bool = False
    """Objects survive a restart of this process."""
    shared_across_hosts: bool = False
    """Other machines see the same objects."""


class StorageBackend(ABC):
    """Batch key/value store for page objects.

    Thread-safety: kvtier calls ``batch_get``/``batch_set`` from one background I/O thread and
    ``batch_exists`` from the scheduling thread; implementations must tolerate that.
    """

    tier: ClassVar[Tier] = "storage"
    name: str = "abstract"
    capabilities: StorageCapabilities = StorageCapabilities()

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._err_lock = threading.Lock()

    @abstractmethod
    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Length of the longest prefix of ``keys`` whose objects all exist."""

    @abstractmethod
    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Read object ``keys[i]`` into ``buffers[i]`` (contiguous CPU tensors of exactly the
        object's size) in order; stop at the first miss or fault.

        Returns how many leading keys were read completely and verified. Buffers past that count
        may hold partial bytes and must not be used.
        """

    @abstractmethod
    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store ``buffers[i]`` under ``keys[i]`` in order; stop at the first fault.

        Returns how many leading keys are now stored (already-present keys count as stored).
        """

    def touch(self, keys: Sequence[PageKey]) -> int:
        """Mark objects as just used (a hit served from another tier) so eviction keeps them;
        returns the length of the leading run of ``keys`` that still exist. Called from the
        background I/O thread. Default: ``batch_exists`` (enough for backends without their own
        recency, or whose lookups refresh it)."""
        return self.batch_exists(keys)

    def read_fence(self) -> Future[None] | None:
        """``None`` when no earlier ``batch_get`` can still write into its buffers; else a future
        that completes once none can. A backend that gives up on a hung read before its transport
        let go of the caller's buffers returns one; the caller must not reuse the buffers of a
        read that came back short until it completes."""
        return None

    def write_fence(self) -> Future[None] | None:
        """As :meth:`read_fence` for ``batch_set``: ``None`` when no earlier write can still
        read its buffers; else a future that completes once none can (a relocatable host
        pool keeps such pages where they are until then)."""
        return None

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Memory that ``batch_get``/``batch_set`` buffers will mostly lie in (the host pool),
        given once at attach so zero-copy backends can register it with their transport.
        Buffers outside it must still work (through a bounce buffer if need be)."""

    def stats(self) -> dict[str, float]:
        """Backend-specific gauges (bytes used, object count, ...)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the backend is not used afterwards."""

    def fault(self, kind: str, message: str) -> None:
        """Count a storage fault of ``kind``; log the first one of each kind."""
        with self._err_lock:
            self.errors[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.warning("L3 %s backend fault (%s): %s; treated as a miss", self.name, kind, message)


def check_lengths(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> None:
    """Raise ``RequestError`` unless there is one buffer per key."""
    if len(keys) != len(buffers):
        raise RequestError(f"{len(keys)} keys but {len(buffers)} buffers")


def flat_cpu_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A storage buffer's memory as a flat uint8 numpy array (no copy). Raises
    ``RequestError`` unless ``tensor`` is a contiguous CPU tensor."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise RequestError(
            f"storage buffers must be contiguous CPU tensors, got {tensor.device} "
            f"stride={tuple(tensor.stride())}"
        )
    flat = tensor.detach()
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def cpu_byte_views(tensors: Sequence[torch.Tensor]) -> list[memoryview]:
    """Each storage buffer's memory as a flat, writable byte ``memoryview`` (no copy), for
    syscalls and digests that take any buffer; the views keep their tensors alive. Buffers
    that lie back to back (rows of one tensor, the usual batch) become slices of one view
    (``joined_view`` gives it back when they are also equal in size).
    Per tensor this costs a fifth to a third of ``flat_cpu_bytes`` (no detached tensor or
    numpy array per buffer), which is a tenth of a 64 KiB page's read. Raises
    ``RequestError`` as ``flat_cpu_bytes`` does."""
    strided = torch.strided
    spans: list[tuple[int, int]] = []
    for t in tensors:
        if not t.is_cpu or t.layout is not strided or not t.is_contiguous() or t.is_conj():
            raise RequestError(
                f"storage buffers must be contiguous CPU tensors, got {t.device} "
                f"stride={tuple(t.stride())}"
            )
        spans.append((t.data_ptr(), t.nbytes))
    if not spans:
        return []
    start, size = spans[0]
    end = start
    for ptr, nbytes in spans:
        if ptr != end or nbytes != size:
            return [_view(t, ptr, nbytes) for t, (ptr, nbytes) in zip(tensors, spans, strict=True)]
        end += nbytes
    whole = _view(list(tensors), start, end - start)
    if not size:
        return [whole] * len(spans)
    views = _Joined(whole[i : i + size] for i in range(0, end - start, size))
    views.whole = whole
    return views


class _Joined(list):
    """``cpu_byte_views`` of buffers that lie back to back, equal in size: ``whole`` views
    them all."""

    __slots__ = ("whole",)


def joined_view(views: Sequence[memoryview]) -> memoryview | None:
    """One view of all of ``views`` (a ``cpu_byte_views`` result) when they lie back to back
    and are equal in size, else ``None``."""
    return views.whole if isinstance(views, _Joined) else None


def _view(owner: object, ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``ptr`` that keeps ``owner`` (whose memory it
    is) alive."""
    raw = (ctypes.c_ubyte * nbytes).from_address(ptr)
    raw._owner = owner  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")  # plain bytes format: sliceable and assignable
