"""Sampling parameters and the sampler: greedy argmax, or temperature/top-k/top-p drawn from a
per-request generator so that a given seed reproduces the same tokens."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import RequestError

_SEEDS = (-(1 << 63), 1 << 64)
"""Seeds ``torch.Generator.manual_seed`` takes."""


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator | None:
        """A fresh CPU generator for this request (``None`` when greedy)."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.randrange(1 << 62)
        return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick one token from a CPU float ``[vocab]`` logits row."""
    if params.greedy or gen is None:
        return int(torch.argmax(logits))
    scores = logits.double() / params.temperature
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
