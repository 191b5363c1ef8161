"""Do both directions' batched copy-engine lists share one engine? A 1 GiB ``Mover.exchange``
(churned host pages) with staged slices queued by ``cuMemcpyBatchAsync`` (as shipped) and by one
``cuMemcpyAsync`` per block; two contiguous copies at once by ``Tensor.copy_``, by one-block
batch lists and by ``cuMemcpyAsync``. Interleaved, best of 5, ratios to ``Tensor.copy_``. Dense
and hybrid at page size 1; ``$OUT/ce_sharing.json``.

Its one run (run 11) stopped at the first one-block batch list: the driver refused a single
1 GiB block (``CUresult`` 1, invalid value), so it gave no figure."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import numpy as np
import torch

from kvtier.transfer import dma

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ContiguousPair, ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
LIB = ctypes.CDLL("libcuda.so.1")
MEMCPY = LIB.cuMemcpyAsync
MEMCPY.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
MEMCPY.restype = ctypes.c_int
BATCHED = dma.copy_blocks
RAW_BATCHED = dma._copy_batched


def per_block(dst, src, size, stream):  # noqa: ANN001, ANN201
    h = ctypes.c_void_p(stream.cuda_stream)
    for d, s, z in zip(dst.tolist(), src.tolist(), size.tolist(), strict=True):
        rc = MEMCPY(d, s, z, h)
        if rc:
            raise RuntimeError(f"cuMemcpyAsync {rc}")


def case(family: str, ps: int) -> dict:
    c = ExchangeCase(family, ps, DEV)
    n, pb = c.pages, c.page_bytes
    pair = ContiguousPair(c.nbytes, DEV)
    side = pair.side

    def ex(fn):  # noqa: ANN001, ANN202
        def run() -> None:
            dma.copy_blocks = fn
            try:
                c.exchange()
            finally:
                dma.copy_blocks = BATCHED

        return run

    def raw_pair(fn):  # noqa: ANN001, ANN202
        nb = n * pb
        one = np.array([nb], dtype=np.uint64)

        def run() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            d0, h0 = pair.dev[0].data_ptr(), pair.host[0].data_ptr()
            d1, h1 = pair.dev[1].data_ptr(), pair.host[1].data_ptr()
            fn(np.array([h1], dtype=np.uint64), np.array([d1], dtype=np.uint64), one, main)
            fn(np.array([d0], dtype=np.uint64), np.array([h0], dtype=np.uint64), one, side)
            main.wait_stream(side)

        return run

    fns = {
        "copy_": pair.both,
        "pair_batched": raw_pair(RAW_BATCHED),
        "pair_memcpy": raw_pair(per_block),
        "exchange_batched": ex(RAW_BATCHED),
        "exchange_default": ex(BATCHED),
        "exchange_memcpy": ex(per_block),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(5):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    base = min(times["copy_"])
    out = {k: round(base / min(v), 3) for k, v in times.items()}
    out["copy_gbps"] = round(2 * n * pb / base / 1e9, 1)
    return out


if __name__ == "__main__":
    res = {}
    for fam, ps in (("dense", 1), ("hybrid", 1), ("dsa", 1), ("mla", 16)):
        res[f"{fam} ps{ps}"] = case(fam, ps)
        print(fam, ps, json.dumps(res[f"{fam} ps{ps}"]), flush=True)
    with open(f"{OUT}/ce_sharing.json", "w") as f:
        json.dump(res, f, indent=1)
