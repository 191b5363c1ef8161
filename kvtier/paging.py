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


def check_page_ids(pages: torch.Tensor, num_pages: int, what: str, distinct: bool) -> None:
    """Debug check of a copy's physical page ids (a CPU tensor): one dimension, each in
    ``[0, num_pages)``, and with ``distinct`` (a copy's destination) each page at most once,
    since two copies into one page race. Raises ``IntegrityError`` naming ``what``."""
    if pages.dim() != 1:
        raise IntegrityError(f"{what}: expected 1-D page ids, got shape {tuple(pages.shape)}")
    a = pages.numpy()
    if a.size == 0:
        return
    out = (a < 0) | (a >= num_pages)
    if out.any():
        raise IntegrityError(f"{what}: page {int(a[out][0])} is not in [0, {num_pages})")
    if distinct:
        ids, counts = np.unique(a, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"{what}: page {int(ids[counts > 1][0])} is a destination twice")
