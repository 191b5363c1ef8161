"""Both directions at once through ``Mover.exchange`` at page size 1 with random host pages,
under ``auto`` and with each direction's mechanism forced (``d2h/h2d`` pairs of kernel and
staged), for FAMILIES; against two contiguous copies at once. Writes $OUT/mix_page1.json
after every cell.

    FAMILIES=mla,dense,dsa,swa python3 results/h200-dma/mix_page1.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ContiguousPair, best_of, force_mechanisms, random_case  # noqa: E402

from kvtier.transfer import plan  # noqa: E402
from kvtier.transfer.mover import Mover  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
PAIRS = [("staged", "kernel"), ("kernel", "staged"), ("staged", "staged"), ("kernel", "kernel")]
FORCED: dict[str, str] = {}
force_mechanisms(FORCED, plan.KERNEL)
res: dict = {"cells": {}}
for fam in os.environ.get("FAMILIES", "mla,dense,dsa,swa").split(","):
    specs, pb, n, dpool, hpool, src, dst, hload, hback = random_case(fam, DEV)
    mover = Mover(dpool, hpool)
    # the load's host pages hold a backup of src first, so the roundtrip can be checked
    op = mover.device_to_host(src, hload)
    op.wait(), op.complete()
    pair = ContiguousPair(n * pb, DEV)
    cb = 2 * n * pb / best_of(pair.both, 3) / 1e9
    cell: dict = {"page_bytes": pb, "contiguous_both_gbps": round(cb, 1)}
    for d2h, h2d in [("auto", "auto"), *PAIRS]:
        FORCED.clear()
        if d2h != "auto":
            FORCED.update(d2h=d2h, h2d=h2d)
        paths: dict = {}

        def both() -> None:
            b, ld = mover.exchange((src, hback), (hload, dst))  # noqa: B023
            b.wait(), ld.wait(), b.complete()
            paths.update(d2h=b.paths, h2d=ld.paths)  # noqa: B023

        cell[f"{d2h}/{h2d}"] = {
            "ratio": round(2 * n * pb / best_of(both, 3) / 1e9 / cb, 3),
            **paths,
        }
        torch.cuda.synchronize()
        cell[f"{d2h}/{h2d}"]["verified"] = all(
            torch.equal(
                dpool.page_bytes_view(s.name)[:, dst.to(DEV)],
                dpool.page_bytes_view(s.name)[:, src.to(DEV)],
            )
            for s in specs
        )
        print(fam, d2h, h2d, cell[f"{d2h}/{h2d}"], flush=True)
        res["cells"][fam] = cell
        with open(f"{OUT}/mix_page1.json", "w") as f:
            json.dump(res, f, indent=1)
    mover = dpool = hpool = pair = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()
