"""CPU and wall time of the file tier against plain file I/O and an older tree of itself,
interleaved in one process (process CPU time is steadier than wall time on a shared host).

    git archive <commit> kvtier | tar -x -C /tmp/oldtree
    NEWT=<io_threads> python results/file-tier/file_tier_ab.py PAGE_BYTES NUM_PAGES REPEATS
"""

import importlib
import os
import shutil
import statistics
import sys
import time

import torch

pb, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def load(root):
    for m in [k for k in sys.modules if k.startswith("kvtier")]:
        del sys.modules[m]
    sys.path.insert(0, root)
    mod = importlib.import_module("kvtier.storage.file")
    keys = importlib.import_module("kvtier.keys")
    sys.path.pop(0)
    return mod.FileBackend, keys.Namespace


Old, NsO = load("/tmp/oldtree")
New, NsN = load(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
fio = importlib.import_module("kvtier.storage.file_io")  # the tree loaded last

fio.READ_CHUNK = int(os.environ.get("CHUNK", fio.READ_CHUNK))
NT = int(os.environ.get("NEWT", "2"))
src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
dst = torch.empty_like(src)
keys = [f"{i:032x}" for i in range(n)]
work = "/tmp/fprobe/ab"
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
T = {}


def rec(k, dt):
    T.setdefault(k, []).append(dt)


for r in range(reps):
    for name, cls, ns in (("old", Old, NsO), ("new", New, NsN)):
        be = cls(
            work,
            ns(f"{name}{r}"),
            4 * n * (pb + 200),
            **({"io_threads": NT} if name == "new" else {}),
        )
        os.sync()
        t0 = time.perf_counter()
        c0 = time.process_time()
        assert be.batch_set(keys, list(src)) == n
        rec(name + "_w", time.perf_counter() - t0)
        rec(name + "_wc", time.process_time() - c0)
        torch.ones(256 << 20, dtype=torch.uint8)
        t0 = time.perf_counter()
        c0 = time.process_time()
        assert be.batch_get(keys, list(dst)) == n
        rec(name + "_r", time.perf_counter() - t0)
        rec(name + "_rc", time.process_time() - c0)
        assert torch.equal(src, dst)
        be.close()
        shutil.rmtree(be.dir)
    d = f"{work}/plain{r}"
    os.makedirs(d)
    os.sync()
    t0 = time.perf_counter()
    c0 = time.process_time()
    for i in range(n):
        with open(f"{d}/{i}", "wb", buffering=0) as f:
            f.write(src[i].numpy())
    rec("plain_w", time.perf_counter() - t0)
    rec("plain_wc", time.process_time() - c0)
    torch.ones(256 << 20, dtype=torch.uint8)
    t0 = time.perf_counter()
    c0 = time.process_time()
    for i in range(n):
        with open(f"{d}/{i}", "rb", buffering=0) as f:
            f.readinto(dst[i].numpy())
    rec("plain_r", time.perf_counter() - t0)
    rec("plain_rc", time.process_time() - c0)
    shutil.rmtree(d)
tot = n * pb
g = {k: tot / statistics.median(v) / 1e9 for k, v in T.items()}
print(
    os.getloadavg(),
    " ".join(f"{k}={v:.2f}" for k, v in sorted(g.items())),
    f"| CPU/plain new w {g['plain_wc'] / g['new_wc']:.2f} r {g['plain_rc'] / g['new_rc']:.2f} old w {g['plain_wc'] / g['old_wc']:.2f} r {g['plain_rc'] / g['old_rc']:.2f} | new/plain w {g['new_w'] / g['plain_w']:.2f} r {g['new_r'] / g['plain_r']:.2f} | old/plain w {g['old_w'] / g['plain_w']:.2f} r {g['old_r'] / g['plain_r']:.2f}",
)
shutil.rmtree(work)
