"""Row copies: ``dst[dst_idx[i]] = src[src_idx[i]]`` for 2-D ``[rows, words]`` views.

Every transfer is expressed as rows — one row is one page of one layer of one component — so one
primitive serves device ↔ host (through a device view of pinned memory), device ↔ staging and
the CPU. On CUDA it is one Triton kernel launch with a bounded grid that loops over rows; measured
on an H200 (1 GiB batches of 4 KiB to 256 KiB rows) it moves 0.89-0.92 of a contiguous pinned
copy's bandwidth host → device and 0.91-0.95 device → host, where ``index_select`` +
``index_copy_`` reached 0.88-0.90 and needed a temporary. Without Triton (or on CPU) the two torch index ops do it.
"""

from __future__ import annotations

import functools

import torch

PCIE_CTAS = 64
"""Programs for copies that cross PCIe: enough to keep the link busy (32 measured as fast as 528)
while leaving most SMs to the kernels the copy overlaps."""
STAGING_CTAS = 16
"""Programs for device-local staging gathers and scatters, which only need to keep ahead of the
copy engine; few programs leave the SMs to the decode or forward beside them."""
BLOCK_WORDS = 1024
"""Most words of one row moved per loop iteration."""
ONE_BLOCK = BLOCK_WORDS
"""``tile_words`` for one block per program per iteration: one row when rows are at least a block
long, else as many rows as fill one (a lone 1 KiB row in flight per program left PCIe copies of
MLA rows at page size 1 at 0.75 of a contiguous copy). The gentlest on kernels running beside."""
TILE_WORDS = 4096
"""``tile_words`` for ``TILE_WORDS // BLOCK`` rows per program per iteration (32 KiB in flight),
for copies that must be fast with small rows."""
FALLBACK_TEMP_BYTES = 4 << 20
"""Largest temporary of the torch fallback (rows are gathered and scattered in chunks)."""


@functools.cache
def _kernels():  # noqa: ANN202
    """``(row kernel, tile kernel, page kernel, next_power_of_2)``, or ``None`` without
    Triton."""
    try:
        from kvtier.transfer import rows_triton as k
    except ImportError:
        return None
    return k.copy_rows_kernel, k.copy_tiles_kernel, k.copy_pages_kernel, k.next_power_of_2


def copy_rows(
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    ctas: int | None = None,
    tile_words: int = ONE_BLOCK,
) -> None:
    """Copy rows ``src[src_idx]`` into ``dst[dst_idx]`` (contiguous ``[rows, words]`` tensors of
    one dtype; index tensors on the tensors' device). On CUDA the copy is queued on the current
    stream with at most ``ctas`` programs (default: four per SM), each moving whole rows,
    ``tile_words`` words' worth (at least one row), per iteration."""
    n = src_idx.numel()
    if n == 0:
        return
    kernels = _kernels() if src.is_cuda else None
    if kernels is None:
        # Bounded temporaries: a fresh multi-MiB one per call costs more in page faults (CPU)
        # than the copy itself; small ones are recycled by the allocator.
        step = max(1, FALLBACK_TEMP_BYTES // (src.shape[1] * src.element_size()))
        for lo in range(0, n, step):
            dst.index_copy_(
                0, dst_idx[lo : lo + step], src.index_select(0, src_idx[lo : lo + step])
            )
        return
    rows_kernel, tiles_kernel, _, pow2 = kernels
    words = src.shape[1]
    block = min(BLOCK_WORDS, pow2(words))
    if ctas is None:
        ctas = 4 * torch.cuda.get_device_properties(src.device).multi_processor_count
    rows = tile_words // block
    if rows <= 1:
        rows_kernel[(min(n, ctas),)](src, dst, src_idx, dst_idx, n, WORDS=words, BLOCK=block)
        return
    tiles = -(-n // rows)
    tiles_kernel[(min(tiles, ctas),)](
        src, dst, src_idx, dst_idx, n, tiles, WORDS=words, BLOCK=block, ROWS=rows
    )


def copy_page_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    pages: torch.Tensor,
    layers: int,
    stride: int,
    gather: bool,
    ctas: int,
    tile_words: int = ONE_BLOCK,
    layer_major: bool = False,
) -> None:
    """Copy every layer of ``pages`` (``k`` of them) between a paged ``[rows, words]`` view,
    where layer ``l`` of page ``p`` is row ``p + l * stride``, and a flat one holding them
    page-major (flat row ``f = i * layers + l``) or, with ``layer_major``, layer-major
    (``f = l * k + i``):

        gather    dst[f] = src[pages[i] + l * stride]
        scatter   dst[pages[i] + l * stride] = src[f]

    ``pages`` lives on the tensors' device. On CUDA one launch of at most ``ctas`` programs (see
    :func:`copy_rows` for ``tile_words``) computes the paged rows itself; elsewhere the row lists
    are built and :func:`copy_rows` copies them."""
    n = pages.numel() * layers
    if n == 0:
        return
    kernels = _kernels() if src.is_cuda else None
    if kernels is None:
        offsets = torch.arange(layers, device=pages.device) * stride
        p = pages.long()
        paged = (offsets[:, None] + p[None, :] if layer_major else p[:, None] + offsets).reshape(-1)
        flat = torch.arange(n, device=pages.device)
        if gather:
            copy_rows(src, paged, dst, flat)
        else:
            copy_rows(src, flat, dst, paged)
        return
    words = src.shape[1]
    block = min(BLOCK_WORDS, kernels[3](words))
    rows = max(1, tile_words // block)
    tiles = -(-n // rows)
    kernels[2][(min(tiles, ctas),)](
        src,
        dst,
        pages,
        n,
        pages.numel(),
        stride,
        LAYERS=layers,
        GATHER=gather,
        LAYER_MAJOR=layer_major,
        WORDS=words,
        BLOCK=block,
        ROWS=rows,
    )


@functools.cache
def compile_kernels(
    words: int,
    dtype: torch.dtype,
    device: torch.device,
    layers: int,
    layer_major: bool,
    staged: bool = True,
) -> None:
    """Compile the row-kernel variants a component of this geometry uses, so that no transfer
    waits for one: the row copy across PCIe (``kvtier.transfer.component``'s kernel path) and,
    where ``staged``, the staging gather and scatter of ``layers``-layer pages (page-major, or
    ``layer_major`` for a layer-first host). Once per geometry and process; Triton's disk
    cache keeps the binaries for the next process. Does nothing off CUDA or without Triton.

    Why: compiled on first use, a variant a family's first copies had not needed (a small batch
    by row kernel, say) held a transfer 0.08-0.37 s in the middle of a mix of batch sizes, in
    three to four of six families on an H200. Compiled here, making a ``Mover`` took 0.3-0.6 s
    (3-6 variants; 1.5-1.8 s for the first, with Triton's start) and no transfer compiled
    (``results/h200-dma/jit_variants.py``, ``results/h200-dma/run18/``)."""
    if device.type != "cuda" or _kernels() is None:
        return
    a = torch.zeros((layers, words), dtype=dtype, device=device)
    b = torch.zeros_like(a)
    first = torch.zeros(1, dtype=torch.int64, device=device)
    copy_rows(a, first, b, first, ctas=1)
    if not staged:
        return
    kw = {"ctas": 1, "layer_major": layer_major}
    copy_page_rows(a, b, first, layers, 1, True, tile_words=ONE_BLOCK, **kw)
    copy_page_rows(b, a, first, layers, 1, False, tile_words=TILE_WORDS, **kw)
