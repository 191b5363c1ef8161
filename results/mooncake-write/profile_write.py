"""Where a Mooncake write (and read) of 256 x 2 MiB objects goes: the raw client's calls in the
shapes kvtier could use, the envelope digest alone, and kvtier's ``batch_set``/``batch_get``,
each timed in rounds on one local cluster, in a shuffled order each round; medians, and the
median of each side's per-round ratio to the raw client.

    python results/mooncake-write/profile_write.py [--rounds 12] [--nice 10] [--json PATH]
        [--sides raw,raw_low,...]

Sides (all on the same registered source/destination bytes; ``low``: the call runs on a worker
thread at ``--nice``, as kvtier's store calls do; the client busy-polls its calling thread until
the transfer completes):
  raw / raw_low       batch_put_from, one call for every object (raw: the bench's peer)
  env_1               batch_put_from_multi_buffers, header (112 B, registered) + payload, one
                      call, low, headers made beforehand (the envelope's second buffer alone)
  env_g32 / env_g128  the same in sequential calls of 32 / 128 objects (call boundaries)
  digest              XXH3-64 of every payload on the caller's thread, no store call
  pipe_g32 / pipe_ramp  digest + header of a group, then its put (low) while the next group is
                      digested; groups of 32, or 2 objects growing 4x a group up to 128
  kvtier_write        MooncakeBackend.batch_set as the tree has it
  before_write        the same from another tree's kvtier, renamed to the package
                      ``kvtier_before`` under ``--before DIR`` (the commit before this work:
                      ``git archive 09a3c23 kvtier``, then ``kvtier.`` -> ``kvtier_before.``)
  raw_get / raw_get_low / env_get_g32 (header + payload into place, no verify)
  kvtier_read / before_read  MooncakeBackend.batch_get
"""

# The sides are closures over the round's objects, called within that round.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.envelope import HEADER_BYTES as H
from kvtier.storage.mooncake import MooncakeBackend
from kvtier.storage.mooncake_local import LocalMooncake
from kvtier.storage.mooncake_url import parse_storage_url

