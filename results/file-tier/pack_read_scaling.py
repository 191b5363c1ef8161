"""What bounds reads of packed 64 KiB pages on several threads: one file or several, payloads
page-aligned in the file or not, 64 KiB iovecs or one buffer per read, digest or none.

64 MiB of 64 KiB pages are written as one file (``one``: a pack of a whole round, payloads
from offset 0), as one file whose payloads start 16 + 1,024 x 112 bytes in (``unaligned``: a
version 1 pack), and as files of 4 MiB (``per4m``: a pack per ``file_layout.RUN_BYTES``).
Each variant reads them back
on T threads, each claiming the next 4 MiB run (open, ``preadv`` per 1 MiB into the
destination rows, close), optionally digesting each page (``envelope.digest``) right after its
piece lands. Medians of REPEATS after a 256 MiB sweep each, GB/s.

    python results/file-tier/pack_read_scaling.py [REPEATS] [DIR] [THREADS, e.g. 1,2,4,8]
"""

import itertools
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch

from kvtier.storage import envelope
from kvtier.storage.base import cpu_byte_views

torch.set_num_threads(1)
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
work = (sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvst") + "/pack_read_scaling"
THREADS = [int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4").split(",")]
pb, n, run, piece = 65536, 1024, 4 << 20, 1 << 20
per_run, per_piece = run // pb, piece // pb
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
os.system(f"rm -rf {work}")
os.makedirs(work)
whole = src.numpy().tobytes()
UNALIGNED = 16 + n * 112
with open(f"{work}/one", "wb") as f:
    f.write(whole)
with open(f"{work}/unaligned", "wb") as f:
    f.write(bytes(UNALIGNED) + whole)
for r in range(n // per_run):
    with open(f"{work}/run{r}", "wb") as f:
        f.write(whole[r * run : (r + 1) * run])
os.sync()
rows = cpu_byte_views(list(dst))
flat = cpu_byte_views([dst])[0]
runs = n // per_run


def reader(layout: str, digest: bool, iov: str):
    def read_run(r: int) -> None:
        path, base = {
            "one": (f"{work}/one", r * run),
            "unaligned": (f"{work}/unaligned", UNALIGNED + r * run),
            "per4m": (f"{work}/run{r}", 0),
        }[layout]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for p in range(run // piece):
                lo = r * per_run + p * per_piece
                bufs = (
                    rows[lo : lo + per_piece]
                    if iov == "rows"
                    else [flat[lo * pb : (lo + per_piece) * pb]]
                )
                os.preadv(fd, bufs, base + p * piece)
                if digest:
                    for k in range(lo, lo + per_piece):
                        envelope.digest(rows[k])
        finally:
            os.close(fd)

    return read_run


def on_threads(t: int, fn) -> None:
    claim = itertools.count()

    def loop() -> None:
        while (r := next(claim)) < runs:
            fn(r)

    others = [threading.Thread(target=loop) for _ in range(t - 1)]
    for th in others:
        th.start()
    loop()
    for th in others:
        th.join()


variants = {
    f"{layout}/{'xxh3' if d else 'raw'}/{iov}/t{t}": (t, reader(layout, d, iov))
    for layout in ("one", "unaligned", "per4m")
    for d in (False, True)
    for iov in ("rows", "flat")
    if iov == "rows" or layout == "one"
    for t in THREADS
}
res: dict[str, list[float]] = {k: [] for k in variants}
for rep in range(REPEATS):
    order = list(variants.items())
    for name, (t, fn) in order if rep % 2 else order[::-1]:
        dst.zero_()
        torch.ones(256 << 20, dtype=torch.uint8)
        w0 = time.perf_counter()
        on_threads(t, fn)
        res[name].append(time.perf_counter() - w0)
        assert torch.equal(dst, src), name
print(f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
for name, ts in res.items():
    print(f"{name:24s} {n * pb / statistics.median(ts) / 1e9:6.2f} GB/s")
