"""L3 objects of a window pool set: kvtier's two-object layout against one-object page envelopes.

The ``swa`` family's pool set is an anchor ``kv`` (full-attention layers) and a window component
``swa`` (sliding layers) that a page has or not (``Node.ckpt``). Each design below is a
``StorageIO`` whose writes and prefetch reads lay the objects out its way; all of them go
through the real backends, the real host pool and ``ObjectCodec``. The workload is one stored
prefix of ``--pages`` pages whose last ``window / page`` pages carry window rows (what a long
prompt leaves behind: only the last window's pages keep their rows), restored ``--runs`` times
into other host pages, byte-exact and with the right flags, on the file backend and on a local
Mooncake Store (master and storage node started here, stopped at the end).

    two-object       what kvtier ships. Page object (anchor rows) per page; window object
                     (``state_key``) per page with window rows. A restore reads the page objects
                     in chunks, then per page probes its window object and reads it alone.
    two-object-runs  the same objects; the restore probes and reads window objects by runs
                     (``batch_exists`` answers a leading run, so a run costs one probe and one
                     read; an absent page still costs one probe).
    envelope-fixed   one object per page, always anchor + window size, the window part valid
                     when the 8-byte component mask says so: one read per page and no probe.
                     The match side (``cache.resume``) still learns from ``state_key`` which
                     pages have window rows, so window pages also get an 8-byte marker there.
    envelope-keyed   objects sized to what they carry, the key saying which: the anchor-only
                     envelope under the page key for every page (the match's chain probes it),
                     the whole envelope (anchor + window) under ``state_key`` for pages with
                     window rows. A restore probes by runs, then reads one object per page.
    envelope-sized   a bound, not a design: objects sized to what they carry under the page key,
                     read with the right buffer size known beforehand (told by this script: the
                     backend contract reads exact sizes and has no way to ask), no probe.

``late``: 8 pages stored without window rows, written again after their rows arrived (what
``WindowBackups`` does); how many of them a restore then brings back with their rows. A
backend keeps an object it already has (``batch_set`` skips stored keys), so a design that
puts the rows under a key already written loses them.

Run from the repository root: ``python results/l3-envelope/measure.py`` (``--json PATH`` to
save the figures, ``--backends file`` to skip Mooncake).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kvtier.controller.records import PrefetchOp
from kvtier.controller.storage_io import CHUNK_PAGES, StorageIO, WriteOp
from kvtier.keys import Namespace, PageKey, chain_keys, namespace_digest, state_key
from kvtier.metrics import Metrics
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.storage.base import StorageBackend
from kvtier.storage.file import FileBackend
from kvtier.transfer.objects import ObjectCodec
from kvtier.tree.node import Node

PS = 16
ANCHOR, WINDOW = 1, 2
"""Component mask bits of a fixed envelope."""


class Counting(StorageBackend):
    """A backend that counts the calls, keys and bytes going to the one it wraps."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.reset()

    def reset(self) -> None:
        self.n = dict.fromkeys(
            ("exists_calls", "exists_keys", "get_calls", "got", "got_bytes", "set_calls"), 0
        )
        self.n.update(set_keys=0, set_bytes=0)

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        self.n["exists_calls"] += 1
        self.n["exists_keys"] += len(keys)
        return self.inner.batch_exists(keys)

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        got = self.inner.batch_get(keys, buffers)
        self.n["get_calls"] += 1
        self.n["got"] += got
        self.n["got_bytes"] += sum(b.nbytes for b in buffers[:got])
        return got

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        self.n["set_calls"] += 1
        self.n["set_keys"] += len(keys)
        self.n["set_bytes"] += sum(b.nbytes for b in buffers)
        return self.inner.batch_set(keys, buffers)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        self.inner.register_buffers(buffers)

    def read_fence(self) -> Future[None] | None:
        return self.inner.read_fence()

    def close(self) -> None:
        self.inner.close()


def runs(flags: torch.Tensor) -> list[tuple[int, int, bool]]:
    """``(start, stop, value)`` of each run of equal ``flags``."""
    out: list[tuple[int, int, bool]] = []
    vals = flags.tolist()
    start = 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            out.append((start, i, bool(vals[start])))
            start = i
    return out


class TwoObject(StorageIO):
    """What kvtier ships."""


class RunProbes(StorageIO):
    """Probing window objects by runs: one ``batch_exists`` per run present, one per absent
    page."""

    def probe(self, keys: list[PageKey]) -> torch.Tensor:
        has = torch.zeros(len(keys), dtype=torch.bool)
        i = 0
        while i < len(keys):
            run = self.backend.batch_exists([state_key(k) for k in keys[i:]])
            has[i : i + run] = True
            i += run + 1  # the page after the run has none (or the keys ended)
        return has


