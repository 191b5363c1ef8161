"""Small pieces under the local-file L3 backend (``kvtier.storage.file``): the per-object fault,
unbuffered whole-buffer reads and writes, and OS-error kinds."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES


class ObjectFault(Exception):
    """A storage fault of ``kind`` on one object; ``corrupt`` objects are deleted."""

    def __init__(self, kind: str, message: str, corrupt: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.corrupt = corrupt


def bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat uint8 numpy array (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"storage buffers must be contiguous CPU tensors, got {tensor.device} "
            f"stride={tuple(tensor.stride())}"
        )
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def readinto_all(f: object, dest: memoryview) -> int:
    """Fill ``dest`` from the unbuffered file ``f``; returns the bytes read (short at EOF)."""
    done = 0
    while done < len(dest):
        n = f.readinto(dest[done:])  # type: ignore[attr-defined]
        if not n:
            break
        done += n
    return done


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def result_of(value: Future[int] | int) -> int:
    return value if isinstance(value, int) else value.result()


def check_lengths(keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> None:
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")


def os_kind(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "io"


def read_object(path: str, namespace: Namespace, key: str, dest: np.ndarray) -> int:
    """Fill ``dest`` with the payload at ``path`` after verifying the envelope header and
    sizes; returns the stored payload crc32 for the caller to verify."""
    with open(path, "rb", buffering=0) as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
        try:
            length, crc = envelope.unpack(head, namespace, key)
        except envelope.EnvelopeError as e:
            raise ObjectFault(e.kind, str(e), corrupt=True) from None
        if file_size < HEADER_BYTES + length:
            raise ObjectFault(
                "short_read",
                f"file has {file_size - HEADER_BYTES} of {length} payload bytes",
                corrupt=True,
            )
        if file_size > HEADER_BYTES + length:
            raise ObjectFault(
                "checksum", f"file size {file_size} exceeds header + {length}", corrupt=True
            )
        if length != dest.nbytes:
            raise ObjectFault("checksum", f"stored payload is {length} bytes, buffer {dest.nbytes}")
        got = readinto_all(f, memoryview(dest))
    if got != length:
        raise ObjectFault("short_read", f"read {got} of {length} payload bytes", corrupt=True)
    return crc
