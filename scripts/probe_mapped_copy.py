"""Probe: GPU kernels reading/writing pinned host memory through a mapped (UVA) view, vs cudaMemcpy."""
import time, torch

class _Mapped:
    def __init__(self, t):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1" if t.dtype == torch.uint8 else "<i8",
            "data": (t.data_ptr(), False), "version": 3, "strides": None}

def mapped(t):
    assert t.is_pinned()
    return torch.as_tensor(_Mapped(t), device="cuda")

def bench(fn, nbytes, reps=5):
    fn(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9

L, P, n = 32, 1024, 512
for chunk_words in (8 * 128 * 2 * 2 // 8 * 1, 8 * 128 * 2 * 2 // 8 * 16, 8 * 128 * 2 * 2 // 8 * 64):  # ps 1, 16, 64 (int64 words)
    dev = torch.randint(0, 1 << 60, (L, P, chunk_words), device="cuda", dtype=torch.int64)
    host = torch.empty((P, L, chunk_words), dtype=torch.int64, pin_memory=True)
    hv = mapped(host)
    src = torch.randperm(P, device="cuda")[:n]; dst = torch.randperm(P, device="cuda")[:n]
    nbytes = L * n * chunk_words * 8
    c_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); c_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    contig_d2h = bench(lambda: c_host.copy_(c_dev, non_blocking=True), nbytes)
    contig_h2d = bench(lambda: c_dev.copy_(c_host, non_blocking=True), nbytes)
    def d2h():
        g = dev.index_select(1, src).transpose(0, 1)  # device gather [n, L, w]
        hv.index_copy_(0, dst, g)                     # kernel writes over PCIe into pinned pages
    def h2d():
        g = hv.index_select(0, dst)                   # kernel reads over PCIe
        dev.index_copy_(1, src, g.transpose(0, 1))
    d2h()
    torch.cuda.synchronize()
    ok = torch.equal(host[dst.cpu()], dev.index_select(1, src).transpose(0, 1).cpu())
    a = bench(d2h, nbytes); b = bench(h2d, nbytes)
    print(f"ps={chunk_words*8//(8*128*2*2)} chunk={chunk_words*8}B ok={ok} contig d2h {contig_d2h:.1f} h2d {contig_h2d:.1f} | mapped d2h {a:.1f} ({a/contig_d2h:.2f}) h2d {b:.1f} ({b/contig_h2d:.2f})")
