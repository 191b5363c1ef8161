"""Paged decode attention on CUDA in Triton: every decoding sequence's one query reads its K/V
rows straight from the pool by slot, split over the context (flash decoding), so a step reads
each row once instead of gathering the context into a copy first.

``decode_attention`` in ``kvtier.engine.attention`` is the reference (and the path on CPU and
wherever Triton is missing); ``paged_decode`` computes the same thing.

Work split, for sequence ``b``, kv head ``h`` and split ``s`` of ``S``::

    program (b, h, s)  reads  locs[b, s*chunk : min((s+1)*chunk, lens[b])]
                       query  rows h*G .. h*G+G-1 of q[b] (G = heads // kv_heads, padded to 16)
                       writes part[b, h*G.., s, :] (un-normalised by the split's sum)
                              and lse[b, h*G.., s]  (the split's log-sum-exp; -inf when empty)
    program (b, head)  merges the S partials by their log-sum-exps.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels: the SDPA reference serves every call
    triton = None

BLOCK_N = 64
"""Context rows per inner iteration of a split."""
MERGE_BLOCK = 16
"""Splits the merge reads per iteration."""
SPLIT_ROWS = 512
"""Context rows a split covers at most (rounded to ``BLOCK_N``): enough splits that a small
batch still fills the device, few enough that merging stays cheap."""


def available(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether ``paged_decode`` serves these tensors: CUDA, Triton, 16-bit floats, a head
    size the kernel tiles (a power of two from 16) and equal dtypes."""
    d = q.shape[-1]
    return (
        triton is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and kv.dtype == q.dtype
        and d >= 16
        and d & (d - 1) == 0
        and kv.stride(-1) == 1
    )


def paged_decode(
    q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor, lens: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one query per sequence over its context in a paged layer.

    ``q``: ``[B, heads, d]``; ``kv``: the layer ``[rows, 2, kv_heads, d]`` (K then V);
    ``locs``: int64 ``[B, C]``, sequence ``b``'s context slots in its first ``lens[b]``
    columns (``None``: all ``C``). Returns ``[B, heads, d]`` in ``q``'s dtype, equal to
    ``decode_attention`` over the gathered rows.
    """
    b, heads, d = q.shape
    kv_heads = kv.shape[2]
    group = heads // kv_heads
    c = locs.shape[1]
    if lens is None:
        lens = torch.full((b,), c, dtype=torch.int32, device=q.device)
    chunk = min(SPLIT_ROWS, triton.cdiv(c, BLOCK_N) * BLOCK_N)
    splits = triton.cdiv(c, chunk)
    q = q.contiguous()
    locs = locs.contiguous()
    part = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(b, kv_heads, splits)](
        q,
        kv,
        locs,
        lens,
        part,
        lse,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        locs.stride(0),
        1.0 / math.sqrt(d) * 1.4426950408889634,  # softmax in base 2
        chunk,
        splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=d,
        BLOCK=BLOCK_N,
    )
    if splits == 1:
        return part[:, :, 0].to(q.dtype)
    out = torch.empty_like(q)
    _merge_kernel[(b, heads)](part, lse, out, splits, D=d, BLOCK_S=MERGE_BLOCK)
    return out


if triton is not None:
    # the context length's stride and split sizes change from step to step: one compiled kernel
    @triton.jit(do_not_specialize=["locs_sb", "chunk", "splits"])
    def _split_kernel(
        q_ptr,
        kv_ptr,
        locs_ptr,
        lens_ptr,
        part_ptr,
        lse_ptr,
        q_sb,
        q_sh,
        kv_row,
        kv_kv,
        kv_head,
        locs_sb,
        scale,
        chunk,
        splits,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        heads = tl.num_programs(1) * GROUP
        g = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, D)
        g_ok = g < GROUP
        qh = h * GROUP + g
        q = tl.load(
            q_ptr + b * q_sb + qh[:, None] * q_sh + dims[None, :], mask=g_ok[:, None], other=0.0
        )
        n_len = tl.load(lens_ptr + b)
        start = s * chunk
        end = tl.minimum(start + chunk, n_len)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < end
            loc = tl.load(locs_ptr + b * locs_sb + n, mask=ok, other=0)
            row = kv_ptr + loc[:, None] * kv_row + h * kv_head + dims[None, :]
            k = tl.load(row, mask=ok[:, None], other=0.0)
            score = tl.dot(q, tl.trans(k)) * scale
            score = tl.where(ok[None, :], score, float("-inf"))
            m_new = tl.maximum(m, tl.max(score, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(score - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(row + kv_kv, mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        slot = (b * heads + qh) * splits + s
        empty = l_sum == 0.0
        out = acc / tl.where(empty, 1.0, l_sum)[:, None]
        tl.store(part_ptr + slot[:, None] * D + dims[None, :], out, mask=g_ok[:, None])
        # base-2 log-sum-exp of the split's scores; an empty split weighs zero in the merge
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l_sum)))
        tl.store(lse_ptr + slot, lse, mask=g_ok)

    # one compiled merge for every split count: a split count given as a constant compiled a
    # variant each time a decoding context crossed a new power of two of splits
    @triton.jit(do_not_specialize=["splits"])
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, splits, D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        base = b * heads + head
        dims = tl.arange(0, D)
        top = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            lse = tl.load(lse_ptr + base * splits + s, mask=s < splits, other=float("-inf"))
            top = tl.maximum(top, lse)
        m = tl.max(top, 0)
        acc = tl.zeros([D], tl.float32)
        weight = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            lse = tl.load(lse_ptr + base * splits + s, mask=s < splits, other=float("-inf"))
            w = tl.exp2(lse - m)
            parts = tl.load(
                part_ptr + (base * splits + s)[:, None] * D + dims[None, :],
                mask=(s < splits)[:, None],
                other=0.0,
            )
            acc += tl.sum(parts * w[:, None], 0)
            weight += w
        out = acc / tl.sum(weight, 0)
        tl.store(out_ptr + base * D + dims, out.to(out_ptr.dtype.element_ty))
