"""The collectives a CP group needs: a gather of one tensor from every rank, and the MIN
all-reduce of integers built on it.

Ranks agree on tree decisions (a backup completed, a prefetch usable) by taking the minimum of
what each rank can vouch for (contract 4); the reference engine merges per-rank attention
partials gathered the same way. Implementations: :class:`SoloGroup` (no context parallelism), :class:`LocalWorld`
(ranks as threads of one process, for tests) and :class:`GlooGroup` (``torch.distributed``).

A rank that does not take part within the group's timeout (dead, or stuck) makes the others
raise :class:`RankError` naming it, never hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, TypeVar

import torch

from kvtier.errors import ConfigError, RankError

T = TypeVar("T")


class Group(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank, on the CPU), by rank;
        every rank calls it the same number of times in the same order. Raises ``RankError``
        naming a rank that did not join (``what`` names the call in the message)."""
        ...

    def all_reduce_min(self, value: int) -> int:
        """The minimum of ``value`` over every rank (a gather of one integer)."""
        ...

    def all_reduce_min_many(self, values: list[int]) -> list[int]:
        """Elementwise minimum over ranks of ``values`` (the same length on every rank)."""
        ...


class _Reductions:
    """The reductions every group builds on its ``all_gather``."""

    def all_gather(
        self, tensor: torch.Tensor, what: str = "all_gather"
    ) -> list[torch.Tensor]:  # pragma: no cover - every group defines it
        raise NotImplementedError

    def all_reduce_min(self, value: int) -> int:
        return self.all_reduce_min_many([int(value)])[0]

    def all_reduce_min_many(self, values: list[int]) -> list[int]:
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        parts = self.all_gather(t, "all_reduce_min")
        return torch.stack(parts).min(0).values.tolist() if t.numel() else []


class SoloGroup(_Reductions):
    """A group of one: the minimum is the value."""

    rank = 0
    size = 1

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        return [tensor]

    def all_reduce_min(self, value: int) -> int:
        return int(value)

    def all_reduce_min_many(self, values: list[int]) -> list[int]:
        return [int(v) for v in values]


class LocalWorld:
    """``size`` ranks as threads of one process, meeting in rounds (the n-th call of each rank
    joins round n). For tests; :meth:`run` runs one function per rank."""

    def __init__(self, size: int, timeout: float = 5.0) -> None:
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._calls = [0] * size
        self._rounds: dict[int, dict[int, torch.Tensor]] = {}
        self._reads: dict[int, int] = {}

    def group(self, rank: int) -> LocalGroup:
        return LocalGroup(self, rank)

    def gather(self, rank: int, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        with self._cond:
            n = self._calls[rank]
            self._calls[rank] += 1
            slot = self._rounds.setdefault(n, {})
            slot[rank] = tensor.detach().cpu().clone()
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(slot) == self.size, self.timeout):
                missing = tuple(r for r in range(self.size) if r not in slot)
                raise RankError(
                    missing,
                    f"rank {rank}: rank(s) {list(missing)} did not join {what} "
                    f"#{n} within {self.timeout}s",
                )
            result = [slot[r].clone() for r in range(self.size)]
            # The last reader drops the round so a long run does not keep every round.
            self._reads[n] = self._reads.get(n, 0) + 1
            if self._reads[n] == self.size:
                del self._rounds[n], self._reads[n]
            return result

    def run(self, fn: Callable[[LocalGroup], T]) -> list[T]:
        """``fn(group)`` on every rank at once; the results by rank. The first rank's error
        (in rank order) is re-raised after every thread finished."""
        results: list[T | None] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.group(rank))
            except BaseException as e:  # handed to the caller below
                errors[rank] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
        return results  # type: ignore[return-value]


class LocalGroup(_Reductions):
    """One rank of a :class:`LocalWorld`."""

    __slots__ = ("world", "rank")

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.rank = rank

    @property
    def size(self) -> int:
        return self.world.size

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        return self.world.gather(self.rank, tensor, what)


class GlooGroup(_Reductions):
    """The default ``torch.distributed`` process group (gloo on CPU) as a :class:`Group`.

    The gather is a star through rank 0 made of point-to-point messages, each waited on with
    ``timeout``, so the rank that failed to answer is known and named (a plain collective only
    says it broke). Rank 0 collects every tensor, then sends each peer a status (the failed rank
    or -1) and the stacked tensors; a peer that hears nothing from rank 0 within two timeouts
    names rank 0. Rank 0 must host the rendezvous anyway (``tcp://`` init), so it is the hub.
    Sized for control decisions and the small attention partials of the CPU reference engine.
    """

    def __init__(self, timeout: float = 10.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                "GlooGroup: torch.distributed is not initialised; call "
                "GlooGroup.init(rank=..., size=..., init_method=...) first"
            )
        self._dist = dist
        self._rank = dist.get_rank()
        self._size = dist.get_world_size()
        self._timeout = timedelta(seconds=timeout)

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, timeout: float = 10.0) -> GlooGroup:
        """Initialise the default process group (gloo) and wrap it."""
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
        )
        return cls(timeout)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        t = tensor.detach().cpu().contiguous()
        if self._size == 1:
            return [t]
        if self._rank == 0:
            return self._collect(t, what)
        self._wait(self._dist.isend(t, dst=0), 0)
        failed = torch.zeros(1, dtype=torch.int64)
        # Rank 0 may arrive up to one timeout late and then wait one timeout on a lost peer
        # before it replies; waiting less would blame rank 0 for another rank's silence.
        self._wait(self._dist.irecv(failed, src=0), 0, self._timeout * 2)
        if int(failed[0]) >= 0:
            bad = int(failed[0])
            raise RankError(
                (bad,),
                f"rank {self._rank}: rank {bad} did not join {what} within "
                f"{self._timeout.total_seconds()}s (reported by rank 0)",
            )
        out = torch.empty((self._size, *t.shape), dtype=t.dtype)
        self._wait(self._dist.irecv(out, src=0), 0)
        return list(out.unbind(0))

    def _collect(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        parts, failed, cause = [t], -1, None
        for peer in range(1, self._size):
            buf = torch.empty_like(t)
            try:
                self._wait(self._dist.irecv(buf, src=peer), peer)
            except RankError as e:
                failed, cause = peer, e
                break
            parts.append(buf)
        status = torch.tensor([failed], dtype=torch.int64)
        for peer in range(1, self._size):
            if peer != failed:
                # Peers after the failed one have sent too (or will): they learn of the failure.
                self._wait(self._dist.isend(status, dst=peer), peer)
        if cause is not None:
            raise RankError(
                (failed,),
                f"rank 0: rank {failed} did not join {what} within "
                f"{self._timeout.total_seconds()}s ({cause.__cause__})",
            ) from cause
        out = torch.stack(parts)
        for peer in range(1, self._size):
            self._wait(self._dist.isend(out, dst=peer), peer)
        return parts

    def _wait(self, work: object, peer: int, timeout: timedelta | None = None) -> None:
        timeout = timeout or self._timeout
        try:
            work.wait(timeout)  # type: ignore[attr-defined]
        except RuntimeError as e:  # gloo: a timeout, or the peer's connection closed
            raise RankError(
                (peer,),
                f"rank {self._rank}: rank {peer} did not answer within "
                f"{timeout.total_seconds()}s: {e}",
            ) from e
