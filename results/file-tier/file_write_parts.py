"""Python-side cost per object of a 64 KiB batch_set's steps (header pack, reservation plan, paths,
digest of a cold source), timeit minimums.

    python results/file-tier/file_write_parts.py
"""

import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch

from kvtier.keys import Namespace
from kvtier.storage import envelope
from kvtier.storage.base import cpu_byte_views
from kvtier.storage.file import FileBackend

n = 1024
src = torch.randint(0, 256, (n, 65536), dtype=torch.uint8)
keys = [f"{i:032x}" for i in range(n)]
os.system("rm -rf /tmp/fprobe/wp")
be = FileBackend("/tmp/fprobe/wp", Namespace("ns"), 1 << 40, io_threads=1)
views = cpu_byte_views(list(src))


def t(name, f, k=10):
    v = min(timeit.repeat(f, number=1, repeat=k))
    print(f"{name:20s} {v / n * 1e6:6.2f} us/obj")


t("pack", lambda: [envelope.pack("ns", k, 65536, 12345) for k in keys])
t("plan", lambda: (be._plan(keys, views, 0), be.__setattr__("_used", 0)), k=1)
t("tmp_name", lambda: [f"{be._path(k)}" for k in keys])
t("digest", lambda: [envelope.digest(v) for v in views])
