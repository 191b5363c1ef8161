"""Whether python-xxhash's ``xxh3_64_intdigest`` lets other threads run while it hashes: one
and two threads hashing the same cache-resident buffer (64 KiB, 64 KiB + 1 byte, 1 MiB) in a
loop; GB/s of wall time and process CPU time over wall time. ``zlib.crc32`` beside it for
1 MiB (it releases the GIL).

    python results/file-tier/xxhash_gil.py
"""

from __future__ import annotations

import os
import threading
import time
import zlib

import xxhash

for size in (1 << 16, (1 << 16) + 1, 1 << 20):
    buf = os.urandom(size)
    for name, fn, total in (
        ("xxh3_64", xxhash.xxh3_64_intdigest, 2 << 30),
        ("crc32", zlib.crc32, 256 << 20),
    ):
        if name == "crc32" and size < (1 << 20):
            continue
        n = total // size

        def work(k: int, fn=fn, buf=buf) -> None:  # noqa: ANN001
            for _ in range(k):
                fn(buf)

        for threads in (1, 2):
            ts = [threading.Thread(target=work, args=(n // threads,)) for _ in range(threads)]
            t0, c0 = time.perf_counter(), time.process_time()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(
                f"{size:8d} B {name:8s} {threads} thread(s): {n * size / wall / 1e9:5.1f} GB/s, "
                f"cpu/wall {cpu / wall:.2f}"
            )
