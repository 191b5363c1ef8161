"""Page arithmetic shared by pools, tree and transfers.

A page holds ``page_size`` consecutive token slots; page ``p`` owns slots
``[p * page_size, (p + 1) * page_size)``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvtier.errors import IntegrityError


def num_full_pages(num_tokens: int, page_size: int) -> int:
    """Number of whole pages in ``num_tokens`` tokens."""
    return num_tokens // page_size


def align_down(num_tokens: int, page_size: int) -> int:
    """Largest multiple of ``page_size`` that is ``<= num_tokens``."""
    return num_tokens - num_tokens % page_size


def pages_to_locs(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Expand page ids (1-D) to the token slots they own, in order (int64, on their device)."""
    if page_size == 1:
        return pages.to(torch.int64)
    if pages.device.type == "cpu":
        # numpy: this runs on every allocation and load, where a chain of torch CPU ops on a
        # few pages costs about three times as much (11 against 3.5 µs for one page).
        a = pages.numpy().astype(np.int64, copy=False)
        return torch.from_numpy((a[:, None] * page_size + _offsets(page_size)).reshape(-1))
    offs = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.to(torch.int64).unsqueeze(1) * page_size + offs).reshape(-1)


@functools.cache
def _offsets(page_size: int) -> np.ndarray:
    return np.arange(page_size, dtype=np.int64)


def locs_to_pages(locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of page-aligned slot runs (``locs`` must already be whole pages)."""
    if page_size == 1:
        return locs.to(torch.int64)
    return locs.reshape(-1, page_size)[:, 0].to(torch.int64) // page_size


def check_whole_pages(locs: torch.Tensor, page_size: int, what: str = "indices") -> None:
    """Validate that ``locs`` form whole, aligned pages of consecutive slots.

    Debug-mode helper for transfer paths. It only inspects CPU tensors, so the GPU hot path never
    synchronises: device tensors are skipped.
    """
    if locs.device.type != "cpu":
        return
    if locs.dim() != 1:
        raise IntegrityError(f"{what}: expected a 1-D index tensor, got shape {tuple(locs.shape)}")
    n = locs.numel()
    if n % page_size:
        raise IntegrityError(f"{what}: {n} slots is not a multiple of page_size={page_size}")
    if n == 0 or page_size == 1:
        return
    rows = locs.reshape(-1, page_size).to(torch.int64)
    if bool((rows[:, 0] % page_size != 0).any()):
        bad = int(rows[:, 0][rows[:, 0] % page_size != 0][0])
        raise IntegrityError(f"{what}: page starting at slot {bad} is not aligned to {page_size}")
    expect = rows[:, :1] + torch.arange(page_size, dtype=torch.int64)
    if not torch.equal(rows, expect):
        raise IntegrityError(f"{what}: a page's slots are not consecutive")
