"""Sampling parameters and the sampler: greedy argmax, or temperature/top-k/top-p drawn from a
per-request generator so that a given seed reproduces the same tokens; presence, frequency and
per-token biases applied to the logits first; the log-probabilities a request asks for; and
stop strings found in the streamed text."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import RequestError

_SEEDS = (-(1 << 63), 1 << 64)
"""Seeds ``torch.Generator.manual_seed`` takes."""
PENALTY_RANGE = (-2.0, 2.0)
"""Presence and frequency penalties OpenAI accepts."""
BIAS_RANGE = (-100.0, 100.0)
"""Logit biases OpenAI accepts."""


def _is_int(v: Any) -> bool:
    # bool is an int subclass: True would silently mean 1
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    # nan passes every comparison-based range check
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    """Tokens to generate at most."""
    temperature: float = 0.0
    """``0`` is greedy (argmax); larger values flatten the distribution."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (``0``: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (``1``: all)."""
    seed: int | None = None
    """Seed of the request's generator; ``None`` draws one at random."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end the request (the stop token is part of the output)."""
    return_logits: bool = False
    """Return the logits every generated token was sampled from (``RequestOutput.logits``)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request once the output text holds one (needs a tokenizer). The
    output text ends where the first of them starts; the token that completed it is the last
    output token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds already, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it, in [-2, 2]."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token, bias)`` pairs added to those tokens' logits, biases in [-100, 100]."""
    logprobs: int | None = None
    """Return each output token's log-probability and the ``logprobs`` most likely tokens'
    (``RequestOutput.logprobs``); ``None``: none. Log-probabilities are the model's: the
    log-softmax of its logits, before penalties, biases, temperature, top-k and top-p."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (
            _is_int(self.seed) and _SEEDS[0] <= self.seed < _SEEDS[1]
        ):
            raise RequestError(
                f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}"
            )
        for opt in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, opt), bool):
                raise RequestError(f"{opt} must be True or False, got {getattr(self, opt)!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(_is_int(t) for t in stops):
            raise RequestError(f"stop_token_ids must be a tuple of integers, got {stops!r}")
        self._check_text_and_scores()

    def _check_text_and_scores(self) -> None:
        stop = self.stop
        if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a tuple of non-empty strings, got {stop!r}")
        lo, hi = PENALTY_RANGE
        for opt in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, opt)
            if not _is_real(v) or not lo <= v <= hi:
                raise RequestError(f"{opt} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        bias = self.logit_bias
        lo, hi = BIAS_RANGE
        if not isinstance(bias, tuple) or not all(
            isinstance(p, tuple)
            and len(p) == 2
            and _is_int(p[0])
            and p[0] >= 0
            and _is_real(p[1])
            and lo <= p[1] <= hi
            for p in bias
        ):
            raise RequestError(
                f"logit_bias must be (token id >= 0, bias in [{lo:g}, {hi:g}]) pairs, got {bias!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise RequestError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Penalties or biases change the logits before a token is picked."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def argmax_only(self) -> bool:
        """The next token is the raw logits' argmax: greedy, nothing changes the logits."""
        return self.greedy and not self.shapes_logits

    def make_generator(self) -> torch.Generator | None:
        """A fresh CPU generator for this request (``None`` when greedy)."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.randrange(1 << 62)
        return torch.Generator().manual_seed(seed)


def shaped_logits(
    logits: torch.Tensor, params: SamplingParams, output: Sequence[int]
) -> torch.Tensor:
    """``logits`` (a CPU ``[vocab]`` row) as float64 with ``params``' penalties for the tokens
    ``output`` holds and its biases applied (OpenAI's: ``logit - count * frequency - (count >
    0) * presence + bias``). A bias on an id outside the vocabulary raises ``RequestError``."""
    scores = logits.double()
    if not params.shapes_logits:
        return scores
    scores = scores.clone()
    vocab = scores.numel()
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.int64), minlength=vocab)
        counts = counts[:vocab].double()
        scores -= counts * params.frequency_penalty + (counts > 0).double() * (
            params.presence_penalty
        )
    for token, bias in params.logit_bias:
        if token >= vocab:
            raise RequestError(f"logit_bias token {token} is outside the vocabulary [0, {vocab})")
        scores[token] += bias
    return scores


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    output: Sequence[int] = (),
) -> int:
    """Pick one token from a CPU float ``[vocab]`` logits row; ``output`` (the request's
    tokens so far) is what the penalties count."""
    if params.argmax_only or (gen is None and not params.shapes_logits):
        return int(torch.argmax(logits))
    scores = shaped_logits(logits, params, output)
    if params.greedy or gen is None:
        return int(torch.argmax(scores))
    scores = scores / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # drop a token when the more likely ones already reach top_p; the first always stays
        drop = (cum - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the most likely alternatives at its step."""

    token: int
    """The token the request got."""
    logprob: float
    """Its log-probability under the model (see ``SamplingParams.logprobs``)."""
    top: tuple[tuple[int, float], ...]
    """The ``SamplingParams.logprobs`` most likely tokens and theirs, most likely first."""


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of a CPU ``[vocab]`` logits row with its ``top`` best alternatives."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), best)


