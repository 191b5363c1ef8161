"""Scattered page transfers through ``Mover`` against one contiguous copy of the same bytes.

``kvtier bench transfer [--json OUT.json]`` prints the result as JSON (and writes it to
``OUT.json``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvtier.bench.helpers import gbps, logger
from kvtier.bench.host_runs import churned, mean_run
from kvtier.bench.pool_sets import family_pool_set
from kvtier.errors import ConfigError, IntegrityError
from kvtier.pools.codec import get_codec
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec, tree_page_size
from kvtier.transfer.mover import Mover
from kvtier.transfer.plan import STAGING_BYTES

_log = logger("transfer")

CPU_TRANSFER_BYTES = 64 << 20
"""Bytes moved per copy on CPU (sizes shrink to fit), which keeps the CPU run to seconds."""
FOOTPRINT_COPIES = 13
"""Estimated peak memory in units of the transferred bytes: a device pool of twice and a host
pool of four times the transferred pages, the contiguous pairs (two on CUDA), the verification
snapshot and staging."""
MIN_CPU_PAGES = 16
"""Pages kept on CPU before layers are cut instead."""
SEED = 0
HOST_PAGES = ("churned", "random")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _fit_cpu(num_pages: int, num_layers: int, layer_page_bytes: int) -> tuple[int, int]:
    """Largest ``(num_pages, num_layers)`` not above the request that moves at most
    ``CPU_TRANSFER_BYTES``, halving layers only while fewer than ``MIN_CPU_PAGES`` pages fit."""
    while num_layers > 1 and CPU_TRANSFER_BYTES // (layer_page_bytes * num_layers) < MIN_CPU_PAGES:
        num_layers //= 2
    return max(1, min(num_pages, CPU_TRANSFER_BYTES // (layer_page_bytes * num_layers))), num_layers


def _fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite the bytes of contiguous ``t`` with random bits (in 8-byte words when possible)."""
    b = t.view(-1).view(torch.uint8)
    (b.view(torch.int64) if b.numel() % 8 == 0 else b).random_(generator=gen)


