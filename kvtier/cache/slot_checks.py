"""Checks and page arithmetic on the slot lists an engine hands back (``kvtier.cache.engine_pages``), in
numpy: they run on every ``finish``, ``free`` and ``insert``, where a torch CPU operation on a
few hundred slots costs several times a numpy one (``results/step_cpu.md``).

Every function takes slots as a flat int64 array (``checked``) and raises ``RequestError``
naming ``what`` (the call) and the first offending slot or page.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.errors import RequestError
from kvtier.paging import align_down


def checked(locs: torch.Tensor, limit: int, what: str) -> np.ndarray:
    """``locs`` as a flat int64 numpy array (a view where it can be), every slot in
    ``[0, limit)``."""
    t = locs.reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise RequestError(f"{what}: slots must be an integer tensor, got {t.dtype}")
    a = t.numpy().astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= limit):
        slot = int(a[(a < 0) | (a >= limit)][0])
        raise RequestError(f"{what}: slot {slot} lies outside the device pool [0, {limit})")
    return a


def distinct_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct pages of ``slots``, ascending. Slots come in runs of one page, so runs
    collapse first: sorting a few pages, not every slot (22 µs for 768 slots)."""
    p = slots // page_size
    if p.size > 1:
        p = p[np.concatenate(([True], p[1:] != p[:-1]))]
    return np.unique(p)


def whole_pages(slots: np.ndarray, page_size: int, what: str) -> np.ndarray:
    """Page ids of ``slots``, whole pages of consecutive, aligned slots (checked: the tree
    records a page by its id, so a rotated or gapped page would map tokens to wrong slots)."""
    ps = page_size
    if ps == 1 or slots.size == 0:
        return slots // ps
    rows = slots.reshape(-1, ps)
    bad = (rows != rows[:, :1] + np.arange(ps)).any(1) | (rows[:, 0] % ps != 0)
    if bad.any():
        i = int(bad.nonzero()[0][0])
        raise RequestError(
            f"{what}: page {i} of the slots ({rows[i].tolist()}) is not {ps} consecutive "
            f"slots starting at a multiple of page_size={ps}"
        )
    return rows[:, 0] // ps


def pages_with_tail(slots: np.ndarray, page_size: int, what: str) -> np.ndarray:
    """Page ids of ``slots``: whole pages as for :func:`whole_pages`, then a trailing run of
    consecutive slots from the start of one more page (a partial tail)."""
    ps = page_size
    full = align_down(slots.size, ps)
    pages = whole_pages(slots[:full], ps, what)
    if full == slots.size:
        return pages
    tail = slots[full:]
    page = int(tail[0]) // ps
    if not np.array_equal(tail, page * ps + np.arange(tail.size)):
        raise RequestError(
            f"{what}: the last, partial page of the slots ({tail.tolist()}) does not run "
            f"from the start of one page (page_size={ps})"
        )
    return np.append(pages, page)
