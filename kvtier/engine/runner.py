"""Turns a scheduled batch into one model forward and samples each sequence's next token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.engine import cp, graphs
from kvtier.engine.batch import SeqSlots
from kvtier.engine.model import CausalLM
from kvtier.engine.sampling import sample
from kvtier.engine.scheduler import Work
from kvtier.errors import IntegrityError
from kvtier.transfer import DeviceKV
from kvtier.transfer.layers import Layered
from kvtier.transfer.mapped import map_pinned


class ModelRunner:
    """Flattens ``Work`` items into ``input_ids``/``positions``/``SeqSlots`` and runs the model
    against the device pool ``kv`` (``TieredCache.kv_buffers``). Requests hold the cache's
    logical slots; every slot and state row handed to the model is ``kv.slots`` of them."""

    def __init__(
        self,
        model: CausalLM,
        kv: DeviceKV,
        page_size: int,
        cuda_graphs: bool = True,
        pad_slot: int | None = None,
    ) -> None:
        """``cuda_graphs``: replay recorded decode steps where ``graphs.supported``;
        ``pad_slot``: a device slot no request holds, where padding rows of a replayed step
        write (``graphs.DecodeGraphs``)."""
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.device = model.device
        self.stateful = bool(getattr(model, "stateful", False))
        self.checkpoint_every = (
            int(getattr(model.config, "checkpoint_every", 1)) if self.stateful else 0
        )
        self.window = next((s for s in model.pool_specs() if s.kind == "window"), None)
        """The window component (its layers read only the last ``window`` positions)."""
        self.group = cp.cp_group(kv)
        """The CP group this rank runs in (``None`` without context parallelism)."""
        cp.check_supported(model, self.group)
        self.graphs = (
            graphs.DecodeGraphs(model, kv, pad_slot)
            if cuda_graphs and graphs.supported(model, kv)
            else None
        )
        """Recorded decode steps (``None``: every forward runs eagerly)."""
        self._argmax: tuple[torch.Tensor, torch.Tensor] | None = None
        """The last forward's host logits and their rows' argmax (CUDA only)."""

    def run(self, work: list[Work]) -> list[int]:
        """One forward over ``work``; returns the sampled next token of each item, in order."""
        tokens = self.sample(work, self.forward(work))
        for t in tokens:
            if isinstance(t, Exception):
                raise t
        return self.agree(tokens)

    def forward(
        self,
        work: list[Work],
        layered: Layered | None = None,
        while_running: Callable[[], None] | None = None,
        full: bool | None = None,
    ) -> torch.Tensor:
        """One forward over ``work``; returns each item's last logits, read back to the CPU
        (the step's one device → host read): one row per item, ``1 + len(draft)`` rows (its
        last token's and every draft token's) for an item verifying a draft. ``layered``
        (``cache.backup_layers``) is told of each anchor layer the forward finished.
        ``while_running`` is called once the forward and its read are queued, before the host
        waits for them (CPU work that then overlaps the GPU's).

        ``full``: whether the rows' logits come back; ``None`` asks :meth:`needs_logits`. On
        CUDA a forward whose logits stay behind reads only each row's argmax (for
        :meth:`sample`) and returns a ``(rows, 0)`` tensor; on the CPU the logits are there
        already and always come back."""
        if full is None:
            full = self.needs_logits(work)
        if self.graphs is not None and layered is None and self._replayable(work):
            ctx = [self.kv.slots(w.req.locs[: w.req.num_computed + 1]) for w in work]
            ids = [w.req.tokens[w.req.num_computed] for w in work]
            return self._to_host(self.graphs.forward(ctx, ids), while_running, full)
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlots] = []
        for w in work:
            req = w.req
            if req.locs is None:
                raise IntegrityError(f"request {req.id} scheduled without slots")
            start, end = req.num_computed, req.num_computed + w.num_new
            ids.extend(req.tokens[start : end - len(w.draft)])  # an int32 array: no list +
            ids.extend(w.draft)
            positions.extend(range(start, end))
            if self.group is not None:
                seqs.append(cp.seq_slots(self.kv, req.locs[:end], start, self.device))
                continue
            phys = self.kv.slots(req.locs[:end])
            ctx = phys.to(self.device, non_blocking=True)
            seq = SeqSlots(w.num_new, ctx[start:], ctx)
            if self.window is not None:
                # the first new query reads (start - window, start]: only those rows exist
                lo = max(0, start - self.window.window + 1)
                win = self.kv.slots(req.locs[lo:end], self.window.name)
                seq.window_locs, seq.window_start = win.to(self.device, non_blocking=True), lo
            if self.stateful:
                self._attach_state(req, seq, start, end, phys)
            seqs.append(seq)
        waits = [w.req.layer_events for w in work if w.req.layer_events]
        for w in work:
            w.req.layer_events = None
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            seqs,
            self.kv,
            before_layer=_layer_waiter(waits) if waits else None,
            last_logits=[1 + len(w.draft) for w in work],
            after_layer=layered.layer_done if layered is not None else None,
        )
        return self._to_host(logits, while_running, full)

    @staticmethod
    def needs_logits(work: list[Work]) -> bool:
        """Whether any item of ``work`` needs its logit rows on the host: one that samples
        (not greedy), verifies a draft, or keeps its logits (``return_logits``). A greedy
        batch needs only each row's argmax: a decode step of 32 requests would otherwise
        move 32 x vocabulary logits over the link every step, beside the backups. Log-
        probabilities, penalties and biases need the whole row too."""
        return any(
            w.draft or w.req.logit_rows is not None or w.req.logprobs is not None or not _greedy(w)
            for w in work
        )

    def _to_host(
        self,
        logits: torch.Tensor,
        while_running: Callable[[], None] | None,
        full: bool = True,
    ) -> torch.Tensor:
        """``logits`` on the CPU (``_to_host``); on CUDA each row's argmax is read with them,
        for :meth:`sample`'s greedy rows (kept in :attr:`_argmax` with the rows they are of),
        and without ``full`` only the argmax is read: the rows come back as ``(rows, 0)``."""
        self._argmax = None
        if logits.device.type != "cuda" or logits.dim() != 2:
            return _to_host(logits, while_running)
        best = torch.empty(logits.shape[0], dtype=torch.int64, pin_memory=True)
        torch.argmax(logits, dim=-1, out=map_pinned(best, logits.device))
        host = _to_host(logits, while_running, full)
        self._argmax = (host, best)
        return host

    @staticmethod
    def _replayable(work: list[Work]) -> bool:
        """Every item decodes one token of its own (no draft, no load still arriving)."""
        return len(work) <= graphs.MAX_BATCH and all(
            w.num_new == 1 and not w.draft and not w.req.layer_events and w.req.locs is not None
            for w in work
        )

    def sample(self, work: list[Work], logits: torch.Tensor) -> list[int | Exception]:
        """Each item's next token from its row of ``logits`` (on the CPU), or the exception
        sampling it raised (which ends only that item). Greedy rows share one ``argmax``
        (one per row cost more than a decode step's forward on a large GPU). A request that
        asked for its logits keeps the row of every token sampled for it."""
        greedy = [i for i, w in enumerate(work) if _greedy(w)]
        best: dict[int, int] = {}
        if greedy:
            read = self._argmax
            # the forward's own rows: their argmax came back with them (one CPU argmax over a
            # batch's logits cost 0.6-0.8 ms a step, a tenth of a decode step on a large GPU)
            ids = read[1][greedy] if read is not None and read[0] is logits else None
            if ids is None:
                ids = logits[greedy].argmax(dim=-1)
            best = dict(zip(greedy, ids.tolist(), strict=True))
        tokens: list[int | Exception] = []
        for i, w in enumerate(work):
            try:
                params = w.req.params
                if i in best:
                    t = best[i]
                else:
                    # penalties count the output so far (read only when they are set)
                    out = w.req.tokens[len(w.req.prompt) :] if params.shapes_logits else ()
                    t = sample(logits[i], params, w.req.generator, out)
                w.req.record_logits(logits[i])
                w.req.record_logprob(logits[i], t)
            except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                t = e
            tokens.append(t)
        return tokens

    def agree(self, tokens: list[int]) -> list[int]:
        """The step's tokens, the same on every CP rank: the elementwise minimum over the
        group (ranks whose generators differ still continue identically). A negative entry
        (an item that failed here) stays negative everywhere. Without CP: ``tokens``. Every
        rank calls it once per step with one entry per item, in the same order."""
        if self.group is None:
            return tokens
        return self.group.all_reduce_min_many(tokens)

    def _attach_state(self, req, seq: SeqSlots, start: int, end: int, locs: torch.Tensor) -> None:
        """Give a stateful model the request's running state and where to checkpoint it.

        A request starts from the checkpoint at the end of its cached prefix (the cache only
        hands out prefixes ending at one) or from zeros. The state of page ``j`` (tokens
        ``[j*ps, (j+1)*ps)``) is checkpointed into the page's own state row when ``j + 1`` is a
        multiple of ``checkpoint_every``. ``locs`` are the request's physical slots.
        """
        ps = self.page_size
        if req.state is None:
            if start > 0:
                req.state = self.model.load_state(self.kv, int(locs[start - 1]) // ps)
            else:
                req.state = self.model.zero_state()
        seq.state = req.state
        # Only the last token of each page can end a checkpoint: step from page end to page end.
        for p in range(start + (ps - 1 - start % ps), end, ps):
            page = p // ps
            if (page + 1) % self.checkpoint_every == 0:
                seq.state_out.append((p - start, int(locs[p]) // ps))
                req.checkpoints.add(page)


def _greedy(w: Work) -> bool:
    """The item's next token is its row's argmax (no penalty or bias changes the row)."""
    p = w.req.params
    return p.argmax_only or (w.req.generator is None and not p.shapes_logits)


def _to_host(
    logits: torch.Tensor, while_running: Callable[[], None] | None, full: bool = True
) -> torch.Tensor:
    """``logits`` on the CPU; ``while_running()`` is called before the host waits for them.
    On CUDA a kernel writes them into pinned memory through its device mapping: the copy
    engines serve copies in the order queued, so a copy would wait behind every backup chunk
    queued before it (a step's worth, by the pacer's budget), and a pageable copy cost over a
    millisecond on its own. Backups queued by ``while_running`` therefore cannot delay it.
    Without ``full`` a CUDA forward's rows stay behind (``(rows, 0)`` comes back) and the host
    only waits for the work queued before."""
    if logits.device.type != "cuda":
        host = logits.cpu()
        if while_running is not None:
            while_running()
        return host
    if full:
        host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        torch.mul(logits, 1, out=map_pinned(host, logits.device))  # SM stores, not a copy engine
    else:
        host = torch.empty((logits.shape[0], 0), dtype=logits.dtype)
    if while_running is not None:
        while_running()
    torch.cuda.current_stream(logits.device).synchronize()
    return host


def _layer_waiter(waits: list[list]):  # noqa: ANN202 - a closure over CUDA events
    """Make the compute stream wait, before anchor layer ``j`` is read, for that layer of every
    host load in the batch (per-layer overlap of load-back and prefill)."""

    def wait(j: int) -> None:
        stream = torch.cuda.current_stream()
        for events in waits:
            stream.wait_event(events[min(j, len(events) - 1)])

    return wait
