"""``LLM``: the engine's front end. Builds model, tiered cache, scheduler and runner; validates
requests; runs steps until requests finish."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvtier.cache import TieredCache
from kvtier.config import CacheConfig
from kvtier.engine import graphs, speculative
from kvtier.engine.families import build_model
from kvtier.engine.model import CausalLM
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.request import (
    Request,
    RequestOutput,
    check_limits,
    check_sampling,
    checked_tokens,
    int32_tokens,
)
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams, StopStrings, TokenLogprob
from kvtier.engine.scheduler import Scheduler, Work
from kvtier.engine.weights import load_model, load_tokenizer
from kvtier.errors import ConfigError, RequestError, check_bool, check_type, describe
from kvtier.parallel.group import Group

Prompt = Sequence[int] | str
log = logging.getLogger("kvtier.engine")


class LLM:
    """Offline engine over a ``TieredCache``.

    ``model`` is a model config of any family (seeded random weights; see
    ``kvtier.engine.families.preset``), a HF checkpoint directory, or an already built model.
    The cache namespace gets the model's fingerprint, so L3 objects written by one model are
    never read by another.
    """

    def __init__(
        self,
        model: ModelConfig | CausalLM | str | Path,
        cache_config: CacheConfig | None = None,
        *,
        max_running: int = 16,
        max_prefill_tokens: int = 4096,
        overlap_loads: bool = True,
        group: Group | None = None,
        speculative_tokens: int = 0,
        cuda_graphs: bool = True,
        tokenizer: Any = None,
    ) -> None:
        """``group``: the context-parallel group this rank belongs to (``None`` without
        context parallelism); every rank of it runs the same requests.
        ``speculative_tokens``: draft tokens each decode step of a greedy request proposes
        with the model's draft head and verifies in one forward (``kvtier.engine.speculative``);
        ``0``: off. Needs a draft head (``mtp_layers > 0``); under context parallelism every
        rank proposes, verifies and accepts the same tokens.
        ``cuda_graphs``: decode steps of the dense model on CUDA replay recorded graphs
        (``kvtier.engine.graphs``); ``False`` runs every forward eagerly.
        ``tokenizer``: what text prompts, stop strings and ``RequestOutput.text`` go through
        (``encode``/``decode`` as ``weights.Tokenizer`` offers them, e.g. a
        ``kvtier.engine.byte_tokenizer.ByteTokenizer``); ``None``: a checkpoint directory's
        ``tokenizer.json`` when it has one."""
        if not isinstance(cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        check_bool(overlap_loads, "overlap_loads", "LLM", ConfigError)
        if not is_dataclass(model) or isinstance(model, type):  # every family's config is one
            check_type(
                model,
                (ModelConfig, nn.Module, str, Path),
                "model",
                "LLM",
                "a model config, a checkpoint directory or a built model",
                ConfigError,
            )
        check_type(
            cache_config, (CacheConfig, type(None)), "cache_config", "LLM", error=ConfigError
        )
        for opt, v in (("max_running", max_running), ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{opt} must be a positive integer, got {v!r}")
        self.tokenizer: Any = tokenizer
        if isinstance(model, (str, Path)):
            if tokenizer is None:
                self.tokenizer = load_tokenizer(model)
            model = load_model(model)
        elif not isinstance(model, nn.Module):
            model = build_model(model)
        self.model_config = model.config
        self.speculative_tokens = speculative.check_option(speculative_tokens, model)
        self._drafts = {"spec_draft_proposed": 0, "spec_draft_accepted": 0}
        self._split_forwards = 0
        """Batched forwards that raised and were run again one request at a time."""
        cache_config = dataclasses.replace(
            cache_config or CacheConfig(), model_fingerprint=self.model_config.fingerprint()
        )
        specs = model.pool_specs()
        # without CP the cache is built exactly as before (no group argument at all)
        self.cache = (
            TieredCache(cache_config, specs)
            if group is None
            else TieredCache(cache_config, specs, group=group)
        )
        kv = self.cache.kv_buffers
        self.model = model.to(kv.device)
        self.scheduler = Scheduler(
            self.cache,
            max_running,
            max_prefill_tokens,
            self.model_config.eos_token_ids,
            overlap_loads,
            self.speculative_tokens,
        )
        self._padding = graphs.PaddingPage(self.cache, self.model, cuda_graphs)
        self.runner = ModelRunner(
            self.model, kv, self.cache.page_size, cuda_graphs, self._padding.slot
        )
        # On CUDA every step (cache calls and forward) runs on one high-priority stream, so
        # that when load-back kernels and the forward overlap, the forward's blocks go first.
        self._compute_stream = None
        if self.cache.device.type == "cuda":
            # Out-of-range priorities clamp to the highest the device has.
            self._compute_stream = torch.cuda.Stream(self.cache.device, priority=-100)
        self._ids = itertools.count()
        self._live: dict[int, Request] = {}
        """Unfinished requests by id (the step-wise API's view of them)."""
        self._closed = False
        """Whether a prefill forward ran before (the first one's time is not the rate's)."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Validate and queue one request; returns its id. Raises ``RequestError``."""
        self._check_open("add_request")
        req = self._make_request(prompt, _checked_params(params, "add_request"))
        self._queue(req)
        return req.id

    def _queue(self, req: Request) -> None:
        self.scheduler.add(req)
        self._live[req.id] = req

    def output_ids(self, request_id: int) -> list[int]:
        """The tokens an unfinished request generated so far (a copy); what ``step`` adds to
        it between calls is what a streaming caller sends. Raises ``RequestError`` for an id
        that is unknown or finished."""
        return self._get_live(request_id).output

    def output_logprobs(self, request_id: int, start: int = 0) -> list[TokenLogprob]:
        """The log-probabilities of an unfinished request's output tokens from ``start`` on
        (empty unless its ``SamplingParams.logprobs`` asked for them); ``RequestError`` as
        for ``output_ids``."""
        return list((self._get_live(request_id).logprobs or [])[start:])

    def abort(self, request_id: int) -> RequestOutput:
        """Stop an unfinished request now (``finish_reason="abort"``): its lock and its own
        pages go back (what it computed is cached), a prefetch it waits on is released.
        Raises ``RequestError`` for an id that is unknown or finished."""
        self._check_open("abort")
        req = self.scheduler.cancel(self._get_live(request_id))
        del self._live[request_id]
        return req.to_output(self._decode(req.output))

    def counts(self) -> dict[str, int]:
        """Unfinished requests: ``waiting`` (not admitted, or preempted) and ``running``."""
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running)}

    def _get_live(self, request_id: int) -> Request:
        req = self._live.get(request_id)
        if req is None:
            raise RequestError(f"request {request_id!r} is unknown or already finished")
        return req

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        tokens, held = self._tokens(prompt)  # ``held``: the request's own container
        pool = self.cache.kv_buffers
        check_limits(
            held,
            params.max_tokens,
            self.model_config,
            pool.page_size,
            pool.num_pages,
            self._padding.pages,
        )
        check_sampling(params, self.model_config.vocab_size)
        return Request(
            id=next(self._ids),
            prompt=tokens,
            params=params,
            tokens=held,
            arrival=time.perf_counter(),
            generator=params.make_generator(),
            stops=StopStrings.of(params, self.tokenizer),
        )

    def _tokens(self, prompt: Prompt) -> tuple[list[int], array[int]]:
        """The prompt's ids (``checked_tokens``; a text prompt through the tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompt given but the model has no tokenizer")
            ids = self.tokenizer.encode(prompt)
            return ids, int32_tokens(ids)
        return checked_tokens(prompt)

    def step(self) -> list[RequestOutput]:
        """One scheduler step (at most one forward); returns the requests that finished. The
        cache's KV events of the step (``CacheConfig.kv_events``) are published by its end.

        A request whose forward or sampling raises is finished with ``finish_reason="error"``
        and the error in ``RequestOutput.error``; its pages go back and the others go on."""
        self._check_open("step")
        if self._compute_stream is None:
            done = self._step()
        else:
            with torch.cuda.stream(self._compute_stream):
                done = self._step()
        # the pages the step's finished requests left in the cache are announced now, not at
        # the next step's poll, which an idle engine may never take
        self.cache.publish_events()
        return done

    def _step(self) -> list[RequestOutput]:
        work = self.scheduler.schedule()
        if not work:
            self.cache.poll()
            if self.scheduler.prefetching():  # nothing to compute until storage reads land
                self.cache.wait_prefetch(self.scheduler.prefetch_ops(), timeout=0.05)
            return []
        if self.speculative_tokens:
            self._propose(work)
        polled: list[BaseException | None] = []
        poll_s = 0.0

        def poll() -> None:
            # While the forward runs (its logits come back through SM stores, which no backup
            # copy queued here can delay); its CPU time hid behind the GPU's. The backups it
            # queues have until the next step's read (``CacheConfig.backup_share``). A failure
            # is the poll's, not the forward's: kept, and raised once the forward is done.
            nonlocal poll_s
            if not polled:
                t = time.perf_counter()
                try:
                    self.cache.poll()
                    polled.append(None)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    polled.append(e)
                poll_s = time.perf_counter() - t

        scheduled = work
        splits = self._split_forwards
        t0 = time.perf_counter()
        work, logits, failed = self._forward(work, poll)
        forward_s = time.perf_counter() - t0
        poll()  # a forward that failed before its read
        if self.cache.device.type != "cuda":
            forward_s -= poll_s  # a CPU forward is done before the poll runs
        self._record_prefill(
            scheduled, forward_s if not failed and splits == self._split_forwards else None
        )
        if polled[0] is not None:
            raise polled[0]
        sampled: list[list[int]] = []
        errors: dict[int, Exception] = {}
        firsts = list(itertools.accumulate((1 + len(w.draft) for w in work), initial=0))
        plain = [i for i, w in enumerate(work) if not w.draft]
        drawn = {}
        if plain:  # (a failed forward leaves no work and no logits)
            # without drafts every row is a plain item's, in order: no gathered copy
            rows = logits if len(plain) == logits.shape[0] else logits[[firsts[i] for i in plain]]
            drawn = dict(
                zip(plain, self.runner.sample([work[i] for i in plain], rows), strict=True)
            )
        for i, w in enumerate(work):
            try:
                if w.draft:
                    sampled.append(speculative.accept(w, logits[firsts[i] : firsts[i + 1]]))
                elif isinstance(drawn[i], Exception):
                    raise drawn[i]
                else:
                    sampled.append([drawn[i]])
            except Exception as e:  # noqa: BLE001 - one request's failure ends only that request
                errors[i] = e
                sampled.append([-1])
        # Once per step over every item, on every CP rank: the same tokens everywhere (a
        # verified draft's accepted count included), and an item that failed on any rank (-1,
        # the minimum) fails on all of them.
        agreed = speculative.agree_tokens(self.runner.group, sampled, [len(w.draft) for w in work])
        ok: list[Work] = []
        tokens: list[list[int]] = []
        for i, (w, t) in enumerate(zip(work, agreed, strict=True)):
            if t[0] >= 0:
                ok.append(w)
                tokens.append(t)
                if len(t) < len(sampled[i]):  # another rank accepted fewer: keep its count
                    cut = len(sampled[i]) - len(t)
                    w.req.draft_accepted -= cut
                    if w.req.logit_rows is not None:
                        del w.req.logit_rows[-cut:]
            else:
                e = errors.get(i) or RequestError(
                    f"request {w.req.id}: sampling failed on another CP rank"
                )
                failed.append((w.req, e))
        for w in ok:
            self._drafts["spec_draft_proposed"] += len(w.draft)
        self._drafts["spec_draft_accepted"] += sum(len(t) - 1 for t in tokens)
        finished = self.scheduler.update(ok, tokens)
        finished += [self.scheduler.abort(req, e) for req, e in failed]
        for r in finished:
            self._live.pop(r.id, None)
        return [r.to_output(self._decode(r.output)) for r in finished]

    def _record_prefill(self, work: list[Work], seconds: float | None) -> None:
        """Tell the cache the step's prefill tokens and, for a forward that ran whole
        (``seconds``), how long it took for all its tokens: the prefill rate a restore is
        priced against (on CUDA the time may include a poll the GPU did not hide; the fit
        leaves out each size's first forward, which pays for set-up)."""
        prefill = sum(w.num_new for w in work if w.prefill)
        if not prefill:
            return
        if seconds is None or seconds <= 0:
            self.cache.record_prefill(prefill)
            return
        chunks = [(w.req.num_computed, w.num_new) for w in work]
        self.cache.record_prefill(prefill, seconds, sum(n for _, n in chunks), chunks)

    def _propose(self, work: list[Work]) -> None:
        """Draft tokens for the step's speculating items. A failing draft costs only the
        speculation: the items then decode one token this step."""
        try:
            speculative.propose(self.model, self.cache.kv_buffers, work)
        except Exception as e:  # noqa: BLE001 - the target forward does not need a draft
            log.warning("draft proposal failed, decoding without it: %s: %s", type(e).__name__, e)
            for w in work:
                if w.draft:
                    w.draft, w.num_new = [], 1
        # every CP rank verifies the same drafts (an item whose proposal failed on a rank
        # decodes one token everywhere)
        speculative.agree_drafts(self.runner.group, work)

    def _forward(
        self, work: list[Work], while_running: Callable[[], None]
    ) -> tuple[list[Work], torch.Tensor, list[tuple[Request, Exception]]]:
        """The step's forward (``while_running`` as for ``ModelRunner.forward``). If it raises,
        the requests are run one by one to find the ones that fail (a stateful model's running
        state may be half updated: the whole batch fails); the failures come back to be
        finished with their error."""
        layered = self.cache.backup_layers(
            [
                # a draft's positions may be rejected: only the verified token's KV is kept
                (w.req.tokens, w.req.locs, w.req.num_computed, w.req.num_computed + 1)
                if w.draft
                else (w.req.tokens, w.req.locs, w.req.num_computed, w.req.num_computed + w.num_new)
                for w in work
                if w.req.locs is not None
            ]
        )
        try:
            logits = self.runner.forward(work, layered, while_running)
            if layered is not None:
                self.cache.end_backup_layers(layered)
            return work, logits, []
        except Exception as e:  # noqa: BLE001 - isolated below, re-raised per request
            if layered is not None:  # what it copied may be half written: back up at insert
                self.cache.end_backup_layers(layered, ok=False)
            if len(work) == 1 or self.runner.stateful:
                return [], torch.empty(0), [(w.req, e) for w in work]
            # Said out loud: a failure that no single request reproduces would otherwise only
            # show as steps many times slower.
            self._split_forwards += 1
            log.warning(
                "a forward of %d requests failed, running them one at a time: %s: %s",
                len(work),
                type(e).__name__,
                e,
            )
        ok: list[Work] = []
        rows: list[torch.Tensor] = []
        failed: list[tuple[Request, Exception]] = []
        for w in work:
            try:
                rows.append(self.runner.forward([w], full=True))  # concatenated below
                ok.append(w)
            except Exception as e:  # noqa: BLE001
                failed.append((w.req, e))
        return ok, torch.cat(rows) if rows else torch.empty(0), failed

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion together; outputs come back in prompt order.

        Every prompt is validated before any is queued. Requests queued earlier with
        ``add_request`` also run, but their outputs are not returned here.
        """
        self._check_open("generate")
        if isinstance(prompts, str | bytes) or not (
            hasattr(prompts, "__len__") and hasattr(prompts, "__getitem__")
        ):
            raise RequestError(
                f"generate: prompts must be a list of prompts, got {describe(prompts)} "
                "(one prompt: generate([prompt]))"
            )
        if prompts and not isinstance(prompts[0], str) and not hasattr(prompts[0], "__len__"):
            raise RequestError(
                f"generate: prompts must be a list of prompts, got a list whose item 0 is "
                f"{describe(prompts[0])} (one prompt of token ids: generate([token_ids]))"
            )
        if params is None or isinstance(params, SamplingParams):
            params = [_checked_params(params, "generate")] * len(prompts)
        elif isinstance(params, str | bytes) or not isinstance(params, Sequence):
            raise RequestError(
                "generate: params must be SamplingParams, a list of them (one per prompt) or "
                f"None, got {describe(params)}"
            )
        else:
            params = [
                _checked_params(sp, "generate", f"params[{i}]") for i, sp in enumerate(params)
            ]
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        reqs = [self._make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        for req in reqs:
            self._queue(req)
        ids = [r.id for r in reqs]
        done: dict[int, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    def stats(self) -> dict:
        """The cache's counters, ``split_forwards`` (batched forwards that raised and were run
        again one request at a time, to end only the requests that fail), with CUDA graphs
        the decode graphs recorded, the steps replayed and those padded to their graph's batch
        (``graph_captures``/``graph_replays``/``graph_padded``), and with speculative decoding
        the draft tokens proposed and accepted (``spec_draft_proposed``/
        ``spec_draft_accepted``) over every request."""
        st = self.cache.stats()
        st["split_forwards"] = self._split_forwards
        g = self.runner.graphs
        if g is not None:
            st.update(graph_captures=g.captures, graph_replays=g.replays, graph_padded=g.padded)
        if self.speculative_tokens:
            st.update(self._drafts)
        return st

    def check_integrity(self) -> None:
        """The cache's invariants (``TieredCache.check_integrity``) and the padding page's
        (``graphs.PaddingPage.check``). Raises ``IntegrityError``."""
        self.cache.check_integrity()
        self._padding.check(self.cache, self._live.values())

    def close(self) -> None:
        """Let in-flight cache transfers land (storage writes included) and release L3."""
        self._closed = True
        self.cache.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RequestError(f"LLM.{what}() after close()")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_params(params: object, where: str, name: str = "params") -> SamplingParams:
    """``params`` (``None``: the defaults); ``RequestError`` naming ``where``, ``name`` and the
    value for another type."""
    if params is None:
        return SamplingParams()
    return check_type(params, SamplingParams, name, where, "SamplingParams or None")
