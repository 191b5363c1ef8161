"""Start-up time of a pinned host tier: background pinning against pinning everything up front.

Builds a ``HostPool`` of Llama-8B-sized KV pages (32 layers, 8 KV heads of 128, bf16, 16-token
pages: 2 MiB a page) of ``--host-gb`` GiB on CUDA and prints one JSON object:

    ctor_s          seconds until the constructor returned
    first_page_s    seconds until the allocator handed out the first page
    pinned_s        seconds until every page was pinned
    h2d_16mib_ms    one 16 MiB host -> device copy from a ready page range (after a warm-up)
    old_ctor_s      with ``--old``: ``torch.zeros(..., pin_memory=True)`` of the same bytes

Progress goes to stderr. The CUDA context is created before any timing starts (the weights
would be on the device by then). Run on a GPU host::

    python scripts/measure_startup.py --host-gb 100 --old
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from kvtier.pools.host import HostPool
from kvtier.pools.pinning import DEFAULT_CHUNK_BYTES
from kvtier.pools.spec import PoolSpec

LLAMA_8B_KV = PoolSpec("kv", num_layers=32, row_shape=(2, 8, 128), dtype=torch.bfloat16)
PAGE_SIZE = 16
COPY_BYTES = 16 << 20


def progress(msg: str) -> None:
    print(f"[measure_startup] {msg}", file=sys.stderr, flush=True)


def h2d_ms(pool: HostPool, dev: torch.device) -> float:
    """Milliseconds of one contiguous ``COPY_BYTES`` copy from the first pages (the first
    pages of layer 0 under ``layer_first``), once those are pinned."""
    view = pool.page_bytes_view("kv")  # [layers, pages, bytes]
    if pool.layout == "page_first":
        pages = -(-COPY_BYTES // pool.page_bytes)
        host = pool.buffers["kv"][:pages]
    else:
        pages = -(-COPY_BYTES // (view.shape[2] * view.element_size()))
        host = view[0, :pages]
    assert pool.pinner is not None and pool.pinner.wait(pages)
    dst = torch.empty(host.shape, dtype=host.dtype, device=dev)
    dst.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-gb", type=float, default=100.0, help="host tier size in GiB")
    ap.add_argument("--layout", default="page_first", choices=("page_first", "layer_first"))
    ap.add_argument(
        "--chunk-mb", type=int, default=DEFAULT_CHUNK_BYTES >> 20, help="bytes pinned per step"
    )
    ap.add_argument("--old", action="store_true", help="also time torch.zeros(pin_memory=True)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("measure_startup needs CUDA")
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the context exists before the host tier is built
    page_bytes = LLAMA_8B_KV.page_bytes(PAGE_SIZE)
    pages = int(args.host_gb * 2**30) // page_bytes
    out: dict[str, object] = {
        "host_bytes": pages * page_bytes,
        "pages": pages,
        "layout": args.layout,
        "chunk_bytes": args.chunk_mb << 20,
    }
    progress(f"building a host pool of {pages} pages ({pages * page_bytes / 2**30:.1f} GiB)")
    t0 = time.perf_counter()
    pool = HostPool(
        [LLAMA_8B_KV], pages, PAGE_SIZE, args.layout, pin=True, chunk_bytes=args.chunk_mb << 20
    )
    out["ctor_s"] = time.perf_counter() - t0
    first = pool.allocator.alloc(1)
    out["first_page_s"] = time.perf_counter() - t0
    assert first is not None
    pool.allocator.free(first)
    progress(f"constructor {out['ctor_s']:.3f} s, first page {out['first_page_s']:.3f} s")
    out["h2d_16mib_ms"] = h2d_ms(pool, dev)
    pinner = pool.pinner
    assert pinner is not None
    step = max(1, pages // 20)
    while not pinner.done:
        pinner.wait(min(pages, pinner.ready_items + step), timeout=60)
        progress(f"{pinner.ready_items}/{pages} pages pinned after {pinner.seconds:.1f} s")
    out["pinned_s"] = time.perf_counter() - t0
    out["pages_available"] = pool.allocator.available
    del pool, pinner, first
    gc.collect()
    if args.old:
        progress("old path: torch.zeros(pin_memory=True) of the same bytes")
        t0 = time.perf_counter()
        old = torch.zeros(
            (pages, LLAMA_8B_KV.num_layers, PAGE_SIZE, *LLAMA_8B_KV.row_shape),
            dtype=LLAMA_8B_KV.dtype,
            pin_memory=True,
        )
        out["old_ctor_s"] = time.perf_counter() - t0
        progress(f"old constructor {out['old_ctor_s']:.3f} s")
        del old
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
