"""``kvtier bench multiturn``: does the tiered cache pay off end to end on the reference engine?

One workload runs, closed loop, on a fresh ``LLM`` per cache configuration (one model, one set of
weights, one set of prompts), next to a bound computed from rates measured in the same run.

Workloads (``MultiTurnConfig.workload``):

- ``multiturn`` (after SGLang's HiCache ``bench_multiturn``: clients x rounds, 512 new tokens
  and 64 output tokens per turn, a ready queue popped at random; SGLang has no shared system
  prompt and defaults to 256 clients, 128 in flight and 5 rounds, sized here for one in-process
  engine): every client's first prompt is a system prompt all clients share plus a user turn of
  its own; its turn ``r + 1`` is its turn ``r``'s prompt, the answer and a new user turn, so
  histories grow. A client's next turn becomes ready when its previous one finished.
- ``longdoc`` (after LMCache's long-document QA): ``documents`` documents, each asked
  ``rounds`` questions (prompt = document + question): the first round asks each document once
  in order (the warm-up), the other rounds' questions follow once it finished, shuffled
  together.

At most ``concurrency`` requests are in flight (``LLM.add_request``/``LLM.step``; the engine
runs as many together). TTFT is the engine's ``RequestOutput.ttft_s``: from ``add_request`` to
the end of the step that produced the request's first token. Outputs are greedy and
``ignore_eos``: every request generates exactly ``output_tokens``.

Configurations (``MultiTurnConfig.configs``), each a fresh engine: ``device`` (no host tier),
``host`` (device + a host tier, by default holding the whole working set), ``host-coded`` (the
host tier of ``host_bytes`` holding the attention KV through ``kv_codec``: about twice the pages
of a 16-bit model in the same bytes; its bound prices loads at the uncoded bytes), ``host+file`` (a
small host tier + the file L3 in a fresh directory), ``file-prepopulated`` (small host + a file
L3 that an untimed engine of its own filled over the same workload, with a host tier holding the
working set so that no page's backup is dropped for want of host room and every page reaches
the L3; device and host empty: the first round is served from storage), and
``mooncake`` (small host + Mooncake Store, a fresh tenant salt) when ``mooncake_url`` is given.

Rates measured in the same run (``rates``), on an engine of their own without a host tier:

- ``prefill_tokens_per_s``: a cold prefill of ``prefill_probe_tokens`` (the workload's mean
  prompt length) over its TTFT, best of two;
- ``extend_probe``: a prompt of the same length whose front is the last cold prompt's (cached)
  and whose last ``new_tokens`` (``question_tokens``) are new, best of two, and
  ``short_probe``, a cold prompt as long as that new part, best of two; with the cold prefill
  they fit ``prefill_s_per_forward`` (``c``), ``prefill_s_per_token`` (``a``) and
  ``prefill_s_per_token_context`` (``b``) of the prefill cost ``c + r x (a + b x (h + r / 2))``
  of ``r`` tokens after ``h`` cached ones (``prefill_cost_model``: a forward has a cost of its
  own, which a short extend does not amortise, and attention makes a token after a long
  history dearer than a cold one);
- ``decode_step_s``: the median decode step of ``decode_batch`` (= ``concurrency``) requests at
  a context of ``decode_context`` (the mean prompt length);
- ``link_gbps``: host -> device bytes per second, a contiguous pinned copy on CUDA
  (``bench ttft``'s link) or a plain copy on the CPU;
- ``storage_read_gbps``: a plain sequential read of every object the file L3 holds
  (``kvtier.bench.raw_read``; the page cache is as warm as for the restores), or, for Mooncake,
  the rate the run's own storage reads reached.

Per configuration (``configs[name]``): ``wall_s``, ``requests_per_s``, input/output tokens/s,
``ttft_s`` (p50/p90/p99/mean), prompt tokens served per tier and recomputed (``tokens``; and the
first round's, ``first_round_tokens``, with when its last request finished and its mean TTFT,
``first_round``), ``bound_s`` and ``wall_over_bound``, the speedup over the first configuration,
whether every request's output equals the first configuration's (``outputs_match``,
``mismatched_requests``), whether the outputs that differ differ only where the model was
nearly tied (``divergences``, ``outputs_agree``: below), whether served + recomputed = prompt
tokens for every request (``tokens_add_up``; a preempted request computes more), the rate its
own storage reads reached (``observed``), selected ``llm.stats()`` counters and one record per
request (``requests``).

Outputs in 16-bit arithmetic depend on the batch a request ran in and on how its prefix was
computed (chunks differ once hits differ), so greedy choices between nearly tied tokens fall
either way. Every request whose prompt the reference configuration sent too and whose output
differs is cut at its first differing token, and a third engine (no host tier) judges that
position: the two tokens' log-probabilities must lie within ``logit_tolerance`` (by default
0.1 in 16-bit, 1e-3 in 32-bit) and both among its 20 most likely. A wrong restore feeds the
model wrong keys and values, which moves the whole distribution, not a near-tie. A request
whose prompt the reference never sent (its conversation's earlier answer differed) cannot be
judged and is counted (``unjudged_prompts``). The run fails on a divergence beyond the
tolerance, not on a difference alone.

The bound of a request is what it would cost if it cost only its own work at the measured rates:
``max(prefill cost of recomputed after cached, max((host + storage bytes) / link, storage
bytes / storage rate)) + (output_tokens - 1) x decode_step_s / decode_batch`` (its share of the
batched decode steps); a configuration's bound is the sum over its requests. ``wall_over_bound`` >= 1 means
slower than the bound; on a CPU, where a step's fixed cost dominates and batching prefills with
decodes is cheaper than running them apart, it can fall below 1. On a CPU shared with other work,
run with ``OMP_NUM_THREADS=1``: torch's threads waiting for busy cores make every rate noise.

This module imports only the standard library and ``kvtier.errors`` at import time: the command
line builds its flags (``add_arguments``) without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvtier.config import CacheConfig
    from kvtier.engine import LLM, RequestOutput

WORKLOADS = ("multiturn", "longdoc")
CONFIGS = ("device", "host", "host-coded", "host+file", "file-prepopulated", "mooncake")
"""Every configuration the benchmark knows, in the order it runs them."""
DEFAULT_CONFIGS = ("device", "host", "host+file", "file-prepopulated")
"""What runs unless told otherwise (``mooncake`` joins them when ``mooncake_url`` is given)."""
READY_POLICIES = ("random", "fifo")
LLAMA_8B = "llama-8b"
"""The model name of the Llama-8B-sized dense config with random weights drawn on its device
(``bench ttft``'s and ``bench compute``'s model)."""
TIERS = ("device", "host", "storage")
JUDGE_TOP = 20
"""Most likely tokens ``judge_divergences`` looks at."""

RESULT_KEYS = (
    "bench",
    "workload",
    "device",
    "model",
    "kv_bytes_per_token",
    "rates",
    "configs",
    "summary",
    "outputs_match",
    "outputs_agree",
    "tokens_add_up",
    "reference_config",
)
"""Top-level keys of the result."""
CONFIG_KEYS = (
    "cache",
    "wall_s",
    "requests",
    "num_requests",
    "requests_per_s",
    "input_tokens",
    "output_tokens",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_s",
    "tokens",
    "first_round_tokens",
    "first_round",
    "preemptions",
    "tokens_add_up",
    "bound_s",
    "wall_over_bound",
    "speedup",
    "outputs_match",
    "mismatched_requests",
    "divergences",
    "outputs_agree",
    "observed",
    "stats",
)
"""Keys of every ``configs[name]``."""
REQUEST_KEYS = (
    "conversation",
    "round",
    "prompt_tokens",
    "output_tokens",
    "ttft_s",
    "cached_device",
    "cached_host",
    "cached_storage",
    "recomputed",
    "preemptions",
    "finished_s",
    "bound_s",
)
"""Keys of every record in ``configs[name]["requests"]`` (``conversation``: the client or the
document)."""
RATE_KEYS = (
    "prefill_probe_tokens",
    "prefill_tokens_per_s",
    "extend_probe",
    "short_probe",
    "prefill_s_per_forward",
    "prefill_s_per_token",
    "prefill_s_per_token_context",
    "decode_batch",
    "decode_context",
    "decode_step_s",
    "link_gbps",
    "link_how",
    "storage_read_gbps",
    "storage_read_how",
)
"""Keys of ``rates``."""
STATS_KEYS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "recomputed_tokens",
    "evicted_device_pages",
    "evicted_host_pages",
    "load_bytes",
    "load_seconds",
    "backup_bytes",
    "storage_read_bytes",
    "storage_read_seconds",
    "storage_write_bytes",
    "prefetched_pages",
    "prefetch_failed_pages",
    "storage_errors",
)
"""``llm.stats()`` counters kept per configuration (those the cache has)."""

HELP = "multi-turn or long-document workload with the tiers against device memory alone"
DESCRIPTION = (
    "A closed-loop multi-turn (or long-document) workload on the reference engine, once per "
    "cache configuration (device only, + host tier, + small host and file L3, file L3 filled "
    "beforehand, Mooncake with --mooncake-url): wall time, requests/s, tokens/s, TTFT "
    "percentiles and tokens served per tier, next to a bound from the prefill, decode, link "
    "and storage rates measured in the same run. Every configuration's outputs must equal the "
    "first's (greedy); exits 1 when they do not."
)


@dataclass(frozen=True)
class MultiTurnConfig:
    """The workload, the model and the cache sizes of one run."""

    workload: str = "multiturn"
    """``multiturn`` (clients x rounds over a shared system prompt) or ``longdoc``."""
    model: Any = "tiny"
    """A model preset name, a checkpoint directory, ``llama-8b`` (the Llama-8B-sized dense
    config, random weights drawn on the device) or a model config of any family."""
    dtype: str | None = None
    """The model's dtype (``None``: ``bfloat16`` for ``llama-8b``, the preset's own otherwise)."""
    clients: int = 32
    """``multiturn``: clients, one conversation each."""
    rounds: int = 5
    """``multiturn``: turns per client; ``longdoc``: questions per document (the first round
    is the warm-up)."""
    concurrency: int = 16
    """Requests in flight at most (and the engine's ``max_running``)."""
    system_tokens: int = 2048
    """``multiturn``: the system prompt every client shares (0: none)."""
    context_tokens: int = 0
    """``multiturn``: each client's own context after the system prompt in its first turn (a
    document its conversation is about; 0: none)."""
    new_tokens: int = 512
    """``multiturn``: user tokens each turn adds."""
    output_tokens: int = 64
    """Tokens generated per request."""
    ready_policy: str = "random"
    """``multiturn``: which ready turn starts next, ``random`` (SGLang's default) or ``fifo``;
    ``longdoc`` keeps its own order."""
    documents: int = 8
    """``longdoc``: documents."""
    document_tokens: int = 10_000
    """``longdoc``: tokens per document."""
    question_tokens: int = 32
    """``longdoc``: tokens per question."""
    device_tokens: int = 16_384
    """Device pool, tokens (rounded up to pages)."""
    host_tokens: int | None = None
    """Host tier of ``host``, tokens (``None``: the workload's working set, unless
    ``host_bytes``)."""
    host_bytes: int | None = None
    """Host tier of ``host``, bytes (instead of ``host_tokens``)."""
    small_host_tokens: int | None = None
    """Host tier of the configurations with L3, tokens (``None``: ``device_tokens``)."""
    kv_codec: str = "fp8_e4m3"
    """``CacheConfig.kv_codec`` of ``host-coded``: the ``host`` tier's bytes (``host_bytes``)
    holding the attention KV coded, so about twice the pages of a 16-bit model."""
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    """Configurations to run, of ``CONFIGS`` (run in that order; the first one is the
    reference the others' outputs are compared with)."""
    mooncake_url: str | None = None
    """``storage_url`` of a Mooncake Store (``mooncake://MASTER:PORT?...``): adds ``mooncake``."""
    storage_dir: str | None = None
    """Where the file L3 directories are made (``None``: the system's temporary directory);
    they are removed at the end."""
    page_size: int = 16
    """Tokens per KV page."""
    max_prefill_tokens: int = 16_384
    """The engine's prefill budget per step (a longer prompt runs alone)."""
    prefetch_policy: str = "wait_complete"
    """``CacheConfig.prefetch_policy`` of the configurations with L3."""
    decode_steps: int = 8
    """Decode steps timed for ``rates.decode_step_s``."""
    device: str | None = None
    """Torch device (``None``: CUDA when there is one)."""
    seed: int = 0
    """Seed of the prompts and of the ready queue's pops."""
    logit_tolerance: float | None = None
    """The log-probability gap at which a divergence from the reference counts as a wrong answer
    (``None``: ``default_logit_tolerance`` of the model's dtype)."""
    judge_max: int = 64
    """Divergences judged per configuration at most (the first by ``(conversation, round)``;
    the rest are counted, not judged)."""
    debug_checks: bool = False
    """``CacheConfig.debug_checks`` (integrity at every poll: for tests, not figures)."""
    progress: bool = True
    """Progress lines on stderr."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError(
                f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        for name in (
            "clients",
            "rounds",
            "concurrency",
            "new_tokens",
            "output_tokens",
            "documents",
            "document_tokens",
            "question_tokens",
            "device_tokens",
            "page_size",
            "max_prefill_tokens",
            "decode_steps",
            "judge_max",
        ):
            _positive(name, getattr(self, name))
        for name in ("system_tokens", "context_tokens"):
            _non_negative(name, getattr(self, name))
        for name in ("host_tokens", "host_bytes", "small_host_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.host_tokens is not None and self.host_bytes is not None:
            raise ConfigError(
                f"host_tokens={self.host_tokens} and host_bytes={self.host_bytes} both size the "
                "host tier: set at most one"
            )
        tol = self.logit_tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0
        ):
            raise ConfigError(f"logit_tolerance must be a number >= 0, got {tol!r}")
        if self.ready_policy not in READY_POLICIES:
            raise ConfigError(
                f"ready_policy must be one of {', '.join(READY_POLICIES)}, got {self.ready_policy!r}"
            )
        if not isinstance(self.configs, tuple) or not self.configs:
            raise ConfigError(f"configs must be a non-empty tuple, got {self.configs!r}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ConfigError(
                f"configs: unknown {', '.join(map(repr, unknown))} (known: {', '.join(CONFIGS)})"
            )
        if len(set(self.configs)) != len(self.configs):
            raise ConfigError(f"configs names a configuration twice: {self.configs!r}")
        if "host-coded" in self.configs:
            if self.host_bytes is None:
                raise ConfigError(
                    "configs has 'host-coded', which compares host tiers of equal bytes: set "
                    "host_bytes (--host-bytes)"
                )
            if self.kv_codec == "none":
                raise ConfigError("configs has 'host-coded' but kv_codec is 'none'")
        if "mooncake" in self.configs and not self.mooncake_url:
            raise ConfigError("configs has 'mooncake' but no mooncake_url is given")
        if not isinstance(self.model, str) and not dataclasses.is_dataclass(self.model):
            raise ConfigError(
                f"model must be a preset name, a checkpoint directory, {LLAMA_8B!r} or a model "
                f"config, got {type(self.model).__name__}"
            )

    def run_configs(self) -> tuple[str, ...]:
        """The configurations that run, in ``CONFIGS`` order (``mooncake`` added when
        ``mooncake_url`` is given)."""
        names = set(self.configs) | ({"mooncake"} if self.mooncake_url else set())
        return tuple(c for c in CONFIGS if c in names)


def _positive(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _non_negative(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")


# ---- workloads --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the workload."""

    conversation: int
    """The client (``multiturn``) or the document (``longdoc``)."""
    round: int
    """The client's turn, or the document's question, from 0."""
    prompt: list[int]
    """Token ids."""


class MultiTurnWorkload:
    """Clients x rounds over a shared system prompt (and a context of each client's own);
    every user turn is drawn up front, so every configuration sends the same prompts as long
    as the answers agree."""

    def __init__(self, cfg: MultiTurnConfig, vocab: int, first_id: int = 0) -> None:
        rng = random.Random(cfg.seed)
        self.rounds = cfg.rounds
        self.system = _draw(rng, vocab, cfg.system_tokens, first_id)
        self.user = [
            [_draw(rng, vocab, cfg.new_tokens, first_id) for _ in range(cfg.rounds)]
            for _ in range(cfg.clients)
        ]
        self.context = [_draw(rng, vocab, cfg.context_tokens, first_id) for _ in range(cfg.clients)]
        self.num_requests = cfg.clients * cfg.rounds
        self.output_tokens = cfg.output_tokens
        self.new_tokens = cfg.new_tokens
        """Tokens a turn adds after the history it repeats (``measure_rates``' extend probe)."""
        first = cfg.system_tokens + cfg.context_tokens
        last = first + cfg.rounds * cfg.new_tokens + (cfg.rounds - 1) * cfg.output_tokens
        self.max_prompt = last
        self.mean_prompt = (
            first + (cfg.rounds + 1) / 2 * cfg.new_tokens + (cfg.rounds - 1) / 2 * cfg.output_tokens
        )
        own = cfg.context_tokens + cfg.rounds * (cfg.new_tokens + cfg.output_tokens)
        self.working_set = cfg.system_tokens + cfg.clients * own
        """Distinct tokens the run computes (the system prompt once, every client's turns and
        answers)."""
        self.ordered = False
        """Whether ready turns start in the order they became ready (else ``ready_policy``)."""

    def initial(self) -> list[Turn]:
        """The turns ready at the start of a run: every client's first."""
        return [Turn(c, 0, self.system + self.context[c] + u[0]) for c, u in enumerate(self.user)]

    def after(self, turn: Turn, output: list[int]) -> list[Turn]:
        """The turns that become ready once ``turn`` finished with ``output``."""
        r = turn.round + 1
        if r >= self.rounds:
            return []
        return [Turn(turn.conversation, r, turn.prompt + output + self.user[turn.conversation][r])]


class LongDocWorkload:
    """Documents asked questions: round 0 in document order, then the other rounds shuffled."""

    def __init__(self, cfg: MultiTurnConfig, vocab: int, first_id: int = 0) -> None:
        rng = random.Random(cfg.seed)
        self.docs = [_draw(rng, vocab, cfg.document_tokens, first_id) for _ in range(cfg.documents)]
        self.questions = [
            [_draw(rng, vocab, cfg.question_tokens, first_id) for _ in range(cfg.rounds)]
            for _ in range(cfg.documents)
        ]
        later = [(d, r) for r in range(1, cfg.rounds) for d in range(cfg.documents)]
        rng.shuffle(later)
        self.later = later
        self.num_requests = cfg.documents * cfg.rounds
        self.output_tokens = cfg.output_tokens
        self.max_prompt = cfg.document_tokens + cfg.question_tokens
        self.new_tokens = cfg.question_tokens
        """Tokens a question adds after the document (``measure_rates``' extend probe)."""
        self.mean_prompt = float(self.max_prompt)
        self.working_set = cfg.documents * (
            cfg.document_tokens + cfg.rounds * (cfg.question_tokens + cfg.output_tokens)
        )
        self.ordered = True
        self._warm_left = cfg.documents
        """Warm-up questions not finished yet in the current run."""

    def _turn(self, d: int, r: int) -> Turn:
        return Turn(d, r, self.docs[d] + self.questions[d][r])

    def initial(self) -> list[Turn]:
        """The turns ready at the start of a run (a run starts over: the object is reused)."""
        self._warm_left = len(self.docs)
        return [self._turn(d, 0) for d in range(len(self.docs))]

    def after(self, turn: Turn, output: list[int]) -> list[Turn]:
        """Every later question once the last warm-up question finished; else nothing."""
        if turn.round != 0:
            return []
        self._warm_left -= 1
        return [self._turn(d, r) for d, r in self.later] if self._warm_left == 0 else []


Workload = MultiTurnWorkload | LongDocWorkload


def _draw(rng: random.Random, vocab: int, n: int, first_id: int = 0) -> list[int]:
    """``n`` ids in ``range(first_id, vocab)``."""
    return [rng.randrange(first_id, vocab) for _ in range(n)]


def make_workload(cfg: MultiTurnConfig, vocab: int, first_id: int = 0) -> Workload:
    """The workload ``cfg`` names over token ids ``first_id`` to ``vocab - 1`` (``bench serve``'s
    text prompts draw printable ASCII)."""
    if cfg.workload == "multiturn":
        return MultiTurnWorkload(cfg, vocab, first_id)
    return LongDocWorkload(cfg, vocab, first_id)


# ---- the closed loop --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finished:
    """A request of the workload, done."""

    turn: Turn
    """What was sent."""
    out: RequestOutput
    """What the engine returned."""
    finished_s: float
    """When it finished, seconds from the start of the run."""


def run_closed_loop(
    llm: LLM,
    workload: Workload,
    concurrency: int,
    ready_policy: str,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[Finished], float]:
    """Run ``workload`` on ``llm`` with at most ``concurrency`` requests in flight; returns
    every finished request (in finishing order) and the wall time. A request that fails raises
    ``RuntimeError`` naming it."""
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    pick = random.Random(seed + 1)
    ready = workload.initial()
    flying: dict[int, Turn] = {}
    done: list[Finished] = []
    t0 = time.perf_counter()
    while ready or flying:
        while ready and len(flying) < concurrency:
            i = 0 if workload.ordered or ready_policy == "fifo" else pick.randrange(len(ready))
            turn = ready.pop(i)
            flying[llm.add_request(turn.prompt, params)] = turn
        for out in llm.step():
            turn = flying.pop(out.request_id)
            if out.finish_reason != "length" or len(out.output_ids) != workload.output_tokens:
                raise RuntimeError(
                    f"request of conversation {turn.conversation} round {turn.round} ended "
                    f"{out.finish_reason!r} after {len(out.output_ids)} tokens: {out.error}"
                )
            done.append(Finished(turn, out, time.perf_counter() - t0))
            ready += workload.after(turn, out.output_ids)
            on_done()
    return done, time.perf_counter() - t0


# ---- model and rates --------------------------------------------------------------------


def llama_8b_config(max_position: int, dtype: str = "bfloat16") -> Any:
    """The Llama-8B-sized dense config of ``bench ttft``/``bench compute`` (32 layers, hidden
    4096, GQA 32/8 heads of 128, MLP 14336, vocabulary 32000)."""
    from kvtier.engine import ModelConfig

    return ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=max_position,
        dtype=dtype,
    )


