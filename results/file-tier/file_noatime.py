"""First read of fresh files with and without O_NOATIME, alternating (relatime updates atime on
the first read after a write).

    python results/file-tier/file_noatime.py
"""

import os
import statistics
import time

d = "/tmp/fprobe/at"
os.system(f"rm -rf {d}")
os.makedirs(d)
buf = bytearray(65536 + 112)
n = 4096
for i in range(n):
    fd = os.open(f"{d}/{i}", os.O_WRONLY | os.O_CREAT, 0o666)
    os.write(fd, buf)
    os.close(fd)
os.sync()
dst = bytearray(65536 + 112)
hd = memoryview(dst)
T = {0: [], 1: []}
for i in range(n):
    fl = os.O_RDONLY | (os.O_NOATIME if i % 2 else 0)
    t0 = time.perf_counter()
    fd = os.open(f"{d}/{i}", fl)
    os.preadv(fd, [hd], 0)
    os.close(fd)
    T[i % 2].append(time.perf_counter() - t0)
print("atime", statistics.median(T[0]) * 1e6, "noatime", statistics.median(T[1]) * 1e6)
