"""L3 file backend throughput against plain sequential file I/O on the same directory."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage.file import HEADER_BYTES, FileBackend


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _check(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    if not torch.equal(src, dst):
        raise RuntimeError(f"{what}: bytes read back differ from the bytes written")


def bench_storage(
    directory: str | None = None,
    page_bytes: int = 2 << 20,
    num_pages: int = 256,
    repeats: int = 3,
) -> dict:
    """Write ``num_pages`` random pages of ``page_bytes`` through ``FileBackend`` and read them
    back into preallocated buffers; do the same with one plain file per page as the peer.

    Times are the best of ``repeats`` (fresh namespace/directory each). Raises ``RuntimeError``
    if any read-back differs. Files go to a temp dir under ``directory`` (default: cwd) that is
    removed afterwards. Returns GB/s for both and the ratio backend / plain.
    """
    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    total = num_pages * page_bytes
    keys = [PageKey(f"{i:032x}") for i in range(num_pages)]
    work = tempfile.mkdtemp(prefix="kvtier-bench-storage-", dir=directory or os.getcwd())
    budget = 2 * num_pages * (page_bytes + HEADER_BYTES)

    def log(msg: str) -> None:
        print(f"[bench storage] {msg}", file=sys.stderr, flush=True)

    try:
        backends = [FileBackend(work, Namespace(f"ns{r}"), budget) for r in range(repeats)]

        def be_write(r: int) -> float:
            t0 = time.perf_counter()
            n = backends[r].batch_set(keys, list(src))
            dt = time.perf_counter() - t0
            if n != num_pages:
                raise RuntimeError(f"batch_set stored {n}/{num_pages}: {dict(backends[r].errors)}")
            return dt

        def be_read(r: int) -> float:
            dst.zero_()
            t0 = time.perf_counter()
            n = backends[r].batch_get(keys, list(dst))
            dt = time.perf_counter() - t0
            if n != num_pages:
                raise RuntimeError(f"batch_get read {n}/{num_pages}: {dict(backends[r].errors)}")
            _check(src, dst, "file backend")
            return dt

        plain_dirs = [os.path.join(work, f"plain{r}") for r in range(repeats)]

        def plain_write(r: int) -> float:
            os.makedirs(plain_dirs[r])
            t0 = time.perf_counter()
            for i in range(num_pages):
                with open(os.path.join(plain_dirs[r], str(i)), "wb", buffering=0) as f:
                    f.write(src[i].numpy())
            return time.perf_counter() - t0

        def plain_read(r: int) -> float:
            dst.zero_()
            t0 = time.perf_counter()
            for i in range(num_pages):
                with open(os.path.join(plain_dirs[r], str(i)), "rb", buffering=0) as f:
                    f.readinto(dst[i].numpy())
            dt = time.perf_counter() - t0
            _check(src, dst, "plain I/O")
            return dt

        phases: list[tuple[str, Callable[[int], float]]] = [
            ("file_write", be_write),
            ("plain_write", plain_write),
            ("file_read", be_read),
            ("plain_read", plain_read),
        ]
        best: dict[str, float] = {}
        for r in range(repeats):
            # Interleaved so both sides see the same page-cache and writeback state.
            for name, fn in phases:
                if name.endswith("write"):
                    os.sync()  # start each write phase without the other side's dirty pages
                dt = fn(r)
                best[name] = min(best.get(name, dt), dt)
                log(
                    f"repeat {r} {name}: {_gbps(total, dt):.2f} GB/s ({num_pages} x {page_bytes} B)"
                )
            backends[r].close()
            shutil.rmtree(backends[r].dir)
            shutil.rmtree(plain_dirs[r])
        results = {name: _gbps(total, dt) for name, dt in best.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    out = {
        "bench": "storage",
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "total_bytes": total,
        "file_backend": {"write_gbps": results["file_write"], "read_gbps": results["file_read"]},
        "plain_io": {"write_gbps": results["plain_write"], "read_gbps": results["plain_read"]},
        "ratio": {
            "write": results["file_write"] / results["plain_write"],
            "read": results["file_read"] / results["plain_read"],
        },
    }
    log(f"ratio backend/plain: write {out['ratio']['write']:.2f}, read {out['ratio']['read']:.2f}")
    return out
