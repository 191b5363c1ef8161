"""Per-core rate of the L3 envelope's checksum candidates (results/file-tier/README.md).

    pip install crc32c==2.9.post0 google-crc32c==1.9.0 xxhash==4.1.0
    python results/file-tier/checksum_rate.py

Prints GB/s on a cache-hot 1 MiB buffer (256 passes), on 64 MiB (memory-bound), and whether a
second thread makes progress while one checksum runs (the GIL is released).
"""

from __future__ import annotations

import statistics
import threading
import time
import zlib

import crc32c
import google_crc32c
import numpy as np
import xxhash

hot = np.random.randint(0, 256, 1 << 20, dtype=np.uint8)
cold = np.random.randint(0, 256, 64 << 20, dtype=np.uint8)
hot_bytes, cold_bytes = hot.tobytes(), cold.tobytes()  # google_crc32c takes read-only bytes only

CANDIDATES = {
    "zlib.crc32": lambda b, raw: zlib.crc32(memoryview(b)),
    "crc32c.crc32c": lambda b, raw: crc32c.crc32c(memoryview(b)),
    "google_crc32c.value (bytes copy not timed)": lambda b, raw: google_crc32c.value(raw),
    "xxhash.xxh3_64": lambda b, raw: xxhash.xxh3_64_intdigest(memoryview(b)),
}

for name, fn in CANDIDATES.items():
    hot_rates, cold_rates = [], []
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(256):
            fn(hot, hot_bytes)
        hot_rates.append((256 << 20) / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        fn(cold, cold_bytes)
        cold_rates.append(cold.nbytes / (time.perf_counter() - t) / 1e9)
    done, spins = [False], 0

    def run(fn=fn) -> None:
        for _ in range(4):
            fn(cold, cold_bytes)
        done[0] = True  # noqa: B023

    th = threading.Thread(target=run)
    th.start()
    while not done[0]:
        spins += 1
    th.join()
    print(
        f"{name:44s} hot 1 MiB {statistics.median(hot_rates):6.2f} GB/s  "
        f"64 MiB {statistics.median(cold_rates):5.2f} GB/s  main-thread spins {spins}"
    )
