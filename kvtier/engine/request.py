"""A request's life inside the engine (``Request``) and what the caller gets back
(``RequestOutput``)."""

from __future__ import annotations

import enum
import numbers
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.engine.sampling import SamplingParams, StopStrings, TokenLogprob, token_logprob
from kvtier.errors import RequestError

if TYPE_CHECKING:
    from kvtier.engine.model_config import ModelConfig

TOKEN_MIN, TOKEN_MAX = -(2**31), 2**31 - 1
"""Token ids a request can hold: ``Request.tokens`` is int32 (``array('i')``), the container
the prefix tree compares without a copy."""


def token_ids(prompt: Any) -> list[int]:
    """``prompt``'s token ids as Python ints.

    ``prompt`` is a sequence (list, tuple, 1-D tensor or array) of Python ints or numpy/torch
    integer scalars, each within int32. Anything else raises ``RequestError`` naming the index
    and the value: ``int(1.7)`` or ``int('5')`` would silently serve another prompt, bools are
    no ids, and an id past int32 cannot be held (wrapping it would serve another prompt).
    """
    return checked_tokens(prompt)[0]


def checked_tokens(prompt: Any) -> tuple[list[int], array[int]]:
    """``token_ids(prompt)`` and the same ids as an ``array('i')`` (``int32_tokens``), packed
    once: the range check packs them anyway (about 0.3 ms for a 32K-token prompt)."""
    if isinstance(prompt, bytes | bytearray | set | frozenset | dict) or not isinstance(
        prompt, Iterable
    ):
        raise RequestError(
            f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}"
        )
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise RequestError(f"a prompt tensor must be 1-D, got shape {tuple(prompt.shape)}")
        if _integer_dtype(prompt.dtype):
            ids = prompt.tolist()
            return ids, int32_tokens(ids)
    if type(prompt) is list and set(map(type, prompt)) <= _PLAIN_INT:
        # The common case at C speed: one ABC check per token cost ~1 µs, 30 ms for a 32K
        # prompt, ahead of everything its TTFT waits for.
        return list(prompt), int32_tokens(prompt)
    ids: list[int] = []
    for i, t in enumerate(prompt):
        if isinstance(t, torch.Tensor):
            ok = t.dim() == 0 and _integer_dtype(t.dtype)
        else:
            ok = isinstance(t, numbers.Integral) and not isinstance(t, bool)
        if not ok:
            raise RequestError(
                f"prompt token {i} is {t!r} ({type(t).__name__}): token ids must be integers"
            )
        t = int(t)
        if not TOKEN_MIN <= t <= TOKEN_MAX:
            raise _out_of_range(i, t)
        ids.append(t)
    return ids, int32_tokens(ids)


def int32_tokens(ids: Sequence[int]) -> array[int]:
    """``ids`` (Python ints) as an ``array('i')``; ``RequestError`` naming the first id
    outside int32."""
    out = array("i")
    try:
        # struct packs a list about twice as fast as ``array('i', ids)`` builds one
        out.frombytes(struct.pack(f"{len(ids)}i", *ids))
    except struct.error as e:
        for i, t in enumerate(ids):
            if isinstance(t, int) and not TOKEN_MIN <= t <= TOKEN_MAX:
                raise _out_of_range(i, t) from None
        raise RequestError(f"prompt token ids must be integers: {e}") from None
    return out


def check_limits(
    held: array[int],
    max_tokens: int,
    model: ModelConfig,
    page_size: int,
    pool_pages: int,
    padding_pages: int,
) -> None:
    """Refuse a request of prompt ``held`` (``int32_tokens``) and ``max_tokens`` that cannot
    run: empty, an id outside ``model``'s vocabulary, longer than its context, or needing more
    pages than a device pool of ``pool_pages`` has beside the ``padding_pages`` the engine
    holds for CUDA graphs. Raises ``RequestError`` naming the value and the option."""
    n = len(held)
    if not n:
        raise RequestError("empty prompt: a request needs at least one token")
    ids = np.frombuffer(held, dtype=np.int32)  # checked as numpy: no loop
    outside = (ids < 0) | (ids >= model.vocab_size)
    if outside.any():
        bad = int(ids[outside.argmax()])
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    total = n + max_tokens
    if total > model.max_position:
        raise RequestError(
            f"prompt of {n} tokens + max_tokens={max_tokens} exceeds the "
            f"model's context length max_position={model.max_position}"
        )
    pages = -(-total // page_size)
    if pages > pool_pages - padding_pages:
        note = f", {padding_pages} of them held for CUDA graphs" if padding_pages else ""
        raise RequestError(
            f"prompt + max_tokens needs {pages} pages but the device pool has only "
            f"{pool_pages} (device_pages{note})"
        )


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Refuse ``params`` that name a token outside a vocabulary of ``vocab_size`` ids (a
    logit bias, a stop token); ``RequestError`` naming the field and the id."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise RequestError(
                f"logit_bias token {token} is outside the vocabulary [0, {vocab_size})"
            )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise RequestError(
            f"logprobs={params.logprobs} asks for more alternatives than the vocabulary's "
            f"{vocab_size} tokens"
        )


