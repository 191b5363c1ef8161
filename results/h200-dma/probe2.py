"""Driver issue cost of cuMemcpyBatchAsync and whether a worker thread hides it."""

import ctypes
import json
import os
import threading
import time

import numpy as np
import torch

from kvtier.transfer.dma import _Attributes, _entry, _Location

OUT = os.environ.get("OUT", "/tmp")
res = {}
dev = torch.device("cuda")
L, P, RB = 32, 2048, 65536
host = torch.empty((2 * P, L, RB // 8), dtype=torch.int64, pin_memory=True)
devb = torch.empty((L, 2 * P, RB // 8), dtype=torch.int64, device=dev)
g = torch.Generator().manual_seed(0)
hp = torch.randperm(2 * P, generator=g)[:P].numpy().astype(np.uint64)
dp = torch.randperm(2 * P, generator=g)[:P].numpy().astype(np.uint64)
hptr = [
    np.uint64(host.data_ptr()) + (hp * np.uint64(L) + np.uint64(layer)) * np.uint64(RB)
    for layer in range(L)
]
dptr = [
    np.uint64(devb.data_ptr()) + (np.uint64(layer * 2 * P) + dp) * np.uint64(RB)
    for layer in range(L)
]
sizes = np.full(P, RB, dtype=np.uint64)
s = torch.cuda.Stream()

fn, fail = _entry()


def call(d, sr, z, stream, hints=False, flags=0):
    a = _Attributes(1)
    if hints:
        a.src_loc_hint = _Location(3, 0)  # CU_MEM_LOCATION_TYPE_HOST = 0x2? try host numa
        a.dst_loc_hint = _Location(1, 0)  # device 0
    a.flags = flags
    idx = (ctypes.c_size_t * 1)(0)
    args = [
        ctypes.c_void_p(d.ctypes.data),
        ctypes.c_void_p(sr.ctypes.data),
        ctypes.c_void_p(z.ctypes.data),
        ctypes.c_size_t(len(z)),
        ctypes.byref(a),
        idx,
        ctypes.c_size_t(1),
    ]
    if fail:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    rc = fn(*args, ctypes.c_void_p(s.cuda_stream))
    return rc


def issue(batch, hints=False, flags=0):
    t0 = time.perf_counter()
    for layer in range(L):
        for lo in range(0, P, batch):
            rc = call(
                dptr[layer][lo : lo + batch],
                hptr[layer][lo : lo + batch],
                sizes[lo : lo + batch],
                s,
                hints,
                flags,
            )
            if rc:
                return f"rc {rc}"
    t1 = time.perf_counter()
    s.synchronize()
    t2 = time.perf_counter()
    return {"issue_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3}


issue(512)
for batch in (64, 512, 2048):
    res[f"batch{batch}"] = issue(batch)
for hint_type in (1, 2, 3, 4):

    def call_h(d, sr, z, stream, hints=False, flags=0, ht=hint_type):
        a = _Attributes(1)
        a.src_loc_hint = _Location(ht, 0)
        a.dst_loc_hint = _Location(1, 0)
        idx = (ctypes.c_size_t * 1)(0)
        args = [
            ctypes.c_void_p(d.ctypes.data),
            ctypes.c_void_p(sr.ctypes.data),
            ctypes.c_void_p(z.ctypes.data),
            ctypes.c_size_t(len(z)),
            ctypes.byref(a),
            idx,
            ctypes.c_size_t(1),
        ]
        return fn(*args, ctypes.c_void_p(s.cuda_stream))

    t0 = time.perf_counter()
    rc = call_h(dptr[0], hptr[0], sizes, s)
    t1 = time.perf_counter()
    s.synchronize()
    res[f"hint{hint_type}"] = {"rc": rc, "issue_ms_one_layer": (t1 - t0) * 1e3}
res["flag_overlap"] = issue(512, flags=1)
print(res, flush=True)

# CPU-bound main thread: many small kernels (like the reference engine's forward)
x = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.01


def forward():
    y = x
    for _ in range(32 * 40):
        y = torch.nn.functional.silu(y)
    return y


forward()
torch.cuda.synchronize()
t0 = time.perf_counter()
forward()
torch.cuda.synchronize()
res["forward_alone_ms"] = (time.perf_counter() - t0) * 1e3


def worker():
    for layer in range(L):
        for lo in range(0, P, 512):
            call(dptr[layer][lo : lo + 512], hptr[layer][lo : lo + 512], sizes[lo : lo + 512], s)


t0 = time.perf_counter()
worker()
s.synchronize()
res["dma_alone_ms"] = (time.perf_counter() - t0) * 1e3
torch.cuda.synchronize()
t0 = time.perf_counter()
th = threading.Thread(target=worker)
th.start()
forward()
t1 = time.perf_counter()
th.join()
torch.cuda.synchronize()
s.synchronize()
res["threaded"] = {"forward_ms": (t1 - t0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3}
t0 = time.perf_counter()
worker()
forward()
torch.cuda.synchronize()
s.synchronize()
res["serial_ms"] = (time.perf_counter() - t0) * 1e3
print(res, flush=True)
with open(f"{OUT}/probe2.json", "w") as fh:
    json.dump(res, fh, indent=1)
