"""CPU time of each thread during raw Mooncake calls: one ``batch_put_from`` and one
``batch_get_into`` of 256 x 2 MiB from this thread, against a local cluster, per round: the
calling thread, the client's other threads and the storage node's threads (Linux ``/proc``).
Shows that the client busy-polls the calling thread for the whole transfer.

    python results/mooncake-write/thread_cpu.py [--rounds 4] > results/mooncake-write/thread_cpu.txt
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from kvtier.storage.mooncake_local import LocalMooncake
from kvtier.storage.mooncake_url import parse_storage_url


def cpu_ms(pid: int | str = "self") -> dict[int, float]:
    """Milliseconds of CPU (user + system) of each thread of ``pid``."""
    tick = 1000 / os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that just ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) * tick
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore

    n, pb = 256, 2 << 20
    src = torch.randint(0, 256, (n, pb), dtype=torch.uint8)
    dst = torch.empty_like(src)
    me = threading.get_native_id()
    with LocalMooncake(segment_bytes=2 * n * pb) as cluster:
        raw = MooncakeDistributedStore()
        assert raw.setup(*parse_storage_url(cluster.url()).setup_args(segment=0)) == 0
        raw.register_buffer(src.data_ptr(), n * pb)
        raw.register_buffer(dst.data_ptr(), n * pb)
        node = cluster.node.pid
        for r in range(a.rounds + 1):  # round 0 warms the segment up and is not shown
            names = [f"t/{r}/{i}" for i in range(n)]
            for what in ("put", "get"):
                before, node_before = cpu_ms(), cpu_ms(node)
                t0 = time.perf_counter()
                if what == "put":
                    codes = raw.batch_put_from(names, [t.data_ptr() for t in src], [pb] * n)
                else:
                    codes = raw.batch_get_into(names, [t.data_ptr() for t in dst], [pb] * n)
                wall = (time.perf_counter() - t0) * 1000
                assert set(codes) == ({0} if what == "put" else {pb})
                used = {t: c - before.get(t, 0) for t, c in cpu_ms().items()}
                node_used = sum(c - node_before.get(t, 0) for t, c in cpu_ms(node).items())
                others = sum(c for t, c in used.items() if t != me)
                if r:
                    print(
                        f"round {r} {what}: wall {wall:.0f} ms; CPU: calling thread "
                        f"{used.get(me, 0):.0f} ms, client's other threads {others:.0f} ms, "
                        f"storage node {node_used:.0f} ms",
                        flush=True,
                    )
            raw.batch_remove(names, True)
        raw.close()


if __name__ == "__main__":
    main()
