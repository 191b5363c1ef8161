"""What one forward of the reference engine reads besides the weights: where each sequence of a
flattened batch writes and reads its K/V (``SeqSlots``), the batch as every layer sees it
(``ForwardBatch``) and the pool set it writes into (``KVBuffers``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvtier.parallel.group import Group


class KVBuffers(Protocol):
    """Anything exposing the device pool's per-layer KV view (``DevicePool`` does)."""

    def layer(self, layer: int, name: str | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class SeqSlots:
    """Where one sequence of a flattened batch writes and reads its K/V.

    The sequence's ``num_new`` tokens are consecutive in the batch and sit at the end of its
    context: ``ctx_locs[-num_new:]`` must equal ``out_locs``, and ``ctx_locs[i]`` holds the token
    at position ``i``.
    """

    num_new: int
    """Tokens of this sequence computed in this forward."""
    out_locs: torch.Tensor
    """int64 ``[num_new]``: pool slots receiving the new tokens' K/V."""
    ctx_locs: torch.Tensor
    """int64 ``[context_len]``: slots of the whole context (cached prefix + new tokens), in order."""
    state: list[torch.Tensor] | None = None
    """Stateful (recurrent) models: the sequence's running state, one tensor per recurrent
    layer, holding the state before the first new token; the model updates it in place to the
    state after the last new token. ``None`` for attention-only models."""
    state_out: list[tuple[int, int]] = field(default_factory=list)
    """Stateful models: ``(i, row)`` pairs: after new token ``i`` (0-based among the new
    tokens), write the state into row ``row`` of the pool's state component (a checkpoint)."""
    ctx_cols: torch.Tensor | None = None
    """Context parallelism: int64 ``[len(ctx_locs)]``, the positions (ascending) of the rows in
    ``ctx_locs``, which are only the rows this rank holds. ``None``: ``ctx_locs[i]`` is
    position ``i`` (every row)."""
    out_rows: torch.Tensor | None = None
    """Context parallelism: int64, which of the ``num_new`` tokens (0-based) this rank writes,
    aligned with ``out_locs``. ``None``: all of them."""
    context_len: int | None = None
    """Context parallelism: the whole context's length. ``None``: ``len(ctx_locs)``."""
    window_locs: torch.Tensor | None = None
    """Window pools: int64, the window component's slots of positions ``window_start ..``
    up to the last new token (the new tokens' window rows are its last ``num_new``)."""
    window_start: int = 0
    """Window pools: the position of ``window_locs[0]``."""

    @property
    def seq_len(self) -> int:
        """Tokens in the whole context (cached prefix + new tokens), on every rank."""
        return self.ctx_locs.shape[0] if self.context_len is None else self.context_len


@dataclass(slots=True)
class ForwardBatch:
    """What every layer of one forward reads besides the residual stream."""

    positions: torch.Tensor
    """``[T]``: each input token's position in its sequence."""
    seqs: Sequence[SeqSlots]
    """The sequences, in the order their tokens are concatenated."""
    out_locs: torch.Tensor
    """``[T]``: the pool slots receiving the tokens' rows (the sequences' ``out_locs``)."""
    kv: KVBuffers
    """The pool set the layers write and read."""
    group: Group | None = None
    """The CP group the attention partials merge over; ``None`` without context parallelism."""
    out_rows: torch.Tensor | None = None
    """Context parallelism: indices into the ``T`` tokens of the rows this rank writes, aligned
    with ``out_locs``. ``None``: every token's row."""
    window_out: torch.Tensor | None = None
    """Window pools: ``[T]``, the window component's slots receiving the tokens' rows."""
