"""Copy-engine blocks of a staged copy (see ``ComponentRows.staged``), slice by slice.

A staged copy moves its host pages slice by slice through a device staging buffer laid out as
they are on the host, so each run of consecutive host pages in a slice is one block (per layer
for a layer-first host). The runs are found once per batch (:func:`host_breaks`, shared by every
component and by the mechanism choice); cutting them at a slice's start gives its blocks with
a handful of numpy operations.

    host layout   staging row of (layer l, slice page i)   blocks of a slice
    page_first    i * layers + l                           one per run (all layers)
    layer_first   l * k + i   (k pages in the slice)       one per run and layer, layer-major
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvtier.transfer.plan import RowGeometry


def host_breaks(host: np.ndarray) -> np.ndarray:
    """Positions ``i > 0`` in ``host`` (page ids, in transfer order) where a run of consecutive
    pages starts: ``host[i] != host[i - 1] + 1``.

    >>> host_breaks(np.array([4, 5, 6, 9, 10, 3]))
    array([3, 5])
    """
    return np.flatnonzero(np.diff(host) != 1) + 1


def slice_blocks(
    host: np.ndarray,
    breaks: np.ndarray,
    slices: Sequence[int],
    geo: RowGeometry,
    host_base: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each slice in turn (``slices[j]`` pages of ``host``, in order), the copy-engine
    blocks between its host pages and a staging buffer: ``(host addresses, byte offsets into
    the buffer, sizes)``, int64, where ``host_base`` is the host pool's address and ``breaks``
    is :func:`host_breaks` of ``host``. Each slice is worked out when asked for, so the first
    copy waits for the first slice's blocks only."""
    rb, layers = geo.row_bytes, geo.layers
    layer = np.arange(layers, dtype=np.int64)[:, None]
    lo = 0
    for k in slices:
        hi = lo + k
        first, last = np.searchsorted(breaks, (lo + 1, hi))  # breaks in (lo, hi)
        starts = np.concatenate(((lo,), breaks[first:last]))
        rel = starts - lo
        runs = np.diff(rel, append=k)
        if geo.host_layout == "page_first":
            page = layers * rb
            yield host_base + host[starts] * page, rel * page, runs * page
        else:
            host_rows = layer * geo.host_pages + host[starts][None, :]
            stage_rows = layer * k + rel[None, :]
            sizes = np.broadcast_to(runs * rb, host_rows.shape)
            yield (host_base + host_rows * rb).ravel(), (stage_rows * rb).ravel(), sizes.ravel()
        lo = hi
