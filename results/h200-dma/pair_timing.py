"""Timing shared by the both-directions probes: the best wall time of a few runs, each after a
device synchronise, and two contiguous copies at once (the both-ways baseline)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn`` (after one untimed run), each timed
    from a device synchronise to the next."""
    fn()
    best = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    return min(best)


class ContiguousPair:
    """Two device buffers and two pinned host buffers of ``nbytes`` each (``torch.empty_like``
    would drop the pinning), copied one way or both ways at once."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.side = torch.cuda.Stream(device)

    def d2h(self) -> None:
        self.host[0].copy_(self.dev[0], non_blocking=True)

    def both(self) -> None:
        """A device → host copy on the current stream and a host → device one beside it."""
        self.side.wait_stream(torch.cuda.current_stream())
        self.host[1].copy_(self.dev[1], non_blocking=True)
        with torch.cuda.stream(self.side):
            self.dev[0].copy_(self.host[0], non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.side)


class ExchangeCase:
    """A 1 GiB exchange of one family at one page size: pools (page-first pinned host of four
    times the pages), a mover, device pages ``src`` (backed up into host pages ``ho``) and
    ``dst`` (loaded from host pages ``hp``), host pages churned as a busy tier hands them out."""

    def __init__(self, family: str, page_size: int, device: torch.device) -> None:
        from kvtier.bench.host_runs import churned
        from kvtier.bench.pool_sets import family_pool_set
        from kvtier.pools.device import DevicePool
        from kvtier.pools.host import HostPool
        from kvtier.pools.spec import tree_page_size
        from kvtier.transfer.mover import Mover

        specs = family_pool_set(family, torch.bfloat16)
        ps = tree_page_size(page_size, specs)
        self.page_bytes = sum(s.page_bytes(ps) for s in specs)
        self.pages = n = (1 << 30) // self.page_bytes
        dpool = DevicePool(specs, 2 * n, ps, device)
        hpool = HostPool(specs, 4 * n, ps, layout="page_first", pin=True)
        perm = torch.randperm(2 * n)
        self.src, self.dst = perm[:n], perm[n:]
        self.hp, self.ho = churned(4 * n, [n, n], ps, seed=1)
        self.mover = Mover(dpool, hpool)

    @property
    def nbytes(self) -> int:
        """Bytes of one direction."""
        return self.pages * self.page_bytes

    def exchange(self) -> None:
        """Both directions by ``Mover.exchange``, waited for."""
        back, load = self.mover.exchange((self.src, self.ho), (self.hp, self.dst))
        back.wait()
        load.wait()
        back.complete()


def force_mechanisms(
    forced: dict[str, str] | Callable[[], dict[str, str]], unstageable: str
) -> None:
    """Route the mover's choice of mechanism through ``forced`` (direction -> a ``plan``
    mechanism, read at every choice; or a function returning such a dict, called at every
    choice; a direction absent from it, and per-layer copies, keep ``plan.choose``). A forced
    ``staged`` for a component that cannot be staged (one layer or envelope rows) becomes
    ``unstageable``."""
    from kvtier.transfer import mechanisms, plan

    original = plan.choose

    def choose(
        geo,
        direction,
        host_pages,
        device_pages,
        per_layer=False,
        dma=True,
        mechanism="auto",
        shared_link=False,
        host_run=None,
    ):  # noqa: ANN001, ANN202, E501
        want = (forced() if callable(forced) else forced).get(direction)
        if want is None or per_layer:
            return original(
                geo,
                direction,
                host_pages,
                device_pages,
                per_layer,
                dma,
                mechanism,
                shared_link,
                host_run,
            )
        if want == plan.STAGED and (geo.envelope or geo.layers == 1):
            return unstageable
        return want

    mechanisms.choose = choose


def random_pools(specs: list, pages: int, page_size: int, device: torch.device) -> tuple:
    """``(device pool, host pool)``: ``2 x pages`` device pages of random bytes and a pinned
    page-first host pool of ``4 x pages``."""
    from kvtier.pools.device import DevicePool
    from kvtier.pools.host import HostPool

    dpool = DevicePool(specs, 2 * pages, page_size, device)
    hpool = HostPool(specs, 4 * pages, page_size, layout="page_first", pin=True)
    for b in dpool.buffers.values():
        b.view(-1).view(torch.uint8).random_()
    return dpool, hpool


def random_case(family: str, device: torch.device) -> tuple:
    """A 1 GiB page-size-1 case of ``family`` over :func:`random_pools`: ``(specs, page_bytes,
    pages, device pool, host pool, src, dst, hload, hback)``, where device pages ``src`` are
    backed up into host pages ``hback`` and ``hload`` loaded into device pages ``dst``, all
    random (seed 0), as ``mix_page1.py`` and ``split_directions.py`` use them."""
    from kvtier.bench.pool_sets import family_pool_set
    from kvtier.pools.spec import tree_page_size

    specs = family_pool_set(family, torch.bfloat16)
    ps = tree_page_size(1, specs)
    pb = sum(s.page_bytes(ps) for s in specs)
    n = max(1, (1 << 30) // pb)
    dpool, hpool = random_pools(specs, n, ps, device)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(2 * n, generator=g)
    hperm = torch.randperm(4 * n, generator=g)
    return specs, pb, n, dpool, hpool, perm[:n], perm[n:], hperm[:n], hperm[n : 2 * n]
