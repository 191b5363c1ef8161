"""``kvtier demo``: a multi-turn, shared-prefix chat workload through every tier.

Phase ``live`` runs conversations turn by turn (round-robin, so a conversation's history is
usually evicted from the device before its next turn) with a device pool far smaller than the
working set; every output is checked against a cold run (no cached prefix): the tokens must be
equal and the logits of every generated step within ``DemoConfig.logit_tolerance`` (tiny random
models often keep their argmax under corrupted KV, so tokens alone would miss it).
Phase ``restart`` runs the last turn of every conversation again in a fresh process whose device
and host tiers are empty and whose storage directory is the one ``live`` filled; outputs must
equal the cold outputs in the same way.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from kvtier.bench.helpers import Progress
from kvtier.config import CacheConfig
from kvtier.demo.oracle import Expected, compare, default_tolerance
from kvtier.demo.table import summarize_phases
from kvtier.errors import ConfigError
from kvtier.parallel.launch import package_root
from kvtier.pools.spec import tree_page_size

_MARKER = ".kvtier-demo"


@dataclass(frozen=True)
class DemoConfig:
    """Workload and cache sizes of the demo."""

    model: str = "tiny"
    """Model preset name or a Hugging Face checkpoint directory."""
    storage_dir: str = "kvtier-data/demo"
    """L3 directory; wiped at the start of the live phase (only if the demo created it)."""
    conversations: int = 8
    """Concurrent conversations."""
    turns: int = 4
    """Turns per conversation."""
    system_tokens: int = 128
    """Length of the system prompt every conversation shares."""
    user_tokens: tuple[int, int] = (24, 64)
    """Range of a user message's length."""
    max_tokens: int = 12
    """Tokens generated per turn (greedy)."""
    page_size: int = 16
    """Tokens per page."""
    device_pages: int = 64
    """Device pool pages: far below the working set so pages move down the tiers."""
    host_ratio: float = 2.0
    """Host pool size relative to the device pool."""
    max_running: int = 4
    """Requests decoded together."""
    seed: int = 0
    """Workload seed."""
    cp: int = 1
    """Context-parallel ranks (local processes over gloo); the group's device pages add up to
    ``device_pages``, and each rank's outputs are checked against a cold CP=1 run."""
    speculative_tokens: int = 0
    """Draft tokens each greedy decode step proposes with the model's draft head and verifies
    (``LLM(speculative_tokens=...)``; 0: off; needs a model with one, e.g. ``tiny-mtp``). The
    oracle's cold runs decode one token at a time."""
    backup_timing: str = "at_insert"
    """When device pages are copied to host (``CacheConfig.backup_timing``): ``at_insert`` or
    ``per_layer`` (during the forward, each layer as it finishes; under CP each rank its own
    shard)."""
    logit_tolerance: float | None = None
    """Largest |logit difference| to the cold run, over every generated step, that the oracle
    accepts; ``None`` picks it from the model's dtype (``kvtier.demo.oracle.LOGIT_TOLERANCES``)."""

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ConfigError(f"cp must be a positive integer, got {self.cp!r}")
        k = self.speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"speculative_tokens must be an integer >= 0, got {k!r}")
        tol = self.logit_tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 <= tol < math.inf
        ):
            raise ConfigError(f"logit_tolerance must be None or a finite number >= 0, got {tol!r}")


def logit_tolerance(cfg: DemoConfig, dtype: str) -> float:
    """The tolerance the oracle checks for a model of element type ``dtype``."""
    if cfg.logit_tolerance is not None:
        return float(cfg.logit_tolerance)
    return default_tolerance(dtype)


@dataclass
class PhaseReport:
    name: str
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    recomputed_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    checked: int = 0
    mismatches: int = 0
    token_mismatches: int = 0
    logit_mismatches: int = 0
    logit_tolerance: float = 0.0
    max_logit_diff: float = 0.0
    cache: dict = field(default_factory=dict)

    def add(self, out, expected: Expected | None) -> None:
        self.requests += 1
        self.prompt_tokens += len(out.prompt)
        self.output_tokens += len(out.output_ids)
        self.device_hit_tokens += out.cached_device
        self.host_hit_tokens += out.cached_host
        self.storage_hit_tokens += out.cached_storage
        self.recomputed_tokens += out.recomputed
        if out.ttft_s is not None:
            self.ttft_s.append(out.ttft_s)
        if expected is not None:
            same, diff = compare(out.output_ids, out.logits, expected)
            bad_logits = not diff <= self.logit_tolerance
            self.checked += 1
            self.token_mismatches += int(not same)
            self.logit_mismatches += int(bad_logits)
            self.mismatches += int(not same or bad_logits)
            if diff < math.inf:  # no logits to compare is a mismatch, not a difference
                self.max_logit_diff = max(self.max_logit_diff, diff)