def bench_transfer(
    device: str | None = None,
    page_size: int = 16,
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    num_pages: int = 512,
    repeats: int = 5,
    host_layout: str = "page_first",
    family: str | None = None,
    staging_mib: int | None = None,
    target_mib: int | None = None,
    host_pages: str = "churned",
    kv_codec: str = "none",
) -> dict:
    """Time ``Mover`` copies of ``num_pages`` scattered pages of one GQA KV pool and a single
    contiguous ``copy_`` of the same byte count, in each direction, in the same process.

    ``device`` defaults to CUDA when available, else CPU; the host pool and the contiguous host
    tensor are pinned on CUDA. The device pool holds ``2 * num_pages`` pages and the device
    pages moved are random, unordered subsets of them. The host pool holds ``4 * num_pages``
    pages; ``host_pages`` picks the host pages moved: ``churned`` (default), as a host tier
    hands them out after node churn (``kvtier.bench.host_runs``: runs of consecutive pages, one
    per tree node), or ``random``, random unordered subsets (one run per page, the worst case).
    ``sizes`` reports the mean host run. On CPU ``num_pages`` (then ``num_layers``) is
    reduced so one copy moves at most ``CPU_TRANSFER_BYTES`` (peak memory about
    ``FOOTPRINT_COPIES`` times that); ``sizes`` reports what was used.

    d2h is timed from the call to after ``op.wait()`` and ``op.complete()`` (the host copy is
    then valid), h2d from the call to after ``op.wait()``; contiguous copies to after a device
    synchronise. One untimed d2h → h2d roundtrip (into a second set of device pages) first checks
    that the host copy and the restored device pages are byte-identical to the originals and
    raises ``RuntimeError`` otherwise. Figures are the best and the median of ``repeats``.

    ``staging_mib`` sets the mover's device staging memory (default ``plan.STAGING_BYTES``);
    ``target_mib`` replaces ``num_pages`` by the page count that moves about that many MiB.

    ``family`` replaces the single GQA pool by that family's whole pool set (see
    ``kvtier.bench.pool_sets``; a page is then the family's tree page and every component moves
    in the same transfer); ``num_layers``/``num_kv_heads``/``head_dim`` are ignored and on CPU
    only ``num_pages`` shrinks.

    On CUDA ``both`` times a backup of the source pages (into the other host pages) and the load
    issued together (``Mover.exchange``: chunks in turn), against contiguous copies both ways at
    once; its GB/s count the bytes of both directions. ``both_whole`` times the same pair queued
    one after the other (the backup whole, then the load), the order without ``exchange``.

    ``kv_codec`` (``fp8_e4m3``, ``int8``) also times the same copies into a host pool holding
    the lossy KV coded (``kvtier.pools.codec``), after checking that a roundtrip gives the
    codec's decode of the source rows exactly (and every other component byte for byte):
    ``codec`` reports host bytes per page against ``none`` and, per direction, logical bytes
    (the device pages' bytes) over time against the uncoded copies of the same run.

    Returns ``{"bench": "transfer", "device", "sizes", "verified", "repeats", "d2h", "h2d",
    "both", "both_whole", "codec"}`` where
    each direction has ``paths`` (the mechanism per component), ``gbps``, ``median_gbps``, ``contiguous_gbps``, ``contiguous_median_gbps``,
    ``ratio`` (best scattered / best contiguous) and ``median_ratio``.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise ConfigError(f"dtype={dtype!r} is not a torch dtype name")
    if num_pages <= 0 or repeats <= 0:
        raise ConfigError(f"num_pages={num_pages} and repeats={repeats} must be positive")
    if host_pages not in HOST_PAGES:
        raise ConfigError(f"host_pages={host_pages!r} is not one of {', '.join(HOST_PAGES)}")
    if target_mib is not None and target_mib <= 0:
        raise ConfigError(f"target_mib={target_mib} must be positive")
    codec = get_codec(kv_codec)
    cuda = dev.type == "cuda"
    row = (2, num_kv_heads, head_dim)
    if family is not None:
        specs = family_pool_set(family, tdtype)
        page_size = tree_page_size(page_size, specs)
    else:
        specs = [PoolSpec("kv", num_layers, row, tdtype, lossy=True)]
    if target_mib is not None:
        num_pages = max(1, (target_mib << 20) // sum(s.page_bytes(page_size) for s in specs))
    requested = {"num_pages": num_pages, "num_layers": num_layers}
    if family is not None:
        if not cuda:
            page_bytes = sum(s.page_bytes(page_size) for s in specs)
            num_pages = max(1, min(num_pages, CPU_TRANSFER_BYTES // page_bytes))
        num_layers = specs[0].num_layers
    else:
        if not cuda:
            layer_page = PoolSpec("kv", 1, row, tdtype).page_bytes(page_size)
            num_pages, num_layers = _fit_cpu(num_pages, num_layers, layer_page)
        specs = [PoolSpec("kv", num_layers, row, tdtype, lossy=True)]
    spec = specs[0]
    pool_pages = 2 * num_pages
    dpool = DevicePool(specs, pool_pages, page_size, dev)
    hpool = HostPool(specs, 2 * pool_pages, page_size, layout=host_layout, pin=cuda)
    staging = STAGING_BYTES if staging_mib is None else staging_mib << 20
    mover = Mover(dpool, hpool, staging_bytes=staging)
    coded_pool, coded_mover = None, mover  # the coded copies run only with a coded pool
    if codec.dtype is not None:
        coded_pool = HostPool(specs, 2 * pool_pages, page_size, host_layout, cuda, codec=codec)
        coded_mover = Mover(dpool, coded_pool, staging_bytes=staging)
    total = num_pages * dpool.page_bytes
    sizes = {
        "family": family or "single GQA pool",
        "pool_set": [s.describe() for s in specs],
        "page_size": page_size,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype": spec.dtype_name,
        "num_pages": num_pages,
        "page_bytes": dpool.page_bytes,
        "total_bytes": total,
        "device_pool_pages": pool_pages,
        "host_pool_pages": 2 * pool_pages,
        "host_pages": host_pages,
        "host_layout": host_layout,
        "staging_bytes": mover.staging_bytes,
        "pinned": cuda,
        "estimated_peak_bytes": FOOTPRINT_COPIES * total,
        "requested": requested,
        "reduced": requested != {"num_pages": num_pages, "num_layers": num_layers},
    }
    _log(
        f"{dev}: {num_pages} pages x {dpool.page_bytes} B ({num_layers} layers) = {total} B"
        + (f" (reduced from {requested})" if sizes["reduced"] else "")
    )

    gen = torch.Generator().manual_seed(SEED)
    dgen = torch.Generator(device=dev).manual_seed(SEED) if cuda else gen
    for buf in dpool.buffers.values():
        _fill_random(buf, dgen)
    perm = torch.randperm(pool_pages, generator=gen)
    src, dst = perm[:num_pages], perm[num_pages:]
    if host_pages == "random":
        hperm = torch.randperm(2 * pool_pages, generator=gen)
        hpages, hother = hperm[:num_pages], hperm[num_pages:pool_pages]
    else:
        hpages, hother = churned(2 * pool_pages, [num_pages, num_pages], page_size, seed=SEED)
    sizes["mean_host_run"] = round(mean_run(hpages), 1)
    cdev = torch.empty(total, dtype=torch.uint8, device=dev)
    chost = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    paths: dict[str, dict[str, str]] = {}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def pages_of(pages: torch.Tensor) -> torch.Tensor:
        parts = [dpool.page_bytes_view(s.name).index_select(1, pages.to(dev)) for s in specs]
        return torch.cat([_bytes(p).reshape(-1) for p in parts])

    def host_pages_of(pages: torch.Tensor) -> torch.Tensor:
        parts = [hpool.page_bytes_view(s.name).index_select(1, pages) for s in specs]
        return torch.cat([_bytes(p).reshape(-1) for p in parts])

    def d2h(m: Mover = mover, key: str = "d2h") -> None:
        op = m.device_to_host(src, hpages)
        op.wait()
        op.complete()
        paths[key] = op.paths

    def h2d(m: Mover = mover, key: str = "h2d") -> None:
        op = m.host_to_device(hpages, dst)
        op.wait()
        paths[key] = op.paths

    def both() -> None:
        # A backup of the source pages into the other host pages while the load runs.
        back, load = mover.exchange((src, hother), (hpages, dst))
        back.wait()
        load.wait()
        back.complete()
        paths["both"] = {n: f"d2h {back.paths[n]}, h2d {load.paths[n]}" for n in load.paths}

    def both_whole() -> None:
        back = mover.device_to_host(src, hother)
        load = mover.host_to_device(hpages, dst)
        back.wait()
        load.wait()
        back.complete()

    cdev2 = torch.empty(total, dtype=torch.uint8, device=dev) if cuda else cdev
    chost2 = torch.empty(total, dtype=torch.uint8, pin_memory=True) if cuda else chost
    side = torch.cuda.Stream(dev) if cuda else None

    def contiguous_both() -> None:
        if side is None:
            raise IntegrityError("contiguous_both copies on CUDA only")
        side.wait_stream(torch.cuda.current_stream(dev))
        cdev.copy_(chost, non_blocking=True)
        with torch.cuda.stream(side):
            chost2.copy_(cdev2, non_blocking=True)
        torch.cuda.current_stream(dev).wait_stream(side)

    def verify() -> None:
        orig = pages_of(src)
        d2h()
        if not torch.equal(host_pages_of(hpages), orig.cpu()):
            raise RuntimeError("device_to_host: host pages differ from the device pages")
        h2d()
        sync()
        if not torch.equal(pages_of(dst), orig):
            raise RuntimeError("host_to_device: restored device pages differ from the originals")

    def coded_d2h() -> None:
        d2h(coded_mover, "coded_d2h")

    def coded_h2d() -> None:
        h2d(coded_mover, "coded_h2d")

    def verify_coded() -> None:
        want = {}
        for s in specs:
            view = dpool.page_bytes_view(s.name).view(s.dtype)  # [layers, pages, elements]
            x = view.index_select(1, src.to(dev))
            if codec.codes(s):
                rows = x.reshape(-1, s.rows_per_page(page_size), s.row_numel)
                x = codec.decode(*codec.encode(rows, s), s).view(x.shape)
            want[s.name] = _bytes(x)
        coded_d2h()
        coded_h2d()
        sync()
        for s in specs:
            got = dpool.page_bytes_view(s.name).view(s.dtype).index_select(1, dst.to(dev))
            if not torch.equal(_bytes(got), want[s.name]):
                raise RuntimeError(f"kv_codec={codec.name!r}: restored {s.name!r} rows differ")

    verify()
    if coded_pool is not None:
        verify_coded()
    phases: list[tuple[str, Callable[[], object]]] = [
        ("d2h", d2h),
        ("contiguous_d2h", lambda: chost.copy_(cdev)),
        ("h2d", h2d),
        ("contiguous_h2d", lambda: cdev.copy_(chost)),
    ]
    if coded_pool is not None:
        phases += [("coded_d2h", coded_d2h), ("d2h_again", d2h)]
        phases += [("coded_h2d", coded_h2d), ("h2d_again", h2d)]
    if cuda:  # both directions at once only mean something with two copy engines
        phases += [("both", both), ("contiguous_both", contiguous_both)]
        phases += [("both_whole", both_whole), ("contiguous_both_whole", contiguous_both)]
    for _, fn in phases[1::2]:
        fn()  # warm-up: first touch of the contiguous buffers
    times: dict[str, list[float]] = {name: [] for name, _ in phases}
    for r in range(repeats):
        for name, fn in phases:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            _log(f"repeat {r} {name}: {gbps(2 * total if 'both' in name else total, dt):.2f} GB/s")

    def direction(name: str) -> dict:
        nbytes = 2 * total if "both" in name else total
        best = gbps(nbytes, min(times[name]))
        med = gbps(nbytes, statistics.median(times[name]))
        c = f"contiguous_{name}"
        cbest, cmed = gbps(nbytes, min(times[c])), gbps(nbytes, statistics.median(times[c]))
        return {
            "paths": paths.get(name, {}),
            "gbps": best,
            "median_gbps": med,
            "contiguous_gbps": cbest,
            "contiguous_median_gbps": cmed,
            "ratio": best / cbest,
            "median_ratio": med / cmed,
        }

    def coded(name: str) -> dict:
        # Against the uncoded copies of both passes (each pair ran back to back).
        plain = min(times[name] + times[f"{name}_again"])
        best = gbps(total, min(times[f"coded_{name}"]))
        return {
            "paths": paths.get(f"coded_{name}", {}),
            "logical_gbps": best,
            "none_gbps": gbps(total, plain),
            "ratio": best / gbps(total, plain),
        }

    coded_result = None
    if coded_pool is not None:
        coded_result = {
            "kv_codec": codec.name,
            "host_page_bytes": coded_pool.page_bytes,
            "host_page_bytes_none": hpool.page_bytes,
            "pages_per_gib_ratio": hpool.page_bytes / coded_pool.page_bytes,
            "d2h": coded("d2h"),
            "h2d": coded("h2d"),
        }
    out = {
        "bench": "transfer",
        "device": str(dev),
        "sizes": sizes,
        "verified": True,
        "repeats": repeats,
        "d2h": direction("d2h"),
        "h2d": direction("h2d"),
        "both": direction("both") if cuda else None,
        "both_whole": direction("both_whole") if cuda else None,
        "codec": coded_result,
    }
    _log(
        f"ratio scattered/contiguous: d2h {out['d2h']['ratio']:.2f}, h2d {out['h2d']['ratio']:.2f}"
    )
    return out
