"""Which direction ``Mover.exchange`` should queue first: both orders of a 1 GiB exchange
(churned host pages) against two contiguous copies at once, interleaved round-robin, every
family at page sizes 1 and 16; then a profile of the CPU work before a staged load's first
copy. Prints one line per case; ``$OUT/exchange_order.json``."""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from kvtier.bench.host_runs import churned
from kvtier.bench.pool_sets import FAMILIES, family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.transfer.chunks import interleave
from kvtier.transfer.mover import Mover

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ContiguousPair, ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")


def exchange(mover: Mover, backup, load, load_first: bool):  # noqa: ANN001, ANN201
    bpages, bop = mover._begin("d2h", backup[0], backup[1])
    lpages, lop = mover._begin("h2d", load[1], load[0])
    with torch.cuda.device(DEV):
        compute = torch.cuda.current_stream(DEV)
        start = torch.cuda.Event()
        start.record(compute)
        b = (mover._backup(bpages, bop, start, 0), mover.backup_stream)
        ld = (mover._load_chunks(lpages, lop, False, compute), mover.load_stream)
        interleave([ld, b] if load_first else [b, ld])
    return bop, lop


def case(family: str, ps: int, repeats: int = 7) -> dict:
    c = ExchangeCase(family, ps, DEV)
    mover, src, dst, hp, ho = c.mover, c.src, c.dst, c.hp, c.ho
    n, pb = c.pages, c.page_bytes
    pair = ContiguousPair(c.nbytes, DEV)

    def run(load_first: bool) -> None:
        bop, lop = exchange(mover, (src, ho), (hp, dst), load_first)
        bop.wait()
        lop.wait()
        bop.complete()

    fns = {
        "contiguous": pair.both,
        "load_first": lambda: run(True),
        "backup_first": lambda: run(False),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    c = times["contiguous"]
    out = {
        k: {
            "best": round(min(c) / min(v), 3),
            "median": round(statistics.median(c) / statistics.median(v), 3),
        }
        for k, v in times.items()
        if k != "contiguous"
    }
    out["contiguous_gbps"] = round(2 * n * pb / min(c) / 1e9, 1)
    return out


def profile_first_load_chunk() -> str:
    specs = family_pool_set("dense", torch.bfloat16)
    pb = sum(s.page_bytes(1) for s in specs)
    n = (1 << 30) // pb
    dpool = DevicePool(specs, 2 * n, 1, DEV)
    hpool = HostPool(specs, 4 * n, 1, layout="page_first", pin=True)
    dst = torch.randperm(2 * n)[:n]
    hp = churned(4 * n, [n], 1, seed=1)[0]
    mover = Mover(dpool, hpool)
    for _ in range(3):
        mover.host_to_device(hp, dst).wait()
    prof = cProfile.Profile()
    spans = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        pages, op = mover._begin("h2d", dst, hp)
        with torch.cuda.device(DEV):
            compute = torch.cuda.current_stream(DEV)
            gen = mover._load_chunks(pages, op, False, compute)
            from kvtier.transfer.streams import on

            with on(mover.load_stream):
                next(gen)
                t1 = time.perf_counter()
                for _ in gen:
                    pass
        prof.disable()
        spans.append(1e6 * (t1 - t0))
        torch.cuda.synchronize()
        op.release()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return (
        f"to first yield (unprofiled order of magnitude, profiled): median {statistics.median(spans):.0f} us\n"
        + s.getvalue()
    )


if __name__ == "__main__":
    res = {}
    for ps in (1, 16):
        for fam in FAMILIES:
            res[f"{fam} ps{ps}"] = case(fam, ps)
            print(fam, ps, json.dumps(res[f"{fam} ps{ps}"]), flush=True)
    with open(f"{OUT}/exchange_order.json", "w") as f:
        json.dump(res, f, indent=1)
    text = profile_first_load_chunk()
    print(text[:6000])
    with open(f"{OUT}/first_load_profile.txt", "w") as f:
        f.write(text)
