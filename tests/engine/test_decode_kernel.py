"""The paged Triton decode kernel equals the SDPA reference over gathered rows (CUDA only)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier.engine import decode_kernel
from kvtier.engine.attention import decode_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(decode_kernel.triton is None, reason="needs Triton"),
]


def _reference(q, kv, locs, lens):  # noqa: ANN001, ANN202
    b, c = locs.shape
    ctx = kv.index_select(0, locs.reshape(-1)).view(b, c, *kv.shape[1:]).float()
    visible = torch.arange(c, device=q.device)[None, :] < lens[:, None].long()
    return decode_attention(q.float(), ctx[:, :, 0], ctx[:, :, 1], visible)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "lens"),
    [
        (8, 8, 64, [1, 5, 64, 65]),
        (32, 8, 128, [2056, 1, 700, 513, 1024]),
        (16, 2, 128, [3000, 2999]),
        (4, 4, 32, [17]),
        (8, 2, 64, [9000, 40, 8193]),  # 18 splits: the merge reads them in two blocks
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_equals_reference(heads, kv_heads, d, lens, dtype) -> None:  # noqa: ANN001
    g = torch.Generator(device="cuda").manual_seed(sum(lens) + heads)
    rows = 2 * sum(lens) + 7
    # a strided layer view, as pools hand out: every other row of a larger buffer
    base = torch.randn(2 * rows, 2, kv_heads, d, generator=g, device="cuda", dtype=dtype)
    kv = base[::2]
    b, c = len(lens), max(lens)
    perm = torch.randperm(rows, generator=g, device="cuda")
    locs = torch.zeros(b, c, dtype=torch.int64, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        locs[i, :n] = perm[used : used + n]
        used += n
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, heads, d, generator=g, device="cuda", dtype=dtype)
    assert decode_kernel.available(q, kv)
    got = decode_kernel.paged_decode(q, kv, locs, lens_t)
    want = _reference(q, kv, locs, lens_t)
    assert got.shape == (b, heads, d) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    if min(lens) == c:  # every row visible: the lens-free form gives the same
        same = decode_kernel.paged_decode(q, kv, locs, None)
        torch.testing.assert_close(same, got, atol=0, rtol=0)


def test_unavailable_for_cpu_and_float32() -> None:
    kv = torch.zeros(4, 2, 2, 64, dtype=torch.bfloat16)
    assert not decode_kernel.available(torch.zeros(1, 2, 64, dtype=torch.bfloat16), kv)
    qc = torch.zeros(1, 2, 64, device="cuda")
    assert not decode_kernel.available(qc, kv.cuda().float())


VARIANTS = """
import os, pathlib, tempfile
cache = tempfile.mkdtemp()
os.environ["TRITON_CACHE_DIR"] = cache
import torch
from kvtier.engine import decode_kernel

kv = torch.randn(40000, 2, 2, 64, device="cuda", dtype=torch.bfloat16)
q = torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)
# contexts of 2, 3, 5, 9, 17, 33 and 70 splits, as a decoding sequence grows
for c in (600, 1100, 2100, 4200, 8300, 16500, 35500):
    locs = torch.randint(0, 40000, (3, c), device="cuda")
    lens = torch.tensor([c, c - 1, 1], dtype=torch.int32, device="cuda")
    decode_kernel.paged_decode(q, kv, locs, lens)
torch.cuda.synchronize()
print(sum(1 for _ in pathlib.Path(cache).rglob("*.cubin")))
"""


def test_one_variant_per_kernel_as_the_context_grows() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(VARIANTS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # the split kernel and the merge, each compiled once
    assert int(done.stdout) == 2
