"""Verified reads against their ceiling, one process, interleaved, medians: ``batch_get`` (two
I/O threads) at each payload piece size in CHUNKS (``file_io.READ_CHUNK``, and the pieces of
pack runs), plain sequential
``readinto`` on one thread (``plain1``), on two threads (``plain2``) and on two threads each
digesting what it read with XXH3 (``plain2h``: the ceiling of a verified read that copies,
then digests). Every side reads files written before the first repeat, from the page cache;
a 256 MiB sweep runs before each side.

    python results/file-tier/file_read_ceiling.py PAGE_BYTES NUM_PAGES REPEATS CHUNKS
    python results/file-tier/file_read_ceiling.py 2097152 256 5 1048576,2097152,262144
"""

import os
import shutil
import statistics
import sys
import threading
import time

import torch
import xxhash

import kvtier.storage.file_io as fio
import kvtier.storage.file_pack as fpack
from kvtier.keys import Namespace
from kvtier.storage.file import FileBackend

pb, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
chunks = [int(c) for c in sys.argv[4].split(",")]
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [f"{i:032x}" for i in range(n)]
work = "/tmp/fprobe/ceiling"
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
be = FileBackend(work, Namespace("ns"), 4 * n * (pb + 200), io_threads=2)
assert be.batch_set(keys, list(src)) == n
pd = f"{work}/plain"
os.makedirs(pd)
for i in range(n):
    with open(f"{pd}/{i}", "wb", buffering=0) as f:
        f.write(src[i].numpy())
os.sync()
T = {}
sweep = torch.empty(256 << 20, dtype=torch.uint8)
views = [memoryview(dst[i].numpy()) for i in range(n)]


def plain(idx, h=False):
    for i in idx:
        with open(f"{pd}/{i}", "rb", buffering=0) as f:
            f.readinto(views[i])
        if h:
            xxhash.xxh3_64_intdigest(views[i])


def par(h):
    ts = [threading.Thread(target=plain, args=(range(k, n, 2), h)) for k in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]


for r in range(reps):
    sides = [(f"kv{c >> 10}K", c) for c in chunks] + [
        ("plain1", None),
        ("plain2", None),
        ("plain2h", None),
    ]
    if r % 2:
        sides.reverse()
    for name, c in sides:
        sweep.fill_(r)
        t0 = time.perf_counter()
        if c is None:
            plain(range(n)) if name == "plain1" else par(name == "plain2h")
        else:
            fio.READ_CHUNK = fpack.RUN_READ_CHUNK = c
            assert be.batch_get(keys, list(dst)) == n
        T.setdefault(name, []).append(time.perf_counter() - t0)
    assert torch.equal(src, dst)
g = {k: n * pb / statistics.median(v) / 1e9 for k, v in T.items()}
print(
    f"{pb >> 10}K x {n} load {os.getloadavg()[0]:.1f}",
    " ".join(f"{k}={v:.2f}" for k, v in g.items()),
    "| /plain2",
    " ".join(f"{k}={g[k] / g['plain2']:.2f}" for k in g if k.startswith("kv") or k == "plain2h"),
)
be.close()
shutil.rmtree(work)
