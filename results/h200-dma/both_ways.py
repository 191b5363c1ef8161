"""Both directions at once: how the issue order and the mechanism pair set the ratio.

For the ``bench transfer`` cells whose both-at-once ratio was lowest, one backup (device → host)
and one load (host → device) of 1 GiB each are timed against contiguous copies both ways, with
the copies issued: backup then load (the bench's order), load then backup, the backup from a
second thread while this one issues the load, and both interleaved chunk by chunk on this thread.
Each under the mechanisms ``auto``, ``copy_engine`` and ``kernel``. Also: the CPU time each
direction's call takes to return alone, and the device's async engine count.
Writes ``$OUT/both_ways.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

import torch

from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec, tree_page_size
from kvtier.transfer.mover import Mover

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
CHUNK = 64 << 20
REPEATS = int(os.environ.get("REPEATS", "3"))
CELLS = {
    "gqa page_first ps1": {"page_size": 1},
    "gqa layer_first ps1": {"page_size": 1, "layout": "layer_first"},
    "gqa layer_first ps16": {"page_size": 16, "layout": "layer_first"},
    "gqa page_first ps16": {"page_size": 16},
    "mla ps1": {"page_size": 1, "family": "mla"},
    "dsa ps1": {"page_size": 1, "family": "dsa"},
    "hybrid ps64": {"page_size": 64, "family": "hybrid"},
    "mla ps64": {"page_size": 64, "family": "mla"},
}
if os.environ.get("CELLS"):
    CELLS = {k: v for k, v in CELLS.items() if k in os.environ["CELLS"].split(",")}


def engines() -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit(0)
    v = ctypes.c_int(0)
    lib.cuDeviceGetAttribute(ctypes.byref(v), 40, 0)  # CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT
    return v.value


def interleaved(mover: Mover, src, hother, hpages, dst) -> tuple:  # noqa: ANN001
    """Backup and load issued chunk by chunk in turn (mover internals, as the pacer does)."""
    pb, ob = mover._begin("d2h", src, hother)
    start = torch.cuda.Event()
    start.record()
    gb = mover._backup(pb, ob, start, CHUNK)
    pl, ol = mover._begin("h2d", dst, hpages)
    ls = mover.load_stream
    ls.wait_stream(torch.cuda.current_stream())

    def load_chunks():  # noqa: ANN202
        for name, part in pl.items():
            yield from mover._component(name, mover.rows[name], "h2d", part, ls, ol, CHUNK)
        ol.event = torch.cuda.Event()
        ol.event.record(ls)

    gl = load_chunks()
    live = [(gb, mover.backup_stream), (gl, ls)]
    while live:
        for item in list(live):
            with torch.cuda.stream(item[1]):
                if next(item[0], None) is None:
                    live.remove(item)
    return ob, ol


def cell(name: str, page_size: int, layout: str = "page_first", family: str | None = None) -> dict:
    dtype = torch.bfloat16
    if family:
        specs = family_pool_set(family, dtype)
        page_size = tree_page_size(page_size, specs)
    else:
        specs = [PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=dtype)]
    page_bytes = sum(s.page_bytes(page_size) for s in specs)
    n = max(1, (1 << 30) // page_bytes)
    dpool = DevicePool(specs, 2 * n, page_size, DEV)
    hpool = HostPool(specs, 2 * n, page_size, layout=layout, pin=True)
    for b in dpool.buffers.values():
        b.view(-1).view(torch.uint8).random_()
    g = torch.Generator().manual_seed(0)
    perm, hperm = torch.randperm(2 * n, generator=g), torch.randperm(2 * n, generator=g)
    src, dst, hpages, hother = perm[:n], perm[n:], hperm[:n], hperm[n:]
    total = n * page_bytes
    cd, ch = (
        torch.empty(total, dtype=torch.uint8, device=DEV),
        torch.empty(total, dtype=torch.uint8, pin_memory=True),
    )
    cd2, ch2 = torch.empty_like(cd), torch.empty_like(ch)
    side = torch.cuda.Stream()
    out: dict = {"pages": n, "page_bytes": page_bytes, "total": total}

    def timed(fn) -> float:  # noqa: ANN001
        best = []
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best.append(time.perf_counter() - t0)
        return min(best)

    def contiguous_both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        cd.copy_(ch, non_blocking=True)
        with torch.cuda.stream(side):
            ch2.copy_(cd2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    t_cb = timed(contiguous_both)
    t_c1 = timed(lambda: ch.copy_(cd, non_blocking=True))
    out["contiguous_both_gbps"] = round(2 * total / t_cb / 1e9, 1)
    out["contiguous_d2h_gbps"] = round(total / t_c1 / 1e9, 1)
    for mech in ("auto", "copy_engine", "kernel"):
        mover = Mover(dpool, hpool, mechanism=mech)
        res: dict = {}
        m = mover

        def issue_times(mover: Mover = m, res: dict = res) -> None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            op = mover.device_to_host(src, hpages)
            t1 = time.perf_counter()
            op.wait()
            op.complete()
            t2 = time.perf_counter()
            op = mover.host_to_device(hpages, dst)
            t3 = time.perf_counter()
            op.wait()
            t4 = time.perf_counter()
            res["issue_ms"] = {"d2h": round(1e3 * (t1 - t0), 2), "h2d": round(1e3 * (t3 - t2), 2)}
            res["alone_ratio"] = {
                "d2h": round(total / (t2 - t0) / 1e9 / out["contiguous_d2h_gbps"], 3),
                "h2d": round(total / (t4 - t2) / 1e9 / out["contiguous_d2h_gbps"], 3),
            }

        issue_times()
        issue_times()

        def seq(mover: Mover = m) -> None:
            b = mover.device_to_host(src, hother)
            ld = mover.host_to_device(hpages, dst)
            b.wait(), ld.wait(), b.complete()

        def rev(mover: Mover = m) -> None:
            ld = mover.host_to_device(hpages, dst)
            b = mover.device_to_host(src, hother)
            b.wait(), ld.wait(), b.complete()

        def threaded(mover: Mover = m) -> None:
            box: list = []
            th = threading.Thread(target=lambda: box.append(mover.device_to_host(src, hother)))
            th.start()
            ld = mover.host_to_device(hpages, dst)
            th.join()
            box[0].wait(), ld.wait(), box[0].complete()

        def inter(mover: Mover = m) -> None:
            b, ld = interleaved(mover, src, hother, hpages, dst)
            b.wait(), ld.wait(), b.complete()

        for vname, fn in (("seq", seq), ("rev", rev), ("thread", threaded), ("inter", inter)):
            fn()
            res[vname] = round(2 * total / timed(fn) / 1e9 / out["contiguous_both_gbps"], 3)
        b = mover.device_to_host(src, hother)
        ld = mover.host_to_device(hpages, dst)
        b.wait(), ld.wait(), b.complete()
        res["paths"] = {k: f"d2h {b.paths[k]}, h2d {ld.paths[k]}" for k in ld.paths}
        out[mech] = res
        print(name, mech, res, flush=True)
        del mover
    # Correctness of the interleaved issue: the loaded pages equal the host pages.
    mover = Mover(dpool, hpool)
    op = mover.device_to_host(src, hpages)
    op.wait(), op.complete()
    b, ld = interleaved(mover, src, hother, hpages, dst)
    b.wait(), ld.wait(), b.complete()
    torch.cuda.synchronize()
    ok = all(
        torch.equal(
            dpool.page_bytes_view(s.name)[:, dst.to(DEV)],
            dpool.page_bytes_view(s.name)[:, src.to(DEV)],
        )
        for s in specs
    )
    out["interleaved_verified"] = ok
    return out


def main() -> None:
    res = {"async_engine_count": engines(), "cells": {}}
    print("async engines", res["async_engine_count"], flush=True)
    for name, kw in CELLS.items():
        res["cells"][name] = cell(name, **kw)
        with open(f"{OUT}/both_ways.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
