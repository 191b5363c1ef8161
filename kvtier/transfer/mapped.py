"""Device views of pinned host memory.

With unified virtual addressing a pinned host allocation has the same address on the GPU, so a
CUDA tensor can alias it: kernels then gather and scatter scattered pages across PCIe in one
launch per component, with no staging copy and no host-side scatter. Measured on an H200 this
reaches 0.89-0.93 of a contiguous pinned ``cudaMemcpy`` for 4 KiB to 256 KiB page chunks.
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError


class _ArrayInterface:
    """Just enough of ``__cuda_array_interface__`` for ``torch.as_tensor`` to alias memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def map_pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing pinned, contiguous CPU tensor ``t`` (same shape and dtype).

    The caller keeps ``t`` alive for as long as the view is used. ``t`` may be pinned only in
    part (a host pool pinned in the background, ``kvtier.pools.pinning``: its start is pinned
    first): the view is valid wherever ``t`` is registered, and kernels only touch pages the
    pool's allocator handed out, which are. Registered memory has the same address on the
    device where the driver can use host pointers for it (x86-64 and Grace with unified
    addressing), as pinned allocations always do.
    """
    if not (t.is_pinned() and t.is_contiguous()):
        raise ConfigError("only contiguous pinned host tensors can be mapped (pin_host)")
    nbytes = t.numel() * t.element_size()
    with torch.cuda.device(device):
        flat = torch.as_tensor(_ArrayInterface(t.data_ptr(), nbytes), device=device)
    return flat.view(t.dtype).view(t.shape)
