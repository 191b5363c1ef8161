"""Page lists to the GPU through reused pinned buffers."""

from __future__ import annotations

import torch

KEEP = 4
"""Pinned buffers kept for reuse; more uploads in flight at once allocate more."""


class Uploads:
    """Pinned host buffers a mover's page lists go to the GPU through.

    ``Tensor.pin_memory()`` took about 100 µs of CPU per batch on an H200 host, before the first
    copy of every staged backup (``results/h200-dma/run11/first_load_profile.txt``). A buffer
    here is reused once the copy out of it has run (one event per buffer), so an upload costs a
    CPU copy of the lists. A buffer dropped while its copy is in flight stays allocated until
    the copy is done (PyTorch's pinned-memory allocator records the copy's stream)."""

    def __init__(self) -> None:
        self._bufs: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def upload(self, lists: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``lists`` (a CPU int64 tensor) copied to ``device`` on the current stream; the host
        never waits for the GPU."""
        n = lists.numel()
        buf = self._take(n)
        # Through numpy: the lists may be inference tensors (made under ``inference_mode``)
        # and the buffer not, or the other way round; neither may update the other in place.
        buf.numpy()[:n] = lists.numpy().reshape(-1)
        out = buf[:n].view(lists.shape).to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._bufs.append((buf, done))
        if len(self._bufs) > KEEP:
            del self._bufs[0]
        return out

    def _take(self, n: int) -> torch.Tensor:
        for i, (buf, done) in enumerate(self._bufs):
            if buf.numel() >= n and done.query():
                del self._bufs[i]
                return buf
        size = 1 << max(12, (n - 1).bit_length())
        with torch.inference_mode(False):  # reused outside inference mode too
            return torch.empty(size, dtype=torch.int64, pin_memory=True)
