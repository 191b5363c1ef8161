"""KV events as vLLM encodes them (``vllm.distributed.kv_events``, the array layout:
``msgspec`` structs with ``array_like=True, tag=True``), built as plain lists for ``msgpack``.

A batch is ``[ts, events, data_parallel_rank]``; an event is an array whose first element is its
struct's tag (the class name), then its fields in declaration order::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

``medium`` names the tier: ``device``, ``host`` or ``storage`` (vLLM's own engine says ``GPU``).
``lora_name`` (always ``None`` here) is written because vLLM versions that have the field
declare it without a default, so their decoder needs it; decoders of versions without it ignore
a trailing element. ``parent_block_hash`` is ``None`` for the first page of a sequence.

On the wire (``kvtier.events.publisher``) a batch travels as the multipart message
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0, ``payload`` the batch
packed by ``msgpack``, ``topic`` the publishing instance's id (what vLLM leaves to the
deployment; kvtier's one addition, invisible to a decoder of the payload).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MEDIA = ("device", "host", "storage")
"""The tiers an event's ``medium`` names."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay (vLLM's ``ZmqEventPublisher.END_SEQ``)."""


def block_stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
) -> list[Any]:
    """A ``BlockStored`` event: pages ``hashes`` (in order, each chained on the one before,
    the first on ``parent``) holding ``token_ids`` became resident in ``medium``."""
    return ["BlockStored", list(hashes), parent, list(token_ids), block_size, None, medium, None]


def block_removed(hashes: Sequence[int], medium: str) -> list[Any]:
    """A ``BlockRemoved`` event: pages ``hashes`` are no longer resident in ``medium``."""
    return ["BlockRemoved", list(hashes), medium]


def all_blocks_cleared() -> list[Any]:
    """An ``AllBlocksCleared`` event: the instance holds nothing in any tier."""
    return ["AllBlocksCleared"]


def event_batch(ts: float, events: list[list[Any]], data_parallel_rank: int | None = None) -> list:
    """A batch of events as vLLM's ``EventBatch`` (array layout)."""
    return [ts, events, data_parallel_rank]


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as its 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")
