"""``kvtier bench storage --backend mooncake``: ``MooncakeBackend`` against the raw Mooncake
client (``batch_put_from`` / ``batch_get_into`` on the same registered bytes, no envelope or
checksums) on the same cluster, in interleaved rounds; medians."""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.bench.helpers import check_equal, gbps, logger
from kvtier.keys import Namespace, PageKey
from kvtier.storage.envelope import HEADER_BYTES

_log = logger("storage")


def bench_mooncake(
    url: str | None = None,
    page_bytes: int = 2 << 20,
    num_pages: int = 256,
    repeats: int = 5,
) -> dict:
    """Write ``num_pages`` random pages of ``page_bytes`` through ``MooncakeBackend`` and read
    them back into a preallocated buffer; do the same with the raw client on the same
    registered source and destination bytes (no envelope, no checksums) as the peer, called
    plainly from this thread (``raw_client``) and from a worker thread at the backend's
    ``poll_nice`` (``raw_client_low_priority``: the client busy-polls its calling thread, and
    the backend's store calls run at that priority; on a host short of cores this alone moves
    the raw figure).

    Without ``url`` a local cluster sized for the run is started and stopped. Each of
    ``repeats`` rounds runs every side once with fresh keys (the run's objects are removed
    after each round), the backend and the raw client alternating which goes first; one
    uncounted round before them touches the storage node's memory (its first writes into
    fresh pages pay page faults no later round pays). Figures are medians over the rounds;
    ``ratio`` is kvtier / raw client of the medians, ``ratio_paired`` the median of the
    rounds' own ratios (steadier on a shared host). Raises ``RuntimeError`` if a call falls
    short or a read-back differs. Returns GB/s for each side and the ratios.
    """
    from mooncake.store import MooncakeDistributedStore

    from kvtier.storage.mooncake import MooncakeBackend
    from kvtier.storage.mooncake_buffers import lower_priority
    from kvtier.storage.mooncake_local import LocalMooncake
    from kvtier.storage.mooncake_url import parse_storage_url

    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    total = num_pages * page_bytes
    keys = [PageKey(f"{i:032x}") for i in range(num_pages)]
    run = uuid.uuid4().hex
    times: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        where = url or "local cluster"
        if url is None:
            # Three sides' objects of one round, and room for the allocator to place them.
            need = 4 * (total + num_pages * HEADER_BYTES) + (64 << 20)
            url = stack.enter_context(LocalMooncake(segment_bytes=need)).url()
        s = parse_storage_url(url)
        raw = MooncakeDistributedStore()
        rc = raw.setup(*s.setup_args(segment=0))
        if rc != 0:
            raise RuntimeError(f"raw Mooncake client setup against {where} returned {rc}")
        stack.callback(raw.close)
        for t in (src, dst):
            raw.register_buffer(t.data_ptr(), t.numel())
        rows = [src[i].data_ptr() for i in range(num_pages)]
        out_rows = [dst[i].data_ptr() for i in range(num_pages)]
        sizes = [page_bytes] * num_pages
        low = ThreadPoolExecutor(1, initializer=lambda: lower_priority(s.poll_nice))
        stack.callback(low.shutdown)

        for r in range(-1, repeats):
            be = MooncakeBackend(url, Namespace(f"{run[:23]}{r + 1:09d}"))
            be.register_buffers([src, dst])
            raw_keys = {
                side: [f"kvtier-bench-{side}/{run}/{r}/{i}" for i in range(num_pages)]
                for side in ("raw", "low")
            }

            def be_write(be: MooncakeBackend = be) -> None:
                if (n := be.batch_set(keys, list(src))) != num_pages:
                    raise RuntimeError(f"batch_set stored {n}/{num_pages}: {dict(be.errors)}")

            def be_read(be: MooncakeBackend = be) -> None:
                if (n := be.batch_get(keys, list(dst))) != num_pages:
                    raise RuntimeError(f"batch_get read {n}/{num_pages}: {dict(be.errors)}")

            def raw_write(names: list[str]) -> None:
                codes = raw.batch_put_from(names, rows, sizes)
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"raw batch_put_from answered {sorted(set(codes))}")

            def raw_read(names: list[str]) -> None:
                got = raw.batch_get_into(names, out_rows, sizes)
                if any(g != page_bytes for g in got):
                    raise RuntimeError(f"raw batch_get_into answered {sorted(set(got))}")

            def on_low(
                fn: Callable[[list[str]], None], names: list[str] = raw_keys["low"]
            ) -> Callable[[], None]:
                return lambda: low.submit(fn, names).result()

            writes: list[tuple[str, Callable[[], None]]] = [
                ("mooncake_write", be_write),
                ("raw_write", lambda rk=raw_keys: raw_write(rk["raw"])),
                ("raw_low_write", on_low(raw_write)),
            ]
            reads: list[tuple[str, Callable[[], None]]] = [
                ("mooncake_read", be_read),
                ("raw_read", lambda rk=raw_keys: raw_read(rk["raw"])),
                ("raw_low_read", on_low(raw_read)),
            ]
            if r % 2:  # odd rounds: the peers first
                writes, reads = writes[::-1], reads[::-1]
            for name, fn in writes + reads:
                dst.zero_()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if name.endswith("read"):
                    check_equal(src, dst, name)
                if r >= 0:
                    times.setdefault(name, []).append(dt)
                _log(
                    f"{f'round {r}' if r >= 0 else 'warm-up'} {name}: "
                    f"{gbps(total, dt):.2f} GB/s ({num_pages} x {page_bytes} B)"
                )
            be.close()
            raw.batch_remove([be.store_key(k) for k in keys] + sum(raw_keys.values(), []), True)
    res = {name: gbps(total, statistics.median(dts)) for name, dts in times.items()}

    def paired(side: str, peer: str) -> float:
        return statistics.median(p / t for p, t in zip(times[peer], times[side], strict=True))

    out = {
        "bench": "storage",
        "backend": "mooncake",
        "cluster": where,
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "total_bytes": total,
        "repeats": repeats,
        "statistic": "median",
        "poll_nice": s.poll_nice,
        "mooncake_backend": {
            "write_gbps": res["mooncake_write"],
            "read_gbps": res["mooncake_read"],
        },
        "raw_client": {"write_gbps": res["raw_write"], "read_gbps": res["raw_read"]},
        "raw_client_low_priority": {
            "write_gbps": res["raw_low_write"],
            "read_gbps": res["raw_low_read"],
        },
        "ratio": {
            "write": res["mooncake_write"] / res["raw_write"],
            "read": res["mooncake_read"] / res["raw_read"],
        },
        "ratio_paired": {
            "write": paired("mooncake_write", "raw_write"),
            "read": paired("mooncake_read", "raw_read"),
        },
        "ratio_vs_low_priority": {
            "write": res["mooncake_write"] / res["raw_low_write"],
            "read": res["mooncake_read"] / res["raw_low_read"],
        },
        "seconds": times,
    }
    _log(
        f"ratio backend/raw: write {out['ratio']['write']:.2f}, read {out['ratio']['read']:.2f} "
        f"(paired {out['ratio_paired']['write']:.2f}, {out['ratio_paired']['read']:.2f}); "
        f"backend/raw at poll_nice: write {out['ratio_vs_low_priority']['write']:.2f}, "
        f"read {out['ratio_vs_low_priority']['read']:.2f}"
    )
    return out
