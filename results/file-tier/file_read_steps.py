"""Single-thread steps of a verified 1 MiB read (64 objects in the page cache, medians of 7,
sweep before each): plain payload preadv, + header read, + XXH3 after the copy, in pieces, the
full read_object and batch_get on one thread; then digest piece sizes, mmap copies and the
digest rate on bytes just copied versus the same bytes hashed again."""

import mmap
import os
import shutil
import statistics
import time

import torch
import xxhash

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.file import FileBackend
from kvtier.storage.file_io import read_object

N, SZ = 64, 1 << 20
H = envelope.HEADER_BYTES
root = "/tmp/rp/store2"
shutil.rmtree(root, ignore_errors=True)
ns = Namespace("ns")
be = FileBackend(root, ns, 1 << 34, io_threads=1)
src = torch.randint(0, 256, (N, SZ), dtype=torch.uint8)
keys = [PageKey(f"{i:032x}") for i in range(N)]
assert be.batch_set(keys, list(src)) == N
os.sync()
dst = torch.empty_like(src)
paths = [be._path(k) for k in keys]
mvs = [memoryview(dst[i].numpy()).cast("B") for i in range(N)]
prefixes = [envelope.expected_prefix(ns, k, SZ) for k in keys]
head = bytearray(H)


def raw():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [m], H)
        os.close(fd)


def hdr_payload():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [head], 0)
        os.preadv(fd, [m], H)
        os.close(fd)


def hdr_payload_hash():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [head], 0)
        os.preadv(fd, [m], H)
        os.close(fd)
        xxhash.xxh3_64_intdigest(m)


def hdr_payload_hash_chunks():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [head], 0)
        for off in range(0, SZ, 256 << 10):
            os.preadv(fd, [m[off : off + (256 << 10)]], H + off)
        os.close(fd)
        xxhash.xxh3_64_intdigest(m)


def hdr_payload_hash_interleave():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [head], 0)
        h = xxhash.xxh3_64()
        for off in range(0, SZ, 256 << 10):
            v = m[off : off + (256 << 10)]
            os.preadv(fd, [v], H + off)
            h.update(v)
        os.close(fd)


def ro():
    for i in range(N):
        read_object(paths[i], ns, keys[i], prefixes[i], mvs[i])


def bget():
    assert be.batch_get(keys, list(dst)) == N


sweep = torch.empty(512 << 20, dtype=torch.uint8)
fns = dict(
    raw=raw,
    hdr_payload=hdr_payload,
    hash=hdr_payload_hash,
    hash_chunks=hdr_payload_hash_chunks,
    interleave256=hdr_payload_hash_interleave,
    read_object=ro,
    batch_get_1thread=bget,
)
res = {k: [] for k in fns}
for rep in range(7):
    for k, fn in fns.items():
        sweep.fill_(rep & 0xFF)
        t = time.perf_counter()
        fn()
        res[k].append(N * SZ / (time.perf_counter() - t) / 1e9)
for k, v in res.items():
    print(f"{k:20s} median {statistics.median(v):.2f} GB/s  max {max(v):.2f}")
assert torch.equal(src, dst)
print("---- interleave chunk sizes")


def mk(ch):
    def f():
        for p, m in zip(paths, mvs, strict=True):
            fd = os.open(p, os.O_RDONLY)
            os.preadv(fd, [head], 0)
            h = xxhash.xxh3_64()
            for off in range(0, SZ, ch):
                v = m[off : off + ch]
                os.preadv(fd, [v], H + off)
                h.update(v)
            os.close(fd)

    return f


fns = {
    f"il{ch >> 10}K": mk(ch)
    for ch in (16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
}
fns["raw"] = raw
res = {k: [] for k in fns}
for rep in range(7):
    for k, fn in fns.items():
        sweep.fill_(rep & 0xFF)
        t = time.perf_counter()
        fn()
        res[k].append(N * SZ / (time.perf_counter() - t) / 1e9)
for k, v in res.items():
    print(f"{k:20s} median {statistics.median(v):.2f} GB/s  max {max(v):.2f}")
print("---- mmap variants")


def mk_mmap(ch):
    def f():
        for p, m, _d in zip(paths, mvs, dst, strict=True):
            fd = os.open(p, os.O_RDONLY)
            mm = mmap.mmap(
                fd,
                H + SZ,
                prot=mmap.PROT_READ,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            )
            os.close(fd)
            sv = memoryview(mm)
            h = xxhash.xxh3_64()
            for off in range(0, SZ, ch):
                v = sv[H + off : H + off + ch]
                h.update(v)
                m[off : off + ch] = v
            del v, sv
            mm.close()

    return f


def hash_twice():
    for p, m in zip(paths, mvs, strict=True):
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [m], H)
        os.close(fd)
        xxhash.xxh3_64_intdigest(m)
        t = time.perf_counter()
        xxhash.xxh3_64_intdigest(m)
        hot.append(time.perf_counter() - t)


hot = []
fns = {
    "mmap256K": mk_mmap(256 << 10),
    "mmap64K": mk_mmap(64 << 10),
    "mmap1M": mk_mmap(1 << 20),
    "raw": raw,
    "read_object": ro,
}
res = {k: [] for k in fns}
for rep in range(7):
    for k, fn in fns.items():
        sweep.fill_(rep & 0xFF)
        t = time.perf_counter()
        fn()
        res[k].append(N * SZ / (time.perf_counter() - t) / 1e9)
for k, v in res.items():
    print(f"{k:20s} median {statistics.median(v):.2f} GB/s  max {max(v):.2f}")
assert torch.equal(src, dst)
sweep.fill_(1)
hash_twice()
print("second hash after copy %.1f GB/s" % (SZ / statistics.median(hot) / 1e9))
