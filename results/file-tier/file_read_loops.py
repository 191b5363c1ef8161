"""Per-object cost of 64 KiB-2 MiB reads, step by step, interleaved in one process (medians):
the bench's plain loop, raw os.open/preadv/close loops with and without the header read and the
digest, read_object, and batch_get on one thread (kv) and on two with the pool's size floor off
(kv2).

    python results/file-tier/file_read_loops.py PAGE_BYTES NUM_PAGES REPEATS [CANDIDATE,...]
"""

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import xxhash

import kvtier.storage.file_pool as _fpool
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend
from kvtier.storage.file_io import read_object

pb, n = int(sys.argv[1]), int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 7
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [PageKey(f"{i:032x}") for i in range(n)]
work = "/tmp/fprobe/rl"
os.system(f"rm -rf {work}")
os.makedirs(work)
be = FileBackend(work, Namespace("ns"), 4 * n * (pb + HEADER_BYTES), io_threads=1)
assert be.batch_set(keys, list(src)) == n
be2 = FileBackend(work, Namespace("ns2"), 4 * n * (pb + HEADER_BYTES), io_threads=2)
assert be2.batch_set(keys, list(src)) == n
pdir = work + "/plain"
os.makedirs(pdir)
for i in range(n):
    with open(f"{pdir}/{i}", "wb", buffering=0) as f:
        f.write(src[i].numpy())
paths = [be._path(k) for k in keys]
dsts = [dst[i].numpy() for i in range(n)]


def plain():
    for i in range(n):
        with open(os.path.join(pdir, str(i)), "rb", buffering=0) as f:
            f.readinto(dst[i].numpy())


def plain_os():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY)
        os.preadv(fd, [dsts[i]], HEADER_BYTES)
        os.close(fd)


ex = ThreadPoolExecutor(1)


def _pos(lo, hi, h=False):
    for i in range(lo, hi):
        fd = os.open(paths[i], os.O_RDONLY)
        os.preadv(fd, [dsts[i]], HEADER_BYTES)
        os.close(fd)
        if h:
            xxhash.xxh3_64_intdigest(dsts[i])


def plain_os_t2():
    f = ex.submit(_pos, n // 2, n)
    _pos(0, n // 2)
    f.result()


def plain_os_h_t2():
    f = ex.submit(_pos, n // 2, n, True)
    _pos(0, n // 2, True)
    f.result()


def plain_os_h():
    _pos(0, n, True)


def open_close():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY)
        os.close(fd)


sp = bytearray(1)
hd = bytearray(HEADER_BYTES)


def two_preadv():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY)
        os.preadv(fd, [hd], 0)
        os.preadv(fd, [dsts[i], sp], HEADER_BYTES)
        os.close(fd)


def two_preadv_hash():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY)
        os.preadv(fd, [hd], 0)
        os.preadv(fd, [dsts[i], sp], HEADER_BYTES)
        os.close(fd)
        xxhash.xxh3_64_intdigest(dsts[i])


def two_preadv_hash_noatime():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY | os.O_NOATIME)
        os.preadv(fd, [hd], 0)
        os.preadv(fd, [dsts[i], sp], HEADER_BYTES)
        os.close(fd)
        xxhash.xxh3_64_intdigest(dsts[i])


def one_preadv_hash():
    for i in range(n):
        fd = os.open(paths[i], os.O_RDONLY)
        os.preadv(fd, [hd, dsts[i], sp], 0)
        os.close(fd)
        xxhash.xxh3_64_intdigest(dsts[i])


prefixes = [envelope.expected_prefix("ns", keys[i], pb) for i in range(n)]


def readobj():
    for i in range(n):
        read_object(paths[i], "ns", keys[i], prefixes[i], dsts[i])


def hash_only():
    for i in range(n):
        xxhash.xxh3_64_intdigest(dsts[i])


def kv():
    assert be.batch_get(keys, list(dst)) == n


def kv2():
    old = _fpool.POOL_MIN_OBJECT_BYTES
    _fpool.POOL_MIN_OBJECT_BYTES = 0
    try:
        assert be2.batch_get(keys, list(dst)) == n
    finally:
        _fpool.POOL_MIN_OBJECT_BYTES = old


cands = dict(
    plain=plain,
    plain_os=plain_os,
    open_close=open_close,
    two_preadv=two_preadv,
    two_preadv_hash=two_preadv_hash,
    one_preadv_hash=one_preadv_hash,
    readobj=readobj,
    hash_only=hash_only,
    kv=kv,
    two_preadv_hash_noatime=two_preadv_hash_noatime,
    plain_os_t2=plain_os_t2,
    plain_os_h_t2=plain_os_h_t2,
    plain_os_h=plain_os_h,
    kv2=kv2,
)
sel = sys.argv[4].split(",") if len(sys.argv) > 4 else list(cands)
T = {}
for _ in range(reps):
    for k in sel:
        torch.ones(256 << 20, dtype=torch.uint8)
        t0 = time.perf_counter()
        c0 = time.process_time()
        cands[k]()
        T.setdefault(k, []).append((time.perf_counter() - t0, time.process_time() - c0))
print(os.getloadavg())
for k in sel:
    w = statistics.median(x[0] for x in T[k])
    c = statistics.median(x[1] for x in T[k])
    print(
        f"{k:18s} {w / n * 1e6:7.1f} us/obj wall {c / n * 1e6:7.1f} cpu  {n * pb / w / 1e9:.2f} GB/s"
    )