WRITES = ["raw", "raw_low", "env_1", "env_g32", "env_g128", "digest", "pipe_g32", "pipe_ramp"]
WRITES += ["kvtier_write", "before_write"]
READS = ["raw_get", "raw_get_low", "env_get_g32", "kvtier_read", "before_read"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-bytes", type=int, default=2 << 20)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--sides", default=",".join(WRITES + READS))
    ap.add_argument("--before", help="directory holding the package kvtier_before")
    ap.add_argument("--json")
    a = ap.parse_args()
    before_cls = None
    if a.before:
        sys.path.insert(0, a.before)
        from kvtier_before.storage.mooncake import MooncakeBackend as before_cls
    from mooncake.store import MooncakeDistributedStore

    sides = [s for s in a.sides.split(",") if s and (a.before or not s.startswith("before"))]
    n, pb = a.pages, a.page_bytes
    total = n * pb
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
    dst = torch.empty_like(src)
    views = [src[i].numpy() for i in range(n)]
    heads = np.zeros(n * H, np.uint8)
    rows = [src[i].data_ptr() for i in range(n)]
    out_rows = [dst[i].data_ptr() for i in range(n)]
    hp = [heads.ctypes.data + i * H for i in range(n)]
    keys = [PageKey(f"{i:032x}") for i in range(n)]
    run = uuid.uuid4().hex

    def low() -> None:
        if sys.platform == "linux":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), a.nice)

    pool = ThreadPoolExecutor(2, initializer=low)

    def mkheads(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            h = envelope.pack("n" * 32, keys[i], pb, xxhash.xxh3_64_intdigest(views[i]))
            heads[i * H : (i + 1) * H] = np.frombuffer(h, np.uint8)

    mkheads(0, n)
    segment = (len([s for s in sides if s not in READS]) + 2) * (total + n * H) + (64 << 20)
    times: dict[str, list[float]] = {}
    with LocalMooncake(segment_bytes=segment) as cluster:
        url = cluster.url()
        raw = MooncakeDistributedStore()
        assert raw.setup(*parse_storage_url(url).setup_args(segment=0)) == 0
        for ptr, size in ((src.data_ptr(), total), (dst.data_ptr(), total)):
            raw.register_buffer(ptr, size)
        raw.register_buffer(heads.ctypes.data, heads.nbytes)

        def multi(names: list[str], lo: int, hi: int) -> list[int]:
            return raw.batch_put_from_multi_buffers(
                names[lo:hi], [[hp[i], rows[i]] for i in range(lo, hi)], [[H, pb]] * (hi - lo)
            )

        def pipe(names: list[str], bounds: list[int], digest: bool) -> None:
            prev = None
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                if digest:
                    mkheads(lo, hi)
                if prev is not None:
                    assert set(prev.result()) == {0}
                prev = pool.submit(multi, names, lo, hi)
            assert prev is not None and set(prev.result()) == {0}

        def fixed(g: int) -> list[int]:
            return [*range(0, n, g), n]

        def ramp(first: int = 2, cap: int = 128) -> list[int]:
            b, size = [0], first
            while b[-1] < n:
                b.append(min(n, b[-1] + size))
                size = min(size * 4, cap)
            return b

        def check(codes: list[int], want: int) -> None:
            assert set(codes) == {want}, sorted(set(codes))

        for rnd in range(a.rounds + 1):  # round 0 warms the segment up and is not counted
            be = MooncakeBackend(url, Namespace(f"{run[:24]}{rnd:08d}"))
            be.register_buffers([src, dst])
            old = None
            if before_cls is not None:
                old = before_cls(url, Namespace(f"{run[:24]}{rnd:07d}b"))
                old.register_buffers([src, dst])
            names = {s: [f"p/{run}/{rnd}/{s}/{i}" for i in range(n)] for s in sides}
            written = names["raw"] if "raw" in names else names[sides[0]]
            fns: dict[str, Callable[[], None]] = {
                "raw": lambda: check(raw.batch_put_from(names["raw"], rows, [pb] * n), 0),
                "raw_low": lambda: check(
                    pool.submit(raw.batch_put_from, names["raw_low"], rows, [pb] * n).result(), 0
                ),
                "env_1": lambda: pipe(names["env_1"], [0, n], False),
                "env_g32": lambda: pipe(names["env_g32"], fixed(32), False),
                "env_g128": lambda: pipe(names["env_g128"], fixed(128), False),
                "digest": lambda: mkheads(0, n),
                "pipe_g32": lambda: pipe(names["pipe_g32"], fixed(32), True),
                "pipe_ramp": lambda: pipe(names["pipe_ramp"], ramp(), True),
                "kvtier_write": lambda: check([be.batch_set(keys, list(src))], n),
                "raw_get": lambda: check(raw.batch_get_into(written, out_rows, [pb] * n), pb),
                "raw_get_low": lambda: check(
                    pool.submit(raw.batch_get_into, written, out_rows, [pb] * n).result(), pb
                ),
                "env_get_g32": lambda: [
                    check(
                        pool.submit(
                            raw.batch_get_into_multi_buffers,
                            names["env_1"][lo : lo + 32],
                            [[hp[i], out_rows[i]] for i in range(lo, lo + 32)],
                            [[H, pb]] * 32,
                        ).result(),
                        H + pb,
                    )
                    for lo in range(0, n, 32)
                ],
                "kvtier_read": lambda: check([be.batch_get(keys, list(dst))], n),
                "before_write": lambda: check([old.batch_set(keys, list(src))], n),
                "before_read": lambda: check([old.batch_get(keys, list(dst))], n),
            }
            order = [s for s in sides if s not in READS]
            random.shuffle(order)
            reads = [s for s in sides if s in READS]
            random.shuffle(reads)
            for w in ("kvtier", "before"):
                if f"{w}_read" in reads and f"{w}_write" not in order:
                    order.append(f"{w}_write")
            for name in order + reads:
                dst.zero_()
                t0 = time.perf_counter()
                fns[name]()
                dt = time.perf_counter() - t0
                if rnd:
                    times.setdefault(name, []).append(dt)
                if name in READS and name != "env_get_g32":
                    assert torch.equal(src, dst), name
            if rnd:
                line = " ".join(f"{k}={total / v[-1] / 1e9:.2f}" for k, v in times.items())
                print(f"round {rnd}: {line}", flush=True)
            be.close()
            stored = [be.store_key(k) for k in keys]
            if old is not None:
                old.close()
                stored += [old.store_key(k) for k in keys]
            raw.batch_remove(stored + sum(names.values(), []), True)
        raw.close()
    med = {k: total / statistics.median(v) / 1e9 for k, v in times.items()}

    def paired(peer: str) -> dict[str, float]:
        if peer not in times:
            return {}
        return {
            k: statistics.median(p / t for p, t in zip(times[peer], v, strict=True))
            for k, v in times.items()
        }

    w, r = paired("raw"), paired("raw_get")
    for k in times:
        vs = w.get(k) if k not in READS else r.get(k)
        print(f"{k:14s} {med[k]:6.2f} GB/s  ratio to raw (median of rounds) {vs or 0:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "rounds": a.rounds,
                    "pages": n,
                    "page_bytes": pb,
                    "nice": a.nice,
                    "cpus": len(os.sched_getaffinity(0)),
                    "gbps_median": med,
                    "ratio_to_raw_write": w,
                    "ratio_to_raw_read": r,
                    "seconds": times,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
