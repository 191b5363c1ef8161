"""What the requests in flight on an instance cost a new one, by where each of them is, and how
long a request lasts: measured by each ``kvtier serve`` instance on the requests it serves (and
reported in ``/health``), and by ``kvtier route`` on the answers it relays.

``kvtier route`` prices an instance by the prefill its cache predicts plus the load below and,
where the new request must wait for room in the device pool, a wait priced by the duration
(``kvtier.route.scorer``). Both depend on the instance (its model, its batch, its CPU or GPU)
and on the workload (how long requests run), so fixed priors misprice them: too high and the
router moves conversations away from the instance holding their KV on host to an idle one that
must read it from storage; too low and it piles them onto one instance, where they queue.

A request ahead that is still in its prefill holds the engine for some of that prefill (a new
request waits for the step under way), while one that already streams output only shares the
decode steps: on the same instances, the first cost about three times the second in the median
and far more in the tail (``results/route/README.md``). So a request ahead is priced by its
phase::

    load = prefill_cost * (requests ahead in their prefill)
         + decode_cost  * (requests ahead that stream output)

For the router, a request is in its prefill until its first output passed it (one answered
whole, not streamed, until its answer: the router cannot see its phase); for an instance, until
the engine ran its prefill (queued to the engine or waiting there, against running). (The rest
of its predicted prefill would be the natural price, but behind one request in its prefill the
excess measured through the router levels off past about 10 ms of it: ``results/route``'s
``pooled.py`` prints it by quartile.)

Each finished request gives one sample: the requests ahead of it when it was sent (the router)
or reached the server (an instance; the wait for the step under way is then the first thing a
request ahead costs), how many were in their prefill and how many streamed; its excess, the
time from then to its first output less the prefill its own hits predict at the instance's
measured rates (``predicted_prefill_s``); and its duration. Over the last ``window`` samples,
with ``idle`` the median excess of the samples that had nothing ahead (what every request pays:
the handoff to the engine, the proxy, a prediction's bias)::

    decode_cost  = sum(excess - idle) / sum(streaming ahead)
                   over the samples with requests ahead, none of them in its prefill
    prefill_cost = sum(excess - idle - decode_cost * streaming) / sum(prefilling)
                   over the samples with some request ahead in its prefill

each never below 0. The idle baseline is a median, not a mean: the first requests an instance
serves (kernels warming up, its storage client's first reads) come slow and mostly find nothing
ahead, and a busy instance has few idle samples besides them, so a mean baseline would take
those outliers for what every request pays, price the busy instance's load low and draw yet
more to it. The costs are ratios of sums, not a least-squares slope: the first request ahead
costs the most (a new request waits for the step under way, whatever its batch), the next ones
less, so the slope of a busy instance, which rarely sees 0 ahead, would come out low too. The
duration is the mean over the window of the time a request held its pages: from sending to its
end (the router), or its predicted prefill plus the time from its first token to its end, as
if admitted at once (an instance).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Ahead", "LoadCost", "predicted_prefill_s"]


def predicted_prefill_s(recomputed: int, host: int, storage: int, rates: dict[str, float]) -> float:
    """Seconds a request's own prefill takes at ``rates`` (``EngineLoop._rates``: tokens per
    second; a tier it does not list costs nothing): its computed tokens, its host and storage
    hits loaded from the host tier, its storage hits read first. The same terms as the
    router's expected time, without the load."""
    seconds = recomputed / rates["prefill_tokens_per_s"]
    if "host_tokens_per_s" in rates:
        seconds += (host + storage) / rates["host_tokens_per_s"]
    if "storage_tokens_per_s" in rates:
        seconds += storage / rates["storage_tokens_per_s"]
    return seconds


@dataclass(frozen=True, slots=True)
class Ahead:
    """The requests in flight on an instance when a new one was sent there (reached it)."""

    prefilling: int = 0
    """Those still in their prefill (module docstring)."""
    decoding: int = 0
    """Those that streamed output already (running, for an instance)."""

    @property
    def count(self) -> int:
        return self.prefilling + self.decoding


class LoadCost:
    """The fitted cost of a request ahead in its prefill and of one streaming output, and the
    mean duration of a request, on one instance (module docstring). Not thread-safe: one
    thread feeds and reads it (an instance's engine thread; the router's event loop).

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