class TwoObjectRuns(RunProbes):
    def _read_states(self, op: PrefetchOp, lo: int, hi: int) -> int:
        has = self.probe(op.keys[lo:hi])
        for a, b, present in runs(has):
            if not present:
                continue
            fences = len(op.fences)
            skeys = [state_key(k) for k in op.keys[lo + a : lo + b]]
            got = self._read(self.states, skeys, op.pages[lo + a : lo + b], op)
            op.ckpt[lo + a : lo + a + got] = True
            if got < b - a and len(op.fences) > fences:
                return lo + a + got
        return hi


class EnvelopeKeyed(RunProbes):
    """Anchor-only envelopes under page keys, whole envelopes under ``state_key``."""

    def __init__(self, backend: StorageBackend, host: HostPool, metrics: Metrics) -> None:
        super().__init__(backend, host, metrics, PS)
        self.states = ObjectCodec(host, host.specs)  # what ``_do_write`` stores under state keys

    def _do_prefetch(self, op: PrefetchOp) -> None:
        for lo in range(0, len(op.keys), CHUNK_PAGES):
            hi = min(lo + CHUNK_PAGES, len(op.keys))
            has = self.probe(op.keys[lo:hi])
            done = 0
            for a, b, whole in runs(has):
                keys = op.keys[lo + a : lo + b]
                codec = self.states if whole else self.pages
                keys = [state_key(k) for k in keys] if whole else keys
                got = self._read(codec, keys, op.pages[lo + a : lo + b], op)
                if whole:
                    op.ckpt[lo + a : lo + a + got] = True
                done += got
                if got < b - a:
                    break
            op.publish(lo + done)
            if done < hi - lo:
                return


class EnvelopeFixed(StorageIO):
    """One fixed-size object per page: anchor rows, window rows, an 8-byte component mask."""

    def __init__(self, backend: StorageBackend, host: HostPool, metrics: Metrics) -> None:
        super().__init__(backend, host, metrics, PS)
        self.anchor_bytes = self.pages.nbytes
        self.body = self.pages.nbytes + self.states.nbytes
        self.nbytes = self.body + 8

    def _envelopes(self, pages: torch.Tensor, ckpt: torch.Tensor) -> torch.Tensor:
        out = torch.empty((pages.numel(), self.nbytes), dtype=torch.uint8)
        at = 0
        for s in self.host.specs:
            part = self.host.read_pages(s.name, pages).reshape(pages.numel(), -1)
            nb = part.shape[1] * part.element_size()
            out[:, at : at + nb] = part.view(torch.uint8)
            at += nb
        mask = torch.where(ckpt, ANCHOR | WINDOW, ANCHOR).to(torch.int64)
        out[:, self.body :] = mask.unsqueeze(1).view(torch.uint8).reshape(-1, 8)
        return out

    def _do_write(self, op: WriteOp) -> torch.Tensor:
        env = self._envelopes(op.pages, op.ckpt)
        stored = self.backend.batch_set(op.keys, list(env.unbind(0)))
        done = torch.zeros(len(op.keys), dtype=torch.bool)
        done[:stored] = True
        idx = op.ckpt[:stored].nonzero().reshape(-1).tolist()
        if idx:  # markers for the match side's window probe
            marks = env[idx, self.body :]
            ok = self.backend.batch_set([state_key(op.keys[i]) for i in idx], list(marks))
            done[idx[ok:]] = False
        return done

    def _do_prefetch(self, op: PrefetchOp) -> None:
        for lo in range(0, len(op.keys), CHUNK_PAGES):
            hi = min(lo + CHUNK_PAGES, len(op.keys))
            staged = torch.empty((hi - lo, self.nbytes), dtype=torch.uint8)
            got = self.backend.batch_get(op.keys[lo:hi], list(staged.unbind(0)))
            staged, pages = staged[:got], op.pages[lo : lo + got]
            mask = staged[:, self.body :].contiguous().view(torch.int64).reshape(-1)
            whole = (mask & WINDOW) != 0
            self.pages.scatter(pages, staged[:, : self.anchor_bytes])
            if bool(whole.any()):
                self.states.scatter(pages[whole], staged[whole, self.anchor_bytes : self.body])
            op.ckpt[lo : lo + got] = whole
            op.publish(lo + got)
            if got < hi - lo:
                return


