"""What the requests in flight cost a new one, as an instance measures it.

``kvtier route`` prices an instance by the prefill its cache predicts plus
``in_flight * request_cost`` and, where the new request must wait for room in the device pool,
a wait priced by ``request_duration`` (``kvtier.route.scorer``). Both depend on the instance (its
model, its batch, its CPU or GPU) and on the workload (how long requests run), so fixed priors
misprice them: too high and the router moves conversations away from the instance holding their
KV on host to an idle one that must read it from storage; too low and it piles them onto one
instance, where they queue.

Each finished request gives one sample: how many requests were ahead of it when it reached the
server (handed to the engine thread, waiting or running), and its excess, the time from then
to its first token less the prefill its own hits predict at the instance's measured rates. The
time counts from its arrival, not from when the engine took it: the engine takes new requests
between steps, and the wait for the step under way is the first thing a request ahead costs. Over the last ``window`` samples, the cost is
the excess of the requests that had some ahead, less the median excess of those that had none
(what every request pays: the handoff to the engine, a prediction's bias), per request ahead::

    cost = sum(excess - idle_excess  for samples with ahead > 0) / sum(ahead)

The idle baseline is a median, not a mean: the first requests an instance serves (kernels
warming up, its storage client's first reads) come slow and mostly find nothing ahead, and a
busy instance has few idle samples besides them, so a mean baseline would take those outliers
for what every request pays, price the busy instance's load low and draw yet more to it. The
requests ahead are summed in full: a slow first token behind a long prefill is the cost that
the router's choice avoids.

Not a least-squares slope: the first request ahead costs the most (a new request waits for the
step under way, whatever its batch), the next ones less, so the slope of a busy instance, which
rarely sees 0 ahead, would come out low and draw yet more load to it.

The duration is the mean, over the same window, of the time each request held its pages as if
it had been admitted at once: its predicted prefill plus the time from its first token to its
end.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["RequestCost", "predicted_prefill_s"]


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


class RequestCost:
    """The fitted seconds each request ahead adds to a new request's first token, and the mean
    duration of a request (module docstring). Not thread-safe: one thread feeds and reads it
    (an instance's engine thread; ``kvtier route``'s event loop, which measures the same on
    the answers it relays, ``Instance.observed``).

    ``window``: samples kept (the newest). ``min_samples``: fewer give no estimate.
    """

    def __init__(self, window: int = 256, min_samples: int = 16) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 2 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [2, window], got {min_samples}")
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float, float]] = deque(maxlen=window)
        """``(ahead, excess_s, held_s)`` per finished request, oldest first."""

    def observe(self, ahead: int, excess_s: float, held_s: float) -> None:
        """One finished request: ``ahead`` requests were in the server when it arrived, its
        first token came ``excess_s`` seconds later than its own prefill predicts, and it held
        its pages ``held_s`` seconds (its predicted prefill, then first token to end)."""
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        if not held_s >= 0:
            raise ValueError(f"held_s must be >= 0, got {held_s}")
        self._samples.append((ahead, excess_s, held_s))

    def duration_s(self) -> float | None:
        """The mean of the window's ``held_s``; ``None`` with fewer than ``min_samples``."""
        if len(self._samples) < self.min_samples:
            return None
        return sum(h for _, _, h in self._samples) / len(self._samples)

    def seconds(self) -> float | None:
        """The cost per request ahead (module docstring; never below 0, the idle excess 0
        without idle samples); ``None`` with fewer than ``min_samples`` samples or none that
        had a request ahead."""
        if len(self._samples) < self.min_samples:
            return None
        idle = [e for k, e, _ in self._samples if k == 0]
        busy = [(k, e) for k, e, _ in self._samples if k > 0]
        if not busy:
            return None
        base = statistics.median(idle) if idle else 0.0
        return max(sum(e - base for _, e in busy) / sum(k for k, _ in busy), 0.0)

    def __len__(self) -> int:
        return len(self._samples)
