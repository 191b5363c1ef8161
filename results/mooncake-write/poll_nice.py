"""kvtier's Mooncake writes and reads at ``poll_nice`` 0, 10 and 19 against the raw client
(called plainly), 256 x 2 MiB objects on one local cluster, in rounds in a shuffled order;
medians of each side's per-round ratio to the raw client.

    python results/mooncake-write/poll_nice.py [--rounds 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid

import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage.mooncake import MooncakeBackend
from kvtier.storage.mooncake_local import LocalMooncake
from kvtier.storage.mooncake_url import parse_storage_url

NICES = (0, 10, 19)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore

    n, pb = 256, 2 << 20
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
    dst = torch.empty_like(src)
    keys = [PageKey(f"{i:032x}") for i in range(n)]
    rows = [src[i].data_ptr() for i in range(n)]
    out_rows = [dst[i].data_ptr() for i in range(n)]
    times: dict[str, list[float]] = {}
    with LocalMooncake(segment_bytes=5 * n * pb) as cluster:
        raw = MooncakeDistributedStore()
        assert raw.setup(*parse_storage_url(cluster.url()).setup_args(segment=0)) == 0
        raw.register_buffer(src.data_ptr(), n * pb)
        raw.register_buffer(dst.data_ptr(), n * pb)
        backends = {
            k: MooncakeBackend(cluster.url(poll_nice=k), Namespace(uuid.uuid4().hex)) for k in NICES
        }
        for b in backends.values():
            b.register_buffers([src, dst])
        for r in range(a.rounds + 1):  # round 0 warms the segment up and is not counted
            order: list[str | int] = ["raw", *NICES]
            random.shuffle(order)
            stored: list[str] = []
            for side in order:
                t0 = time.perf_counter()
                if side == "raw":
                    names = [f"raw/{r}/{i}" for i in range(n)]
                    stored += names
                    assert set(raw.batch_put_from(names, rows, [pb] * n)) == {0}
                    t1 = time.perf_counter()
                    assert set(raw.batch_get_into(names, out_rows, [pb] * n)) == {pb}
                else:
                    b = backends[side]
                    assert b.batch_set(keys, list(src)) == n
                    t1 = time.perf_counter()
                    assert b.batch_get(keys, list(dst)) == n
                    stored += [b.store_key(k) for k in keys]
                t2 = time.perf_counter()
                assert torch.equal(src, dst)
                if r:
                    times.setdefault(f"{side}_write", []).append(t1 - t0)
                    times.setdefault(f"{side}_read", []).append(t2 - t1)
            raw.batch_remove(stored, True)
        for b in backends.values():
            b.close()
        raw.close()
    out = {"rounds": a.rounds, "pages": n, "page_bytes": pb, "gbps_median": {}, "ratio": {}}
    for side, dts in times.items():
        peer = times["raw_" + side.rsplit("_", 1)[1]]
        out["gbps_median"][side] = n * pb / statistics.median(dts) / 1e9
        out["ratio"][side] = statistics.median(p / t for p, t in zip(peer, dts, strict=True))
        print(f"{side:10s} {out['gbps_median'][side]:.2f} GB/s  ratio {out['ratio'][side]:.2f}")
    out["seconds"] = times
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
