"""Reads of 1 MiB object files by where the payload starts: at 0 (a plain file), 112 bytes in
(after an envelope header) and at 4096 (after a header padded to a page).

64 files of each kind are written once; then, alternated, medians of REPEATS, each after a
256 MiB sweep with the destination zeroed before it: every file opened, its payload read with
one ``preadv`` at its offset, closed. Prints GB/s per kind.

    python results/file-tier/file_payload_align.py [REPEATS] [DIR]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch

from kvtier.storage.base import cpu_byte_views

torch.set_num_threads(1)  # no intra-op thread spinning beside a timed read
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 9
work = (sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvst") + "/file_payload_align"
pb, n = 1 << 20, 64
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
rows, drows = cpu_byte_views(list(src)), cpu_byte_views(list(dst))
offsets = {"at0": 0, "at112": 112, "at4096": 4096}
os.system(f"rm -rf {work}")
for kind, at in offsets.items():
    os.makedirs(f"{work}/{kind}")
    for i in range(n):
        with open(f"{work}/{kind}/{i}", "wb") as f:
            f.write(bytes(at))
            f.write(rows[i])
os.sync()
res: dict[str, list[float]] = {k: [] for k in offsets}
for r in range(REPEATS):
    order = list(offsets.items())
    for kind, at in order if r % 2 else order[::-1]:
        dst.zero_()
        torch.ones(256 << 20, dtype=torch.uint8)
        t0 = time.perf_counter()
        for i in range(n):
            fd = os.open(f"{work}/{kind}/{i}", os.O_RDONLY)
            os.preadv(fd, [drows[i]], at)
            os.close(fd)
        res[kind].append(time.perf_counter() - t0)
        assert torch.equal(dst, src)
print(f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
for kind, ts in res.items():
    print(f"{kind:7s} {n * pb / statistics.median(ts) / 1e9:6.2f} GB/s")
