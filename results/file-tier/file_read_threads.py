"""Read rates of one set of pages in one process, interleaved, medians of 5: plain sequential
file reads, kvtier batch_get, and raw reads of kvtier's object files (one preadv per file, with
or without the digest, on one or two threads).

    python results/file-tier/file_read_threads.py PAGE_BYTES NUM_PAGES [CANDIDATE,...]
"""

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from kvtier.keys import Namespace, PageKey
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend

pb, n = int(sys.argv[1]), int(sys.argv[2])
reps = 5
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [PageKey(f"{i:032x}") for i in range(n)]
work = "/tmp/fprobe/w"
os.system(f"rm -rf {work}")
os.makedirs(work)
be = FileBackend(
    work, Namespace("ns"), 4 * n * (pb + HEADER_BYTES), io_threads=int(os.environ.get("T", "2"))
)
assert be.batch_set(keys, list(src)) == n
pdir = work + "/plain"
os.makedirs(pdir)
for i in range(n):
    with open(f"{pdir}/{i}", "wb", buffering=0) as f:
        f.write(src[i].numpy())
paths = [be._path(k) for k in keys]
dsts = [dst[i].numpy() for i in range(n)]


def sweep():
    torch.ones(256 << 20, dtype=torch.uint8)


def plain():
    for i in range(n):
        with open(f"{pdir}/{i}", "rb", buffering=0) as f:
            f.readinto(dsts[i])


def plain_osread():
    for i in range(n):
        fd = os.open(f"{pdir}/{i}", os.O_RDONLY)
        os.preadv(fd, [dsts[i]], 0)
        os.close(fd)


def kv():
    assert be.batch_get(keys, list(dst)) == n


head = [bytearray(HEADER_BYTES) for _ in range(n)]


def one_preadv(hash_=True, threads=1):
    def job(lo, hi):
        sp = bytearray(1)
        for i in range(lo, hi):
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            os.preadv(fd, [head[i], dsts[i], sp], 0)
            os.close(fd)
            if hash_:
                xxhash.xxh3_64_intdigest(dsts[i])

    if threads == 1:
        job(0, n)
        return
    b = [n * j // threads for j in range(threads + 1)]
    with ThreadPoolExecutor(threads - 1) as ex:
        fs = [ex.submit(job, b[j], b[j + 1]) for j in range(1, threads)]
        job(b[0], b[1])
        [f.result() for f in fs]


def chunked(threads=1, chunk=256 << 10):
    def job(lo, hi):
        sp = memoryview(bytearray(1))
        for i in range(lo, hi):
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            h = xxhash.xxh3_64()
            d = memoryview(dsts[i])
            off = 0
            os.preadv(fd, [head[i], d[: min(chunk, pb)]] + ([sp] if chunk >= pb else []), 0)
            h.update(d[: min(chunk, pb)])
            off = min(chunk, pb)
            while off < pb:
                end = min(off + chunk, pb)
                os.preadv(fd, [d[off:end], sp] if end == pb else [d[off:end]], HEADER_BYTES + off)
                h.update(d[off:end])
                off = end
            os.close(fd)
            h.intdigest()

    if threads == 1:
        job(0, n)
        return
    b = [n * j // threads for j in range(threads + 1)]
    with ThreadPoolExecutor(threads - 1) as ex:
        fs = [ex.submit(job, b[j], b[j + 1]) for j in range(1, threads)]
        job(b[0], b[1])
        [f.result() for f in fs]


def utimes():
    for p in paths:
        os.utime(p)


cands = {
    "plain": plain,
    "plain_osread": plain_osread,
    "kv": kv,
    "1preadv_nohash": lambda: one_preadv(False),
    "1preadv_hash": lambda: one_preadv(True),
    "1preadv_hash_t2": lambda: one_preadv(True, 2),
    "1preadv_nohash_t2": lambda: one_preadv(False, 2),
    "chunk_t1": lambda: chunked(1),
    "chunk_t2": lambda: chunked(2),
    "chunk64k_t2": lambda: chunked(2, 64 << 10),
    "utime_only": utimes,
}
if len(sys.argv) > 3:
    cands = {k: cands[k] for k in sys.argv[3].split(",")}
res = {k: [] for k in cands}
for _ in range(reps):
    for k, fn in cands.items():
        sweep()
        t0 = time.perf_counter()
        fn()
        res[k].append(time.perf_counter() - t0)
tot = n * pb
for k, v in res.items():
    print(f"{k:20s} {tot / statistics.median(v) / 1e9:6.2f} GB/s  (min {tot / min(v) / 1e9:.2f})")
os.system(f"rm -rf {work}")