def build_bench_model(cfg: MultiTurnConfig, dev: torch.device, max_position: int) -> Any:
    """The model ``cfg.model`` names, on ``dev``, long enough for ``max_position`` positions
    (a preset's or config's ``max_position`` is raised to it when shorter)."""
    from kvtier.engine import load_model
    from kvtier.engine.families import build_model, preset, preset_names

    m = cfg.model
    if m == LLAMA_8B:
        from kvtier.bench.ttft import _DeviceInitLM

        with dev:
            model = _DeviceInitLM(llama_8b_config(max_position, cfg.dtype or "bfloat16"))
        model.fill_random(0)
        return model
    if isinstance(m, str) and m not in preset_names() and Path(m).is_dir():
        return load_model(m).to(dev)
    over = {"dtype": cfg.dtype} if cfg.dtype else {}
    mc = preset(m, **over) if isinstance(m, str) else dataclasses.replace(m, **over)
    if mc.max_position < max_position:
        mc = dataclasses.replace(mc, max_position=max_position)
    return build_model(mc).to(dev)


def kv_bytes_per_token(model: Any, page_size: int) -> float:
    """Bytes of every pool's state per token (a page's bytes over its tokens)."""
    return sum(s.page_bytes(page_size) for s in model.pool_specs()) / page_size


