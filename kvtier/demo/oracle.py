"""The content oracle's comparison: a cached run's output against a cold run of the same
prompt, tokens exactly and the logits of every generated step within a tolerance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOGIT_TOLERANCES = {"float32": 1e-4, "float64": 1e-4, "float16": 2e-2, "bfloat16": 2.5e-1}
"""Default oracle tolerance per model dtype (max |logit difference| to the cold run): 30 times
(float32) or about 5 times (16-bit types) the largest difference a clean restore or batching
showed. Measured on the tiny,
MLA, DSA, SWA and hybrid presets (|logits| < 9), CPU and H200: float32 at most 3e-6 (CPU and
CUDA); on CUDA float16 4e-3 and bfloat16 5.5e-2 (one or two units in the last place; on CPU
both were exact). A zeroed row, 1% noise in one page or one negated value of restored KV
moved float32 logits by 2e-3 to 10 (bfloat16 on CPU: 3e-2 to 10), mostly without changing a
greedy token."""


def default_tolerance(dtype: str) -> float:
    """``LOGIT_TOLERANCES[dtype]``; an unknown element type gets the loosest."""
    return LOGIT_TOLERANCES.get(dtype, max(LOGIT_TOLERANCES.values()))


@dataclass(frozen=True)
class Expected:
    """A cold run's output: what a cached run of the same prompt must reproduce."""

    tokens: list[int]
    """Greedy output ids."""
    logits: torch.Tensor
    """``[len(tokens), vocab]`` float32 logits of every generated step."""


def compare(
    tokens: Sequence[int], logits: torch.Tensor | None, expected: Expected
) -> tuple[bool, float]:
    """Whether a run's output ``tokens`` equal the expected ones, and the max |logit
    difference| of its ``logits`` (``RequestOutput.logits``) over the steps up to the first
    differing token: later steps read other contexts, their difference says nothing more.
    The difference is ``inf`` when there are no logits to compare."""
    same = list(tokens) == list(expected.tokens)
    if logits is None or logits.shape[1:] != expected.logits.shape[1:]:
        return same, math.inf
    n = min(logits.shape[0], expected.logits.shape[0])
    if not same:
        pairs = zip(tokens, expected.tokens, strict=False)
        n = min(n, next((i + 1 for i, (a, b) in enumerate(pairs) if a != b), n))
    if n == 0:
        return same, math.inf
    return same, float((logits[:n] - expected.logits[:n]).abs().max())
