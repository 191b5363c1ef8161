"""The row kernels compile once per row geometry, whatever the batch (CUDA with Triton only).

A transfer's row and page counts and the slices of its page lists change from batch to batch;
had Triton specialised on them, a new combination would compile a kernel variant (0.1-0.3 s) in
the middle of serving. The copies run in a child process with an empty Triton cache, which
counts the variants compiled.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHILD = textwrap.dedent(
    """
    import os, pathlib, tempfile
    cache = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = cache
    import torch
    from kvtier.transfer import rows

    dev = torch.device("cuda")
    layers, npages, words = 3, 40, 256
    pool = torch.arange(layers * npages * words, dtype=torch.int32, device=dev)
    pool = pool.reshape(layers * npages, words)
    order = torch.randperm(npages, generator=torch.Generator().manual_seed(0)).to(dev)
    flat = torch.arange(layers * npages, device=dev)
    # Counts 16, 17, 1, 1 and 33 rows; slices starting at even and odd (8-byte) offsets.
    for lo, hi in ((0, 16), (1, 18), (0, 1), (3, 4), (2, 35)):
        out = torch.zeros_like(pool)
        rows.copy_rows(pool, order[lo:hi], out, flat[lo:hi])
        assert torch.equal(out[: hi - lo], pool[order[lo:hi]])
        staged = torch.zeros(layers * (hi - lo), words, dtype=torch.int32, device=dev)
        rows.copy_page_rows(pool, staged, order[lo:hi], layers, npages, True, ctas=4)
        want = (order[lo:hi, None] + npages * torch.arange(layers, device=dev)).reshape(-1)
        assert torch.equal(staged, pool[want])
    torch.cuda.synchronize()
    print(sum(1 for _ in pathlib.Path(cache).rglob("*.cubin")))
    """
)


def test_row_kernels_compile_one_variant_per_geometry() -> None:
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    # One tile kernel (256-word rows) and one page gather, for five batches of other shapes.
    assert int(done.stdout.split()[-1]) == 2