def _cache_config(cfg: DemoConfig) -> CacheConfig:
    return CacheConfig(
        page_size=cfg.page_size,
        device_pages=cfg.device_pages,
        host_ratio=cfg.host_ratio,
        storage="file",
        storage_dir=cfg.storage_dir,
        write_policy="write_through",
        prefetch_policy="wait_complete",
        backup_timing=cfg.backup_timing,
    )


def _make_llm(
    cfg: DemoConfig,
    cache_config: CacheConfig,
    group=None,  # noqa: ANN001
    speculative_tokens: int | None = None,
):  # noqa: ANN202
    """The demo's engine (``speculative_tokens``: ``cfg``'s unless given)."""
    from kvtier.engine import LLM
    from kvtier.engine.families import build_model, preset, preset_names
    from kvtier.engine.weights import load_model
    from kvtier.errors import ConfigError

    if os.path.isdir(cfg.model):
        model = load_model(cfg.model)
    elif "/" in cfg.model or os.sep in cfg.model or os.path.exists(cfg.model):
        hint = " (it is a file: pass the directory holding config.json)"
        raise ConfigError(
            f"--model {cfg.model}: no such checkpoint directory"
            + (hint if os.path.exists(cfg.model) else "")
        )
    elif cfg.model not in preset_names():
        raise ConfigError(
            f"--model {cfg.model!r} is neither a checkpoint directory nor a model preset; "
            f"known presets: {', '.join(preset_names())}"
        )
    else:
        model = build_model(preset(cfg.model))
    # device_pages is sized in page_size pages; a family whose tree page is larger (compressed
    # index groups) gets the same device memory in fewer, larger pages.
    tree = tree_page_size(cache_config.page_size, model.pool_specs())
    pages = max(1, cache_config.device_pages * cache_config.page_size // tree)
    spec = cfg.speculative_tokens if speculative_tokens is None else speculative_tokens
    if group is None:
        return LLM(
            model,
            replace(cache_config, device_pages=pages),
            max_running=cfg.max_running,
            speculative_tokens=spec,
        )
    # A CP rank holds its share of the group's pages.
    cc = replace(
        cache_config,
        device_pages=-(-pages // group.size),
        cp_size=group.size,
        cp_rank=group.rank,
    )
    return LLM(model, cc, max_running=cfg.max_running, group=group, speculative_tokens=spec)


def _run(llm, prompts, max_tokens: int, report: PhaseReport, expected, progress: Progress):
    """Run ``prompts`` together (outputs in prompt order), recording them in ``report``."""
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    ids = [llm.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in llm.step():
            done[out.request_id] = out
            progress.step()
    outs = [done[i] for i in ids]
    for k, out in enumerate(outs):
        report.add(out, None if expected is None else expected[k])
    return outs


def _cold(ref, prompt: list[int], max_tokens: int) -> Expected:
    """Greedy output of ``prompt`` with nothing cached."""
    from kvtier.engine import SamplingParams

    ref.cache.flush()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    (out,) = ref.generate([prompt], params)
    return Expected(list(out.output_ids), out.logits)


def _fresh_storage(cfg: DemoConfig) -> None:
    root = Path(cfg.storage_dir)
    if root.exists():
        if not (root / _MARKER).exists() and any(root.iterdir()):
            raise SystemExit(f"--storage-dir {root} exists and was not created by the demo")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / _MARKER).write_text("kvtier demo storage\n")


def run_live(cfg: DemoConfig, group=None) -> tuple[PhaseReport, list[dict]]:  # noqa: ANN001
    """The live phase; returns its report and the restart phase's work: for each request the
    prompt and the cold output (``Expected``). ``group``: this rank's CP group (the storage
    directory is then prepared by the launcher)."""
    if group is None:
        _fresh_storage(cfg)
    llm = _make_llm(cfg, _cache_config(cfg), group)
    cold_cache = CacheConfig(
        page_size=cfg.page_size, device_pages=cfg.device_pages, enable_host=False
    )
    ref = _make_llm(cfg, cold_cache, speculative_tokens=0)  # the oracle: one token a step
    vocab = llm.model_config.vocab_size
    rng = random.Random(cfg.seed)
    system = [rng.randrange(vocab) for _ in range(cfg.system_tokens)]
    history = [list(system) for _ in range(cfg.conversations)]
    report = PhaseReport("live", logit_tolerance=logit_tolerance(cfg, llm.model_config.dtype))
    progress = Progress("live", cfg.conversations * cfg.turns, group is None or group.rank == 0)
    last: list[dict] = []
    t0 = time.perf_counter()
    for turn in range(cfg.turns):
        prompts = []
        for h in history:
            h += [rng.randrange(vocab) for _ in range(rng.randint(*cfg.user_tokens))]
            prompts.append(list(h))
        t_ref = time.perf_counter()
        expected = [_cold(ref, p, cfg.max_tokens) for p in prompts]
        t0 += time.perf_counter() - t_ref  # the oracle's cold runs are not the workload's time
        outs = _run(llm, prompts, cfg.max_tokens, report, expected, progress)
        for h, out in zip(history, outs, strict=True):
            h += list(out.output_ids)
        if turn == cfg.turns - 1:
            last = [
                {"prompt": p, "tokens": e.tokens, "logits": e.logits}
                for p, e in zip(prompts, expected, strict=True)
            ]
    llm.cache.drain()
    report.wall_s = time.perf_counter() - t0
    report.cache = llm.stats()
    llm.cache.close()
    ref.cache.close()
    return report, last


def run_restart(cfg: DemoConfig, work: list[dict], group=None) -> PhaseReport:  # noqa: ANN001
    """The restart phase (run in a fresh process, or fresh ranks)."""
    llm = _make_llm(cfg, _cache_config(cfg), group)
    report = PhaseReport("restart", logit_tolerance=logit_tolerance(cfg, llm.model_config.dtype))
    progress = Progress("restart", len(work), group is None or group.rank == 0)
    t0 = time.perf_counter()
    prompts = [w["prompt"] for w in work]
    expected = [Expected(w["tokens"], w["logits"]) for w in work]
    _run(llm, prompts, cfg.max_tokens, report, expected, progress)
    report.wall_s = time.perf_counter() - t0
    report.cache = llm.stats()
    llm.cache.close()
    return report


def run_demo(cfg: DemoConfig) -> dict:
    """Both phases; the restart phase in a child process. Returns the JSON summary."""
    if cfg.cp > 1:
        from kvtier.parallel.launch import launch, results

        _fresh_storage(cfg)
        print(f"live: {cfg.cp} context-parallel ranks (gloo)", file=sys.stderr, flush=True)
        live, work = results(launch(cfg.cp, _live_rank, cfg, timeout=60))[0]
    else:
        live, work = run_live(cfg)
    # The cold logits travel as a tensor file: as JSON, vocab x steps floats a request are slow.
    work_file = Path(cfg.storage_dir) / "restart-work.pt"
    torch.save({"config": _cfg_json(cfg), "work": work}, work_file)
    child = subprocess.run(
        kvtier_command("demo", "--restart-phase", str(work_file)),
        stdout=subprocess.PIPE,
        check=False,
        text=True,
    )
    if child.returncode != 0:
        raise SystemExit(f"restart phase failed (exit {child.returncode})")
    restart = PhaseReport(**json.loads(child.stdout))
    return summarize(cfg, [live, restart])


_PINNED_MAIN = (
    "import sys; sys.path[0] = sys.argv.pop(1); from kvtier.cli import main; sys.exit(main())"
)


def kvtier_command(*args: str) -> list[str]:
    """The command line of ``kvtier ARGS`` run in a fresh interpreter that imports the kvtier
    this process runs: its ``sys.path`` starts with ``launch.package_root()`` where ``python -m``
    would put the working directory, whose ``kvtier/`` folder (a clone's, seen from the folder
    holding it) would shadow the installed package."""
    return [sys.executable, "-c", _PINNED_MAIN, package_root(), *args]


def _cfg_json(cfg: DemoConfig) -> dict:
    d = asdict(cfg)
    d["user_tokens"] = list(cfg.user_tokens)
    return d


def config_from_json(d: dict) -> DemoConfig:
    d = dict(d)
    d["user_tokens"] = tuple(d["user_tokens"])
    return DemoConfig(**d)


def restart_main(work_file: str) -> None:
    """Entry of the child process: run the restart phase, print its report as JSON."""
    data = torch.load(work_file, weights_only=True)
    cfg = config_from_json(data["config"])
    if cfg.cp > 1:
        from kvtier.parallel.launch import launch, results

        report = results(launch(cfg.cp, _restart_rank, cfg, data["work"], timeout=60))[0]
    else:
        report = run_restart(cfg, data["work"])
    print(json.dumps(asdict(report)))


def _live_rank(group, cfg: DemoConfig) -> tuple[PhaseReport, list[dict]]:  # noqa: ANN001
    """One CP rank of the live phase; every rank checks its outputs against the oracle."""
    # Every rank's outputs are checked; the ranks agree on every token, so rank 0's report
    # stands for the group.
    return run_live(cfg, group)


def _restart_rank(group, cfg: DemoConfig, work: list[dict]) -> PhaseReport:  # noqa: ANN001
    return run_restart(cfg, work, group)


def summarize(cfg: DemoConfig, phases: list[PhaseReport]) -> dict:
    """The JSON summary of the demo's phases."""
    return summarize_phases(_cfg_json(cfg), phases)
