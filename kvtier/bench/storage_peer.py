"""SGLang's ``HiCacheFile`` as the peer of ``kvtier bench storage``, run as a script by an
interpreter where ``sglang`` imports (``--peer-python``); it imports nothing from kvtier.

    python storage_peer.py DIR PAGE_BYTES NUM_PAGES

Writes ``NUM_PAGES`` random pages of ``PAGE_BYTES`` with ``batch_set`` under ``DIR`` (a size
cap of twice the bytes, so its LRU accounting runs as kvtier's budget does), reads them back
with ``batch_get`` into preallocated buffers (after an ``os.sync()`` and writing
``SWEEP_BYTES`` elsewhere, so no writeback runs beside the read and the pages are not in the CPU
cache), checks the bytes, and prints one JSON line:
``{"write_s", "read_s", "write_cpu_s", "read_cpu_s", "sglang"}`` (wall and process CPU
seconds). Exits 2 with the reason on stderr when ``sglang`` does not
import, 1 when a call falls short or the bytes differ.
"""

from __future__ import annotations

import json
import os
import sys
import time

SWEEP_BYTES = 256 << 20
"""Written before a read so it does not find the pages it reads in the CPU's last-level cache."""


def main(argv: list[str]) -> int:
    directory, page_bytes, num_pages = argv[0], int(argv[1]), int(argv[2])
    try:
        import sglang
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
        print(f"sglang does not import: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config={"file_storage_path": directory, "max_size": 2 * page_bytes * num_pages},
    )
    torch.set_num_threads(1)  # as kvtier's side does: no intra-op thread spins beside a phase
    store = HiCacheFile(cfg, file_path=directory)
    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = [f"{i:032x}" for i in range(num_pages)]
    os.sync()  # as kvtier's side does: start the write without earlier dirty pages
    t0, c0 = time.perf_counter(), time.process_time()
    ok = store.batch_set(keys, list(src))
    write_s, write_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    os.sync()  # as kvtier's side does: read without writeback running beside it
    torch.ones(SWEEP_BYTES, dtype=torch.uint8)  # as kvtier's side does before every read
    t0, c0 = time.perf_counter(), time.process_time()
    got = store.batch_get(keys, list(dst))
    read_s, read_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if not ok or any(g is None for g in got) or not torch.equal(src, dst):
        print("HiCacheFile fell short or read back other bytes", file=sys.stderr)
        return 1
    times = {"write_s": write_s, "read_s": read_s, "write_cpu_s": write_cpu_s}
    print(json.dumps({**times, "read_cpu_s": read_cpu_s, "sglang": _version(sglang)}))
    return 0


def _version(sglang: object) -> str:
    """SGLang's version; from its dist-info where it loads without its ``__init__`` (a copy of
    the modules ``HiCacheFile`` needs, ``scripts/peer_file_only.sh``)."""
    found = getattr(sglang, "__version__", None)
    if found is None:
        from importlib.metadata import version

        found = version("sglang")
    return str(found)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
