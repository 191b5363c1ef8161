"""``kvtier bench storage --backend mooncake``: ``MooncakeBackend`` against the raw Mooncake
client (``batch_put_from`` / ``batch_get_into`` on the same registered bytes, no envelope or
checksums) on the same cluster."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import torch

from kvtier.bench.helpers import check_equal, gbps, logger
from kvtier.keys import Namespace, PageKey
from kvtier.storage.envelope import HEADER_BYTES

_log = logger("storage")


def bench_mooncake(
    url: str | None = None,
    page_bytes: int = 2 << 20,
    num_pages: int = 256,
    repeats: int = 3,
) -> dict:
    """Write ``num_pages`` random pages of ``page_bytes`` through ``MooncakeBackend`` and read
    them back into a preallocated buffer; do the same with the raw client on the same
    registered source and destination bytes (no envelope, no checksums) as the peer.

    Without ``url`` a local cluster sized for the run is started and stopped. Times are the
    best of ``repeats`` (fresh keys each; the run's objects are removed after each repeat).
    Raises ``RuntimeError`` if a call falls short or a read-back differs. Returns GB/s for both
    and the ratio backend / raw.
    """
    from mooncake.store import MooncakeDistributedStore

    from kvtier.storage.mooncake import MooncakeBackend
    from kvtier.storage.mooncake_local import LocalMooncake
    from kvtier.storage.mooncake_url import parse_storage_url

    src = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    total = num_pages * page_bytes
    keys = [PageKey(f"{i:032x}") for i in range(num_pages)]
    run = uuid.uuid4().hex
    best: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        where = url or "local cluster"
        if url is None:
            need = 5 * (total + num_pages * HEADER_BYTES) // 2 + (64 << 20)
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

        for r in range(repeats):
            be = MooncakeBackend(url, Namespace(f"{run[:24]}{r:08d}"))
            be.register_buffers([src, dst])
            raw_keys = [f"kvtier-bench-raw/{run}/{r}/{i}" for i in range(num_pages)]

            def be_write(be: MooncakeBackend = be) -> None:
                if (n := be.batch_set(keys, list(src))) != num_pages:
                    raise RuntimeError(f"batch_set stored {n}/{num_pages}: {dict(be.errors)}")

            def be_read(be: MooncakeBackend = be) -> None:
                if (n := be.batch_get(keys, list(dst))) != num_pages:
                    raise RuntimeError(f"batch_get read {n}/{num_pages}: {dict(be.errors)}")

            def raw_write(raw_keys: list[str] = raw_keys) -> None:
                codes = raw.batch_put_from(raw_keys, rows, sizes)
                if any(c != 0 for c in codes):
                    raise RuntimeError(f"raw batch_put_from answered {sorted(set(codes))}")

            def raw_read(raw_keys: list[str] = raw_keys) -> None:
                got = raw.batch_get_into(raw_keys, out_rows, sizes)
                if any(g != page_bytes for g in got):
                    raise RuntimeError(f"raw batch_get_into answered {sorted(set(got))}")

            phases: list[tuple[str, Callable[[], None]]] = [
                ("mooncake_write", be_write),
                ("raw_write", raw_write),
                ("mooncake_read", be_read),
                ("raw_read", raw_read),
            ]
            # Interleaved so both sides see the same cluster state.
            for name, fn in phases:
                dst.zero_()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if name.endswith("read"):
                    check_equal(src, dst, name)
                best[name] = min(best.get(name, dt), dt)
                _log(
                    f"repeat {r} {name}: {gbps(total, dt):.2f} GB/s ({num_pages} x {page_bytes} B)"
                )
            be.close()
            raw.batch_remove([be.store_key(k) for k in keys] + raw_keys, True)
    res = {name: gbps(total, dt) for name, dt in best.items()}
    out = {
        "bench": "storage",
        "backend": "mooncake",
        "cluster": where,
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "total_bytes": total,
        "mooncake_backend": {
            "write_gbps": res["mooncake_write"],
            "read_gbps": res["mooncake_read"],
        },
        "raw_client": {"write_gbps": res["raw_write"], "read_gbps": res["raw_read"]},
        "ratio": {
            "write": res["mooncake_write"] / res["raw_write"],
            "read": res["mooncake_read"] / res["raw_read"],
        },
    }
    _log(f"ratio backend/raw: write {out['ratio']['write']:.2f}, read {out['ratio']['read']:.2f}")
    return out
