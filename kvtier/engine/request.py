"""A request's life inside the engine (``Request``) and what the caller gets back
(``RequestOutput``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity: two requests are never "equal"
class Request:
    """Mutable state of one request.

    While running, ``locs[i]`` is the device slot of ``tokens[i]`` for every token whose K/V is
    written (``num_computed`` of them); its first ``prefix_len`` slots belong to the cache, the
    rest are the request's own pages. ``locs`` always covers whole pages.
    """

    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    locs: torch.Tensor | None = None
    num_computed: int = 0
    prefix_len: int = 0
    handle: Any = None
    prefetch: Any = None
    storage_wanted: int = 0
    """Tokens storage held beyond the cached prefix when last matched (0: nothing to fetch)."""
    prefetch_epoch: int = -1
    """The scheduler's release count at the last prefetch attempt."""
    prefetch_tries: int = 0
    """Prefetch attempts so far."""
    first_token_time: float | None = None
    admitted: bool = False
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    recomputed: int = 0
    preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    state: list[torch.Tensor] | None = None
    """Stateful models: the running recurrent state after ``num_computed`` tokens."""
    layer_events: list | None = None
    """Per-anchor-layer arrival events of a host load the next forward must wait on."""
    checkpoints: set[int] = field(default_factory=set)
    """Stateful models: pages (by index in ``tokens``) whose state row this request wrote."""

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def to_output(self, text: str | None = None) -> RequestOutput:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        return RequestOutput(
            request_id=self.id,
            prompt=list(self.prompt),
            output_ids=self.output,
            finish_reason=self.finish_reason,
            ttft_s=ttft,
            cached_device=self.cached_device,
            cached_host=self.cached_host,
            cached_storage=self.cached_storage,
            recomputed=self.recomputed,
            preemptions=self.preemptions,
            text=text,
            error=self.error,
        )


@dataclass(frozen=True)
class RequestOutput:
    """A finished request."""

    request_id: int
    """Id returned by ``LLM.add_request``."""
    prompt: list[int]
    """Prompt token ids."""
    output_ids: list[int]
    """Generated token ids (a stop token, when one ended the request, is the last)."""
    finish_reason: str | None
    """``length`` (max_tokens reached), ``stop`` (eos or a stop token), ``error`` (see
    ``error``) or ``None``."""
    ttft_s: float | None
    """Seconds from submission to the first generated token."""
    cached_device: int
    """Prompt tokens served from the device tier (L1) at first admission."""
    cached_host: int
    """Prompt tokens restored from the host tier (L2) at first admission."""
    cached_storage: int
    """Prompt tokens fetched from storage (L3, through L2) at first admission."""
    recomputed: int
    """Tokens the model computed in prefill (the uncached suffix; more after preemptions)."""
    preemptions: int = 0
    """Times the request was sent back to the waiting queue for lack of pages."""
    text: str | None = None
    """Decoded output when the model directory has a usable tokenizer."""
    error: str | None = None
    """Why the request failed (``finish_reason == "error"``); the engine served the others."""

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage
