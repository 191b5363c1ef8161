"""Both directions at once with each direction split between a copy engine and a row kernel:
page size 1, random host pages, for FAMILIES; against two contiguous copies at once.

Two ``Mover.exchange`` calls over the same pools run together, issued from two threads (the
driver calls release the GIL): exchange X backs up ``1 - KD`` of the pages staged (copy engine)
and loads ``KH`` of them by row kernel; exchange Y backs up the other ``KD`` by row kernel and
loads the other ``1 - KH`` staged. ``KD = 0, KH = 1`` is ``plan``'s choice for 70-86 KiB pages
beside a load (staged backup, kernel load). Writes $OUT/split_directions.json after every cell.

    FAMILIES=mla,dense SPLITS="0:1 0:0.8 0:0.6 0.2:1 0.2:0.8" python3 results/h200-dma/split_directions.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ContiguousPair, best_of, force_mechanisms, random_case  # noqa: E402

from kvtier.transfer import plan  # noqa: E402
from kvtier.transfer.mover import Mover  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
SPLITS = [
    tuple(float(x) for x in s.split(":"))
    for s in os.environ.get("SPLITS", "0:1 0:0.8 0:0.6 0.2:1 0.2:0.8").split()
]
local = threading.local()
# Each issuing thread forces its own mechanisms (``local.forced``).
force_mechanisms(lambda: getattr(local, "forced", {}), plan.KERNEL)
pool = ThreadPoolExecutor(1)
res: dict = {"splits": SPLITS, "cells": {}}
for fam in os.environ.get("FAMILIES", "mla,dense").split(","):
    specs, pb, n, dpool, hpool, src, dst, hload, hback = random_case(fam, DEV)
    x, y = Mover(dpool, hpool), Mover(dpool, hpool)
    op = x.device_to_host(src, hload)
    op.wait(), op.complete()
    pair = ContiguousPair(n * pb, DEV)
    cb = 2 * n * pb / best_of(pair.both, 3) / 1e9
    cell: dict = {"page_bytes": pb, "contiguous_both_gbps": round(cb, 1)}
    for kd, kh in SPLITS:
        j, k = round(n * (1 - kd)), round(n * kh)
        paths: dict = {}

        def half(mover: Mover, forced: dict, backup: tuple, load: tuple, tag: str) -> None:
            local.forced = forced
            b, ld = mover.exchange(backup, load)
            b.wait(), ld.wait(), b.complete()
            paths[tag] = {"d2h": b.paths, "h2d": ld.paths, "pages": [b.num_pages, ld.num_pages]}  # noqa: B023

        def both() -> None:
            # Y (kernel backup, staged load) from the worker; X (staged backup, kernel load) here.
            fy = pool.submit(
                half,
                y,  # noqa: B023
                {"d2h": plan.KERNEL, "h2d": plan.STAGED},
                (src[j:], hback[j:]),  # noqa: B023
                (hload[k:], dst[k:]),  # noqa: B023
                "y",
            )
            half(
                x,  # noqa: B023
                {"d2h": plan.STAGED, "h2d": plan.KERNEL},
                (src[:j], hback[:j]),  # noqa: B023
                (hload[:k], dst[:k]),  # noqa: B023
                "x",
            )
            fy.result()

        key = f"kd{kd}:kh{kh}"
        cell[key] = {"ratio": round(2 * n * pb / best_of(both, 3) / 1e9 / cb, 3), **paths}
        torch.cuda.synchronize()
        cell[key]["verified"] = all(
            torch.equal(
                dpool.page_bytes_view(s.name)[:, dst.to(DEV)],
                dpool.page_bytes_view(s.name)[:, src.to(DEV)],
            )
            for s in specs
        )
        print(fam, key, cell[key], flush=True)
        res["cells"][fam] = cell
        with open(f"{OUT}/split_directions.json", "w") as f:
            json.dump(res, f, indent=1)
    x = y = dpool = hpool = pair = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()
