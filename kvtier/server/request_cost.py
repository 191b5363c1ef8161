"""What each request in flight costs a new one, as an instance measures it.

``kvtier route`` prices an instance by the prefill its cache predicts plus
``in_flight * request_cost`` (``kvtier.route.scorer``). The second term depends on the
instance (its model, its batch, its CPU or GPU) and on the workload (how long requests run),
so a fixed prior misprices it: too high and the router moves conversations away from the
instance holding their KV on host to an idle one that must read it from storage; too low and it
piles them onto one instance.

Each finished request gives one sample: how many requests were ahead of it when the engine took
it (waiting or running), and its excess, the time to its first token less the prefill its own
hits predict at the instance's measured rates. The cost is the slope of the least-squares line
of excess on requests ahead over the last ``window`` samples: the intercept takes what every
request pays (the handoff to the engine, a prediction's bias), so only the part that grows with
the load is charged per request in flight.
"""

from __future__ import annotations

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
    """The fitted seconds each request ahead adds to a new request's first token (module
    docstring). Not thread-safe: the engine thread feeds and reads it.

    ``window``: samples kept (the newest). ``min_samples``: fewer give no estimate.
    """

    def __init__(self, window: int = 256, min_samples: int = 16) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 2 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [2, window], got {min_samples}")
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, ahead: int, excess_s: float) -> None:
        """One finished request: ``ahead`` requests were in the engine when it was taken, and
        its first token came ``excess_s`` seconds later than its own prefill predicts."""
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self._samples.append((ahead, excess_s))

    def seconds(self) -> float | None:
        """The slope (never below 0); ``None`` with fewer than ``min_samples`` samples or
        while every sample had the same number of requests ahead (no slope to fit)."""
        n = len(self._samples)
        if n < self.min_samples:
            return None
        mean_k = sum(k for k, _ in self._samples) / n
        mean_e = sum(e for _, e in self._samples) / n
        var = sum((k - mean_k) ** 2 for k, _ in self._samples)
        if var == 0:
            return None
        cov = sum((k - mean_k) * (e - mean_e) for k, e in self._samples)
        return max(cov / var, 0.0)

    def __len__(self) -> int:
        return len(self._samples)
