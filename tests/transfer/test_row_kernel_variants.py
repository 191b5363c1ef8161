"""No transfer waits for a kernel compile or a module load (CUDA with Triton only).

A transfer's row and page counts and the slices of its page lists change from batch to batch:
had Triton specialised the row kernels on them, a new combination would compile a variant (up
to half a second on an H200) in the middle of serving. And a ``Mover`` compiles the variants
its components use when it is made, and launches the torch kernels that build row lists (CUDA
loads a kernel's module at its first launch). Each case runs in a child process with an empty
Triton cache, which counts the variants compiled (one ``.cubin`` each).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

PRELUDE = """
import os, pathlib, tempfile
cache = tempfile.mkdtemp()
os.environ["TRITON_CACHE_DIR"] = cache
import torch

def compiled():
    torch.cuda.synchronize()
    return sum(1 for _ in pathlib.Path(cache).rglob("*.cubin"))

dev = torch.device("cuda")

def launched(fn):
    # fn()'s result and the names of the device kernels it launched (copies left out).
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return out, {n for n in names if not n.startswith(("Memcpy", "Memset"))}
"""

ROWS = """
from kvtier.transfer import rows

layers, npages, words = 3, 40, 256
pool = torch.arange(layers * npages * words, dtype=torch.int32, device=dev)
pool = pool.reshape(layers * npages, words)
order = torch.randperm(npages, generator=torch.Generator().manual_seed(0)).to(dev)
flat = torch.arange(layers * npages, device=dev)
# Counts 16, 17, 1, 1 and 33 rows; slices starting at even and odd (8-byte) offsets.
for lo, hi in ((0, 16), (1, 18), (0, 1), (3, 4), (2, 35)):
    out = torch.zeros_like(pool)
    rows.copy_rows(pool, order[lo:hi], out, flat[lo:hi])
    assert torch.equal(out[lo:hi], pool[order[lo:hi]])
    staged = torch.zeros(layers * (hi - lo), words, dtype=torch.int32, device=dev)
    rows.copy_page_rows(pool, staged, order[lo:hi], layers, npages, True, ctas=4)
    want = (order[lo:hi, None] + npages * torch.arange(layers, device=dev)).reshape(-1)
    assert torch.equal(staged, pool[want])
print(compiled())
"""

MOVER = """
from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.transfer import Mover, dma

specs = [
    PoolSpec("kv", 4, (2, 2, 64), torch.bfloat16),
    PoolSpec("index_k", 4, (64,), torch.bfloat16, kind="sidecar"),
]
dpool = DevicePool(specs, 64, 4, dev)
hpool = HostPool(specs, 96, 4, layout="layer_first", pin=True)
for buf in dpool.buffers.values():
    buf.view(torch.uint8).random_()
# Copy engines (and so staging) need a driver with batched copies.
mechanisms = ("kernel", "copy_engine", "auto") if dma.available() else ("kernel", "auto")
movers, loaded = launched(lambda: [Mover(dpool, hpool, mechanism=m) for m in mechanisms])
made = compiled()
seen = set()
for k in (1, 2, 5, 16, 17, 31):
    for mover in movers:
        src, hp = torch.arange(k), torch.arange(50, 50 + k)

        def transfer():
            back = mover.device_to_host(src, hp)
            back.wait()
            back.complete()
            load = mover.host_to_device(hp, torch.arange(32, 32 + k))
            load.wait()
            return back, load

        (back, load), kernels = launched(transfer)
        # Every kernel a transfer launches was launched (its module loaded) by a mover's making.
        assert kernels <= loaded, (k, sorted(kernels - loaded))
        seen |= set(back.paths.values()) | set(load.paths.values())
        for s in specs:
            view = dpool.page_bytes_view(s.name)
            assert torch.equal(view[:, 32 : 32 + k], view[:, :k])
assert ({"kernel", "staged"} if dma.available() else {"kernel"}) <= seen, seen
print(made, compiled())
"""


def child(body: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELUDE + body)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [int(x) for x in done.stdout.split()]


def test_row_kernels_compile_one_variant_per_geometry() -> None:
    pytest.importorskip("triton")
    # One tile kernel (256-word rows) and one page gather, for five batches of other shapes.
    assert child(ROWS) == [2]


# A driver without batched copies is played by hiding the driver entry, so the branch runs on a
# GPU whose driver has them.
NO_DMA = """
from kvtier.transfer import dma
dma._entry = lambda: None
"""


@pytest.mark.parametrize("driver", ["as_is", "no_batched_copies"])
def test_movers_compile_their_kernels_when_made_and_never_in_a_transfer(driver: str) -> None:
    pytest.importorskip("triton")
    made, after = child((NO_DMA if driver == "no_batched_copies" else "") + MOVER)
    assert made > 0
    assert after == made