class TextStream:
    """Incremental decoding: each ``feed`` returns the text its ids add, decoded from a window
    of the output's last tokens rather than the whole output each time (which grows
    quadratically with its length).

    The window starts at ``start``; ``done`` tokens have been turned into text. Both decodes
    begin at ``start``, so whatever a tokenizer does at the start of a decode (a dropped
    leading space) is the same in both and cancels, as long as the window's first tokens show
    text. A trailing replacement character (a multi-byte character cut between tokens) waits
    for the next tokens, unless ``final``. Without a tokenizer every feed returns ``None``.
    The texts returned, joined, are the whole output decoded at once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = self.done = 0

    def feed(self, ids: Sequence[int], final: bool = False) -> str | None:
        self.ids += ids
        if self.tok is None:
            return None
        sent = self.tok.decode(self.ids[self.start : self.done])
        text = self.tok.decode(self.ids[self.start :])
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(sent) :]
        # The next window starts at tokens that showed text: one that decodes to nothing (a
        # special token) would leave nothing before the next word for its space to cancel.
        self.start, self.done = (self.done if delta else self.start), len(self.ids)
        return delta


class StopScan:
    """Stop strings over text that arrives in pieces: which of it is safe to show, and where
    the first stop string starts.

    ``push`` returns the new text that can no longer turn out to be part of a stop string:
    text that ends in the beginning of one is held back until the next pieces decide. Once a
    stop string is complete, ``matched`` is it and ``cut`` where it starts, and nothing from
    ``cut`` on is ever returned. The stop string that matches is the one that completes first
    in the text (of two that complete at the same character, the longer): so the answer
    depends on the text alone, not on how it was cut into pieces, and a request that stops at
    the token completing a stop string gets the same answer as a reader of its whole text."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0
        """Characters of ``text`` returned so far."""
        self.matched: str | None = None
        self.cut: int | None = None

    def push(self, piece: str | None) -> str:
        if self.matched is not None or not piece:
            return ""
        # a stop string that completes now ends in ``piece``: it starts no earlier than this
        begin = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [(i + len(s), i, s) for s in self.stops if (i := self.text.find(s, begin)) >= 0]
        if found:
            _, self.cut, self.matched = min(found)
            safe = self.cut
        else:
            safe = len(self.text) - self._held()
        out = self.text[self.released : safe]
        self.released = max(self.released, safe)
        return out

    def flush(self) -> str:
        """The output ended: what was held back, unless a stop string matched."""
        if self.matched is not None:
            return ""
        out = self.text[self.released :]
        self.released = len(self.text)
        return out

    def _held(self) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for k in range(min(len(self.text), self.longest - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class StopStrings:
    """A request's stop strings against its output tokens (``feed`` one token at a time)."""

    def __init__(self, stops: Sequence[str], tokenizer: Any) -> None:
        self.stream = TextStream(tokenizer)
        self.scan = StopScan(stops)

    @classmethod
    def of(cls, params: SamplingParams, tokenizer: Any) -> StopStrings | None:
        """The matcher of ``params.stop`` (``None`` without stop strings); ``RequestError``
        when there are some but no tokenizer to see them with."""
        if not params.stop:
            return None
        if tokenizer is None:
            raise RequestError("stop strings need a tokenizer; the model has none")
        return cls(params.stop, tokenizer)

    def feed(self, token: int) -> bool:
        """Whether the output, ``token`` included, now holds a stop string."""
        self.scan.push(self.stream.feed([token]))
        return self.scan.matched is not None

    @property
    def matched(self) -> str | None:
        return self.scan.matched

    @property
    def text(self) -> str:
        """The output text before the stop string (``matched`` set), else so far."""
        return self.scan.text if self.scan.cut is None else self.scan.text[: self.scan.cut]


def logit_bias_pairs(bias: Mapping[Any, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` object (token ids as strings) as ``SamplingParams.logit_bias``;
    ``RequestError`` for a key that is no token id."""
    pairs = []
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {k!r}") from None
        pairs.append((token, float(v) if _is_real(v) else v))
    return tuple(pairs)
