"""Per-object cost of reading 1,024 x 64 KiB objects on one thread, three ways: the backend's
``read_object`` (header read, then payload), header and payload in one ``preadv``, and that
opened relative to a directory descriptor. Page cache hot, interleaved, medians of 9.

    python results/file-tier/file_read_variants.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from kvtier.keys import Namespace, PageKey  # noqa: E402
from kvtier.storage import envelope  # noqa: E402
from kvtier.storage.envelope import HEADER_BYTES  # noqa: E402
from kvtier.storage.file import FileBackend  # noqa: E402
from kvtier.storage.file_io import read_object  # noqa: E402

pb, n = 65536, 1024
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [PageKey(f"{i:032x}") for i in range(n)]
work = "/tmp/fr/v"
os.system(f"rm -rf {work}")
be = FileBackend(work, Namespace("ns"), 4 * n * (pb + HEADER_BYTES), io_threads=1)
assert be.batch_set(keys, list(src)) == n
paths = [be._path(k) for k in keys]
ns = be.namespace
prefixes = [envelope.expected_prefix(ns, k, pb) for k in keys]
dests = [memoryview(dst[i].numpy()) for i in range(n)]
flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
head = bytearray(HEADER_BYTES)
fields = memoryview(head)[: envelope.FIELDS_BYTES]
spare = memoryview(bytearray(1))
dirs = {}
for p in paths:
    d = p.rsplit("/", 1)[0]
    if d not in dirs:
        dirs[d] = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
rel = [(dirs[p.rsplit("/", 1)[0]], p.rsplit("/", 1)[1]) for p in paths]


def current():
    for i in range(n):
        read_object(paths[i], ns, keys[i], prefixes[i], dests[i])


def _one_preadv(open_object):  # noqa: ANN001, ANN202
    def run():  # noqa: ANN202
        for i in range(n):
            fd = open_object(i)
            try:
                got = os.preadv(fd, [head, dests[i], spare], 0)
            finally:
                os.close(fd)
            want = envelope.fast_payload_digest(head, fields, prefixes[i])
            if got != HEADER_BYTES + pb or want != envelope.digest(dests[i]):
                raise RuntimeError("bad")

    return run


one_preadv = _one_preadv(lambda i: os.open(paths[i], flags))
one_preadv_dirfd = _one_preadv(lambda i: os.open(rel[i][1], flags, dir_fd=rel[i][0]))


def plain():
    for i in range(n):
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(dests[i])


fns = {"current": current, "one_preadv": one_preadv, "dirfd": one_preadv_dirfd, "plain_open": plain}
T = {k: [] for k in fns}
for _ in range(9):
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        T[k].append((time.perf_counter() - t0) / n * 1e6)
for k, v in T.items():
    print(f"{k:12s} {statistics.median(v):6.2f} us/obj")
