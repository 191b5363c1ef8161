"""L3 backend throughput against the same storage used plainly, measured in one run.

``file``: ``FileBackend`` against plain sequential file I/O of the same bytes on the same
directory, against the same plain I/O on the backend's I/O thread count (the rate a reader or
writer on that many threads reaches on the host) and, for reads, against those threads each
digesting what it read with the backend's checksum (the ceiling of a verified read that
copies the bytes out, then checks them), and optionally against SGLang's ``HiCacheFile`` in
its own process.
``mooncake`` (``kvtier.bench.storage_mooncake``): ``MooncakeBackend`` against the raw Mooncake
client on the same cluster.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.bench.helpers import check_equal, gbps, logger
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend

_log = logger("storage")


def _clock() -> tuple[float, float]:
    """Wall and process CPU time now (CPU time moves less than wall time on a shared host)."""
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - t0[0], cpu - t0[1]


def _on_threads(
    pool: ThreadPoolExecutor | None, threads: int, n: int, job: Callable[[int], None]
) -> None:
    """Run ``job(i)`` for ``i`` in ``range(n)`` on ``threads`` threads, the caller's among them
    (the others from ``pool``), each claiming the next ``i`` in order until none is left;
    returns when all have ended, raising the first exception a thread raised."""
    claim = itertools.count()

    def run() -> None:
        while (i := next(claim)) < n:
            job(i)

    futures = [pool.submit(run) for _ in range(1, min(threads, n))] if pool is not None else []
    try:
        run()
    finally:
        for f in futures:
            f.exception()
    for f in futures:
        f.result()


def _write_file(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


def _read_file(path: str, dest: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < len(dest):
            got = os.preadv(fd, [dest[done:]], done)
            if got == 0:
                raise RuntimeError(f"{path}: {done} of {len(dest)} bytes, then end of file")
            done += got
    finally:
        os.close(fd)


SIZES = ((1 << 20, 64), (2 << 20, 256), (64 << 10, 1024))
"""(page bytes, pages) runs of the file bench by default."""
PAGE_CACHE = (
    "reads hit the page cache: each side reads back files it wrote in the same run (dropping "
    "caches needs root), and no side fsyncs; the figures are syscall, copy and checksum cost. "
    "Every phase starts after an os.sync() (no side runs beside the writeback of another's "
    "writes), and before every read phase 256 MiB are written elsewhere so no side finds its "
    "pages or its destination buffers in the CPU's last-level cache"
)
_SWEEP_BYTES = 256 << 20


def bench_storage(
    directory: str | None = None,
    page_bytes: int | None = None,
    num_pages: int | None = None,
    repeats: int = 5,
    backend: str = "file",
    url: str | None = None,
    peer_python: str | None = None,
    encryption: bool = False,
) -> dict:
    """Benchmark L3 ``backend`` (``file`` or ``mooncake``) against its plain peer; with
    ``encryption`` (``file``), the file backend sealed by ``storage_encryption`` too.

    ``file`` uses ``directory`` (created when missing) and runs every size of ``SIZES``
    unless ``page_bytes`` and ``num_pages`` name one, with SGLang's ``HiCacheFile`` as a second
    peer when ``peer_python`` is given (see ``bench_file``); ``mooncake`` uses the cluster at
    ``url`` (a ``storage_url``), or starts a local one for the run when ``url`` is ``None``.
    Raises ``ValueError`` for another backend name.
    """
    if backend == "file":
        if directory:
            os.makedirs(directory, exist_ok=True)
        sizes = SIZES if page_bytes is None else ((page_bytes, num_pages or 256),)
        runs = [bench_file(directory, pb, n, repeats, peer_python, encryption) for pb, n in sizes]
        return {"bench": "storage", "backend": "file", "page_cache": PAGE_CACHE, "runs": runs}
    if backend == "mooncake":
        from kvtier.bench.storage_mooncake import bench_mooncake

        return bench_mooncake(url, page_bytes or 2 << 20, num_pages or 256, repeats)
    raise ValueError(f"backend={backend!r} is not file or mooncake")


def _peer_run(python: str, directory: str, page_bytes: int, num_pages: int) -> dict:
    """One write + read through SGLang's ``HiCacheFile`` in its own process; ``{"error"}``
    with the reason when it cannot run."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage_peer.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG_"))}
    try:
        done = subprocess.run(
            [python, script, directory, str(page_bytes), str(num_pages)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{python}: {e}"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{python} exited {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_file(
    directory: str | None = None,
    page_bytes: int = 2 << 20,
    num_pages: int = 256,
    repeats: int = 5,
    peer_python: str | None = None,
    encryption: bool = False,
) -> dict:
    """Write ``num_pages`` random pages of ``page_bytes`` through ``FileBackend`` (one
    ``batch_set``) and read them back into preallocated buffers (one ``batch_get``, every
    object verified); do the same with one plain file per page, written and read
    sequentially, as the peer (``plain_io``). ``parallel_plain_io`` is that plain I/O on the
    backend's I/O thread count (returned as ``io_threads``), whatever the batch size: the
    plain side's files read with ``os.preadv`` straight into the destination rows, and the
    pages written to files of their own, by threads each claiming the next page in order, no
    checksum. ``verified_read_ceiling`` is that parallel plain read with each page digested
    (``envelope.digest``) right after it lands.
    With ``peer_python``, SGLang's ``HiCacheFile`` does the same in its own process
    (``kvtier.bench.storage_peer``). With ``encryption``, the same backend sealed by
    ``kvtier.storage.encrypted`` (AES-256-GCM, a random key) does it too
    (``encrypted_file_backend``; ``encryption_ratio``: its rates over the plain backend's).

    Each repeat runs every side once, interleaved, in a fresh namespace/directory; figures are
    medians over ``repeats``. Raises ``RuntimeError`` if any read-back differs. Files go to a
    temp dir under ``directory`` (default: cwd) that is removed afterwards. Returns GB/s for
    each side and the ratios kvtier / plain (``ratio``), kvtier / parallel plain
    (``ratio_vs_parallel_plain``), kvtier / SGLang (``ratio_vs_sglang``) and parallel plain /
    SGLang (``parallel_plain_vs_sglang``), the last two when SGLang ran; also GB per second of
    process CPU time (``gb_per_cpu_s``: kvtier's and parallel plain's count all their threads;
    steadier than wall time on a shared host) and its ratios (``cpu_ratio``,
    ``cpu_ratio_vs_sglang``).
    """
    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    total = num_pages * page_bytes
    keys = [PageKey(f"{i:032x}") for i in range(num_pages)]
    work = tempfile.mkdtemp(prefix="kvtier-bench-storage-", dir=directory or os.getcwd())
    budget = 2 * num_pages * (page_bytes + HEADER_BYTES)
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peer_error: str | None = None
    peer_version = None
    pool: ThreadPoolExecutor | None = None

    # torch's intra-op threads spin for about 20 ms after a parallel op (the zeroing, the
    # byte checks): on a small host that takes a core from the phase timed next.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backends = [FileBackend(work, Namespace(f"ns{r}"), budget) for r in range(repeats)]
        sealed = []
        if encryption:
            from kvtier.storage.encrypted import EncryptedBackend

            sealed = [
                EncryptedBackend(
                    FileBackend(work, Namespace(f"sealed{r}"), budget + num_pages * 64),
                    os.urandom(32),
                    Namespace(f"sealed{r}"),
                )
                for r in range(repeats)
            ]
        threads = backends[0]._io.threads
        if threads > 1:
            # Started outside the timed phases: thread start-up is not what the side measures.
            pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="bench-parallel-plain")

        def writer(side: list, what: str) -> Callable[[int], tuple[float, float]]:
            """One timed ``batch_set`` of every page through ``side[r]``."""

            def write(r: int) -> tuple[float, float]:
                t0 = _clock()
                n = side[r].batch_set(keys, list(src))
                dt = _since(t0)
                if n != num_pages:
                    raise RuntimeError(f"{what} batch_set stored {n}/{num_pages}: {side[r].errors}")
                return dt

            return write

        def reader(side: list, what: str) -> Callable[[int], tuple[float, float]]:
            """One timed ``batch_get`` of every page through ``side[r]``, then checked."""

            def read(r: int) -> tuple[float, float]:
                t0 = _clock()
                n = side[r].batch_get(keys, list(dst))
                dt = _since(t0)
                if n != num_pages:
                    raise RuntimeError(f"{what} batch_get read {n}/{num_pages}: {side[r].errors}")
                check_equal(src, dst, what)
                return dt

            return read

        be_write, be_read = writer(backends, "file backend"), reader(backends, "file backend")
        sealed_write = writer(sealed, "encrypted file backend")
        sealed_read = reader(sealed, "encrypted file backend")

        plain_dirs = [os.path.join(work, f"plain{r}") for r in range(repeats)]

        def plain_write(r: int) -> tuple[float, float]:
            os.makedirs(plain_dirs[r])
            t0 = _clock()
            for i in range(num_pages):
                with open(os.path.join(plain_dirs[r], str(i)), "wb", buffering=0) as f:
                    f.write(src[i].numpy())
            return _since(t0)

        def plain_read(r: int) -> tuple[float, float]:
            t0 = _clock()
            for i in range(num_pages):
                with open(os.path.join(plain_dirs[r], str(i)), "rb", buffering=0) as f:
                    f.readinto(dst[i].numpy())
            dt = _since(t0)
            check_equal(src, dst, "plain I/O")
            return dt

        parallel_dirs = [os.path.join(work, f"parallel{r}") for r in range(repeats)]

        def parallel_write(r: int) -> tuple[float, float]:
            os.makedirs(parallel_dirs[r])
            t0 = _clock()
            _on_threads(
                pool,
                threads,
                num_pages,
                lambda i: _write_file(os.path.join(parallel_dirs[r], str(i)), src[i].numpy().data),
            )
            return _since(t0)

        def parallel_read(r: int, digest: bool = False) -> tuple[float, float]:
            """Plain reads on the I/O threads; with ``digest`` each page is digested as it
            lands (the verified-read ceiling)."""

            def job(i: int) -> None:
                dest = dst[i].numpy().data
                _read_file(os.path.join(plain_dirs[r], str(i)), dest)
                if digest:
                    envelope.digest(dest)

            t0 = _clock()
            _on_threads(pool, threads, num_pages, job)
            dt = _since(t0)
            check_equal(src, dst, "parallel plain I/O" + (" with digests" if digest else ""))
            return dt

        phases: list[tuple[str, Callable[[int], tuple[float, float]]]] = [
            ("file_write", be_write),
            ("plain_write", plain_write),
            ("parallel_plain_write", parallel_write),
            ("file_read", be_read),
            ("plain_read", plain_read),
            ("parallel_plain_read", parallel_read),
            ("verified_read_ceiling", lambda r: parallel_read(r, digest=True)),
        ]
        if encryption:
            phases[1:1] = [("sealed_write", sealed_write)]
            phases.insert(phases.index(("file_read", be_read)) + 1, ("sealed_read", sealed_read))
        for r in range(repeats):
            # Interleaved so every side sees the same page-cache and writeback state.
            for name, fn in phases:
                # Every phase starts with no dirty pages: no side runs beside the writeback
                # (block allocation, on the same cores) of what another side wrote.
                os.sync()
                if "_read" in name:
                    # Zeroed (so a read that skips bytes fails the check) before the sweep,
                    # as the SGLang side's buffers are: no side reads into destination lines
                    # already in the cache.
                    dst.zero_()
                    torch.ones(_SWEEP_BYTES, dtype=torch.uint8)
                dt, dcpu = fn(r)
                times.setdefault(name, []).append(dt)
                cpus.setdefault(name, []).append(dcpu)
                _log(
                    f"repeat {r} {name}: {gbps(total, dt):.2f} GB/s ({num_pages} x {page_bytes} B)"
                )
            backends[r].close()
            shutil.rmtree(backends[r].dir)
            if sealed:
                sealed[r].close()
                shutil.rmtree(sealed[r].inner.dir)
            shutil.rmtree(plain_dirs[r])
            shutil.rmtree(parallel_dirs[r])
            if peer_python is not None and peer_error is None:
                peer_dir = os.path.join(work, f"sglang{r}")
                got = _peer_run(peer_python, peer_dir, page_bytes, num_pages)
                shutil.rmtree(peer_dir, ignore_errors=True)
                if "error" in got:
                    peer_error = got["error"]
                    _log(f"SGLang peer not run: {peer_error}")
                    continue
                peer_version = got["sglang"]
                for side in ("write", "read"):
                    times.setdefault(f"sglang_{side}", []).append(got[f"{side}_s"])
                    cpus.setdefault(f"sglang_{side}", []).append(got[f"{side}_cpu_s"])
                    _log(f"repeat {r} sglang_{side}: {gbps(total, got[f'{side}_s']):.2f} GB/s")
        rates = {name: gbps(total, statistics.median(dts)) for name, dts in times.items()}
        per_cpu = {name: gbps(total, statistics.median(dts)) for name, dts in cpus.items()}
    finally:
        torch.set_num_threads(torch_threads)
        if pool is not None:
            pool.shutdown(wait=True)
        shutil.rmtree(work, ignore_errors=True)

    out: dict = {
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "total_bytes": total,
        "repeats": repeats,
        "statistic": "median",
        "file_backend": {"write_gbps": rates["file_write"], "read_gbps": rates["file_read"]},
        "plain_io": {"write_gbps": rates["plain_write"], "read_gbps": rates["plain_read"]},
        "io_threads": threads,
        "parallel_plain_io": {
            "write_gbps": rates["parallel_plain_write"],
            "read_gbps": rates["parallel_plain_read"],
        },
        "ratio": {
            "write": rates["file_write"] / rates["plain_write"],
            "read": rates["file_read"] / rates["plain_read"],
        },
        "ratio_vs_parallel_plain": {
            d: rates[f"file_{d}"] / rates[f"parallel_plain_{d}"] for d in ("write", "read")
        },
        "verified_read_ceiling": {"read_gbps": rates["verified_read_ceiling"]},
        "ratio_vs_verified_ceiling": {"read": rates["file_read"] / rates["verified_read_ceiling"]},
    }
    if encryption:
        out["encrypted_file_backend"] = {
            "write_gbps": rates["sealed_write"],
            "read_gbps": rates["sealed_read"],
        }
        out["encryption_ratio"] = {
            d: rates[f"sealed_{d}"] / rates[f"file_{d}"] for d in ("write", "read")
        }
    sides = {"file_backend": "file", "plain_io": "plain", "parallel_plain_io": "parallel_plain"}
    if "sglang_write" in per_cpu:
        sides["sglang_hicache_file"] = "sglang"
    out["gb_per_cpu_s"] = {
        side: {d: per_cpu[f"{p}_{d}"] for d in ("write", "read")} for side, p in sides.items()
    }
    out["cpu_ratio"] = {d: per_cpu[f"file_{d}"] / per_cpu[f"plain_{d}"] for d in ("write", "read")}
    if "sglang_write" in per_cpu:
        out["cpu_ratio_vs_sglang"] = {
            d: per_cpu[f"file_{d}"] / per_cpu[f"sglang_{d}"] for d in ("write", "read")
        }
    if peer_python is not None:
        if "sglang_write" in rates:
            out["sglang_hicache_file"] = {
                "version": peer_version,
                "write_gbps": rates["sglang_write"],
                "read_gbps": rates["sglang_read"],
            }
            out["ratio_vs_sglang"] = {
                "write": rates["file_write"] / rates["sglang_write"],
                "read": rates["file_read"] / rates["sglang_read"],
            }
            out["parallel_plain_vs_sglang"] = {
                d: rates[f"parallel_plain_{d}"] / rates[f"sglang_{d}"] for d in ("write", "read")
            }
        else:
            out["sglang_hicache_file"] = {"error": peer_error}
    _log(
        f"{num_pages} x {page_bytes} B: ratio backend/plain write {out['ratio']['write']:.2f}, "
        f"read {out['ratio']['read']:.2f}; backend/parallel plain ({threads} threads) write "
        f"{out['ratio_vs_parallel_plain']['write']:.2f}, "
        f"read {out['ratio_vs_parallel_plain']['read']:.2f}; backend/verified ceiling read "
        f"{out['ratio_vs_verified_ceiling']['read']:.2f}"
    )
    return out
