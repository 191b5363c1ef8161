"""Completion delays for tests (``CacheConfig.test_completion_polls``): every copy and every
storage I/O completes, as the controller's polls see it, only after a random number of polls
drawn per rank, so the ranks of a CP group see completions at different times (as real
asynchronous copies make them) and an agreement that is not enforced shows. Never on by
default; nothing outside tests should set it.
"""

from __future__ import annotations

import random


class CompletionDelays:
    """Draws how many completion queries answer "not yet" before an op is seen done: uniform
    in ``[0, polls]`` from ``random.Random(seed)`` (the caller mixes the rank into ``seed``).
    ``polls == 0``: no delay, and :meth:`draw` answers -1 (off) without drawing."""

    def __init__(self, polls: int = 0, seed: int | str = 0) -> None:
        self.polls = polls
        self._rng = random.Random(seed)

    @property
    def on(self) -> bool:
        return self.polls > 0

    def draw(self) -> int:
        """Queries an op stays unseen (-1 when delays are off)."""
        return self._rng.randint(0, self.polls) if self.polls > 0 else -1