class EnvelopeSized(StorageIO):
    """Objects sized to what they carry under page keys, read with sizes told beforehand."""

    known: torch.Tensor | None = None
    """Which pages have window rows, as a reader would need to be told."""

    def __init__(self, backend: StorageBackend, host: HostPool, metrics: Metrics) -> None:
        super().__init__(backend, host, metrics, PS)
        self.whole = ObjectCodec(host, host.specs)

    def _do_write(self, op: WriteOp) -> torch.Tensor:
        bufs: list[torch.Tensor] = []
        for a, b, whole in runs(op.ckpt):
            codec = self.whole if whole else self.pages
            bufs += codec.gather(b - a, codec.slots(op.pages[a:b]))
        stored = self.backend.batch_set(op.keys, bufs)
        done = torch.zeros(len(op.keys), dtype=torch.bool)
        done[:stored] = True
        idx = op.ckpt[:stored].nonzero().reshape(-1).tolist()
        if idx:  # markers for the match side's window probe
            marks = [torch.full((8,), ANCHOR | WINDOW, dtype=torch.uint8) for _ in idx]
            ok = self.backend.batch_set([state_key(op.keys[i]) for i in idx], marks)
            done[idx[ok:]] = False
        return done

    def _do_prefetch(self, op: PrefetchOp) -> None:
        assert self.known is not None
        for lo in range(0, len(op.keys), CHUNK_PAGES):
            hi = min(lo + CHUNK_PAGES, len(op.keys))
            done = 0
            for a, b, whole in runs(self.known[lo:hi]):
                codec = self.whole if whole else self.pages
                got = self._read(codec, op.keys[lo + a : lo + b], op.pages[lo + a : lo + b], op)
                if whole:
                    op.ckpt[lo + a : lo + a + got] = True
                done += got
                if got < b - a:
                    break
            op.publish(lo + done)
            if done < hi - lo:
                return


DESIGNS = {
    "two-object": TwoObject,
    "two-object-runs": TwoObjectRuns,
    "envelope-fixed": EnvelopeFixed,
    "envelope-keyed": EnvelopeKeyed,
    "envelope-sized": EnvelopeSized,
}


def make_io(design: str, backend: StorageBackend, host: HostPool) -> StorageIO:
    cls = DESIGNS[design]
    if cls in (TwoObject, TwoObjectRuns):
        return cls(backend, host, Metrics(), PS)
    return cls(backend, host, Metrics())


def specs(args: argparse.Namespace) -> list[PoolSpec]:
    row = (2, args.heads, args.head_dim)
    return [
        PoolSpec("kv", args.full_layers, row, torch.bfloat16),
        PoolSpec("swa", args.swa_layers, row, torch.bfloat16, kind="window", window=args.window),
    ]


def namespace(design: str, run: str) -> Namespace:
    return namespace_digest(
        model_fingerprint="l3-envelope",
        dtype="bf16",
        page_size=PS,
        tree_page_size=PS,
        components=[design],
        rank=0,
        world_size=1,
        extra=[run],
    )


def node_of(pages: torch.Tensor, ckpt: torch.Tensor) -> Node:
    node = Node(1, None, b"")
    node.host, node.ckpt = pages, ckpt
    return node


def write(io: StorageIO, keys: list[PageKey], pages: torch.Tensor, ckpt: torch.Tensor) -> float:
    t0 = time.perf_counter()
    op = io.write([node_of(pages, ckpt)], [keys])
    done = op.future.result()
    dt = time.perf_counter() - t0
    assert bool(done.all()), "a write failed"
    io.reap_writes()
    return dt


def restore(io: StorageIO, keys: list[PageKey], pages: torch.Tensor) -> tuple[float, PrefetchOp]:
    op = PrefetchOp(None, (), (), keys, pages, time.monotonic() + 60)
    op.ckpt = torch.zeros(len(keys), dtype=torch.bool)
    t0 = time.perf_counter()
    io.read(op)
    op.future.result()
    return time.perf_counter() - t0, op


