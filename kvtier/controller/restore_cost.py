"""Load or recompute (``CacheConfig.restore_policy='cost'``): whether bringing a matched prefix
up from the host tier or storage is faster than computing it again, from rates measured as
pages move and forwards run.

A prefix as ``match`` finds it, in the order it would be restored::

    [0, device)                 device tier: nothing to move
    [device, usable)            host tier: one host → device load
    [usable, usable + stored)   storage: a fetch into the host tier, then the same load

Restoring the front up to ``end`` and computing the rest again costs, in seconds on this rank::

    Ql + (host pages + fetched pages) x host page bytes / load rate      when end > device
    Qs + fetched pages x storage page bytes / storage read rate         when end > usable
    max(c, a x work(end, usable + stored - end))                        the forward after it

``work(d, n)`` is ``kvtier.tree.recompute``'s: ``n`` tokens after ``d`` cached ones, in units of
one token's linear work (attention makes a token after a long prefix dearer). The forward is
priced by a fit, not a rate (``PrefillFit``): it takes at least ``c``, the time to launch it,
and otherwise its work at ``a`` seconds a unit; every option pays one forward (a request
computes at least its last token), so restoring pays off only where the bytes move in less
than the work it saves beyond ``c``. A tokens-per-second rate cannot do this: measured on the
short forwards after a restore (16 tokens, say) it reads the launch time as a slow prefill and
prices a 32K-token recompute dozens of times too high; and a line ``c + a x work`` adds the
launch time to work the device does while the host is still launching, pricing a 1K-token
recompute on a GPU at twice its time.

``Ql`` is how long the loads already in flight keep the host → device path busy and ``Qs`` how
long the fetches and storage writes queued on the one storage I/O thread keep it busy (the
bytes queued ahead, at that path's rate). Each term is linear in the pages restored, so the
cheapest ``end`` is a tier boundary: ``device`` (recompute it all), ``usable`` (load the host
part, recompute what storage holds) or the whole prefix. Under ``prefetch_policy='timeout'`` a
request stops waiting for its fetch at the deadline, so a fetch that cannot land by then is
cut to the pages that can: the front fetched, the rest recomputed (a prefix is contiguous: the
front is always the part to restore). Models that resume only at checkpoints fetch all or
nothing. A tie restores: restored pages are device copies for later requests too.

Rates (:class:`Rate`) are exponentially weighted, from priors (``CacheConfig``) until the first
measurement: storage reads and writes from the ``storage_read_*``/``storage_write_*`` counters
(the I/O thread's own time per backend call), host → device loads timed here around the copy
alone (the ``load_seconds`` counter runs until the poll that sees a copy done, which is a
whole forward later on the reference engine). The prefill fit takes the forwards the engine
reports (``TieredCache.record_prefill``, each with the work of its items), weighted the same
way within each size class; its prior is ``a = 1 / restore_prefill_rate``, ``c = 0``.

A tier declined ``PROBE_AFTER`` times in a row has its next restore taken anyway (the front
that moves in the time its tokens take to compute, at least a page, where a fetch may stop at
any page): a rate measured slow once would otherwise never be measured again. A tier whose rate was never measured is probed at its first decline: its
prior is a guess, and with the forward's launch time priced a short prefix is never worth
restoring, so without a probe the rate of a fast tier would stay a guess for 32 requests. Under context parallelism every rank plans from its own rates and the group
takes the MIN of the planned ends (contract 4: the least any rank would restore); the probe
counts follow the agreed ends, so they agree too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.config import CacheConfig
from kvtier.errors import IntegrityError
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.tree.recompute import RecomputeWork

if TYPE_CHECKING:
    from kvtier.controller.core import Controller

PROBE_AFTER = 32
"""Restores of one tier declined in a row after which the next one is taken (a new sample)."""

PATHS = ("storage_read", "storage_write", "load", "prefill")
"""The rates a plan uses: bytes per second of storage reads, storage writes and host → device
loads (this rank's bytes), and tokens per second of prefill."""

STATS = {
    "storage_read": "restore_storage_read_bytes_per_s",
    "storage_write": "restore_storage_write_bytes_per_s",
    "load": "restore_load_bytes_per_s",
    "prefill": "restore_prefill_tokens_per_s",
}
"""The ``stats()`` key of each rate."""


@dataclass(slots=True)
class Rate:
    """An amount per second, exponentially weighted over measurements: each adds its amount and
    its seconds to sums that first decay by ``1 - weight``, so a measurement counts by the time
    it took (a quick miss barely moves the rate; a read that timed out with nothing pulls it
    down). ``prior`` until the first measurement; ``weight == 0`` keeps the prior."""

    prior: float
    """The rate before any measurement."""
    weight: float
    """Share of the sums a new measurement replaces, in ``[0, 1]``."""
    amount: float = 0.0
    """Decayed sum of the amounts measured."""
    seconds: float = 0.0
    """Decayed sum of the seconds they took."""
    measurements: int = 0
    """Measurements taken into the sums."""

    def observe(self, amount: float, seconds: float) -> None:
        """Take ``amount`` moved (or computed) in ``seconds`` into the rate. A measurement
        without time, or not a finite non-negative pair, is dropped."""
        if self.weight == 0 or not (
            math.isfinite(amount) and math.isfinite(seconds) and amount >= 0 and seconds > 0
        ):
            return
        keep = 1.0 - self.weight
        self.amount = keep * self.amount + amount
        self.seconds = keep * self.seconds + seconds
        self.measurements += 1

    @property
    def known(self) -> bool:
        """Whether the rate is measured: a measurement was taken, or ``weight == 0`` makes the
        prior the rate (set by hand)."""
        return self.measurements > 0 or self.weight == 0

    @property
    def value(self) -> float:
        """The current rate (the prior before the first measurement)."""
        return self.amount / self.seconds if self.seconds > 0 else self.prior


@dataclass(slots=True)
class _Bucket:
    """Forwards of one size class: decayed sums of their count, work and seconds."""

    n: float = 0.0
    work: float = 0.0
    seconds: float = 0.0


@dataclass(slots=True)
class PrefillFit:
    """Forward seconds as ``max(c, a x work)``, from the forwards measured.

    A forward runs on two clocks: the host launching its kernels (about the same whatever it
    computes) and the device computing them (proportional to the work). The device overlaps
    the host's launches, so a short forward takes the launch time ``c`` and a long one its
    work, ``a x work``; on a CPU the two add, and ``max`` is short by at most ``c``, which is
    small there. Measured on an H200 (Llama-8B-sized, eager): 16 tokens after a 1K prefix
    took as long as 1,024 tokens cold, about 30 ms, while 4,096 took 119 ms; a line through
    such points prices the 1K recompute at twice its time.

    Forwards are kept in size classes (a power of two of work each), every class an
    exponentially weighted mean of its forwards (each decays the class's sums by ``1 -
    weight``, as :class:`Rate`). ``a`` is the least seconds per work unit of any class (the
    longest forwards, where launching no longer shows), ``c`` the least seconds of any class
    (the shortest). From one class only the fit is a rate through the origin (``c = 0``):
    nothing tells the launch time from the work. ``prior`` until the first measurement.

    The first forward of each class is counted, not timed: it pays for one-time set-up
    (library handles, kernels compiled or tuned for its shapes, workspaces allocated), seconds
    of it on a GPU, which would price every recompute of its size dozens of times too high
    until decayed."""

    prior: float
    """Work units per second before any measurement: ``a = 1 / prior``, ``c = 0``."""
    weight: float
    """Share of a class's sums a new measurement replaces, in ``[0, 1]``."""
    classes: dict[int, _Bucket] = field(default_factory=dict)
    """Size class (``floor(log2(work))``) → its decayed sums."""
    seen: set[int] = field(default_factory=set)
    """Classes whose first forward went by (untimed)."""
    measurements: int = 0
    """Measurements taken."""

    def observe(self, work: float, seconds: float) -> None:
        """A forward did ``work`` in ``seconds``; a measurement without time or work, or not
        finite, is dropped, and so is the first of each size class."""
        if self.weight == 0 or not (
            math.isfinite(work) and math.isfinite(seconds) and work > 0 and seconds > 0
        ):
            return
        size = math.floor(math.log2(work))
        if size not in self.seen:
            self.seen.add(size)
            return
        b = self.classes.setdefault(size, _Bucket())
        keep = 1.0 - self.weight
        b.n = keep * b.n + 1.0
        b.work = keep * b.work + work
        b.seconds = keep * b.seconds + seconds
        self.measurements += 1

    @property
    def known(self) -> bool:
        """Whether the fit is measured (or ``weight == 0`` makes the prior the fit)."""
        return self.measurements > 0 or self.weight == 0

    def coefficients(self) -> tuple[float, float]:
        """``(c, a)``: the launch time of a forward, seconds per work unit."""
        if not self.classes:
            return 0.0, 1.0 / self.prior
        a = min(b.seconds / b.work for b in self.classes.values())
        if len(self.classes) == 1:
            return 0.0, a
        return min(b.seconds / b.n for b in self.classes.values()), a

    def seconds(self, work: float) -> float:
        """A forward of ``work``: ``max(c, a x work)``."""
        c, a = self.coefficients()
        return max(c, a * work)

    @property
    def value(self) -> float:
        """Work units per second at the margin (``1 / a``)."""
        return 1.0 / self.coefficients()[1]


@dataclass(frozen=True, slots=True)
class Prefix:
    """A matched prefix as a plan sees it (token positions from ``match``)."""

    device: int
    """Tokens ``[0, device)`` are on device."""
    usable: int
    """Tokens ``[device, usable)`` are in the host tier."""
    stored: int
    """Tokens after ``usable`` that a fetch of every stored page makes usable."""
    stored_pages: int
    """Storage pages of that fetch."""
    page_size: int
    """Tokens per tree page."""
    host_page_bytes: float
    """Bytes one page's load moves on this rank."""
    storage_page_bytes: float
    """Bytes one page's fetch reads on this rank."""
    cuttable: bool = True
    """Whether a fetch may stop after any page (no checkpoint to resume at is needed)."""

    @property
    def end(self) -> int:
        """Where the whole prefix ends."""
        return self.usable + self.stored


@dataclass(frozen=True, slots=True)
class Queued:
    """Bytes already queued ahead on each path (this rank's)."""

    load_bytes: float = 0.0
    """Host → device loads in flight."""
    read_bytes: float = 0.0
    """Storage pages open fetches have still to read."""
    write_bytes: float = 0.0
    """Storage writes in flight on the same I/O thread."""


class CostModel:
    """The rates of the paths a restore takes and the prefill rate, and the plan of one prefix
    from them (arithmetic only: a test gives it explicit rates, ``weight=0`` keeps them)."""

    def __init__(
        self,
        storage_read: float,
        load: float,
        prefill: float,
        storage_write: float | None = None,
        weight: float = 0.0,
        work: RecomputeWork | None = None,
    ) -> None:
        """Priors in bytes per second (``storage_write`` defaults to ``storage_read``) and
        work units (tokens) per second; ``weight`` as for :class:`Rate`; ``work`` prices
        recomputed tokens by the prefix they follow (``None``: a token is a work unit
        wherever it stands)."""
        priors = {
            "storage_read": storage_read,
            "storage_write": storage_read if storage_write is None else storage_write,
            "load": load,
            "prefill": prefill,
        }
        for name, prior in priors.items():
            if not (math.isfinite(prior) and prior > 0):
                raise IntegrityError(f"cost model: the {name} prior must be positive, got {prior}")
        self.rates: dict[str, Rate | PrefillFit] = {
            n: Rate(float(p), float(weight)) for n, p in priors.items() if n != "prefill"
        }
        self.rates["prefill"] = PrefillFit(float(prefill), float(weight))
        self.work = work

    @classmethod
    def from_config(cls, config: CacheConfig, work: RecomputeWork | None = None) -> CostModel:
        """The priors and weight of ``config``; ``work`` as for the constructor."""
        return cls(
            config.restore_storage_rate,
            config.restore_load_rate,
            config.restore_prefill_rate,
            weight=config.restore_rate_weight,
            work=work,
        )

    def observe(self, path: str, amount: float, seconds: float) -> None:
        """``amount`` (bytes; work units of one forward for ``prefill``) went through ``path``
        in ``seconds``."""
        self._rate(path).observe(amount, seconds)

    def work_of(self, depth: int, tokens: int) -> float:
        """Work units of ``tokens`` computed after ``depth`` cached ones."""
        return self.work.tokens(depth, tokens) if self.work is not None else float(tokens)

    def prefill_fit(self) -> tuple[float, float]:
        """``(c, a)`` of the prefill fit (``PrefillFit.coefficients``)."""
        return self._fit().coefficients()

    def forward_seconds(self, work: float) -> float:
        """How long the forward computing ``work`` units takes (``PrefillFit.seconds``: its
        launch time included, which every plan pays at least once)."""
        return self._fit().seconds(work)

    def _fit(self) -> PrefillFit:
        fit = self.rates["prefill"]
        if not isinstance(fit, PrefillFit):
            raise IntegrityError("cost model: the prefill path is not a fit")
        return fit

    def rate(self, path: str) -> float:
        """``path``'s current rate."""
        return self._rate(path).value

    def known(self, path: str) -> bool:
        """Whether ``path``'s rate is measured (``Rate.known``)."""
        return self._rate(path).known

    def seconds(self, path: str, amount: float) -> float:
        """How long ``amount`` takes through ``path`` (infinite at a rate of zero; for
        ``prefill``, work units at the margin: without the forward's own cost)."""
        if amount <= 0:
            return 0.0
        rate = self.rate(path)
        return amount / rate if rate > 0 else math.inf

    def _rate(self, path: str) -> Rate | PrefillFit:
        rate = self.rates.get(path)
        if rate is None:
            raise IntegrityError(f"cost model: no path {path!r} (one of {', '.join(PATHS)})")
        return rate

    def plan(self, p: Prefix, queued: Queued = Queued(), deadline: float | None = None) -> int:
        """Where the front of ``p`` that is cheapest to restore ends (the rest is recomputed):
        ``p.device``, ``p.usable``, ``p.end``, or with a fetch ``deadline`` (seconds a request
        waits for it) ``p.usable`` plus the whole pages that land by then (see the module)."""
        ps = p.page_size
        host_pages = -(-(p.usable - p.device) // ps)
        q_load = self.seconds("load", queued.load_bytes)
        q_store = self.seconds("storage_read", queued.read_bytes)
        q_store += self.seconds("storage_write", queued.write_bytes)

        def cost(end: int, fetched: int) -> float:
            t = self.forward_seconds(self.work_of(end, p.end - end))
            if end > p.device:
                t += q_load + self.seconds("load", (host_pages + fetched) * p.host_page_bytes)
            if fetched:
                t += q_store + self.seconds("storage_read", fetched * p.storage_page_bytes)
            return t

        candidates = [(p.device, 0)]
        if p.usable > p.device:
            candidates.append((p.usable, 0))
        fetch = p.stored_pages
        if fetch and deadline is not None and p.cuttable:
            per_page = self.seconds("storage_read", p.storage_page_bytes)
            room = deadline - q_store
            if per_page > 0:
                fetch = min(fetch, max(0, math.floor(room / per_page)) if room > 0 else 0)
        if fetch:
            end = p.end if fetch == p.stored_pages else p.usable + fetch * ps
            candidates.append((end, fetch))
        best, best_cost = candidates[-1][0], cost(*candidates[-1])
        for end, fetched in reversed(candidates[:-1]):  # deeper first: a tie restores
            c = cost(end, fetched)
            if c < best_cost:
                best, best_cost = end, c
        return best


@dataclass(slots=True, eq=False)
class _LoadClock:
    """One load being timed: the flights before it, and its start (a CUDA event on the load
    stream, or the host clock where the copy is synchronous)."""

    flights: int
    started: float = 0.0
    event: torch.cuda.Event | None = None


@dataclass(slots=True, eq=False)
class _Timed:
    """A CUDA load whose copy time is read once its end event completed."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    nbytes: int


_IO_COUNTERS = (
    "storage_read_bytes",
    "storage_read_seconds",
    "storage_write_bytes",
    "storage_write_seconds",
)
"""The counters the storage rates are measured from, in ``RestoreCost._io``'s order."""


@dataclass(slots=True)
class _Counted:
    """Storage I/O counted but not yet taken into a rate: a backend call's bytes are counted as
    they arrive, its seconds when it returns."""

    seen_bytes: float = 0.0
    seen_seconds: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0


class RestoreCost:
    """The cost model of one cache: what is queued on each path, the load clock, the
    measurements at each poll, the agreement of a CP group and the probes.

    With ``restore_policy='always'`` rates are still measured and reported; only
    :meth:`restore_end` is not asked."""

    def __init__(
        self,
        config: CacheConfig,
        controller: Controller,
        group: Group,
        page_size: int,
        metrics: Metrics,
        model: CostModel | None = None,
    ) -> None:
        self.on = config.restore_policy == "cost"
        """Whether restores are decided by cost (``restore_policy='cost'``)."""
        self.model = model or CostModel.from_config(config)
        self.config = config
        self.controller = controller
        self.group = group
        self.page_size = page_size
        self.metrics = metrics
        self.declined = {"host": 0, "storage": 0}
        """Restores of each tier declined in a row (agreed ends: the same on every rank)."""
        self._timed: list[_Timed] = []
        self._io = {"storage_read": _Counted(), "storage_write": _Counted()}

    # ---- the decision ---------------------------------------------------------------------
    def restore_end(
        self, device: int, usable: int, stored: int, stored_pages: int, cuttable: bool
    ) -> int:
        """Where the restored front of a prefix ends (``CostModel.plan`` from this rank's
        rates and queues, MIN over a CP group, then the probes). Every rank of a group calls
        it at the same point with the same arguments."""
        host = self.controller.host
        lanes = max(1, self.config.cp_size)
        io = self.controller.io
        p = Prefix(
            device,
            usable,
            stored,
            stored_pages,
            self.page_size,
            host.page_bytes / lanes if host is not None else 0.0,
            io.pages.nbytes / lanes if io is not None else 0.0,
            cuttable,
        )
        policy = self.config.prefetch_policy
        deadline = self.config.prefetch_timeout_s if policy == "timeout" else None
        end = self.model.plan(p, self._queued(p), deadline)
        if self.group.size > 1:
            end = self.group.all_reduce_min(end)
        return self._probe(p, end)

    def _probe(self, p: Prefix, end: int) -> int:
        """``end``, or one tier deeper when that tier was declined ``PROBE_AFTER`` times in a
        row (its rate is measured again), or declined at all while its rate was never measured
        (a prior decides nothing for good). A probe takes the front of the tier that, at the
        current rates, moves in no longer than computing the tier's tokens would take, and
        at least a page (:meth:`_probe_pages`): one page measures mostly a call's own
        overhead, and a rate read from it would keep the tier declined."""
        ps = p.page_size
        host_after = PROBE_AFTER if self.model.known("load") else 1
        storage_after = PROBE_AFTER if self.model.known("storage_read") else 1
        if p.usable > p.device:
            if end < p.usable:
                self.declined["host"] += 1
                if self.declined["host"] >= host_after:
                    self.declined["host"] = 0
                    pages = -(-(p.usable - p.device) // ps)
                    per_page = self.model.seconds("load", p.host_page_bytes)
                    n = self._probe_pages(p.device, p.usable, pages, per_page)
                    end = min(p.usable, p.device + n * ps) if p.cuttable else p.usable
            else:
                self.declined["host"] = 0
        if p.stored_pages and end >= p.usable:
            if end == p.usable:
                self.declined["storage"] += 1
                if self.declined["storage"] >= storage_after:
                    self.declined["storage"] = 0
                    per_page = self.model.seconds("storage_read", p.storage_page_bytes)
                    per_page += self.model.seconds("load", p.host_page_bytes)
                    n = self._probe_pages(p.usable, p.end, p.stored_pages, per_page)
                    end = p.usable + n * ps if p.cuttable and n < p.stored_pages else p.end
            else:
                self.declined["storage"] = 0
        return end

    def _probe_pages(self, start: int, stop: int, pages: int, per_page: float) -> int:
        """How many of a tier's ``pages`` (tokens ``[start, stop)``) a probe restores: those
        that move, at ``per_page`` seconds each, in the time computing the tokens takes."""
        budget = self.model.forward_seconds(self.model.work_of(start, stop - start))
        fit = pages if per_page <= 0 else math.floor(budget / per_page)
        return max(1, min(pages, fit))

    def _queued(self, p: Prefix) -> Queued:
        """Bytes queued ahead on each path now: loads in flight (CUDA; a CPU copy is done when
        issued), pages open fetches have still to read, storage writes in flight."""
        ctl = self.controller
        load = 0.0
        if ctl.mover is not None and ctl.mover.cuda:
            load = float(sum(f.op.nbytes for f in ctl.loads.flights))
        read = write = 0.0
        if ctl.prefetcher is not None:
            read = ctl.prefetcher.queued_pages() * p.storage_page_bytes
        if ctl.io is not None:
            pages = sum(len(sp.part) for sp in ctl.io.pinned() if isinstance(sp.part, range))
            write = pages * p.storage_page_bytes
        return Queued(load, read, write)

    # ---- measurements ---------------------------------------------------------------------
    def start_load(self) -> _LoadClock:
        """Before a host → device load: start its clock (on CUDA an event on the load stream
        once it caught up with the compute stream, as the copy itself does first)."""
        ctl = self.controller
        clock = _LoadClock(len(ctl.loads.flights))
        mover = ctl.mover
        if mover is not None and mover.cuda and mover.load_stream is not None:
            stream = mover.load_stream
            stream.wait_stream(torch.cuda.current_stream(mover.dev.device))
            clock.event = torch.cuda.Event(enable_timing=True)
            clock.event.record(stream)
        else:
            clock.started = time.perf_counter()
        return clock

    def end_load(self, clock: _LoadClock) -> None:
        """After the load: its bytes and time are a measurement of the load rate (on CUDA
        once its copy completed, read at a later :meth:`poll`)."""
        ctl = self.controller
        if len(ctl.loads.flights) <= clock.flights:
            return  # nothing was copied
        nbytes = ctl.loads.flights[-1].op.nbytes
        if nbytes <= 0:
            return
        if clock.event is None:
            self.model.observe("load", nbytes, time.perf_counter() - clock.started)
            return
        mover = ctl.mover
        if mover is None or mover.load_stream is None:
            raise IntegrityError("a CUDA load clock without the mover's load stream")
        end = torch.cuda.Event(enable_timing=True)
        end.record(mover.load_stream)
        self._timed.append(_Timed(clock.event, end, nbytes))

    def prefill(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A forward computed, for each of its items, ``n`` tokens after ``d`` cached ones
        (``chunks``: ``(d, n)`` pairs) in ``seconds``."""
        self.model.observe("prefill", sum(self.model.work_of(d, n) for d, n in chunks), seconds)

    def poll(self) -> None:
        """Take the loads whose copy completed and the storage I/O counted since the last poll
        into the rates. Never blocks."""
        while self._timed and self._timed[0].end.query():
            t = self._timed.pop(0)
            self.model.observe("load", t.nbytes, t.start.elapsed_time(t.end) / 1e3)
        counts = self.metrics.values(_IO_COUNTERS)
        for i, (path, c) in enumerate(self._io.items()):
            b, s = counts[2 * i], counts[2 * i + 1]
            c.bytes += b - c.seen_bytes
            c.seconds += s - c.seen_seconds
            c.seen_bytes, c.seen_seconds = b, s
            if c.seconds > 0:  # a call returned: its bytes came before its seconds
                self.model.observe(path, c.bytes, c.seconds)
                c.bytes = c.seconds = 0.0

    def stats(self) -> dict[str, float]:
        """The current rates (``STATS``; the prefill's is work units per second at the margin)
        and the prefill fit's seconds per forward (``restore_prefill_seconds_per_forward``)."""
        out = {key: self.model.rate(path) for path, key in STATS.items()}
        out["restore_prefill_seconds_per_forward"] = self.model.prefill_fit()[0]
        return out
