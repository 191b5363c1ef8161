"""Packed 64 KiB ``batch_get`` against the bare reads it makes, by I/O thread count and
digest path.

1,024 objects of 64 KiB are stored as packs, then read back, alternated, medians of REPEATS
after a 256 MiB sweep each:

- ``bare``: the same pack runs read on the calling thread with nothing else (open, header
  ``pread``, ``preadv`` per 1 MiB of rows, XXH3 of each object, close);
- ``kvT``: ``batch_get`` of a backend with ``io_threads=T`` (python-xxhash holds the GIL while
  it digests a 64 KiB page);
- ``ctT``: the same with every digest through python-xxhash's own ``XXH3_64bits_dispatch``
  called by ``ctypes``, which releases the GIL for the call (tried, and not taken: 0.3-1.7 µs
  slower a page on one thread, no faster on 2-8 threads of a 16-core host).

Prints µs of wall time and of process CPU time per object.

    python results/file-tier/pack_read_cost.py [REPEATS] [DIR] [THREADS, e.g. 1,2,4]
"""

import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import xxhash

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope, file_layout
from kvtier.storage.base import cpu_byte_views
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend
from kvtier.storage.file_pack import PACK_HEAD

RUN_READ_CHUNK = 1 << 20

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 9
work = (sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvst") + "/pack_read_cost"
THREADS = [int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1").split(",")]
pb, n = 65536, 1024
torch.set_num_threads(1)  # no intra-op thread spinning beside a timed read
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [PageKey(f"{i:032x}") for i in range(n)]
os.system(f"rm -rf {work}")
os.makedirs(work)
budget = 4 * n * (pb + HEADER_BYTES)
writer = FileBackend(work, Namespace("ns"), budget, io_threads=1)
assert writer.batch_set(keys, list(src)) == n
_, runs = file_layout.reads(keys, writer._index.where, writer._path, [pb] * n)
assert all(first is not None for _, _, first in runs)
writer.close()
backends = {t: FileBackend(work, Namespace("ns"), budget, io_threads=t) for t in THREADS}
_lib = ctypes.CDLL(xxhash._xxhash.__file__)
try:  # the CPU-dispatching variant where the wheel exports it (4.1.0; 4.0.1 does not)
    _fn = _lib.XXH3_64bits_dispatch
except AttributeError:
    _fn = _lib.XXH3_64bits
_fn.restype = ctypes.c_uint64
_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def gil_free_digest(data) -> int:  # noqa: ANN001
    return _fn(ctypes.addressof(ctypes.c_char.from_buffer(data)), data.nbytes)


library_digest = envelope.digest


def bare() -> None:
    views = cpu_byte_views([dst])[0]
    for lo, hi, first in runs:
        fd = os.open(first.pack, os.O_RDONLY | os.O_CLOEXEC)
        os.pread(fd, (hi - lo) * HEADER_BYTES, PACK_HEAD + first.number * HEADER_BYTES)
        at, i = first.payload_at, lo
        per = RUN_READ_CHUNK // pb
        while i < hi:
            j = min(hi, i + per)
            os.preadv(fd, [views[k * pb : (k + 1) * pb] for k in range(i, j)], at)
            for k in range(i, j):
                xxhash.xxh3_64_intdigest(views[k * pb : (k + 1) * pb])
            at += (j - i) * pb
            i = j
        os.close(fd)


def get(t: int, free: bool):
    def fn() -> None:
        envelope.digest = gil_free_digest if free else library_digest
        try:
            assert backends[t].batch_get(keys, list(dst)) == n
        finally:
            envelope.digest = library_digest

    return fn


sides = {"bare": bare}
for t in THREADS:
    sides[f"kv{t}"] = get(t, False)
    sides[f"ct{t}"] = get(t, True)
res: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in sides}
for r in range(REPEATS):
    order = list(sides.items())
    for name, fn in order if r % 2 else order[::-1]:
        torch.ones(256 << 20, dtype=torch.uint8)
        dst.zero_()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        res[name][1].append(time.perf_counter() - w0)
        res[name][0].append(time.process_time() - c0)
        assert torch.equal(dst, src)
print(f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
for name, (cpu, wall) in res.items():
    w = statistics.median(wall)
    print(
        f"{name:5s} wall {w / n * 1e6:6.2f} us/obj ({pb * n / w / 1e9:5.2f} GB/s)  "
        f"cpu {statistics.median(cpu) / n * 1e6:6.2f} us/obj"
    )