def same_rows(host: HostPool, name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(host.read_pages(name, a), host.read_pages(name, b))


def fill(host: HostPool, pages: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in host.specs:
        shape = host.read_pages(s.name, pages).shape
        host.write_pages(s.name, pages, torch.randn(shape, generator=g).to(s.dtype))


def measure(designs: list[str], backend_of, args: argparse.Namespace, host: HostPool) -> dict:
    """Every design on one backend: its write runs, then restore runs taking turns between the
    designs (so a slow moment of the machine falls on all of them), then the late check."""
    n, w = args.pages, -(-(args.window - 1) // PS)
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    ckpt = torch.zeros(n, dtype=torch.bool)
    ckpt[n - w :] = True
    tokens = torch.randint(0, 50_000, (n * PS,), generator=torch.Generator().manual_seed(1))
    out: dict[str, dict] = {}
    ios: dict[str, tuple[StorageIO, Counting, list[PageKey]]] = {}
    for design in designs:
        keys = chain_keys(namespace(design, "keys"), tokens.tolist(), PS)
        write_s = []
        for r in range(args.write_runs):
            be = Counting(backend_of(namespace(design, f"w{r}")))
            io = make_io(design, be, host)
            write_s.append(write(io, keys, src, ckpt))
            if r < args.write_runs - 1:
                io.close()
        out[design] = {
            "pages": n,
            "window_pages": w,
            "write": {
                "objects": be.n["set_keys"],
                "calls": be.n["set_calls"],
                "bytes": be.n["set_bytes"],
                "ms_median": round(statistics.median(write_s) * 1e3, 2),
            },
        }
        if isinstance(io, EnvelopeSized):
            io.known = ckpt
        ios[design] = (io, be, keys)
    times: dict[str, list[float]] = {d: [] for d in designs}
    for r in range(args.runs + 1):  # the first round warms up and is not counted
        for design, (io, be, keys) in ios.items():
            be.reset()
            host.buffers["kv"][dst] = 0
            dt, op = restore(io, keys, dst)
            assert op.done_pages == n, f"{design}: restored {op.done_pages} of {n} pages"
            assert torch.equal(op.ckpt, ckpt), f"{design}: window flags differ"
            assert same_rows(host, "kv", src, dst), f"{design}: anchor rows differ"
            assert same_rows(host, "swa", src[ckpt], dst[ckpt]), f"{design}: window rows differ"
            if r:
                times[design].append(dt)
    for design, (io, be, _) in ios.items():
        t = times[design]
        out[design]["restore"] = {
            "objects_read": be.n["got"],
            "get_calls": be.n["get_calls"],
            "exists_calls": be.n["exists_calls"],
            "backend_calls": be.n["get_calls"] + be.n["exists_calls"],
            "bytes_read": be.n["got_bytes"],
            "ms_median": round(statistics.median(t) * 1e3, 2),
            "ms_min": round(min(t) * 1e3, 2),
            "ms_max": round(max(t) * 1e3, 2),
        }
        io.close()
    for design in designs:  # last: it writes new rows into the source pages
        out[design]["late"] = late(design, backend_of, host)
    return out


def late(design: str, backend_of, host: HostPool) -> str:
    """8 pages stored without window rows, then with them: how many come back with them."""
    if design == "envelope-sized":
        return "n/a (a bound)"
    m = 8
    src, dst = torch.arange(m), torch.arange(m, 2 * m)
    keys = chain_keys(namespace(design, "late-keys"), list(range(m * PS)), PS)
    io = make_io(design, backend_of(namespace(design, "late")), host)
    write(io, keys, src, torch.zeros(m, dtype=torch.bool))
    fill(host, src, seed=7)  # the rows that arrive later
    write(io, keys, src, torch.ones(m, dtype=torch.bool))
    _, op = restore(io, keys, dst)
    ok = int(op.ckpt.sum())
    if ok:
        assert same_rows(host, "swa", src[op.ckpt], dst[op.ckpt]), f"{design}: late rows differ"
    io.close()
    return f"{ok}/{m}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--pages", type=int, default=320, help="pages of the stored prefix")
    p.add_argument("--window", type=int, default=1024, help="sliding window in tokens")
    p.add_argument("--full-layers", type=int, default=4)
    p.add_argument("--swa-layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads per layer")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=7, help="restores measured per design")
    p.add_argument("--write-runs", type=int, default=3)
    p.add_argument("--backends", default="file,mooncake")
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = HostPool(specs(args), 2 * args.pages, PS)
    fill(host, torch.arange(2 * args.pages), seed=0)
    result: dict[str, object] = {
        "config": vars(args),
        "anchor_page_bytes": host.specs[0].page_bytes(PS),
        "window_page_bytes": host.specs[1].page_bytes(PS),
    }
    for name in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cluster = None
            if name == "file":

                def backend_of(ns: Namespace, tmp: str = tmp) -> StorageBackend:
                    return FileBackend(tmp, ns, 64 << 30)

            else:
                from kvtier.storage.mooncake import MooncakeBackend
                from kvtier.storage.mooncake_local import LocalMooncake

                cluster = LocalMooncake(segment_bytes=6 << 30, log_dir=tmp).start()

                def backend_of(ns: Namespace, url: str = cluster.url()) -> StorageBackend:
                    return MooncakeBackend(url, ns)

            try:
                per = measure(args.designs.split(","), backend_of, args, host)
                for design, r in per.items():
                    print(name, design, json.dumps({k: r[k] for k in ("write", "restore", "late")}))
                result[name] = per
            finally:
                if cluster is not None:
                    cluster.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
