"""What the requests in flight on an instance cost a new one, by where each of them is, as the
router measures it on the answers it relays.

A request ahead that is still in its prefill holds the engine for some of that prefill (a new
request waits for the step under way), while one that already streams output only shares the
decode steps: on the same instances, the first cost about three times the second in the median
and far more in the tail (``results/route/README.md``). So the router prices the requests ahead
by their phase::

    load = prefill_cost * (requests ahead in their prefill)
         + decode_cost  * (requests ahead that stream output)

A request counts as in its prefill until its first output passed the router (one answered
whole, not streamed, until its answer: the router cannot see its phase). (The rest of its
predicted prefill would be the natural price, but behind one request in its prefill the
excess measured through the router levels off past about 10 ms of it: ``results/route``'s
``pooled.py`` prints it by quartile.)

Each streamed answer that was priced by its prefill gives one sample when it ends: the requests
ahead of it when it was sent (how many were in their prefill, how many streamed), its excess
(its time to first output less its own predicted prefill) and its duration. Over the last
``window`` samples, with ``idle`` the median excess of the samples that had nothing ahead (what
every request pays: the proxy, the engine's handoff, a prediction's bias)::

    decode_cost  = sum(excess - idle) / sum(streaming ahead)
                   over the samples with requests ahead, none of them in its prefill
    prefill_cost = sum(excess - idle - decode_cost * streaming) / sum(prefilling)
                   over the samples with some request ahead in its prefill

each never below 0. The costs are ratios of sums, not a least-squares fit, for the reason
``kvtier.server.request_cost`` gives: the first request ahead costs the most, so a slope fitted
on a busy instance comes out low and draws yet more load to it. The duration is the mean time
from sending to the end over the window (what ``Rates.request_duration_s`` prices).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Ahead", "LoadCost"]


@dataclass(frozen=True, slots=True)
class Ahead:
    """The requests in flight on an instance when a new one was sent there."""

    prefilling: int = 0
    """Those whose first output had not passed yet."""
    decoding: int = 0
    """Those that streamed output already."""

    @property
    def count(self) -> int:
        return self.prefilling + self.decoding


class LoadCost:
    """The fitted cost of a request ahead in its prefill and of one streaming output, and the
    mean duration of a request, on one instance (module docstring). Fed and read on the
    router's event loop only.

    ``window``: samples kept (the newest). ``min_samples``: fewer give no estimate.
    """

    def __init__(self, window: int = 256, min_samples: int = 16) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 2 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [2, window], got {min_samples}")
        self.min_samples = min_samples
        self._samples: deque[tuple[Ahead, float, float]] = deque(maxlen=window)
        """``(ahead, excess_s, held_s)`` per finished request, oldest first."""
        self._fitted: tuple[float | None, float | None, float | None] | None = None
        """``(prefill, decode, duration)`` for the samples as they are (``None``: not yet
        computed since the last sample): every choice reads them, a sample comes once per
        answer."""

    def observe(self, ahead: Ahead, excess_s: float, held_s: float) -> None:
        """One finished request: ``ahead`` when it was sent, its first output ``excess_s``
        later than its own prefill predicts, ``held_s`` from sending to its end."""
        if ahead.prefilling < 0 or ahead.decoding < 0:
            raise ValueError(f"ahead must count no negative requests, got {ahead}")
        if not held_s >= 0:
            raise ValueError(f"held_s must be >= 0, got {held_s}")
        self._samples.append((ahead, excess_s, held_s))
        self._fitted = None

    def __len__(self) -> int:
        return len(self._samples)

    def prefill_cost_s(self) -> float | None:
        """Seconds a request ahead in its prefill adds; ``None`` with fewer than
        ``min_samples`` samples or none that had such a request ahead."""
        return self._fit()[0]

    def decode_cost_s(self) -> float | None:
        """Seconds a request ahead that streams output adds; ``None`` with fewer than
        ``min_samples`` samples or none that had only such requests ahead."""
        return self._fit()[1]

    def duration_s(self) -> float | None:
        """The mean of the window's ``held_s``; ``None`` with fewer than ``min_samples``."""
        return self._fit()[2]

    def _fit(self) -> tuple[float | None, float | None, float | None]:
        if self._fitted is not None:
            return self._fitted
        samples = self._samples
        if len(samples) < self.min_samples:
            return None, None, None
        # one pass: samples with only streaming requests ahead (``only``), with some request
        # ahead in its prefill (``some``), with none (their excesses, for the median)
        idle_excess: list[float] = []
        held = only_excess = some_excess = 0.0
        only_samples = only_ahead = some_samples = some_ahead = some_decoding = 0
        for a, e, h in samples:
            held += h
            if a.prefilling:
                some_samples += 1
                some_excess += e
                some_ahead += a.prefilling
                some_decoding += a.decoding
            elif a.decoding:
                only_samples += 1
                only_excess += e
                only_ahead += a.decoding
            else:
                idle_excess.append(e)
        idle = statistics.median(idle_excess) if idle_excess else 0.0
        decode = None
        if only_ahead:
            decode = max((only_excess - idle * only_samples) / only_ahead, 0.0)
        prefill = None
        if some_ahead:
            rest = some_excess - idle * some_samples - (decode or 0.0) * some_decoding
            prefill = max(rest / some_ahead, 0.0)
        duration = held / len(samples)
        self._fitted = (prefill, decode, duration)
        return self._fitted
