"""Device probe: h2d/d2h mechanisms by chunk size, both directions at once, overlap with compute."""

import ctypes
import json
import os
import time

import numpy as np
import torch

from kvtier.transfer.mapped import map_pinned

OUT = os.environ.get("OUT", "/tmp")
res = {}


def save():
    with open(f"{OUT}/probe.json", "w") as f:
        json.dump(res, f, indent=1)


def log(*a):
    print(*a, flush=True)


dev = torch.device("cuda")
res["torch"] = torch.__version__
try:
    import triton
    import triton.language as tl

    res["triton"] = triton.__version__
except Exception as e:
    triton = None
    res["triton"] = repr(e)
lib = ctypes.CDLL("libcuda.so.1")
drv = ctypes.c_int()
lib.cuDriverGetVersion(ctypes.byref(drv))
res["driver"] = drv.value
fn_v2 = getattr(lib, "cuMemcpyBatchAsync_v2", None)
fn_v1 = getattr(lib, "cuMemcpyBatchAsync", None)
res["batch_syms"] = [fn_v1 is not None, fn_v2 is not None]
log(res)
save()


class Attr(ctypes.Structure):
    _fields_ = [
        ("order", ctypes.c_int),
        ("src_type", ctypes.c_int),
        ("src_id", ctypes.c_int),
        ("dst_type", ctypes.c_int),
        ("dst_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


def batch_copy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream, flags=0):
    n = len(dsts)
    attr = Attr(1, 0, 0, 0, 0, flags)
    idx = (ctypes.c_size_t * 1)(0)
    p = ctypes.c_void_p
    if fn_v2 is not None:
        rc = fn_v2(
            p(dsts.ctypes.data),
            p(srcs.ctypes.data),
            p(sizes.ctypes.data),
            ctypes.c_size_t(n),
            ctypes.byref(attr),
            idx,
            ctypes.c_size_t(1),
            p(stream.cuda_stream),
        )
    else:
        fail = ctypes.c_size_t(0)
        rc = fn_v1(
            p(dsts.ctypes.data),
            p(srcs.ctypes.data),
            p(sizes.ctypes.data),
            ctypes.c_size_t(n),
            ctypes.byref(attr),
            idx,
            ctypes.c_size_t(1),
            ctypes.byref(fail),
            p(stream.cuda_stream),
        )
    if rc != 0:
        s = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError(f"cuMemcpyBatchAsync {rc} {s.value}")


if triton is not None:

    @triton.jit
    def _copy_chunks(
        src, dst, src_off, dst_off, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for c in range(pid, n_chunks, nprog):
            s = tl.load(src_off + c)
            d = tl.load(dst_off + c)
            for o in tl.static_range(0, CHUNK, BLOCK):
                offs = o + tl.arange(0, BLOCK)
                m = offs < CHUNK
                v = tl.load(src + s + offs, mask=m)
                tl.store(dst + d + offs, v, mask=m)


def setup(chunk, layers, pages):
    """host page-first [hp, layers, chunk] pinned; device layer-first [layers, dp, chunk]"""
    words = chunk // 8
    hostbuf = torch.empty((2 * pages, layers, words), dtype=torch.int64, pin_memory=True)
    devbuf = torch.empty((layers, 2 * pages, words), dtype=torch.int64, device=dev)
    g = torch.Generator().manual_seed(0)
    hp = torch.randperm(2 * pages, generator=g)[:pages]
    dp = torch.randperm(2 * pages, generator=g)[:pages]
    return hostbuf, devbuf, hp, dp


def timeit(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def methods(chunk, layers, pages, stream):
    hostbuf, devbuf, hp, dp = setup(chunk, layers, pages)
    hostbuf.view(-1)[::4096].fill_(7)
    words = chunk // 8
    mapped = map_pinned(hostbuf, dev)
    hpd, dpd = hp.to(dev), dp.to(dev)
    nbytes = chunk * layers * pages
    # pointer tables per layer
    hbase, dbase = hostbuf.data_ptr(), devbuf.data_ptr()
    hptr = [
        (hbase + hp.numpy().astype(np.uint64) * (layers * chunk) + layer * chunk).astype(np.uint64)
        for layer in range(layers)
    ]
    dptr = [
        (dbase + (layer * 2 * pages + dp.numpy().astype(np.uint64)) * chunk).astype(np.uint64)
        for layer in range(layers)
    ]
    sizes = np.full(pages, chunk, dtype=np.uint64)
    out = {}

    def torch_h2d():
        with torch.cuda.stream(stream):
            for layer in range(layers):
                x = mapped[:, layer].index_select(0, hpd)
                devbuf[layer].index_copy_(0, dpd, x)

    def torch_d2h():
        with torch.cuda.stream(stream):
            for layer in range(layers):
                x = devbuf[layer].index_select(0, dpd)
                mapped[:, layer].index_copy_(0, hpd, x)

    def dma_h2d(flags=0):
        with torch.cuda.stream(stream):
            for layer in range(layers):
                batch_copy(dptr[layer], hptr[layer], sizes, stream, flags)

    def dma_d2h(flags=0):
        with torch.cuda.stream(stream):
            for layer in range(layers):
                batch_copy(hptr[layer], dptr[layer], sizes, stream, flags)

    src_off = [(hp * (layers * words) + layer * words).to(dev) for layer in range(layers)]
    dst_off = [((layer * 2 * pages) * words + dp * words).to(dev) for layer in range(layers)]
    hflat, dflat = mapped.view(-1), devbuf.view(-1)

    def tri(ctas, h2d=True):
        def f():
            with torch.cuda.stream(stream):
                for layer in range(layers):
                    if h2d:
                        _copy_chunks[(min(ctas, pages),)](
                            hflat,
                            dflat,
                            src_off[layer],
                            dst_off[layer],
                            pages,
                            CHUNK=words,
                            BLOCK=min(1024, triton.next_power_of_2(words)),
                            num_warps=4,
                        )
                    else:
                        _copy_chunks[(min(ctas, pages),)](
                            dflat,
                            hflat,
                            dst_off[layer],
                            src_off[layer],
                            pages,
                            CHUNK=words,
                            BLOCK=min(1024, triton.next_power_of_2(words)),
                            num_warps=4,
                        )

        return f

    csrc = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    cdst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def c_h2d():
        with torch.cuda.stream(stream):
            cdst.copy_(csrc, non_blocking=True)

    def c_d2h():
        with torch.cuda.stream(stream):
            csrc.copy_(cdst, non_blocking=True)

    s2 = torch.cuda.Stream()

    def c_both():
        with torch.cuda.stream(stream):
            cdst[: nbytes // 2].copy_(csrc[: nbytes // 2], non_blocking=True)
        with torch.cuda.stream(s2):
            csrc[nbytes // 2 :].copy_(cdst[nbytes // 2 :], non_blocking=True)

    out["contig_h2d"] = nbytes / timeit(c_h2d) / 1e9
    out["contig_d2h"] = nbytes / timeit(c_d2h) / 1e9
    out["contig_both"] = nbytes / timeit(c_both) / 1e9
    out["torch_h2d"] = nbytes / timeit(torch_h2d) / 1e9
    out["torch_d2h"] = nbytes / timeit(torch_d2h) / 1e9
    # verify dma correctness
    devbuf.zero_()
    torch.cuda.synchronize()
    dma_h2d()
    torch.cuda.synchronize()
    ok = torch.equal(devbuf[3].index_select(0, dpd).cpu(), hostbuf[:, 3].index_select(0, hp))
    out["dma_ok"] = bool(ok)
    t0 = time.perf_counter()
    dma_h2d()
    t_issue = time.perf_counter() - t0
    torch.cuda.synchronize()
    out["dma_issue_ms"] = t_issue * 1e3
    out["dma_h2d"] = nbytes / timeit(dma_h2d) / 1e9
    out["dma_d2h"] = nbytes / timeit(dma_d2h) / 1e9
    out["dma_h2d_overlapflag"] = nbytes / timeit(lambda: dma_h2d(1)) / 1e9
    if triton is not None:
        for ctas in (32, 132, 528):
            out[f"tri{ctas}_h2d"] = nbytes / timeit(tri(ctas)) / 1e9
            out[f"tri{ctas}_d2h"] = nbytes / timeit(tri(ctas, False)) / 1e9
        devbuf.zero_()
        tri(132)()
        torch.cuda.synchronize()
        out["tri_ok"] = bool(
            torch.equal(devbuf[5].index_select(0, dpd).cpu(), hostbuf[:, 5].index_select(0, hp))
        )

    # both at once: half pages each way
    def both(fh, fd):
        def f():
            fh()
            with torch.cuda.stream(s2):
                pass

        return f

    csrc = cdst = None  # freed (the closures above refer to these names)
    return out, (hostbuf, devbuf, hp, dp, hptr, dptr, sizes, mapped, hpd, dpd, src_off, dst_off)


stream = torch.cuda.Stream()
res["sweep"] = {}
for chunk in (4096, 8192, 18432, 32768, 65536, 262144):
    layers = 32
    pages = max(64, (1 << 30) // (chunk * layers))
    try:
        o, _ = methods(chunk, layers, pages, stream)
    except Exception as e:
        o = {"error": repr(e)}
    res["sweep"][chunk] = o
    log(chunk, {k: round(v, 2) if isinstance(v, float) else v for k, v in o.items()})
    save()
    torch.cuda.empty_cache()

# both directions at once, 64 KiB chunks, dma vs torch
chunk, layers, pages = 65536, 32, 512
o, st = methods(chunk, layers, pages, stream)
hostbuf, devbuf, hp, dp, hptr, dptr, sizes, mapped, hpd, dpd, src_off, dst_off = st
# d2h uses other half of host pages / device pages
hp2 = torch.tensor(sorted(set(range(2 * pages)) - set(hp.tolist())))[:pages]
dp2 = torch.tensor(sorted(set(range(2 * pages)) - set(dp.tolist())))[:pages]
hptr2 = [
    (hostbuf.data_ptr() + hp2.numpy().astype(np.uint64) * (layers * chunk) + layer * chunk).astype(
        np.uint64
    )
    for layer in range(layers)
]
dptr2 = [
    (devbuf.data_ptr() + (layer * 2 * pages + dp2.numpy().astype(np.uint64)) * chunk).astype(
        np.uint64
    )
    for layer in range(layers)
]
s2 = torch.cuda.Stream()
nbytes = chunk * layers * pages


def both_dma():
    for layer in range(layers):
        batch_copy(dptr[layer], hptr[layer], sizes, stream)
        batch_copy(hptr2[layer], dptr2[layer], sizes, s2)


hp2d, dp2d = hp2.to(dev), dp2.to(dev)


def both_torch():
    for layer in range(layers):
        with torch.cuda.stream(stream):
            devbuf[layer].index_copy_(0, dpd, mapped[:, layer].index_select(0, hpd))
        with torch.cuda.stream(s2):
            mapped[:, layer].index_copy_(0, hp2d, devbuf[layer].index_select(0, dp2d))


res["both64k"] = {
    "contig_both": o["contig_both"],
    "dma_both": 2 * nbytes / timeit(both_dma) / 1e9,
    "torch_both": 2 * nbytes / timeit(both_torch) / 1e9,
}
log("both", res["both64k"])
save()
del hostbuf, devbuf, mapped, st
torch.cuda.empty_cache()

# contention: 2048 pages x 32 layers x 64 KiB = 4.29 GB load overlapped with attention-like compute
chunk, layers, pages = 65536, 32, 2048
o, st = (
    methods.__wrapped__(chunk, layers, pages, stream)
    if hasattr(methods, "__wrapped__")
    else (None, setup(chunk, layers, pages))
)
hostbuf, devbuf, hp, dp = st
mapped = map_pinned(hostbuf, dev)
hpd, dpd = hp.to(dev), dp.to(dev)
words = chunk // 8
hptr = [
    (hostbuf.data_ptr() + hp.numpy().astype(np.uint64) * (layers * chunk) + layer * chunk).astype(
        np.uint64
    )
    for layer in range(layers)
]
dptr = [
    (devbuf.data_ptr() + (layer * 2 * pages + dp.numpy().astype(np.uint64)) * chunk).astype(
        np.uint64
    )
    for layer in range(layers)
]
sizes = np.full(pages, chunk, dtype=np.uint64)
nbytes = chunk * layers * pages
kvv = devbuf.view(torch.bfloat16).view(layers, 2 * pages * 16, 2, 8, 128)
locs = (dpd[:, None] * 16 + torch.arange(16, device=dev)).reshape(-1)
W1 = torch.randn(4096, 14336, dtype=torch.bfloat16, device=dev) * 0.01
W2 = torch.randn(4096, 14336, dtype=torch.bfloat16, device=dev) * 0.01
W3 = torch.randn(14336, 4096, dtype=torch.bfloat16, device=dev) * 0.01
Wq = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev) * 0.01
x0 = torch.randn(16, 4096, dtype=torch.bfloat16, device=dev)
cstream = torch.cuda.Stream(priority=-1)


def compute(events=None, sdpa=False):
    with torch.cuda.stream(cstream):
        x = x0
        for layer in range(layers):
            if events is not None:
                cstream.wait_event(events[layer])
            q = (x @ Wq).view(16, 32, 128)
            ctx = kvv[layer].index_select(0, locs)
            if sdpa:
                k = ctx[:, 0].transpose(0, 1)[None]
                v = ctx[:, 1].transpose(0, 1)[None]
                a = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k, v, enable_gqa=True
                )
                a = a[0].transpose(0, 1).reshape(16, 4096)
            else:
                qg = q.view(16, 8, 4, 128)
                s = torch.einsum("nkgd,ckd->kgnc", qg, ctx[:, 0]) * 0.088
                p = torch.softmax(s.float(), -1).to(torch.bfloat16)
                a = torch.einsum("kgnc,ckd->nkgd", p, ctx[:, 1]).reshape(16, 4096)
            x = x + a @ Wq
            x = x + (torch.nn.functional.silu(x @ W1) * (x @ W2)) @ W3
    return x


def load(kind, ev=True):
    events = []
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        for layer in range(layers):
            if kind == "dma":
                batch_copy(dptr[layer], hptr[layer], sizes, stream)
            elif kind == "dma_flag":
                batch_copy(dptr[layer], hptr[layer], sizes, stream, 1)
            elif kind == "torch":
                devbuf[layer].index_copy_(0, dpd, mapped[:, layer].index_select(0, hpd))
            e = torch.cuda.Event()
            e.record(stream)
            events.append(e)
    return events


cont = {}
for sd in (False, True):
    cont[f"compute_ms_sdpa{int(sd)}"] = timeit(lambda: compute(sdpa=sd)) * 1e3  # noqa: B023
for kind in ("torch", "dma", "dma_flag"):
    cont[f"load_ms_{kind}"] = timeit(lambda: load(kind)) * 1e3  # noqa: B023
    for sd in (False, True):
        cont[f"overlap_ms_{kind}_sdpa{int(sd)}"] = (
            timeit(lambda: compute(load(kind), sdpa=sd)) * 1e3  # noqa: B023
        )
cs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
cd = torch.empty(nbytes, dtype=torch.uint8, device=dev)
cont["contig_h2d_ms"] = timeit(lambda: cd.copy_(cs, non_blocking=True)) * 1e3
res["contention"] = cont
log(cont)
save()


# decode stall: backup (d2h) of 1 GB concurrent with decode-like steps
def decode_step():
    with torch.cuda.stream(cstream):
        x = torch.randn(256, 4096, dtype=torch.bfloat16, device=dev)
        for _layer in range(layers):
            x = x + (torch.nn.functional.silu(x @ W1) * (x @ W2)) @ W3


def steps(n=20):
    for _ in range(n):
        decode_step()


st_ = {}
st_["decode_ms"] = timeit(steps) * 1e3 / 20


def backup(kind):
    with torch.cuda.stream(stream):
        for layer in range(layers):
            if kind == "dma":
                batch_copy(hptr[layer], dptr[layer], sizes, stream)
            else:
                mapped[:, layer].index_copy_(0, hpd, devbuf[layer].index_select(0, dpd))


for kind in ("torch", "dma"):
    st_[f"backup_ms_{kind}"] = timeit(lambda: backup(kind)) * 1e3  # noqa: B023

    def both():
        backup(kind)  # noqa: B023
        steps(20)
        cstream.synchronize()
        return

    # time decode steps only while backup runs
    torch.cuda.synchronize()
    backup(kind)
    t0 = time.perf_counter()
    steps(20)
    cstream.synchronize()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    st_[f"decode_ms_during_{kind}"] = t * 1e3 / 20
res["stall"] = st_
log(st_)
save()