def measure_rates(
    model: Any,
    cfg: MultiTurnConfig,
    dev: torch.device,
    workload: Workload,
    bpt: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Prefill rate, decode step time and link rate (module docstring), on an engine of their
    own without a host tier; ``storage_read_*`` are filled in once an L3 is."""
    from kvtier.bench.compute import copy_gbps, decode_step_times
    from kvtier.bench.ttft import _link_gbps
    from kvtier.config import CacheConfig
    from kvtier.engine import LLM, SamplingParams

    ps = cfg.page_size
    vocab = model.config.vocab_size
    rng = random.Random(cfg.seed + 2)
    probe = max(1, min(round(workload.mean_prompt), workload.max_prompt))
    batch = cfg.concurrency
    context = max(3, round(workload.mean_prompt))
    steps = cfg.decode_steps
    pages = max(2 * -(-(probe + 1) // ps), batch * -(-(context + steps + 2) // ps)) + 8
    _release(dev)
    llm = LLM(
        model,
        CacheConfig(
            page_size=ps,
            device_pages=pages,
            device=str(dev),
            enable_host=False,
            debug_checks=cfg.debug_checks,
        ),
        max_running=batch,
        max_prefill_tokens=max(probe, batch * context) + 1,
    )
    try:
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([_draw(rng, vocab, min(probe, 256))], one)  # kernels warmed up
        best = math.inf
        for _ in range(2):
            cold = _draw(rng, vocab, probe)
            out = llm.generate([cold], one)[0]
            best = min(best, out.ttft_s or math.inf)
        prefill_rate = probe / best
        # the last cold prompt's front is cached now: the same length again, most of it a hit
        base = max(0, probe - workload.new_tokens)
        ext = min(
            (
                llm.generate([cold[:base] + _draw(rng, vocab, probe - base)], one)[0]
                for _ in range(2)
            ),
            key=lambda o: o.ttft_s or math.inf,
        )
        short = min(  # a cold prompt as long as the extend's computed part
            (llm.generate([_draw(rng, vocab, ext.recomputed)], one)[0] for _ in range(2)),
            key=lambda o: o.ttft_s or math.inf,
        )
        c, a, b = prefill_cost_model(
            probe, best, ext.cached_device, ext.recomputed, ext.ttft_s or 0.0, short.ttft_s or 0.0
        )
        draw = lambda n: _draw(rng, vocab, n)  # noqa: E731
        step_s = statistics.median(decode_step_times(llm, draw, batch, context, steps))
    finally:
        llm.close()
    _release(dev)
    nbytes = int(min(max(context * bpt, 1 << 20), 1 << 30))
    if dev.type == "cuda":
        link, how = _link_gbps(nbytes, dev), f"pinned host -> device copy of {nbytes} bytes"
    else:
        link, how = copy_gbps(dev, nbytes) / 2, f"host memory copy of {nbytes} bytes"
    log(
        f"rates: prefill {prefill_rate:.0f} tokens/s ({probe} tokens), extend "
        f"{ext.recomputed} after {ext.cached_device} cached in {(ext.ttft_s or 0) * 1e3:.1f} ms, "
        f"decode step {step_s * 1e3:.2f} ms (batch {batch}, context {context}), link "
        f"{link:.1f} GB/s"
    )
    return {
        "prefill_probe_tokens": probe,
        "prefill_tokens_per_s": prefill_rate,
        "extend_probe": {
            "cached": ext.cached_device,
            "recomputed": ext.recomputed,
            "ttft_s": ext.ttft_s,
        },
        "short_probe": {"tokens": short.recomputed, "ttft_s": short.ttft_s},
        "prefill_s_per_forward": c,
        "prefill_s_per_token": a,
        "prefill_s_per_token_context": b,
        "decode_batch": batch,
        "decode_context": context,
        "decode_step_s": step_s,
        "link_gbps": link,
        "link_how": how,
        "storage_read_gbps": None,
        "storage_read_how": None,
    }


def prefill_cost_model(
    cold_tokens: int,
    cold_s: float,
    cached: int,
    recomputed: int,
    extend_s: float,
    short_s: float,
) -> tuple[float, float, float]:
    """``(c, a, b)`` of the prefill cost ``c + r x (a + b x (h + r / 2))`` of ``r`` tokens after
    ``h`` cached ones (``c`` per forward, ``a`` per token, ``b`` per token and token of context
    it attends to), fitted exactly to three probes: a cold prefill (``cold_tokens`` in
    ``cold_s``), an extend (``recomputed`` after ``cached``, ``cached + recomputed =
    cold_tokens``, in ``extend_s``) and a cold prefill of ``recomputed`` tokens (``short_s``).
    A coefficient the fit makes negative (timing noise) is 0 and the next ones are refitted
    without it."""
    L, r, h = cold_tokens, recomputed, cached
    # t_cold - t_short = (L - r) a + b (L^2 - r^2) / 2 ;  t_extend - t_short = b r h
    b = max(0.0, (extend_s - short_s) / (r * h)) if r and h else 0.0
    a = (cold_s - short_s - b * (L * L - r * r) / 2) / (L - r) if r < L else cold_s / L
    if a < 0:
        a = 0.0
    c = max(0.0, short_s - r * a - b * r * r / 2) if r else 0.0
    return c, a, b


def request_bound(
    rec: dict[str, Any], rates: dict[str, Any], bpt: float, storage_gbps: float | None
) -> float:
    """One request's bound (module docstring) from its record and the measured rates."""
    r = rec["recomputed"]
    h = rec["cached_device"] + rec["cached_host"] + rec["cached_storage"]
    compute = rates["prefill_s_per_forward"] + r * (
        rates["prefill_s_per_token"] + rates["prefill_s_per_token_context"] * (h + r / 2)
    )
    moved = (rec["cached_host"] + rec["cached_storage"]) * bpt
    load = moved / (rates["link_gbps"] * 1e9) if rates["link_gbps"] else 0.0
    if rec["cached_storage"] and storage_gbps:
        load = max(load, rec["cached_storage"] * bpt / (storage_gbps * 1e9))
    decode = (rec["output_tokens"] - 1) * rates["decode_step_s"] / rates["decode_batch"]
    return max(compute, load) + decode


# ---- configurations ---------------------------------------------------------------------


def cache_config(
    name: str,
    cfg: MultiTurnConfig,
    dev: torch.device,
    working_set: int,
    storage_dir: str | None,
    salt: str,
) -> CacheConfig:
    """The cache of configuration ``name`` (module docstring) on ``dev``: the host tier of
    ``host`` holds ``working_set`` tokens unless ``cfg`` sizes it, the file L3 of the
    configurations with one lives in ``storage_dir``, Mooncake's under the tenant ``salt``."""
    from kvtier.config import CacheConfig

    ps = cfg.page_size
    base = CacheConfig(
        page_size=ps,
        device_pages=-(-cfg.device_tokens // ps),
        device=str(dev),
        debug_checks=cfg.debug_checks,
    )
    if name == "device":
        return dataclasses.replace(base, enable_host=False)
    if name == "host-coded":
        return dataclasses.replace(base, host_bytes=cfg.host_bytes, kv_codec=cfg.kv_codec)
    if name == "host":
        if cfg.host_bytes is not None:
            return dataclasses.replace(base, host_bytes=cfg.host_bytes)
        tokens = cfg.host_tokens or working_set + cfg.concurrency * ps
        return dataclasses.replace(base, host_pages=-(-tokens // ps))
    small = dataclasses.replace(
        base,
        host_pages=-(-(cfg.small_host_tokens or cfg.device_tokens) // ps),
        prefetch_policy=cfg.prefetch_policy,
    )
    if name == "mooncake":
        return dataclasses.replace(
            small, storage="mooncake", storage_url=cfg.mooncake_url, tenant_salt=salt
        )
    if storage_dir is None:
        raise ValueError(f"configuration {name!r} needs an L3 directory")
    return dataclasses.replace(
        small, storage="file", storage_dir=storage_dir, storage_bytes=1 << 50
    )


def _record(d: Finished) -> dict[str, Any]:
    o = d.out
    return {
        "conversation": d.turn.conversation,
        "round": d.turn.round,
        "prompt_tokens": len(d.turn.prompt),
        "output_tokens": len(o.output_ids),
        "ttft_s": o.ttft_s,
        "cached_device": o.cached_device,
        "cached_host": o.cached_host,
        "cached_storage": o.cached_storage,
        "recomputed": o.recomputed,
        "preemptions": o.preemptions,
        "finished_s": d.finished_s,
        "bound_s": None,
    }


def _tier_tokens(recs: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "device": sum(r["cached_device"] for r in recs),
        "host": sum(r["cached_host"] for r in recs),
        "storage": sum(r["cached_storage"] for r in recs),
        "recomputed": sum(r["recomputed"] for r in recs),
        "prompt": sum(r["prompt_tokens"] for r in recs),
    }


def adds_up(rec: dict[str, Any]) -> bool:
    """Served + recomputed = prompt tokens (a preempted request computes more)."""
    served = rec["cached_device"] + rec["cached_host"] + rec["cached_storage"]
    total = served + rec["recomputed"]
    return (
        total == rec["prompt_tokens"] if not rec["preemptions"] else total >= rec["prompt_tokens"]
    )


def mismatches(
    reference: dict[tuple[int, int], list[int]], outputs: dict[tuple[int, int], list[int]]
) -> int:
    """Requests, by ``(conversation, round)``, whose output ids differ between ``reference``
    and ``outputs`` or that only one of them has."""
    return sum(reference.get(k) != outputs.get(k) for k in reference.keys() | outputs.keys())


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a request's output first differs from the reference configuration's answer to
    the same prompt."""

    key: tuple[int, int]
    """``(conversation, round)``."""
    prefix: list[int]
    """The prompt and the output tokens both agree on."""
    reference: int
    """The reference's next token."""
    token: int
    """This configuration's next token."""


def divergences(
    ref_prompts: dict[tuple[int, int], list[int]],
    ref_outputs: dict[tuple[int, int], list[int]],
    prompts: dict[tuple[int, int], list[int]],
    outputs: dict[tuple[int, int], list[int]],
) -> tuple[list[Divergence], int]:
    """The first divergence of every request (by key order) whose prompt the reference sent too
    and whose output differs, and how many requests had a prompt the reference never sent (a
    conversation whose earlier answer differed: nothing here can judge them)."""
    found: list[Divergence] = []
    unjudged = 0
    for key in sorted(outputs):
        if ref_prompts.get(key) != prompts[key]:
            unjudged += 1
            continue
        a, b = ref_outputs[key], outputs[key]
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if k is None:
            continue  # equal (greedy, ignore_eos: same length)
        found.append(Divergence(key, prompts[key] + a[:k], a[k], b[k]))
    return found, unjudged


def default_logit_tolerance(dtype: Any) -> float:
    """The log-probability gap a divergence may have at most for a model in ``dtype``: 16-bit
    arithmetic makes a token's logits depend on the batch and chunk it ran in (prefill chunks
    and decode batches differ once hits differ), so near-ties fall either way; 32-bit leaves
    room for reduction order only."""
    return 0.1 if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") else 1e-3


def judge_divergences(
    model: Any, cfg: MultiTurnConfig, dev: torch.device, found: list[Divergence]
) -> list[float]:
    """For each divergence, ``|logprob(reference) - logprob(token)|`` at its prefix's next
    position as a third computation sees it (a fresh engine without a host tier, every prefix
    in one batch):
    small when the two tokens were a near-tie that arithmetic noise tipped, ``inf`` when either
    is not among its ``JUDGE_TOP`` most likely tokens."""
    from kvtier.config import CacheConfig
    from kvtier.engine import LLM, SamplingParams

    if not found:
        return []
    ps = cfg.page_size
    longest = max(len(d.prefix) for d in found) + 1
    pages = cfg.concurrency * -(-(longest + 1) // ps) + 8
    _release(dev)
    llm = LLM(
        model,
        CacheConfig(page_size=ps, device_pages=pages, device=str(dev), enable_host=False),
        max_running=cfg.concurrency,
        max_prefill_tokens=max(cfg.max_prefill_tokens, longest),
    )
    try:
        params = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=JUDGE_TOP)
        outs = llm.generate([d.prefix for d in found], params)
    finally:
        llm.close()
    _release(dev)
    gaps = []
    for d, o in zip(found, outs, strict=True):
        top = dict(o.logprobs[0].top) if o.logprobs else {}
        both = d.reference in top and d.token in top
        gaps.append(abs(top[d.reference] - top[d.token]) if both else math.inf)
    return gaps


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between closest ranks (numpy's
    default)."""
    s = sorted(values)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _run_config(
    name: str,
    cfg: MultiTurnConfig,
    model: Any,
    cache: CacheConfig,
    workload: Workload,
) -> tuple[dict[str, Any], dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """One configuration on a fresh engine: its figures (bound and comparisons filled in
    later), and every request's output ids and prompt by ``(conversation, round)``."""
    from kvtier.bench.helpers import Progress
    from kvtier.engine import LLM

    _release(cache.device)
    llm = LLM(
        model,
        cache,
        max_running=cfg.concurrency,
        max_prefill_tokens=cfg.max_prefill_tokens,
    )
    bar = Progress(name, workload.num_requests, shown=cfg.progress)
    try:
        done, wall = run_closed_loop(
            llm, workload, cfg.concurrency, cfg.ready_policy, cfg.seed, on_done=bar.step
        )
        llm.check_integrity()
        stats = llm.stats()
    finally:
        bar.close()
        llm.close()
    _release(cache.device)
    recs = sorted((_record(d) for d in done), key=lambda r: (r["round"], r["conversation"]))
    outputs = {(d.turn.conversation, d.turn.round): d.out.output_ids for d in done}
    prompts = {(d.turn.conversation, d.turn.round): d.turn.prompt for d in done}
    ttfts = [r["ttft_s"] for r in recs]
    first = [r for r in recs if r["round"] == 0]
    n_in = sum(r["prompt_tokens"] for r in recs)
    n_out = sum(r["output_tokens"] for r in recs)
    kept = {k: stats[k] for k in STATS_KEYS if k in stats}
    res = {
        "cache": {
            "device_tokens": stats["device_pages_total"] * cfg.page_size,
            "host_tokens": stats["host_pages_total"] * cfg.page_size,
            "host_bytes": stats["host_bytes_total"],
            "storage": cache.storage,
        },
        "wall_s": wall,
        "requests": recs,
        "num_requests": len(recs),
        "requests_per_s": len(recs) / wall,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tokens_per_s": n_in / wall,
        "output_tokens_per_s": n_out / wall,
        "ttft_s": {
            "p50": percentile(ttfts, 50),
            "p90": percentile(ttfts, 90),
            "p99": percentile(ttfts, 99),
            "mean": sum(ttfts) / len(ttfts),
        },
        "tokens": _tier_tokens(recs),
        "first_round_tokens": _tier_tokens(first),
        "first_round": {
            "wall_s": max(r["finished_s"] for r in first),
            "ttft_mean_s": sum(r["ttft_s"] for r in first) / len(first),
        },
        "preemptions": sum(r["preemptions"] for r in recs),
        "tokens_add_up": all(adds_up(r) for r in recs),
        "bound_s": None,
        "wall_over_bound": None,
        "speedup": None,
        "outputs_match": None,
        "mismatched_requests": None,
        "divergences": None,
        "outputs_agree": None,
        "observed": {
            "storage_read_gbps": _rate(
                stats.get("storage_read_bytes", 0), stats.get("storage_read_seconds", 0)
            ),
        },
        "stats": kept,
    }
    return res, outputs, prompts


def _release(dev: object) -> None:
    """On CUDA (``dev``: a device or its name), give back the pools of engines already closed
    before the next one allocates its own (``decode_stall.release_pools``); on the CPU the
    collector gets to them (a full collection per engine would cost more than a tiny run)."""
    if str(dev).startswith("cuda"):
        from kvtier.bench.decode_stall import release_pools

        release_pools()


def _rate(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds else None


@contextlib.contextmanager
def _scratch(parent: str | None) -> Iterator[Callable[[str], str]]:
    """Fresh L3 directories under ``parent`` (``mkdir(name)``), all removed at the end."""
    root = tempfile.mkdtemp(prefix="kvtier-multiturn-", dir=parent)
    try:
        yield lambda name: tempfile.mkdtemp(prefix=f"{name.replace('+', '-')}-", dir=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- the benchmark ----------------------------------------------------------------------


def bench_multiturn(cfg: MultiTurnConfig) -> dict[str, Any]:
    """Run ``cfg``'s workload on every configuration it names and return the JSON-ready result
    the module docstring describes (keys: ``RESULT_KEYS``, per configuration ``CONFIG_KEYS``).

    Raises ``ConfigError`` for a request that cannot fit the device pool or the model's
    context, before any engine starts."""
    from kvtier.bench.helpers import logger
    from kvtier.bench.raw_read import read_dir
    from kvtier.config import resolve_device

    log = logger("multiturn") if cfg.progress else (lambda msg: None)
    dev = resolve_device(cfg.device)
    names = cfg.run_configs()
    # sizes first: a workload that cannot run fails before a model is built
    probe = make_workload(cfg, 2)
    longest = probe.max_prompt + probe.output_tokens
    if longest + 2 * cfg.page_size > cfg.device_tokens:
        raise ConfigError(
            f"device_tokens={cfg.device_tokens} cannot hold one request of up to {longest} "
            f"tokens (prompt + output_tokens) and a padding page"
        )
    t0 = time.perf_counter()
    model = build_bench_model(cfg, dev, longest + cfg.page_size)
    mc = model.config
    if longest > mc.max_position:
        raise ConfigError(
            f"the longest request has {longest} tokens but the model's context is "
            f"{mc.max_position} positions"
        )
    log(f"model on {dev} in {time.perf_counter() - t0:.1f} s")
    workload = make_workload(cfg, mc.vocab_size)
    bpt = kv_bytes_per_token(model, cfg.page_size)
    rates = measure_rates(model, cfg, dev, workload, bpt, log)
    salt = f"bench-multiturn-{uuid.uuid4().hex}"
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    prompts: dict[str, dict[tuple[int, int], list[int]]] = {}
    storage_gbps: dict[str, float | None] = {}
    with _scratch(cfg.storage_dir) as mkdir:
        for name in names:
            directory = None
            if name == "host+file":
                directory = mkdir(name)
            elif name == "file-prepopulated":
                # Not the host+file run's directory: under its small host tier a backup is
                # dropped when the host has no room, and the page never reaches the L3.
                directory = mkdir("fill")
                log("file-prepopulated: filling its L3 with the workload (untimed)")
                roomy = workload.working_set + cfg.concurrency * cfg.page_size
                fill = dataclasses.replace(
                    cache_config("host+file", cfg, dev, workload.working_set, directory, salt),
                    host_pages=-(-roomy // cfg.page_size),
                )
                _run_config("fill", cfg, model, fill, workload)
            cache = cache_config(name, cfg, dev, workload.working_set, directory, salt)
            res, outs, sent = _run_config(name, cfg, model, cache, workload)
            if cache.storage == "file" and rates["storage_read_gbps"] is None:
                nbytes, seconds = read_dir(cache.storage_dir)
                if nbytes and seconds:
                    rates["storage_read_gbps"] = nbytes / seconds / 1e9
                    rates["storage_read_how"] = (
                        f"plain sequential read of the {nbytes} bytes the file L3 held"
                    )
            storage_gbps[name] = (
                res["observed"]["storage_read_gbps"] if name == "mooncake" else None
            )
            results[name], outputs[name], prompts[name] = res, outs, sent
            tk = res["tokens"]
            log(
                f"{name}: {res['wall_s']:.2f} s, TTFT p50 {res['ttft_s']['p50'] * 1e3:.1f} ms, "
                f"tokens device {tk['device']} host {tk['host']} storage {tk['storage']} "
                f"recomputed {tk['recomputed']}"
            )
    ref = names[0]
    tol = cfg.logit_tolerance
    if tol is None:
        tol = default_logit_tolerance(getattr(mc, "dtype", "float32"))
    for name, res in results.items():
        found, unjudged = divergences(prompts[ref], outputs[ref], prompts[name], outputs[name])
        judged = found[: cfg.judge_max]
        if judged:
            log(f"{name}: judging {len(judged)} of {len(found)} divergence(s) from {ref}")
        gaps = judge_divergences(model, cfg, dev, judged)
        res["divergences"] = {
            "requests": len(found),
            "judged": len(judged),
            "within_tolerance": sum(g <= tol for g in gaps),
            "max_gap": max(gaps, default=None),
            "gaps": gaps,
            "unjudged_prompts": unjudged,
            "tolerance": tol,
        }
        res["outputs_agree"] = all(g <= tol for g in gaps)
        gbps = storage_gbps[name] if name == "mooncake" else rates["storage_read_gbps"]
        for rec in res["requests"]:
            rec["bound_s"] = request_bound(rec, rates, bpt, gbps)
        res["bound_s"] = sum(r["bound_s"] for r in res["requests"])
        res["wall_over_bound"] = res["wall_s"] / res["bound_s"] if res["bound_s"] else None
        res["speedup"] = results[ref]["wall_s"] / res["wall_s"]
        res["mismatched_requests"] = mismatches(outputs[ref], outputs[name])
        res["outputs_match"] = res["mismatched_requests"] == 0
    result = {
        "bench": "multiturn",
        "workload": workload_json(cfg, workload),
        "device": str(dev),
        "model": _model_json(cfg, mc),
        "kv_bytes_per_token": bpt,
        "rates": rates,
        "configs": results,
        "summary": {
            name: {
                "wall_s": r["wall_s"],
                "speedup": r["speedup"],
                "requests_per_s": r["requests_per_s"],
                "ttft_p50_s": r["ttft_s"]["p50"],
                "ttft_p90_s": r["ttft_s"]["p90"],
                "bound_s": r["bound_s"],
                "wall_over_bound": r["wall_over_bound"],
                "served": {t: r["tokens"][t] for t in (*TIERS, "recomputed")},
            }
            for name, r in results.items()
        },
        "outputs_match": all(r["outputs_match"] for r in results.values()),
        "outputs_agree": all(r["outputs_agree"] for r in results.values()),
        "tokens_add_up": all(r["tokens_add_up"] for r in results.values()),
        "reference_config": ref,
    }
    for name, s in result["summary"].items():
        log(
            f"{name}: speedup {s['speedup']:.2f}x over {ref}, wall/bound {s['wall_over_bound']:.2f}"
        )
    return result


def workload_json(cfg: MultiTurnConfig, w: Workload) -> dict[str, Any]:
    """The result's ``workload``: ``cfg``'s workload fields and ``w``'s sizes."""
    keys = ["workload", "concurrency", "output_tokens", "rounds", "seed", "page_size"]
    if cfg.workload == "multiturn":
        keys += ["clients", "system_tokens", "context_tokens", "new_tokens", "ready_policy"]
    else:
        keys += ["documents", "document_tokens", "question_tokens"]
    out: dict[str, Any] = {k: getattr(cfg, k) for k in keys}
    out.update(
        requests=w.num_requests,
        max_prompt_tokens=w.max_prompt,
        mean_prompt_tokens=w.mean_prompt,
        working_set_tokens=w.working_set,
        device_tokens=-(-cfg.device_tokens // cfg.page_size) * cfg.page_size,
        working_set_over_device=w.working_set / cfg.device_tokens,
        max_prefill_tokens=cfg.max_prefill_tokens,
        configs=list(cfg.run_configs()),
    )
    return out


def _model_json(cfg: MultiTurnConfig, mc: Any) -> dict[str, Any]:
    name = cfg.model if isinstance(cfg.model, str) else type(cfg.model).__name__
    keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "dtype")
    return {"name": name, **{k: getattr(mc, k) for k in keys if hasattr(mc, k)}}


# ---- command line -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags on ``parser`` (``--json PATH`` unless it has one already), and
    ``run`` as its ``func``. Imports nothing heavy."""
    d = MultiTurnConfig.__dataclass_fields__

    def opt(flag: str, name: str, help: str) -> None:
        default = d[name].default
        shown = "" if default is None else f" (default {default})"
        parser.add_argument(flag, type=int, default=default, help=help + shown)

    parser.add_argument(
        "--workload", choices=WORKLOADS, default="multiturn", help="workload (default multiturn)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"model preset, checkpoint directory or {LLAMA_8B} (Llama-8B-sized, random "
        "weights drawn on the device; default tiny)",
    )
    parser.add_argument("--dtype", default=None, help="model dtype (llama-8b: bfloat16)")
    opt("--clients", "clients", "multiturn: clients, one conversation each")
    opt("--rounds", "rounds", "multiturn: turns per client; longdoc: questions per document")
    opt("--concurrency", "concurrency", "requests in flight at most")
    opt("--system-tokens", "system_tokens", "multiturn: shared system prompt, tokens")
    opt(
        "--context-tokens",
        "context_tokens",
        "multiturn: each client's own context in its first turn, tokens",
    )
    opt("--new-tokens", "new_tokens", "multiturn: user tokens per turn")
    opt("--output-tokens", "output_tokens", "tokens generated per request")
    parser.add_argument(
        "--ready-policy",
        choices=READY_POLICIES,
        default="random",
        help="multiturn: which ready turn starts next",
    )
    opt("--documents", "documents", "longdoc: documents")
    opt("--document-tokens", "document_tokens", "longdoc: tokens per document")
    opt("--question-tokens", "question_tokens", "longdoc: tokens per question")
    opt("--device-tokens", "device_tokens", "device pool, tokens")
    opt("--host-tokens", "host_tokens", "host tier of 'host', tokens (default: the working set)")
    opt("--host-bytes", "host_bytes", "host tier of 'host', bytes (instead of --host-tokens)")
    opt(
        "--small-host-tokens",
        "small_host_tokens",
        "host tier of the configurations with L3, tokens (default: --device-tokens)",
    )
    parser.add_argument(
        "--kv-codec",
        choices=("fp8_e4m3", "int8"),
        default="fp8_e4m3",
        help="kv_codec of 'host-coded' (the host tier of --host-bytes holding the KV coded)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated configurations of {', '.join(CONFIGS)} (default: "
        f"{','.join(DEFAULT_CONFIGS)}; the first is the reference)",
    )
    parser.add_argument(
        "--mooncake-url", default=None, help="mooncake://MASTER:PORT?...: adds 'mooncake'"
    )
    parser.add_argument(
        "--storage-dir", default=None, help="where the file L3 directories go (default: a temp one)"
    )
    opt("--page-size", "page_size", "tokens per KV page")
    opt("--max-prefill-tokens", "max_prefill_tokens", "prefill tokens per engine step")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    opt("--seed", "seed", "seed of the prompts and the ready queue")
    parser.add_argument(
        "--logit-tolerance",
        type=float,
        default=None,
        help="largest log-probability gap of a divergence from the reference (default: 0.1 "
        "for 16-bit models, 1e-3 for 32-bit)",
    )
    opt("--judge-max", "judge_max", "divergences judged per configuration at most")
    parser.add_argument("--plot", metavar="SVG", default=None, help="also draw the figures")
    with contextlib.suppress(argparse.ArgumentError):  # a parent parser may bring it
        parser.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> MultiTurnConfig:
    """The ``MultiTurnConfig`` of parsed ``add_arguments`` flags; ``ConfigError`` for bad ones."""
    names = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    return MultiTurnConfig(
        workload=args.workload,
        model=args.model or "tiny",
        dtype=args.dtype,
        clients=args.clients,
        rounds=args.rounds,
        concurrency=args.concurrency,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        ready_policy=args.ready_policy,
        documents=args.documents,
        document_tokens=args.document_tokens,
        question_tokens=args.question_tokens,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        host_bytes=args.host_bytes,
        small_host_tokens=args.small_host_tokens,
        kv_codec=args.kv_codec,
        configs=names,
        mooncake_url=args.mooncake_url,
        storage_dir=args.storage_dir,
        page_size=args.page_size,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
        seed=args.seed,
        logit_tolerance=args.logit_tolerance,
        judge_max=args.judge_max,
    )


def failure(result: dict[str, Any]) -> str | None:
    """Why a result is a failed run (outputs differ from the reference's, or tokens served per
    tier do not add up), or ``None``."""
    why = []
    for name, r in result["configs"].items():
        div = r.get("divergences")
        if div is not None:  # judged: only a divergence beyond the tolerance fails
            if not r["outputs_agree"]:
                bad = div["judged"] - div["within_tolerance"]
                why.append(
                    f"{name}: {bad} of {div['judged']} divergence(s) from "
                    f"{result['reference_config']} beyond the log-probability tolerance "
                    f"{div['tolerance']} (largest gap {div['max_gap']})"
                )
        elif not r["outputs_match"]:
            why.append(
                f"{name}: {r['mismatched_requests']} request(s) differ from "
                f"{result['reference_config']}"
            )
        if not r["tokens_add_up"]:
            why.append(f"{name}: served + recomputed != prompt tokens")
    return "; ".join(why) or None


def run(args: argparse.Namespace) -> int:
    """The command: print the JSON result (and write ``--json``, ``--plot``); exit 0, 1 when
    the run's own checks failed (``failure``), 2 for a bad option (one line on stderr)."""
    try:
        result = bench_multiturn(config_from_args(args))
    except ConfigError as e:
        print(f"kvtier bench multiturn: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.plot:
        from kvtier.bench.plot import multiturn_panels, panels_svg

        Path(args.plot).write_text(panels_svg(multiturn_panels(result)), encoding="utf-8")
    why = failure(result)
    if why:
        print(f"kvtier bench multiturn: {why}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.multiturn [flags]``: the command on its own parser."""
    parser = argparse.ArgumentParser(prog="kvtier bench multiturn", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
