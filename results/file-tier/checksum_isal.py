"""Digest rates on cache-hot buffers: XXH3-64 (xxhash), ISA-L CRC32 (isal, not a kvtier dependency:
`pip install --target DIR isal==1.9.1` and put DIR on PYTHONPATH), zlib CRC32.

    python results/file-tier/checksum_isal.py
"""

import timeit
import zlib

import xxhash
from isal import isal_zlib

for size in (64 << 10, 1 << 20, 2 << 20):
    b = bytearray(size)
    mv = memoryview(b)
    for name, f in [
        ("xxh3", lambda: xxhash.xxh3_64_intdigest(mv)),  # noqa: B023
        ("isal.crc32", lambda: isal_zlib.crc32(mv)),  # noqa: B023
        ("zlib.crc32", lambda: zlib.crc32(mv)),  # noqa: B023
    ]:
        k = max(1, (256 << 20) // size)
        v = min(timeit.repeat(f, number=k, repeat=5)) / k
        print(f"{size >> 10:5d} KiB {name:12s} {size / v / 1e9:6.1f} GB/s")