def _out_of_range(i: int, t: int) -> RequestError:
    return RequestError(f"prompt token {i} is {t}: token ids must fit in int32")


_PLAIN_INT = frozenset({int})
"""Element types of a list prompt taken without a per-token check (``bool`` is not one)."""


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity: two requests are never "equal"
class Request:
    """Mutable state of one request.

    ``tokens`` is the prompt and then every generated id, as an ``array('i')`` (int32, built
    from ``prompt`` when not given): the prefix tree reads that container without converting
    it, and slices of it are arrays too (``list(...)`` or ``tolist()`` for Python ints).

    While running, ``locs[i]`` is the device slot of ``tokens[i]`` for every token whose K/V is
    written (``num_computed`` of them); its first ``prefix_len`` slots belong to the cache, the
    rest are the request's own pages. ``locs`` always covers whole pages.
    """

    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    generator: torch.Generator | None
    tokens: array[int] = field(default_factory=lambda: array("i"))
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
    """Prefetch attempts in a row that found no host room."""
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
    window_left: int = 0
    """Window pools: tokens of ``locs`` whose pages' window rows the request gave back."""
    checkpoints: set[int] = field(default_factory=set)
    """Stateful models: pages (by index in ``tokens``) whose state row this request wrote."""
    logit_rows: list[torch.Tensor] | None = None
    """With ``params.return_logits``: the float32 CPU logits of every generated token so far."""
    draft_proposed: int = 0
    """Speculative decoding: draft tokens proposed for this request so far."""
    draft_accepted: int = 0
    """Speculative decoding: of those, the ones the target agreed with."""
    stops: StopStrings | None = None
    """The request's stop strings against its output text (``None`` without any)."""
    stop_reason: str | int | None = None
    """The stop string or stop token that ended the request (``None`` for eos or length)."""
    logprobs: list[TokenLogprob] | None = None
    """With ``params.logprobs``: every generated token's log-probability so far."""

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = int32_tokens(self.prompt)
        elif type(self.tokens) is not array:
            self.tokens = int32_tokens(self.tokens)
        if self.params.return_logits and self.logit_rows is None:
            self.logit_rows = []
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def record_logits(self, row: torch.Tensor) -> None:
        """Keep ``row``, the CPU logits the next output token is sampled from (a copy: the
        step's batch tensor is not held on to)."""
        if self.logit_rows is not None:
            self.logit_rows.append(row.to(torch.float32, copy=True))

    def record_logprob(self, row: torch.Tensor, token: int) -> None:
        """Keep ``token``'s log-probability under ``row`` (the CPU logits it was picked from)
        and the best alternatives', when the request asked for them."""
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(row, token, self.params.logprobs or 0))

    def trim_outputs(self) -> None:
        """Drop the logits and log-probabilities of tokens the output no longer holds (those
        after a stop)."""
        if self.logit_rows is not None:
            del self.logit_rows[self.num_output :]
        if self.logprobs is not None:
            del self.logprobs[self.num_output :]

    @property
    def output(self) -> list[int]:
        """The generated ids so far, as Python ints (a fresh list)."""
        return self.tokens[len(self.prompt) :].tolist()

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def to_output(self, text: str | None = None) -> RequestOutput:
        """What the caller gets; ``text`` is the decoded output, cut where a stop string
        starts when one ended the request."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        rows = self.logit_rows
        if self.stops is not None and self.stops.matched is not None:
            text = self.stops.text
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
            logits=torch.stack(rows) if rows else None,
            draft_proposed=self.draft_proposed,
            draft_accepted=self.draft_accepted,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
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
    """``length`` (max_tokens reached), ``stop`` (eos, a stop token or a stop string),
    ``abort``, ``error`` (see ``error``) or ``None``."""
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
    """Decoded output when the engine has a tokenizer; a stop string that ended the request
    and what follows it are not part of it."""
    error: str | None = None
    """Why the request failed (``finish_reason == "error"``); the engine served the others."""
    logits: torch.Tensor | None = None
    """With ``SamplingParams.return_logits``: float32 CPU ``[len(output_ids), vocab]``, row
    ``i`` the logits ``output_ids[i]`` was sampled from; ``None`` otherwise."""

    draft_proposed: int = 0
    """Speculative decoding (``LLM(speculative_tokens=k)``): draft tokens proposed."""
    draft_accepted: int = 0
    """Of ``draft_proposed``, the tokens the target's greedy choice agreed with."""
    stop_reason: str | int | None = None
    """The stop string or ``stop_token_ids`` entry that ended the request; ``None`` when
    the model's end-of-sequence token or ``max_tokens`` did."""
    logprobs: list[TokenLogprob] | None = None
    """With ``SamplingParams.logprobs``: one entry per ``output_ids`` token."""

    @property
    def acceptance_rate(self) -> float | None:
        """``draft_accepted / draft_proposed``; ``None`` when nothing was proposed."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage
