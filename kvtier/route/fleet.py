"""The fleet: every configured instance, their health checks, and the choice of an instance
for one request (tokenize the prompt as the instances do, hash its pages, look them up in the
``PrefixIndex``, price each instance with ``scorer.choose``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.engine.byte_tokenizer import ByteTokenizer
from kvtier.errors import ConfigError
from kvtier.events.hashing import chain_hashes
from kvtier.route.instances import Instance, InstanceSpec
from kvtier.route.prefix_index import PrefixIndex
from kvtier.route.scorer import Candidate, Decision, Rates, choose
from kvtier.route.subscriber import EventSubscriber
from kvtier.server.load_cost import LoadCost

log = logging.getLogger("kvtier.route")


@dataclass(frozen=True)
class FleetOptions:
    """The router's knobs (``kvtier route`` flags of the same names)."""

    rates: Rates = Rates()
    page_size: int = 16
    """Tokens per page when neither the instance's KV events nor its model card say."""
    health_interval_s: float = 0.5
    """Seconds between two ``/health`` checks of an instance: how soon one that left is
    noticed (a request to it that fails to connect is noticed at once) and how fresh the tier
    rates it reports are."""
    health_timeout_s: float = 2.0
    events_stale_s: float = 10.0
    """An instance whose KV events (or heartbeats) stopped this long is priced by load alone."""
    tokenize_timeout_s: float = 2.0
    tokenize_cache: int = 4096
    """Prompts whose token ids are remembered (by text); 0 turns the cache off."""
    shared_storage: bool = False
    """Every instance reads one L3 (one Mooncake master and tenant salt): a page any of them
    stored counts as a storage page of each, so that storage hits, which every instance can
    take alike, do not pull requests to the instance that wrote them."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        for name in ("health_interval_s", "health_timeout_s", "events_stale_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tokenize_cache < 0:
            raise ValueError(f"tokenize_cache must be >= 0, got {self.tokenize_cache}")


def reported_rates(health: Any, defaults: Rates) -> Rates | None:
    """The rates an instance's ``/health`` answer reports (``rates``: tokens per second of
    prefill, host loads and storage reads, each as measured by its cache; the seconds each
    request in flight before its prefill costs a new one, each running one, and a request's
    duration, from the requests it served), the
    ``defaults`` for what it leaves out; ``None`` when it reports none or a value is out of
    range (that instance is priced with ``defaults``)."""
    got = health.get("rates") if isinstance(health, dict) else None
    if not isinstance(got, dict):
        return None
    fields = (
        "prefill_tokens_per_s",
        "host_tokens_per_s",
        "storage_tokens_per_s",
        "request_cost_s",
        "decode_cost_s",
        "request_duration_s",
    )
    values = {k: got[k] for k in fields if k in got}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()):
        return None
    try:
        return dataclasses.replace(defaults, **values)
    except ValueError:
        return None


def output_tokens(body: dict[str, Any]) -> int:
    """The most tokens the request may generate (``max_completion_tokens``, else
    ``max_tokens``); 0 when it names no number (its footprint then counts the prompt only)."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def tokenize_request(body: dict[str, Any], chat: bool) -> dict[str, Any] | list[int] | None:
    """What ``/tokenize`` of ``kvtier serve`` is asked for this generation request's prompt
    (chat: its messages, rendered with the generation prompt as the chat route does), the
    prompt's token ids when it already is ids, or ``None`` when there is nothing to tokenize.
    A text prompt keeps the request's ``add_special_tokens``. A batch of prompts is routed by
    its first."""
    if chat:
        messages = body.get("messages")
        return {"messages": messages} if isinstance(messages, list) and messages else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        prompt = prompt[0]
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int)]
    if not isinstance(prompt, str):
        return None
    special = body.get("add_special_tokens")  # as the instance will encode the text
    return {
        "prompt": prompt,
        **({"add_special_tokens": special} if isinstance(special, bool) else {}),
    }


@functools.cache
def _byte_tokenizer(vocab_size: int) -> ByteTokenizer:
    return ByteTokenizer(vocab_size)


class Fleet:
    """Instances, their health and their event subscribers; ``decide`` picks one per request.
    ``start``/``stop`` run on the proxy's event loop."""

    def __init__(
        self,
        specs: Sequence[InstanceSpec],
        options: FleetOptions,
        client: Any,
        index: PrefixIndex | None = None,
    ) -> None:
        self.options = options
        self.index = index if index is not None else PrefixIndex()
        self.observed = LoadCost()
        """What a request ahead costs and how long a request lasts, measured on every
        instance's answers: each instance's price until it has its own."""
        self.instances = [Instance(s, fleet_observed=self.observed) for s in specs]
        self._client = client
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._turn = 0
        """Advanced every decision: ties between instances are broken in turn."""
        self._task: asyncio.Task | None = None

    # lifecycle

    async def start(self) -> None:
        """Start every event subscriber, check health once (so that a router started after
        its instances serves at once), then keep checking in the background."""
        for inst in self.instances:
            if inst.spec.events:
                inst.subscriber = EventSubscriber(
                    inst.name, inst.spec.events, self.index, replay_endpoint=inst.spec.replay
                )
                inst.subscriber.start()
        await self.check_health()
        self._task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for inst in self.instances:
            if inst.subscriber is not None:
                inst.subscriber.stop()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # a bug here must not end health checking for good
                log.exception("health check failed")

    async def check_health(self) -> None:
        """One ``/health`` of every instance, side by side; instances join and leave."""
        await asyncio.gather(*(self._check(inst) for inst in self.instances))

    async def _check(self, inst: Instance) -> None:
        try:
            r = await self._client.get(f"{inst.name}/health", timeout=self.options.health_timeout_s)
            ok = r.status_code == 200
            if ok:
                inst.rates = reported_rates(r.json(), self.options.rates)
        except Exception:
            ok = False
        if ok and not inst.healthy:
            try:
                await self._read_models(inst)
            except Exception as e:
                log.warning("%s: /v1/models failed (%s); it stays out", inst.name, e)
                ok = False
        if ok != inst.healthy:
            log.warning("%s %s", inst.name, "joined" if ok else "left (health check failed)")
        inst.healthy = ok

    async def _read_models(self, inst: Instance) -> None:
        r = await self._client.get(f"{inst.name}/v1/models", timeout=self.options.health_timeout_s)
        r.raise_for_status()
        cards = [c for c in r.json().get("data", []) if isinstance(c, dict)]
        inst.models = cards
        sizes = [c.get("page_size") for c in cards if isinstance(c.get("page_size"), int)]
        inst.page_size = sizes[0] if sizes and sizes[0] > 0 else None
        pools = [c.get("device_tokens") for c in cards if isinstance(c.get("device_tokens"), int)]
        inst.device_tokens = pools[0] if pools and pools[0] > 0 else None
        vocabs = [
            c.get("vocab_size")
            for c in cards
            if c.get("tokenizer") == "bytes" and isinstance(c.get("vocab_size"), int)
        ]
        inst.byte_vocab = None
        if vocabs:
            try:
                _byte_tokenizer(vocabs[0])
                inst.byte_vocab = vocabs[0]
            except ConfigError as e:  # a card the byte tokenizer cannot have: ask /tokenize
                log.warning("%s: model card: %s", inst.name, e)

    def leave(self, inst: Instance, why: str) -> None:
        """Take ``inst`` out until its next successful health check."""
        if inst.healthy:
            log.warning("%s left (%s)", inst.name, why)
        inst.healthy = False

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    # the choice

    async def prompt_tokens(
        self, body: dict[str, Any], chat: bool, via: Instance
    ) -> list[int] | None:
        """The request's prompt as token ids, tokenized by ``via`` (cached by prompt), or here
        when ``via`` has a byte-level tokenizer (``Instance.byte_vocab``) and the prompt is
        text; ``None`` when it cannot be (no prompt, the instance refused or failed)."""
        ask = tokenize_request(body, chat)
        if ask is None or isinstance(ask, list):
            return ask
        if via.byte_vocab is not None and "prompt" in ask:
            return _byte_tokenizer(via.byte_vocab).encode(
                ask["prompt"], add_special_tokens=ask.get("add_special_tokens", True)
            )
        # per model: instances of another model tokenize the same text their own way
        key = json.dumps([str(body.get("model")), ask], sort_keys=True)
        hit = self._tokens.get(key)
        if hit is not None:
            self._tokens.move_to_end(key)
            return hit
        try:
            r = await self._client.post(
                f"{via.name}/tokenize", json=ask, timeout=self.options.tokenize_timeout_s
            )
            if r.status_code != 200:
                return None
            ids = r.json().get("tokens")
        except Exception as e:
            log.debug("%s: /tokenize failed: %s", via.name, e)
            return None
        if not isinstance(ids, list):
            return None
        if self.options.tokenize_cache:
            self._tokens[key] = ids
            while len(self._tokens) > self.options.tokenize_cache:
                self._tokens.popitem(last=False)
        return ids

    async def decide(
        self, body: dict[str, Any], chat: bool, tried: Sequence[Instance] = ()
    ) -> tuple[Instance, Decision] | None:
        """The instance this request goes to next and why, among the healthy ones not in
        ``tried`` that serve its ``model`` (``Instance.serves``); ``None`` when none is left."""
        model = body.get("model")
        pool = [i for i in self.healthy() if i not in tried and i.serves(model)]
        if not pool:
            return None
        tokens: list[int] | None = None
        if len(pool) > 1 and any(i.subscriber is not None for i in pool):
            tokens = await self.prompt_tokens(body, chat, pool[0])
        candidates = []
        now = time.monotonic()
        hashes: dict[int, list[int]] = {}
        # every configured instance: what one that left wrote to the L3 is still there
        shared = [i.name for i in self.instances] if self.options.shared_storage else []
        for inst in pool:
            size = inst.page_size_or(self.options.page_size)
            sub = inst.subscriber
            stale = sub is not None and sub.stale(self.options.events_stale_s)
            match = None
            if sub is not None and not stale and tokens is not None:
                if size not in hashes:
                    hashes[size] = chain_hashes(tokens, size)
                match = self.index.match(inst.name, hashes[size], shared)
            candidates.append(
                Candidate(
                    inst.name,
                    inst.in_flight,
                    match,
                    stale,
                    size,
                    inst.priced_rates(self.options.rates),
                    inst.device_tokens,
                    tuple(f.footprint for f in inst.flights),
                    tuple(now - f.sent for f in inst.flights),
                    inst.ahead().decoding,
                )
            )
        n = len(tokens) if tokens is not None else 0
        self._turn += 1
        decision = choose(candidates, n, self.options.rates, self._turn, output_tokens(body))
        return next(i for i in pool if i.name == decision.name), decision
