"""What a model keeps per token and layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError, RequestError

KINDS = ("kv", "sidecar", "state", "window")


@dataclass(frozen=True)
class PoolSpec:
    """One component of a model's pool set: ``num_layers`` layers of ``row_shape`` rows.

    ``kind`` says how rows are indexed:

    ==========  ==========================================  ===============================
    kind        rows                                        example
    ==========  ==========================================  ===============================
    ``kv``      one per token; the anchor (first spec)      GQA ``(2, kv_heads, head_dim)``
    ``sidecar`` one per ``tokens_per_row`` tokens, indexed  indexer keys (1), compressed
                like the anchor: row = token slot // tpr    index rows (group of tokens)
    ``state``   one per page (a checkpoint at its end)      recurrent conv + SSM state
    ``window``  one per token, like the anchor, but only    sliding-window layers' K/V
                for the pages some query's window reads
    ==========  ==========================================  ===============================

    ``state`` and ``window`` components are *partial*: a page has them or not (``Node.ckpt``
    flags which pages do, in every tier holding the page) and each is stored as an object of
    its own per page, next to the page object of the other components.
    """

    name: str
    """Component name; part of the L3 namespace."""
    num_layers: int
    """Layers holding rows."""
    row_shape: tuple[int, ...]
    """Shape of one row in one layer."""
    dtype: torch.dtype
    """Element type."""
    kind: str = "kv"
    """``kv`` (the anchor), ``sidecar`` (token-indexed, derived from KV) or ``state``."""
    tokens_per_row: int = 1
    """Tokens one row covers (``sidecar`` only; the page size must be a multiple)."""
    window: int = 0
    """``window`` only: positions a query reads, ``(p - window, p]`` for the query at ``p``."""
    lossy: bool = False
    """The host and storage tiers may hold this component through a lossy page codec
    (``CacheConfig.kv_codec``, ``kvtier.pools.codec``): set by families on attention KV
    anchors only; indexer keys, compressed rows, recurrent state, window rows and draft
    hidden states stay exact. Allowed for ``kv`` and ``sidecar`` components."""
    scale_block: int = 0
    """Elements of a row sharing one codec scale per page and layer (``lossy`` only): ``0``
    is the row's last dimension (one scale per KV head, K and V apart); MLA's one-dimensional
    latent rows set a block (one scale per latent block). Must divide the row's elements."""

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or not self.row_shape or any(d <= 0 for d in self.row_shape):
            raise ConfigError(
                f"pool {self.name!r}: num_layers={self.num_layers} and row_shape={self.row_shape}"
                " must be positive"
            )
        if self.kind not in KINDS:
            raise ConfigError(f"pool {self.name!r}: kind={self.kind!r} is not one of {KINDS}")
        if self.tokens_per_row < 1 or (self.kind != "sidecar" and self.tokens_per_row != 1):
            raise ConfigError(
                f"pool {self.name!r}: tokens_per_row={self.tokens_per_row} is only allowed "
                "(>= 1) for sidecar pools"
            )
        if (self.kind == "window") != (self.window > 0):
            raise ConfigError(
                f"pool {self.name!r}: window={self.window} must be positive exactly for "
                "kind='window' pools"
            )
        if self.lossy and self.kind not in ("kv", "sidecar"):
            raise ConfigError(
                f"pool {self.name!r}: lossy=True is only allowed for kv and sidecar pools, "
                f"got kind={self.kind!r} (state and window rows stay exact)"
            )
        if self.scale_block < 0 or (self.scale_block and not self.lossy):
            raise ConfigError(
                f"pool {self.name!r}: scale_block={self.scale_block} needs lossy=True and must "
                "be >= 0"
            )
        if self.lossy and self.row_numel % self.block:
            raise ConfigError(
                f"pool {self.name!r}: scale_block={self.scale_block} does not divide the "
                f"{self.row_numel} elements of a row {self.row_shape}"
            )

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def block(self) -> int:
        """Elements per codec scale group: ``scale_block``, else the row's last dimension."""
        return self.scale_block or self.row_shape[-1]

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize

    @property
    def partial(self) -> bool:
        """Present on some pages only (``state``, ``window``): flagged per page, stored as an
        object of its own per page."""
        return self.kind in ("state", "window")

    @property
    def token_indexed(self) -> bool:
        """Rows follow token slots (``kv`` and ``sidecar``); else one row per page."""
        return self.kind != "state"

    def rows_per_page(self, page_tokens: int) -> int:
        """Rows one page of ``page_tokens`` tokens holds in each layer."""
        if not self.token_indexed:
            return 1
        if page_tokens % self.tokens_per_row:
            raise ConfigError(
                f"pool {self.name!r}: a page of {page_tokens} tokens is not a whole number of "
                f"{self.tokens_per_row}-token rows"
            )
        return page_tokens // self.tokens_per_row

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one page across all layers."""
        return self.num_layers * self.rows_per_page(page_tokens) * self.row_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """Stable text naming everything that shapes this component's bytes (for namespaces)."""
        shape = "x".join(map(str, self.row_shape))
        out = f"{self.name}:{self.kind}:{self.num_layers}x{shape}:{self.dtype_name}/{self.tokens_per_row}"
        return f"{out}/w{self.window}" if self.window else out


def validate_pool_set(specs: Sequence[PoolSpec]) -> None:
    """One ``kv`` anchor first, unique names; raises ``ConfigError`` naming the problem."""
    if not specs:
        raise ConfigError("a pool set needs at least one PoolSpec (the kv anchor)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"pool names must be unique, got {names}")
    kinds = [s.kind for s in specs]
    if kinds[0] != "kv" or kinds.count("kv") != 1:
        raise ConfigError(f"a pool set has exactly one kv anchor, listed first; got kinds {kinds}")
    if "state" in kinds and "window" in kinds:
        # One per-page flag (``Node.ckpt``) says which pages carry the partial component.
        raise ConfigError(f"a pool set has state or window components, not both; got {kinds}")


def tree_page_size(page_size: int, specs: Sequence[PoolSpec]) -> int:
    """Least common multiple of the KV page and every sidecar's row granularity: the unit the
    tree splits on, memory is allocated in, and one storage object holds."""
    return math.lcm(page_size, *(s.tokens_per_row for s in specs if s.kind == "sidecar"))


def component_buffer(buffers: dict[str, torch.Tensor], name: str, pool: str) -> torch.Tensor:
    """``buffers[name]``; an unknown component raises ``RequestError`` naming ``pool`` and the
    components it holds."""
    try:
        return buffers[name]
    except KeyError:
        held = ", ".join(buffers)
        raise RequestError(f"{pool} pool has no component {name!r} (it holds {held})") from None


def page_words(buf: torch.Tensor, page_dim: int, num_pages: int) -> torch.Tensor:
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


bytes_view = page_words
"""Former name of ``page_words``, kept while ``kvtier.transfer`` still imports it."""
