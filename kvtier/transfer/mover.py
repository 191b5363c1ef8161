"""Device ↔ host page transfers.

Every component of the pool set is seen as rows (one page of one layer; see
``kvtier.transfer.plan``), and a batch is a handful of row copies per component, never a per-page
Python loop: copy-engine block lists, one staging gather/scatter kernel per slice, or one row-copy
kernel through a device view of the pinned host pool, chosen by block size
(``kvtier.transfer.component`` carries them out). On CUDA loads and backups run on two streams of
their own (a backup never delays a load) and complete asynchronously: ``TransferOp.done()`` polls
an event without blocking. On CPU copies are synchronous and ops are born done; the caller's
visibility rules are the same. A component the host pool holds through a page codec
(``kvtier.pools.codec``) is encoded on its way to the host and decoded on its way back, on the
device (so the link carries coded bytes; on CUDA the host pool must be pinned).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from kvtier.errors import ConfigError, IntegrityError, RequestError
from kvtier.paging import check_page_ids
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.chunks import interleave, queue_all
from kvtier.transfer.component import CodedRows, component_rows
from kvtier.transfer.delays import CompletionDelays
from kvtier.transfer.layers import Layered
from kvtier.transfer.mechanisms import Mechanisms
from kvtier.transfer.op import TransferOp
from kvtier.transfer.pacer import EventMark, Pacer
from kvtier.transfer.page_lists import PageLists, envelope_lists
from kvtier.transfer.plan import SHARED_FIRST_SLICE_BYTES, STAGING_BYTES
from kvtier.transfer.streams import on, recorded
from kvtier.transfer.translate import (
    MECHANISMS,
    ArenaTranslator,
    IdentityTranslator,
    PageTranslator,
)
from kvtier.transfer.uploads import Uploads

__all__ = ["Mover", "TransferOp"]


class Mover:
    """Copies pages between one device pool and one host pool.

    Page lists passed in are logical; ``translator`` maps them to the pools' physical pages
    (both sides, once per batch, before any mechanism sees them). ``mechanism`` is one of
    ``translate.MECHANISMS``. Left ``None``: the identity and ``auto``. ``delays`` (tests
    only) makes every op answer ``done()`` late (``kvtier.transfer.delays``).

    A :class:`~kvtier.pools.unified_pool.UnifiedPool` is translated per component (its
    ``ArenaTranslator``, the default for it): each component copies only the pages holding an
    envelope of it (a page without a window envelope keeps its host window rows untouched).
    Every op on it leases its logical device pages once validated, so compaction cannot move
    them while bytes are in flight, and releases them once: when its copy completed
    (``op.complete()``; on CPU, where the copy is synchronous, when the call returns) or when
    queueing it failed. Per-layer loads and backups are refused for it (``IntegrityError``).

    On CUDA with a pinned host pool it compiles its row kernels and loads the kernels that
    build row lists when made: no transfer waits for a compile or a module load
    (``ComponentRows.warm_up``).
    """

    def __init__(
        self,
        device_pool: DevicePool | UnifiedPool,
        host_pool: HostPool,
        translator: PageTranslator | None = None,
        debug_checks: bool = False,
        staging_bytes: int = STAGING_BYTES,
        backup_share: float = 0.0,
        mechanism: str | None = None,
        delays: CompletionDelays | None = None,
    ) -> None:
        self.dev = device_pool
        self.delays = delays or CompletionDelays()
        """Test completion delays (``CacheConfig.test_completion_polls``; off by default)."""
        self.host = host_pool
        self.arena = device_pool if isinstance(device_pool, UnifiedPool) else None
        """The unified pool when the device pool is one (ops lease its pages)."""
        if self.arena is not None and translator is None:
            translator = ArenaTranslator(self.arena)
        if self.arena is not None and not isinstance(translator, ArenaTranslator):
            raise ConfigError(
                f"translator={type(translator).__name__}: a unified device pool needs its "
                "ArenaTranslator (pass translator=None)"
            )
        self.translator = translator or IdentityTranslator()
        mechanism = mechanism or "auto"
        if mechanism not in MECHANISMS:
            raise ConfigError(
                f"transfer_mechanism={mechanism!r} is not one of {', '.join(MECHANISMS)}"
            )
        self.debug_checks = debug_checks
        if staging_bytes <= 0:
            raise ConfigError(f"staging_bytes={staging_bytes} must be positive")
        self.cuda = device_pool.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        self.backup_stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        # Staging gathers and scatters run beside the copy engines on streams of their own.
        helpers = (
            {d: torch.cuda.Stream(device_pool.device) for d in ("d2h", "h2d")} if self.cuda else {}
        )
        self.pacer = (
            Pacer(backup_share, self._mark, self._on_backup_stream)
            if self.cuda and backup_share > 0
            else None
        )
        """Queues backups chunk by chunk at :meth:`pump` (``CacheConfig.backup_share``); without
        one a backup is queued whole by the call that makes it."""
        pinned = self.cuda and host_pool.pinned
        self.uploads = Uploads() if self.cuda else None
        """Pinned buffers the page lists go to the GPU through."""
        self.mechanisms = Mechanisms(pinned, mechanism, helpers, staging_bytes)
        if mechanism == "copy_engine" and pinned and not self.dma:
            raise ConfigError(
                "transfer_mechanism='copy_engine' but this CUDA driver has no batched "
                "copy-engine transfers (cuMemcpyBatchAsync, driver 12.8+): use 'auto' or 'kernel'"
            )
        codec = getattr(host_pool, "codec", None)
        if self.cuda and not pinned and codec is not None and codec.dtype is not None:
            raise ConfigError(
                f"kv_codec={codec.name!r} on {device_pool.device} needs a pinned host pool (the "
                "coded rows cross by kernel through its device view): use pin_host=True or "
                "kv_codec='none'"
            )
        self.rows = component_rows(device_pool, host_pool, pinned)
        self.coded = [n for n, r in self.rows.items() if isinstance(r, CodedRows)]
        """Components the host pool holds coded (``kvtier.pools.codec``)."""

    @property
    def pinned(self) -> bool:
        """A pinned host pool on CUDA (copy engines and row kernels reach it directly)."""
        return self.mechanisms.pinned

    @property
    def staging_bytes(self) -> int:
        """Device staging memory of one staged component copy (two buffers of half each)."""
        return self.mechanisms.staging_bytes

    @property
    def dma(self) -> bool:
        """Copy engines may be used (off after the driver refused a list)."""
        return self.mechanisms.dma

    def _begin(
        self,
        direction: str,
        device_pages: torch.Tensor,
        host_pages: torch.Tensor,
        copy: bool = True,
        components: Sequence[str] | None = None,
    ) -> tuple[dict[str, PageLists], TransferOp]:
        """The page lists of each component copied (``components``, default all; physical host
        and device pages, on the CPU; one object shared by every component unless the pool is
        a unified arena) and the op; on CPU the copy is done here (unless ``copy`` is off) and
        the op is born done."""
        names = self._names(components)
        if device_pages.numel() != host_pages.numel():
            raise IntegrityError(
                f"{direction} transfer of {device_pages.numel()} device pages into "
                f"{host_pages.numel()} host pages"
            )
        owned = self.translator.device_owned(device_pages)
        if owned is not None:
            # A context-parallel rank moves only its own shard; host pages sit on the lane of
            # their device pages, which ``host_physical`` checks.
            owned = owned.reshape(-1).cpu()
            device_pages = device_pages.reshape(-1).cpu()[owned]
            host_pages = host_pages.reshape(-1).cpu()[owned]
        host = self.translator.host_physical(host_pages).cpu().long()
        if self.debug_checks:
            check_page_ids(host, self.host.num_pages, f"{direction} host pages", direction == "d2h")
        if self.arena is None:
            phys = self.translator.device_physical(device_pages).cpu().long()
            if self.debug_checks:
                what = f"{direction} device pages"
                check_page_ids(phys, self.dev.num_pages, what, direction == "h2d")
            lists = dict.fromkeys(names, PageLists(host, phys, self.uploads))
            nbytes = sum(
                s.page_bytes(self.dev.page_size) for s in self.dev.specs if s.name in lists
            )
            op = TransferOp(direction, phys.numel(), phys.numel() * nbytes)
        else:
            host_arena = self.host if isinstance(self.host, UnifiedPool) else None
            lists, op = envelope_lists(
                self.arena, direction, device_pages, host, names, self.uploads, host_arena
            )
        op.hold = self.delays.draw()
        try:
            if not self.cuda and copy:
                for name, pages in lists.items():
                    if pages.device.numel() or self.arena is None:
                        self.rows[name].cpu(direction, pages)
                    op.paths[name] = "cpu"
        finally:
            if not self.cuda:
                op.release()  # the copy is synchronous: nothing stays in flight
        return lists, op

    def layered_backup(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor
    ) -> Layered | None:
        """A device → host copy made layer by layer while a forward writes the pages
        (``kvtier.transfer.layers``); ``None`` on CUDA with a pageable host pool (the rows
        kernel needs the pinned pool's device view): back up at insertion instead."""
        if self.arena is not None:
            raise IntegrityError("per-layer backups are not supported for a unified device pool")
        if self.cuda and not self.pinned:
            return None
        lists, op = self._begin("d2h", device_pages, host_pages, copy=False)
        return Layered(
            lists[self.dev.specs[0].name],
            op,
            rows=self.rows,
            specs=self.dev.specs,
            device=self.dev.device,
            backup_stream=self.backup_stream,
        )

    def _names(self, components: Sequence[str] | None) -> list[str]:
        """Components a copy moves, in pool order; an unknown name raises ``RequestError``."""
        if components is None:
            return list(self.rows)
        unknown = [c for c in components if c not in self.rows]
        if unknown:
            held = ", ".join(self.rows)
            raise RequestError(f"transfer of components {unknown}: the pools hold {held}")
        return [n for n in self.rows if n in components]

    def device_to_host(
        self,
        device_pages: torch.Tensor,
        host_pages: torch.Tensor,
        components: Sequence[str] | None = None,
    ) -> TransferOp:
        """Copy device pages into host pages (a backup) of ``components`` (default all; the
        host rows of the others stay untouched). The host copy is valid once done.

        On CUDA the copies follow the work already queued on the caller's stream (the data's
        writer); the device pages must stay unchanged until the op is done. With a :attr:`pacer`
        the copies are queued chunk by chunk at later :meth:`pump` calls (``op.wait()`` queues
        the rest at once); else this call queues them all.
        """
        pages, op = self._begin("d2h", device_pages, host_pages, components=components)
        if not self.cuda or not op.num_pages:  # nothing of it on this rank: born done
            op.release()
            return op
        try:
            start = recorded(torch.cuda.current_stream(self.dev.device))
            chunk = max(1, self.staging_bytes // 2) if self.pacer is not None else 0
            chunks = self._backup(pages, op, start, chunk)
            if self.pacer is not None:
                self.pacer.submit(op, chunks)
            else:
                with self._on_backup_stream():
                    queue_all(chunks)
        except BaseException:
            op.release()
            raise
        return op

    def pump(self) -> None:
        """Queue paced backup chunks within the pacer's budget (once per scheduler step)."""
        if self.pacer is not None:
            self.pacer.pump()

    def _on_backup_stream(self) -> contextlib.ExitStack:
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.cuda.device(self.dev.device))
        ctx.enter_context(on(self._stream(self.backup_stream)))
        return ctx

    def _mark(self) -> EventMark:
        return EventMark(self.backup_stream)

    def _backup(
        self, pages: dict[str, PageLists], op: TransferOp, start: torch.cuda.Event, chunk: int
    ) -> Iterator[int]:
        """A backup's chunks (see ``kvtier.transfer.pacer``), on the backup stream after
        ``start``; the last resumption records ``op.event``."""
        stream = self._stream(self.backup_stream)
        stream.wait_event(start)
        finals: list[Callable[[], None]] = []
        for name, part in pages.items():
            if not part.device.numel():
                continue  # no page of the batch holds this (window) component
            final = yield from self.mechanisms.chunks(
                name, self.rows[name], "d2h", part, stream, op, chunk
            )
            if final is not None:
                finals.append(final)
        op.event = recorded(stream)
        if finals:

            def finalize() -> None:
                for f in finals:
                    f()

            op.finalize = finalize

    def close(self) -> None:
        """Queue every paced backup chunk still waiting (the copies then finish on their own)."""
        if self.pacer is not None:
            self.pacer.flush()

    def host_to_device(
        self,
        host_pages: torch.Tensor,
        device_pages: torch.Tensor,
        overlap: bool = False,
        components: Sequence[str] | None = None,
    ) -> TransferOp:
        """Copy host pages into device pages (a load-back) of ``components`` (default all).

        On CUDA the compute stream is made to wait for the copy, so kernels issued after this
        call read the loaded pages without the host ever blocking. With ``overlap`` (CUDA with
        a pinned host pool) the compute stream is not made to wait: the anchor component is
        copied layer by layer, after every other component, and ``op.layer_events[i]`` marks
        anchor layer ``i`` (and everything before it) as arrived; the caller waits per layer.
        """
        if overlap and self.arena is not None:
            raise IntegrityError("per-layer loads are not supported for a unified device pool")
        pages, op = self._begin("h2d", device_pages, host_pages, components=components)
        if not self.cuda or not op.num_pages:  # nothing of it on this rank: born done
            op.release()
            return op
        try:
            compute = torch.cuda.current_stream(self.dev.device)
            with torch.cuda.device(self.dev.device), on(self._stream(self.load_stream)):
                queue_all(self._load_chunks(pages, op, overlap, compute))
        except BaseException:
            op.release()
            raise
        return op

    def exchange(
        self, backup: tuple[torch.Tensor, torch.Tensor], load: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[TransferOp, TransferOp]:
        """A backup ``(device_pages, host_pages)`` and a load ``(host_pages, device_pages)``
        at once: ``(backup op, load op)``, with the contracts of :meth:`device_to_host` and
        :meth:`host_to_device` (no per-layer overlap; the pacer is bypassed).

        Their chunks are queued in turn, the backup's first, each job leading with
        ``plan.SHARED_FIRST_SLICE_BYTES`` (a small component's only slice would leave its copy
        engine idle through the other's set-up). Queued one after the other, the second waits
        for the first's whole CPU issue (2-9 ms per GiB on an H200 for staged copies). The two
        share no host page and no device page: neither waits for the other's copies.
        """
        if self.debug_checks:
            for side, a, b in (("device", backup[0], load[1]), ("host", backup[1], load[0])):
                if bool(torch.isin(a.reshape(-1).cpu(), b.reshape(-1).cpu()).any()):
                    raise RequestError(f"exchange: the backup and the load share {side} pages")
        bpages, bop = self._begin("d2h", backup[0], backup[1])
        try:
            lpages, lop = self._begin("h2d", load[1], load[0])
        except BaseException:
            bop.release()
            raise
        bop.shared_link = lop.shared_link = True
        if not self.cuda:
            return bop, lop
        try:
            with torch.cuda.device(self.dev.device):
                compute = torch.cuda.current_stream(self.dev.device)
                jobs: list[tuple[Iterator[int], torch.cuda.Stream]] = []
                # Load first, MLA at page size 1 ran one direction after the other: 0.53 of two
                # contiguous copies, 0.95 backup first (results/h200-dma/run16/).
                if bop.num_pages:
                    start = recorded(compute)
                    jobs.append((self._backup(bpages, bop, start, 0), self.backup_stream))
                if lop.num_pages:
                    chunks = self._load_chunks(lpages, lop, False, compute)
                    jobs.append((chunks, self.load_stream))
                interleave(jobs, lead=SHARED_FIRST_SLICE_BYTES)
        except BaseException:
            bop.release()
            lop.release()
            raise
        for op in (bop, lop):
            if not op.num_pages:  # nothing of it on this rank: born done
                op.release()
        return bop, lop

    def _load_chunks(
        self,
        pages: dict[str, PageLists],
        op: TransferOp,
        overlap: bool,
        compute: torch.cuda.Stream,
    ) -> Iterator[int]:
        """A load's chunks (see ``Mechanisms.chunks``), each resumed on the load stream; the
        copies follow the work queued on ``compute`` so far, and ``compute`` is made to wait
        for them at the end (unless ``overlap``)."""
        stream, anchor = self._stream(self.load_stream), self.dev.specs[0].name
        stream.wait_stream(compute)
        # A coded anchor is decoded in chunks of rows, not layer by layer: loaded whole.
        overlap = overlap and self.pinned and anchor in pages and anchor not in self.coded
        for name, part in pages.items():
            if not (overlap and name == anchor) and part.device.numel():
                yield from self.mechanisms.chunks(name, self.rows[name], "h2d", part, stream, op)
        # Joined once here: no component's first copy waits for the scatters before it.
        stream.wait_stream(self.mechanisms.helpers["h2d"])
        if overlap:
            op.layer_events = self.mechanisms.load_layers(
                anchor, self.rows[anchor], pages[anchor], stream, op
            )
            op.paths[anchor] += " per layer"
        op.event = recorded(stream)
        if not overlap:
            compute.wait_event(op.event)

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        if stream is None:
            raise IntegrityError(f"CUDA copy path taken by a mover on {self.dev.device}")
        return stream
