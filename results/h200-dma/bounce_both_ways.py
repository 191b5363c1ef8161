"""Both directions at once with host pages scattered one by one (page size 1, random host
pages): the copy engines move one contiguous block per slice between a pinned bounce buffer
and device staging, and CPU threads gather / scatter the host pages to / from the bounce
buffer. Against two contiguous copies at once in the same run. Writes $OUT/bounce.json after
every cell.

    THREADS="4 8" PAGE_BYTES="70272 131072" python3 results/h200-dma/bounce_both_ways.py
"""

import json
import os
import threading
import time

import torch

out = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
total = int(os.environ.get("TOTAL_MIB", "1024")) << 20
slice_bytes = int(os.environ.get("SLICE_MIB", "32")) << 20
res = {"host_cores": os.cpu_count(), "cells": {}}


def save():
    with open(f"{out}/bounce.json", "w") as f:
        json.dump(res, f, indent=1)


def timed(fn, reps=3):
    best = 1e9
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


# contiguous pair
a_h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
b_h = torch.empty(total, dtype=torch.uint8, pin_memory=True)
a_d = torch.empty(total, dtype=torch.uint8, device=dev)
b_d = torch.empty(total, dtype=torch.uint8, device=dev)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()


def pair():
    with torch.cuda.stream(s1):
        a_h.copy_(a_d, non_blocking=True)
    with torch.cuda.stream(s2):
        b_d.copy_(b_h, non_blocking=True)
    s1.synchronize()
    s2.synchronize()


contig = 2 * total / timed(pair) / 1e9
one = total / timed(lambda: a_h.copy_(a_d, non_blocking=True)) / 1e9
res["contiguous_both_gbps"] = contig
res["contiguous_d2h_gbps"] = one
print(f"contiguous both {contig:.1f} GB/s, d2h {one:.1f}", flush=True)
save()
a_h = b_h = a_d = b_d = None  # freed (the closures above refer to these names)

for pb in [int(x) for x in os.environ.get("PAGE_BYTES", "70272 131072").split()]:
    n = total // pb
    host_pages = 4 * n
    pool = torch.empty((host_pages, pb), dtype=torch.uint8, pin_memory=True)
    pool[: n * 2].random_(0, 255)
    devp = torch.empty((2 * n, pb), dtype=torch.uint8, device=dev).random_(0, 255)
    perm = torch.randperm(host_pages)
    hsrc, hdst = perm[:n].sort().values, perm[n : 2 * n]  # load from hsrc, back up into hdst
    hsrc = perm[:n]
    dsrc = torch.arange(n, device=dev)  # device pages backed up
    ddst = torch.arange(n, 2 * n, device=dev)  # device pages loaded
    k = max(1, slice_bytes // pb)
    for nt in [int(x) for x in os.environ.get("THREADS", "4 8").split()]:
        torch.set_num_threads(nt)
        # CPU gather rate alone
        bounce = [torch.empty((k, pb), dtype=torch.uint8, pin_memory=True) for _ in range(4)]
        idx = hsrc[:k]
        t = time.perf_counter()
        for r in range(20):
            torch.index_select(pool, 0, hsrc[(r * k) % (n - k) :][:k], out=bounce[0])
        g = 20 * k * pb / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for r in range(20):
            pool.index_copy_(0, hdst[(r * k) % (n - k) :][:k], bounce[0])
        sc = 20 * k * pb / (time.perf_counter() - t) / 1e9
        stg = [torch.empty((k, pb), dtype=torch.uint8, device=dev) for _ in range(4)]
        sd, sh = torch.cuda.Stream(), torch.cuda.Stream()

        def d2h():
            # device gather -> staging -> CE -> bounce -> CPU scatter into the pool; the CPU
            # scatters slice j-1 while the copy engine moves slice j
            evs, pend = [None, None], [None, None]

            def drain(b):
                evs[b].synchronize()
                lo, hi = pend[b]
                pool.index_copy_(0, hdst[lo:hi], bounce[b][: hi - lo])  # noqa: B023
                evs[b] = None

            for j, lo in enumerate(range(0, n, k)):  # noqa: B023
                hi = min(n, lo + k)  # noqa: B023
                b = j % 2
                if evs[b] is not None:
                    drain(b)
                with torch.cuda.stream(sd):  # noqa: B023
                    torch.index_select(devp, 0, dsrc[lo:hi], out=stg[b][: hi - lo])  # noqa: B023
                    bounce[b][: hi - lo].copy_(stg[b][: hi - lo], non_blocking=True)  # noqa: B023
                    e = torch.cuda.Event()
                    e.record(sd)  # noqa: B023
                evs[b], pend[b] = e, (lo, hi)
            for b in sorted((0, 1), key=lambda b: pend[b] or (0,)):
                if evs[b] is not None:
                    drain(b)

        def h2d():
            evs = [None, None]
            for j, lo in enumerate(range(0, n, k)):  # noqa: B023
                hi = min(n, lo + k)  # noqa: B023
                b = 2 + j % 2
                if evs[b - 2] is not None:
                    evs[b - 2].synchronize()
                torch.index_select(pool, 0, hsrc[lo:hi], out=bounce[b][: hi - lo])  # noqa: B023
                with torch.cuda.stream(sh):  # noqa: B023
                    stg[b][: hi - lo].copy_(bounce[b][: hi - lo], non_blocking=True)  # noqa: B023
                    e = torch.cuda.Event()
                    e.record(sh)  # noqa: B023
                    devp.index_copy_(0, ddst[lo:hi], stg[b][: hi - lo])  # noqa: B023
                evs[b - 2] = e
            sh.synchronize()  # noqa: B023

        def both():
            t1 = threading.Thread(target=d2h)
            t1.start()
            h2d()
            t1.join()

        for name, fn in (("d2h", d2h), ("h2d", h2d), ("both", both)):
            secs = timed(fn)
            gbps = (2 if name == "both" else 1) * n * pb / secs / 1e9
            ref = contig if name == "both" else one
            res["cells"][f"pb{pb} t{nt} {name}"] = {
                "gbps": gbps,
                "ratio": gbps / ref,
                "cpu_gather_gbps": g,
                "cpu_scatter_gbps": sc,
            }
            print(
                f"page {pb} threads {nt} {name}: {gbps:.1f} GB/s ({gbps / ref:.2f}); cpu gather {g:.1f} scatter {sc:.1f}",
                flush=True,
            )
            save()
        # verify the last run's data
        assert torch.equal(pool[hdst[:64]], devp[:64].cpu())
        assert torch.equal(devp[n : n + 64].cpu(), pool[hsrc[:64]])
    pool = devp = None  # freed (the closures above refer to these names)
