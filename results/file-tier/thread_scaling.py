"""Whether two threads run GIL-free digests in parallel here: XXH3, zlib CRC32 and SHA-1 over a
cache-resident 512 KiB buffer on one and two threads (wall and process CPU time).

    python results/file-tier/thread_scaling.py
"""

import hashlib
import threading
import time
import zlib

import xxhash

b = bytearray(512 << 10)
fns = {
    "xxh3": lambda: xxhash.xxh3_64_intdigest(b),
    "xxh3_obj": lambda: xxhash.xxh3_64(b).intdigest(),
    "crc32": lambda: zlib.crc32(b),
    "sha1": lambda: hashlib.sha1(b).digest(),
}
for name, f in fns.items():
    k = 2560 if name.startswith("xxh") else 100

    def work():
        for _ in range(k):  # noqa: B023
            f()  # noqa: B023

    for t in (1, 2):
        ths = [threading.Thread(target=work) for _ in range(t)]
        t0 = time.perf_counter()
        c0 = time.process_time()
        [x.start() for x in ths]
        [x.join() for x in ths]
        print(
            name,
            t,
            "threads",
            f"wall {time.perf_counter() - t0:.3f} cpu {time.process_time() - c0:.3f}",
        )
