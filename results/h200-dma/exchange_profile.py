"""cProfile of one warm 1 GiB ``Mover.exchange`` call (dense, page size 1, churned host pages),
by cumulative time: where the CPU time before and between the copies goes."""

from __future__ import annotations

import cProfile
import pstats

import torch

from kvtier.bench.host_runs import churned
from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.transfer.mover import Mover

DEV = torch.device("cuda")
specs = family_pool_set("dense", torch.bfloat16)
n = (1 << 30) // sum(s.page_bytes(1) for s in specs)
dpool = DevicePool(specs, 2 * n, 1, DEV)
hpool = HostPool(specs, 4 * n, 1, layout="page_first", pin=True)
perm = torch.randperm(2 * n)
src, dst = perm[:n], perm[n:]
hp, ho = churned(4 * n, [n, n], 1, seed=1)
mover = Mover(dpool, hpool)
for _ in range(3):
    b, ld = mover.exchange((src, ho), (hp, dst))
    b.wait(), ld.wait(), b.complete()
prof = cProfile.Profile()
for _ in range(3):
    torch.cuda.synchronize()
    prof.enable()
    b, ld = mover.exchange((src, ho), (hp, dst))
    prof.disable()
    b.wait(), ld.wait(), b.complete()
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(35)
st.sort_stats("tottime").print_stats(25)
