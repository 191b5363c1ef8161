"""Both directions at once on churned host pages (``both_ways_runs.py``): where the rest goes.

Per family pool set (page-first host) at page sizes 1, 16 and 64, 1 GiB each way, ``auto``:
the CPU time each direction takes to queue alone, and both directions issued
``seq`` (backup then load, as ``bench transfer``), ``inter`` (chunk by chunk in turn, one
thread), ``thread`` (the backup from a second thread) and ``load_first`` (the load, then the
backup), against two contiguous copies at once (both buffers pinned). Writes
``$OUT/both_ways_runs2.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from both_ways import interleaved  # noqa: E402
from pair_timing import ContiguousPair, best_of  # noqa: E402

from kvtier.bench.host_runs import churned, mean_run  # noqa: E402
from kvtier.bench.pool_sets import family_pool_set  # noqa: E402
from kvtier.pools.device import DevicePool  # noqa: E402
from kvtier.pools.host import HostPool  # noqa: E402
from kvtier.pools.spec import PoolSpec, tree_page_size  # noqa: E402
from kvtier.transfer.mover import Mover  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
REPEATS = int(os.environ.get("REPEATS", "4"))
GIB = float(os.environ.get("GIB", "1"))


def cell(page_size: int, family: str | None) -> dict:
    dtype = torch.bfloat16
    if family:
        specs = family_pool_set(family, dtype)
        page_size = tree_page_size(page_size, specs)
    else:
        specs = [PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=dtype)]
    page_bytes = sum(s.page_bytes(page_size) for s in specs)
    n = max(1, int(GIB * (1 << 30)) // page_bytes)
    dpool = DevicePool(specs, 2 * n, page_size, DEV)
    hpool = HostPool(specs, 4 * n, page_size, layout="page_first", pin=True)
    for b in dpool.buffers.values():
        b.view(-1).view(torch.uint8).random_()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(2 * n, generator=g)
    src, dst = perm[:n], perm[n:]
    hpages, hother = churned(4 * n, [n, n], page_size, seed=1)
    total = n * page_bytes
    pair = ContiguousPair(total, DEV)

    def timed(fn) -> float:  # noqa: ANN001
        return best_of(fn, REPEATS)

    cb = 2 * total / timed(pair.both) / 1e9
    c1 = total / timed(pair.d2h) / 1e9
    out: dict = {"pages": n, "page_size": page_size, "page_bytes": page_bytes}
    out["mean_run"] = [round(mean_run(hpages), 1), round(mean_run(hother), 1)]
    out["contiguous_both_gbps"], out["contiguous_d2h_gbps"] = round(cb, 1), round(c1, 1)
    mover = Mover(dpool, hpool)
    issue: dict = {"d2h": [], "h2d": []}
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b = mover.device_to_host(src, hother)
        issue["d2h"].append(time.perf_counter() - t0)
        b.wait(), b.complete()
        t0 = time.perf_counter()
        ld = mover.host_to_device(hpages, dst)
        issue["h2d"].append(time.perf_counter() - t0)
        ld.wait()
    out["issue_ms"] = {k: round(1e3 * min(v), 2) for k, v in issue.items()}
    out["paths"] = {k: f"d2h {b.paths[k]}, h2d {ld.paths[k]}" for k in ld.paths}

    def seq() -> None:
        b = mover.device_to_host(src, hother)
        ld = mover.host_to_device(hpages, dst)
        b.wait(), ld.wait(), b.complete()

    def load_first() -> None:
        ld = mover.host_to_device(hpages, dst)
        b = mover.device_to_host(src, hother)
        b.wait(), ld.wait(), b.complete()

    def threaded() -> None:
        box: list = []
        th = threading.Thread(target=lambda: box.append(mover.device_to_host(src, hother)))
        th.start()
        ld = mover.host_to_device(hpages, dst)
        th.join()
        box[0].wait(), ld.wait(), box[0].complete()

    def inter() -> None:
        b, ld = interleaved(mover, src, hother, hpages, dst)
        b.wait(), ld.wait(), b.complete()

    for name, fn in (
        ("seq", seq),
        ("inter", inter),
        ("thread", threaded),
        ("load_first", load_first),
    ):
        out[name] = round(2 * total / timed(fn) / 1e9 / cb, 3)
    mover = dpool = hpool = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    fams = os.environ.get("FAMILIES", "gqa,mla,dsa,dsa-compressed,hybrid").split(",")
    res: dict = {"gib": GIB, "cells": {}}
    for ps in (1, 16, 64):
        for fam in fams:
            if fam == "dsa-compressed" and ps != 64:
                continue
            name = f"{fam} ps{ps}"
            res["cells"][name] = r = cell(ps, None if fam == "gqa" else fam)
            print(name, json.dumps(r), flush=True)
            with open(f"{OUT}/both_ways_runs2.json", "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
