"""batch_get of 1,024 x 64 KiB split into its steps (views, index, paths, prefixes, reads, journal),
each timed after a 256 MiB sweep, medians of 7.

    python results/file-tier/file_batch_get_steps.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.base import cpu_byte_views
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.file import FileBackend
from kvtier.storage.file_io import read_object

pb, n = 65536, 1024
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [PageKey(f"{i:032x}") for i in range(n)]
work = "/tmp/fprobe/steps"
os.system(f"rm -rf {work}")
os.makedirs(work)
be = FileBackend(work, Namespace("ns"), 4 * n * (pb + HEADER_BYTES), io_threads=1)
assert be.batch_set(keys, list(src)) == n
T = {}
for _ in range(7):
    torch.ones(256 << 20, dtype=torch.uint8)
    t = [time.perf_counter()]
    bufs = list(dst)
    t.append(time.perf_counter())
    dests = cpu_byte_views(bufs)
    t.append(time.perf_counter())
    with be._lock:
        for k in keys:
            be._index.move_to_end(k)
    t.append(time.perf_counter())
    paths = [be._path(k) for k in keys]
    t.append(time.perf_counter())
    prefixes = [envelope.expected_prefix("ns", keys[i], dests[i].nbytes) for i in range(n)]
    t.append(time.perf_counter())

    def read(i):
        read_object(paths[i], "ns", keys[i], prefixes[i], dests[i])  # noqa: B023

    out = be._io.run_ordered(read, n, sum(d.nbytes for d in dests))
    t.append(time.perf_counter())
    be._recency.record(keys)
    t.append(time.perf_counter())
    torch.ones(256 << 20, dtype=torch.uint8)
    t0 = time.perf_counter()
    be.batch_get(keys, list(dst))
    t.append(time.perf_counter() - t0 + t[-1])
    for j, name in enumerate(
        ["list", "views", "index", "paths", "prefix", "run", "recency", "whole"]
    ):
        T.setdefault(name, []).append(t[j + 1] - t[j])
for k, v in T.items():
    print(f"{k:8s} {statistics.median(v) / n * 1e6:6.2f} us/obj")
