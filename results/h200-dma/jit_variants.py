"""Triton compiles on the transfer path: the first copy of each kind in a fresh process, then a
serving-like mix of batch sizes after it.

    python3 results/h200-dma/jit_variants.py [--specialize] [--families mla,dsa] [--page-size 1]
        [--host-layout page_first] [--target-mib 256] [--mix 60] [--kernels]

Each run uses a fresh, empty ``TRITON_CACHE_DIR`` (set before Triton is imported), so every
kernel variant the run needs is compiled in it; a compile is counted as a new ``.cubin`` there.
``--specialize`` re-wraps the row kernels with a plain ``triton.jit`` (every integer argument
and pointer specialised, as Triton does by default), for the side-by-side figure. Prints JSON:
per family the seconds and compiles of making the ``Mover``, of the first d2h, h2d and
exchange and of a second exchange, then of ``--mix`` transfers of random sizes (1 to N pages,
log-uniform; d2h, h2d and exchange in turn): how many compiled, their total and worst seconds,
the worst seconds of those that did not compile, and every one over ``SLOW_S`` with its
compiles, device allocations and the garbage collections (generation, seconds) inside it.
``--kernels`` runs every timed step under ``torch.profiler`` and lists the device kernels and
copies each step ran for the first time in the process (a kernel's first launch loads its
module where CUDA loads modules lazily, the default); its seconds include the profiler's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import random
import sys
import tempfile
import time

CACHE = tempfile.mkdtemp(prefix="kvtier-triton-")
os.environ["TRITON_CACHE_DIR"] = CACHE

import torch  # noqa: E402

from kvtier.bench.host_runs import churned  # noqa: E402
from kvtier.bench.pool_sets import family_pool_set  # noqa: E402
from kvtier.pools.device import DevicePool  # noqa: E402
from kvtier.pools.host import HostPool  # noqa: E402
from kvtier.pools.spec import tree_page_size  # noqa: E402
from kvtier.transfer import rows, rows_triton  # noqa: E402
from kvtier.transfer.mover import Mover  # noqa: E402

SLOW_S = 0.015
"""Mixed transfers slower than this are listed with their compiles and device allocations
(``cudaMalloc`` calls by torch's caching allocator)."""


GC_PAUSES: list[tuple[int, float]] = []
"""(generation, seconds) of every garbage collection since the last ``timed`` call began."""
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        GC_PAUSES.append((info["generation"], time.perf_counter() - _gc_started[0]))


def compiled() -> int:
    return sum(1 for _ in pathlib.Path(CACHE).rglob("*.cubin"))


def specialise_all() -> None:
    import triton

    for name in ("copy_rows_kernel", "copy_tiles_kernel", "copy_pages_kernel"):
        setattr(rows_triton, name, triton.jit(getattr(rows_triton, name).fn))
    rows._kernels.cache_clear()


KERNELS: set[str] | None = None
"""With ``--kernels``: every device kernel and copy seen so far (by name)."""
NEW_KERNELS: list[str] = []
"""With ``--kernels``: those the last ``timed`` call ran for the first time in this process."""


def timed(fn) -> tuple[float, int]:  # noqa: ANN001
    torch.cuda.synchronize()
    GC_PAUSES.clear()
    NEW_KERNELS.clear()
    c0, t0 = compiled(), time.perf_counter()
    if KERNELS is None:
        fn()
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    if KERNELS is not None:
        names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
        NEW_KERNELS.extend(sorted(names - KERNELS))
        KERNELS.update(names)
    return s, compiled() - c0


def run_family(family: str, args: argparse.Namespace, rng: random.Random) -> dict:
    specs = family_pool_set(family, torch.bfloat16)
    ps = tree_page_size(args.page_size, specs)
    page_bytes = sum(s.page_bytes(ps) for s in specs)
    n = max(2, (args.target_mib << 20) // page_bytes)
    dev = torch.device("cuda")
    dpool = DevicePool(specs, 2 * n, ps, dev)
    hpool = HostPool(specs, 4 * n, ps, layout=args.host_layout, pin=True)
    movers: list[Mover] = []
    made, made_compiles = timed(lambda: movers.append(Mover(dpool, hpool)))
    mover = movers[0]
    loaded = list(NEW_KERNELS)
    perm = torch.randperm(2 * n)
    src, dst = perm[:n], perm[n:]
    hpages, hother = churned(4 * n, [n, n], ps, seed=0)

    def d2h(k: int = n) -> None:
        op = mover.device_to_host(src[:k], hpages[:k])
        op.wait()
        op.complete()
        op.release()

    def h2d(k: int = n) -> None:
        op = mover.host_to_device(hpages[:k], dst[:k])
        op.wait()
        op.release()

    def both(k: int = n) -> None:
        back, load = mover.exchange((src[:k], hother[:k]), (hpages[:k], dst[:k]))
        back.wait()
        load.wait()
        back.complete()
        back.release()
        load.release()

    out: dict = {"pages": n, "page_bytes": page_bytes, "page_size": ps}
    out["mover_made"] = {"s": round(made, 4), "compiles": made_compiles}
    if KERNELS is not None:
        out["mover_made"]["new_kernels"] = loaded
    for name, fn in (("d2h", d2h), ("h2d", h2d), ("exchange", both), ("exchange_again", both)):
        s, c = timed(fn)
        out[name] = {"s": round(s, 4), "compiles": c}
        if KERNELS is not None:
            out[name]["new_kernels"] = list(NEW_KERNELS)
    kinds = (d2h, h2d, both)
    mix = {"ops": args.mix, "compiled_ops": 0, "compiles": 0, "compile_s": 0.0, "worst_s": 0.0}
    plain: list[float] = []
    slow: list[dict] = []
    first: list[dict] = []
    for i in range(args.mix):
        k = max(1, min(n, int(math.exp(rng.uniform(0, math.log(n))))))
        a0 = torch.cuda.memory_stats(dev).get("num_device_alloc", 0)
        s, c = timed(lambda k=k, i=i: kinds[i % 3](k))
        allocs = torch.cuda.memory_stats(dev).get("num_device_alloc", 0) - a0
        if NEW_KERNELS:
            first.append(
                {
                    "op": i,
                    "kind": kinds[i % 3].__name__,
                    "pages": k,
                    "s": round(s, 4),
                    "new": list(NEW_KERNELS),
                }
            )
        if s > SLOW_S:
            slow.append(
                {
                    "op": i,
                    "kind": kinds[i % 3].__name__,
                    "pages": k,
                    "s": round(s, 4),
                    "compiles": c,
                    "device_allocs": allocs,
                    "gc": [[g, round(t, 4)] for g, t in GC_PAUSES],
                }
            )
        if c:
            mix["compiled_ops"] += 1
            mix["compiles"] += c
            mix["compile_s"] += s
            mix["worst_s"] = max(mix["worst_s"], s)
        else:
            plain.append(s)
    mix["compile_s"] = round(mix["compile_s"], 4)
    mix["worst_s"] = round(mix["worst_s"], 4)
    mix["worst_plain_s"] = round(max(plain), 4) if plain else None
    mix["slow_ops"] = slow
    if KERNELS is not None:
        mix["first_kernels"] = first
    out["mix"] = mix
    mover.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--specialize", action="store_true")
    p.add_argument("--families", default="dense,mla,dsa,dsa-compressed,hybrid,swa")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--host-layout", default="page_first")
    p.add_argument("--target-mib", type=int, default=256)
    p.add_argument("--mix", type=int, default=60)
    p.add_argument("--kernels", action="store_true")
    args = p.parse_args()
    global KERNELS
    if args.kernels:
        KERNELS = set()
    gc.callbacks.append(_on_gc)
    if args.specialize:
        specialise_all()
    import triton

    rng = random.Random(0)
    res = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "specialize": args.specialize,
        "page_size": args.page_size,
        "host_layout": args.host_layout,
        "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
        "families": {},
    }
    for fam in args.families.split(","):
        res["families"][fam] = run_family(fam, args, rng)
        print(fam, json.dumps(res["families"][fam]), file=sys.stderr, flush=True)
    res["compiles_total"] = compiled()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
