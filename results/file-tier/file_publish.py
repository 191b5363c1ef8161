"""Publishing fresh 64 KiB files, interleaved object by object: plain create+write, named temp +
rename, O_TMPFILE + linkat (absolute and dir-relative names). Medians and means per method.

    python results/file-tier/file_publish.py
"""

import os
import statistics
import time

d = "/tmp/fprobe/pub"
os.system(f"rm -rf {d}")
os.makedirs(d)
os.sync()
dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
buf = bytearray(65536 + 112)
n = 4096
T = {"plain": [], "rename": [], "tmpfile": [], "tmpfile_at": []}
W = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
for i in range(n):
    m = ("plain", "rename", "tmpfile", "tmpfile_at")[i % 4]
    name = f"{i:032x}"
    t0 = time.perf_counter()
    if m == "plain":
        fd = os.open(f"{d}/{name}", W, 0o666)
        os.write(fd, buf)
        os.close(fd)
    elif m == "rename":
        t = f"{d}/.{name}.abc-1.tmp"
        fd = os.open(t, W, 0o666)
        os.write(fd, buf)
        os.close(fd)
        os.rename(t, f"{d}/{name}")
    elif m == "tmpfile":
        fd = os.open(d, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        os.write(fd, buf)
        os.link(f"/proc/self/fd/{fd}", f"{d}/{name}", dst_dir_fd=dfd, follow_symlinks=True)
        os.close(fd)
    else:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666, dir_fd=dfd)
        os.write(fd, buf)
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dfd, follow_symlinks=True)
        os.close(fd)
    T[m].append(time.perf_counter() - t0)
for k, v in T.items():
    print(
        f"{k:10s} median {statistics.median(v) * 1e6:7.1f} mean {statistics.mean(v) * 1e6:7.1f} us"
    )
