"""What a model keeps per token and layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class PoolSpec:
    """Shape of one pool: ``num_layers`` layers, each holding one ``row_shape`` row per token.

    A GQA KV pool is ``row_shape=(2, num_kv_heads, head_dim)`` (K and V side by side).
    """

    name: str
    """Component name; part of the L3 namespace."""
    num_layers: int
    """Layers holding a row per token."""
    row_shape: tuple[int, ...]
    """Shape of one token's row in one layer."""
    dtype: torch.dtype
    """Element type."""

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or not self.row_shape or any(d <= 0 for d in self.row_shape):
            raise ConfigError(
                f"pool {self.name!r}: num_layers={self.num_layers} and row_shape={self.row_shape}"
                " must be positive"
            )

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page across all layers."""
        return self.num_layers * page_size * self.row_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def bytes_view(buf: torch.Tensor, page_dim: int, num_pages: int) -> torch.Tensor:
    """Reinterpret ``buf`` as raw words split into ``num_pages`` pages along ``page_dim``.

    ``page_dim=0`` gives ``[layers, pages, words]`` for a layer-first buffer
    ``[layers, slots, *row]``; ``page_dim=1`` gives ``[pages, layers, words]`` for a page-first
    buffer ``[pages, layers, tokens, *row]``. Words are int64 when the per-page-per-layer byte
    count allows (row copies then move 8 bytes per element), else bytes.
    """
    lead = buf.shape[0]
    flat = buf.view(torch.uint8).view(lead, -1) if buf.dtype != torch.uint8 else buf.view(lead, -1)
    if page_dim == 0:
        chunk = flat.shape[1] // num_pages
        out = flat.view(lead, num_pages, chunk)
    else:
        out = flat.view(lead, buf.shape[1], -1)
    return out.view(torch.int64) if out.shape[-1] % 8 == 0 else out
