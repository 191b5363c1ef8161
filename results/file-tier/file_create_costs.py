"""Per-file cost of creating empty files, creating and writing, renaming and overwriting, 1,024 each
(run under `perf record -g` to see where creates go).

    python results/file-tier/file_create_costs.py BYTES
"""

import os
import sys
import time

d = "/tmp/fprobe/wm"
os.system(f"rm -rf {d}")
os.makedirs(d)
os.sync()
n = 1024
buf = bytearray(int(sys.argv[1]))
t0 = time.perf_counter()
for i in range(n):
    fd = os.open(f"{d}/e{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
t1 = time.perf_counter()
for i in range(n):
    fd = os.open(f"{d}/f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.write(fd, buf)
    os.close(fd)
t2 = time.perf_counter()
for i in range(n):
    os.rename(f"{d}/f{i}", f"{d}/g{i}")
t3 = time.perf_counter()
for i in range(n):
    fd = os.open(f"{d}/g{i}", os.O_WRONLY)
    os.pwrite(fd, buf, 0)
    os.close(fd)
t4 = time.perf_counter()
print(
    f"create-empty {(t1 - t0) / n * 1e6:.1f}  create+write {(t2 - t1) / n * 1e6:.1f}  rename {(t3 - t2) / n * 1e6:.1f} overwrite {(t4 - t3) / n * 1e6:.1f} us"
)
