"""Variants of the staged and row-kernel paths for the pool sets with small rows.

For each (family, page size): d2h and h2d of about 1 GiB of scattered pages through ``Mover``,
best of 3 after a warm-up, as GB/s, ratio to a contiguous pinned copy measured alongside, and the
CPU time the mover call took to return (issue time). Variants patch module constants:

    base     the code as committed
    flat     staging slices of the whole buffer from the first (no ramp)
    g32      32 programs for staging gathers and scatters
    wide     PCIe row kernels move 32 KiB tiles per iteration
    onerow   PCIe row kernels move one row per iteration (the previous setting)

Also the device-local gather rate of the staging kernels for MLA and hybrid-state rows.
"""

import json
import os
import time

import torch

from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools import DevicePool, HostPool
from kvtier.pools.spec import tree_page_size
from kvtier.transfer import Mover, component, plan, rows

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res: dict = {}
orig_queue = component.queue_rows


def patch(variant: str) -> None:
    plan.FIRST_SLICE_BYTES = {"flat": 1 << 50, "first4": 4 << 20}.get(variant, 16 << 20)
    component.STAGING_CTAS = 32 if variant == "g32" else 16
    tw = {"wide": rows.TILE_WORDS, "onerow": 1}.get(variant)

    def q(src, si, dst, di, op, ctas=rows.PCIE_CTAS, tile_words=rows.ONE_BLOCK):
        if ctas == rows.PCIE_CTAS and tw is not None:
            tile_words = tw
        orig_queue(src, si, dst, di, op, ctas, tile_words)

    component.queue_rows = q


def timed(fn, total):
    best, issue = 0.0, 0.0
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        op = fn()
        t1 = time.perf_counter()
        if hasattr(op, "complete"):
            op.wait()
            op.complete()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i and total / (t2 - t0) / 1e9 > best:
            best, issue = total / (t2 - t0) / 1e9, (t1 - t0) * 1e3
    return round(best, 2), round(issue, 2)


for fam, ps in [
    ("mla", 1),
    ("dsa", 1),
    ("dense", 1),
    ("mla", 16),
    ("dsa", 16),
    ("hybrid", 16),
    ("dense", 16),
]:
    specs = family_pool_set(fam, torch.bfloat16)
    ps = tree_page_size(ps, specs)
    n = (1 << 30) // sum(s.page_bytes(ps) for s in specs)
    dpool = DevicePool(specs, 2 * n, ps, dev)
    hpool = HostPool(specs, 2 * n, ps, layout="page_first", pin=True)
    for b in dpool.buffers.values():
        b.view(torch.uint8).random_()
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(2 * n, generator=g)[:n]
    hp = torch.randperm(2 * n, generator=g)[:n]
    total = n * dpool.page_bytes
    cdev = torch.empty(total, dtype=torch.uint8, device=dev)
    chost = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    row = {
        "pages": n,
        "page_bytes": dpool.page_bytes,
        "contig_d2h": timed(lambda: chost.copy_(cdev, non_blocking=True), total)[0],  # noqa: B023
        "contig_h2d": timed(lambda: cdev.copy_(chost, non_blocking=True), total)[0],  # noqa: B023
    }
    for variant in ("base", "first4", "flat", "wide"):
        patch(variant)
        mover = Mover(dpool, hpool)
        d2h = timed(lambda: mover.device_to_host(src, hp), total)  # noqa: B023
        h2d = timed(lambda: mover.host_to_device(hp, src), total)  # noqa: B023
        op = mover.device_to_host(src[:4], hp[:4])
        op.wait()
        paths = dict(op.paths)
        op = mover.host_to_device(hp[:4], src[:4])
        op.wait()
        row[variant] = {
            "d2h": [d2h[0], round(d2h[0] / row["contig_d2h"], 3), d2h[1]],
            "h2d": [h2d[0], round(h2d[0] / row["contig_h2d"], 3), h2d[1]],
        }
        print(fam, ps, variant, row[variant], flush=True)
    row["paths_small_batch"] = paths
    res[f"{fam}/{ps}"] = row
    dpool = hpool = cdev = chost = mover = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()

# Device-local gather rate of staging kernels (GB/s of rows copied).
gathers = {}
for name, words in [("mla_ps16_row", 16 * 576 * 2 // 8), ("state_row", 77824 * 2 // 8)]:
    nrows = (128 << 20) // (words * 8)
    srcb = torch.empty((2 * nrows, words), dtype=torch.int64, device=dev)
    dstb = torch.empty((nrows, words), dtype=torch.int64, device=dev)
    si = torch.randperm(2 * nrows, device=dev)[:nrows]
    di = torch.arange(nrows, device=dev)
    for ctas in (16, 32, 64):
        for tw in (rows.ONE_BLOCK, rows.TILE_WORDS):
            rows.copy_rows(srcb, si, dstb, di, ctas=ctas, tile_words=tw)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                rows.copy_rows(srcb, si, dstb, di, ctas=ctas, tile_words=tw)
            e1.record()
            e1.synchronize()
            gb = 5 * nrows * words * 8 / (e0.elapsed_time(e1) / 1e3) / 1e9
            gathers[f"{name} ctas {ctas} tile_words {tw}"] = round(gb, 1)
            print(name, ctas, tw, round(gb, 1), flush=True)
res["gathers"] = gathers
with open(f"{OUT}/probe3.json", "w") as fh:
    json.dump(res, fh, indent=1)
