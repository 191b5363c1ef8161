"""The Triton kernels of ``kvtier.transfer.rows`` (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl

next_power_of_2 = triton.next_power_of_2


def _jit(*varying: str):  # noqa: ANN202
    """``triton.jit`` that specialises none of ``varying``: the arguments that change from call
    to call or pool to pool (row and page counts, slices of page and row lists, pool strides).
    Triton compiles a variant per combination of counts divisible by 16 (or equal to 1) and
    lists aligned to 16 bytes, on the transfer path the first time a combination comes up: on
    an H200, after each family's first copies, 27 compiles in 22-23 of 360 transfers of random
    sizes, the slowest of those transfers 0.54-0.56 s against 0.01 s without a compile
    (``results/h200-dma/jit_variants.py``, ``results/h200-dma/run18/``). The data pointers stay
    specialised."""
    names = list(varying)
    try:
        return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)
    except TypeError:  # a Triton without alignment control: do_not_specialize covers both
        return triton.jit(do_not_specialize=names)


@triton.jit
def copy_tile(src, dst, s, d, live, WORDS: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    """Rows ``s`` of ``src`` into rows ``d`` of ``dst`` (word offsets; ``live`` masks)."""
    for o in tl.range(0, WORDS, BLOCK):
        offs = o + tl.arange(0, BLOCK)
        mask = live[:, None] & (offs < WORDS)[None, :]
        v = tl.load(src + s[:, None] + offs[None, :], mask=mask)
        tl.store(dst + d[:, None] + offs[None, :], v, mask=mask)


@_jit("src_idx", "dst_idx", "n_rows")
def copy_rows_kernel(
    src,
    dst,
    src_idx,
    dst_idx,
    n_rows,
    WORDS: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
):
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        s = tl.load(src_idx + r).to(tl.int64) * WORDS
        d = tl.load(dst_idx + r).to(tl.int64) * WORDS
        for o in tl.range(0, WORDS, BLOCK):
            offs = o + tl.arange(0, BLOCK)
            mask = offs < WORDS
            tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)


@_jit("src_idx", "dst_idx", "n_rows", "n_tiles")
def copy_tiles_kernel(
    src,
    dst,
    src_idx,
    dst_idx,
    n_rows,
    n_tiles,
    WORDS: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ROWS: tl.constexpr,  # noqa: N803
):
    # Each iteration moves a ROWS x BLOCK tile: many independent loads in flight per
    # program, which is what hides latency when rows are small.
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        r = t * ROWS + tl.arange(0, ROWS)
        live = r < n_rows
        s = tl.load(src_idx + r, mask=live, other=0).to(tl.int64) * WORDS
        d = tl.load(dst_idx + r, mask=live, other=0).to(tl.int64) * WORDS
        copy_tile(src, dst, s, d, live, WORDS, BLOCK)


@_jit("pages", "n_rows", "n_pages", "stride")
def copy_pages_kernel(
    src,
    dst,
    pages,
    n_rows,
    n_pages,
    stride,
    LAYERS: tl.constexpr,  # noqa: N803
    GATHER: tl.constexpr,  # noqa: N803
    LAYER_MAJOR: tl.constexpr,  # noqa: N803
    WORDS: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
    ROWS: tl.constexpr,  # noqa: N803
):
    # Row numbers of the paged side come from the page list here, so no row list is built
    # (and no kernel builds one) before the first copy of a staged transfer.
    for t in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        r = t * ROWS + tl.arange(0, ROWS)
        live = r < n_rows
        if LAYER_MAJOR:
            i, layer = r % n_pages, r // n_pages
        else:
            i, layer = r // LAYERS, r % LAYERS
        page = tl.load(pages + i, mask=live, other=0).to(tl.int64)
        paged = (page + layer.to(tl.int64) * stride) * WORDS
        flat = r.to(tl.int64) * WORDS
        if GATHER:
            copy_tile(src, dst, paged, flat, live, WORDS, BLOCK)
        else:
            copy_tile(src, dst, flat, paged, live, WORDS, BLOCK)
