"""``kvtier bench load-or-recompute``: does ``restore_policy='cost'`` take the cheaper of
restoring a prompt from storage and computing it again, across prompt lengths and storage rates?

One model, one file L3 filled with a prompt per length (and short warm-up prompts) by an engine
of its own. Then, per prompt length ``L`` and storage read rate ``R`` (the file backend's reads
held to ``R``: ``throttled_file``, a slower device simulated):

- ``recompute_s``: the prompt's TTFT on an engine without a host tier or storage (its KV
  computed whole);
- ``restore_s``: its TTFT under ``restore_policy='always'`` with device and host empty (every
  whole page fetched from storage at ``R``, then loaded);
- ``cost_s``: its TTFT under ``restore_policy='cost'``, device and host empty, on an engine
  that has first computed prompts no tier holds (a short one, then two of
  ``warmup_cold_tokens``: the first forward of each size pays for set-up and is not timed, so
  the second long one gives the prefill fit its slope) and served warm-up prompts (restored
  from storage, or recomputed, as the policy chose) until its storage read rate was measured
  and a short forward timed (the fit's launch time): the rates the policy prices with are its
  own online measurements, not priors.

Each TTFT is the best of ``repeats`` (device and host flushed before each). Per point:
``cost_over_best`` = ``cost_s / min(recompute_s, restore_s)`` and what the policy did
(``restored_tokens``, ``recomputed_tokens``), and how the cost engine was warmed
(``warmups_served``, ``warmup_computed_tokens``: the prompts no tier held, computed whole, and
``policy_rates_before``); ``max_cost_over_best`` over the grid. Rows for one ``R`` share their
engines; lengths run shortest first.

This module imports only the standard library and ``kvtier.errors`` at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvtier.config import CacheConfig
    from kvtier.engine import LLM

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
"""Prompt lengths of the default grid, tokens."""
RATES_GBPS = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Storage read rates of the default grid, GB/s."""
HELP = "restore_policy='cost' against restoring and recomputing, across lengths and storage rates"


def throttled_file(rate: float) -> str:
    """The name of a storage backend (registered on first use) that is the file backend with
    every ``batch_get`` taking at least ``bytes / rate`` seconds (what it read, at ``rate``
    bytes per second: a slower device, simulated)."""
    from kvtier.storage.file import FileBackend
    from kvtier.storage.registry import available_backends, register_backend

    name = f"bench-throttled-file-{rate:g}"
    if name in available_backends():
        return name

    class ThrottledFile(FileBackend):
        def batch_get(self, keys: Sequence[Any], buffers: Sequence[torch.Tensor]) -> int:
            t0 = time.perf_counter()
            got = super().batch_get(keys, buffers)
            nbytes = sum(b.numel() * b.element_size() for b in buffers[:got])
            left = nbytes / rate - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)  # the simulated device's own time, not a synchronisation
            return got

    register_backend(name, ThrottledFile.from_config)
    return name


def file_l3_config(page_size: int, pages: int, device: str, storage_dir: str) -> CacheConfig:
    """The cache every engine of the grid starts from: ``pages`` device and host pages, a
    file L3 in ``storage_dir`` with no budget to speak of, fetches waited for whole."""
    from kvtier.config import CacheConfig

    return CacheConfig(
        page_size=page_size,
        device_pages=pages,
        host_pages=pages,
        device=device,
        storage="file",
        storage_dir=storage_dir,
        storage_bytes=1 << 50,
        prefetch_policy="wait_complete",
    )


def bench_load_or_recompute(
    model: str = "llama-8b",
    lengths: Sequence[int] = LENGTHS,
    rates_gbps: Sequence[float] = RATES_GBPS,
    page_size: int = 16,
    repeats: int = 2,
    warmup_tokens: int = 512,
    warmups: int = 40,
    warmup_cold_tokens: int = 4096,
    device: str | None = None,
    dtype: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The grid of the module docstring as a JSON-ready dict. ``model``: ``llama-8b`` (the
    Llama-8B-sized dense config, random weights drawn on the device) or a preset name.
    ``warmups`` bounds the warm-up prompts a ``cost`` engine serves before its storage rate
    has been measured (a policy that declines storage probes only every ``PROBE_AFTER``
    restores)."""
    from kvtier.bench.helpers import logger
    from kvtier.bench.multiturn import MultiTurnConfig, _release, build_bench_model
    from kvtier.config import resolve_device
    from kvtier.engine import SamplingParams

    lengths, rates_gbps = sorted(lengths), sorted(rates_gbps)
    _check(lengths, rates_gbps, page_size, repeats, warmup_tokens, warmups, warmup_cold_tokens)
    log = logger("load-or-recompute") if progress else (lambda msg: None)
    dev = resolve_device(device)
    longest = lengths[-1]
    t0 = time.perf_counter()
    mcfg = MultiTurnConfig(model=model, dtype=dtype, page_size=page_size, device=str(dev))
    net = build_bench_model(mcfg, dev, longest + page_size + 1)
    log(f"model on {dev} in {time.perf_counter() - t0:.1f} s")
    vocab = net.config.vocab_size
    rng = random.Random(0)
    prompts = {n: [rng.randrange(vocab) for _ in range(n)] for n in lengths}
    warm = [[rng.randrange(vocab) for _ in range(warmup_tokens)] for _ in range(warmups)]

    def unseen(n: int) -> list[int]:
        # drawn per engine: what an earlier engine computed is in the shared L3 and would be
        # restored, not computed
        return [rng.randrange(vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    pages = 2 * (longest // page_size) + 64
    with tempfile.TemporaryDirectory(prefix="kvtier-load-or-recompute-") as tmp:
        base = file_l3_config(page_size, pages, str(dev), tmp)

        def engine(cache: CacheConfig, rate: float | None = None) -> LLM:
            from kvtier.engine import LLM

            _release(dev)
            if rate is not None:  # the same directory and keys, reads held to the rate
                cache = dataclasses.replace(cache, storage=throttled_file(rate * 1e9))
            return LLM(net, cache, max_running=1, max_prefill_tokens=longest + 1)

        def ttft(llm: LLM, prompt: list[int]) -> dict[str, Any]:
            runs = []
            for _ in range(repeats):
                llm.cache.flush()
                out = llm.generate([prompt], one)[0]
                runs.append(
                    {
                        "ttft_s": out.ttft_s,
                        "restored_tokens": out.cached_host + out.cached_storage,
                        "recomputed_tokens": out.recomputed,
                    }
                )
            llm.cache.check_integrity()
            return min(runs, key=lambda r: r["ttft_s"])

        with _closing(engine(base)) as fill:  # every prompt into the L3, whole
            for p in [*prompts.values(), *warm]:
                fill.generate([p], one)
            fill.cache.drain()
        log(f"L3 filled with {len(prompts)} prompts and {len(warm)} warm-up prompts")
        recompute: dict[int, float] = {}
        with _closing(engine(dataclasses.replace(base, enable_host=False, storage=None))) as llm:
            llm.generate([warm[0]], one)  # kernels warmed up
            for n in lengths:
                recompute[n] = ttft(llm, prompts[n])["ttft_s"]
                log(f"recompute {n}: {recompute[n] * 1e3:.1f} ms")
        grid: list[dict[str, Any]] = []
        for rate in rates_gbps:
            restore: dict[int, dict[str, Any]] = {}
            with _closing(engine(base, rate)) as llm:
                llm.generate([warm[0]], one)
                for n in lengths:
                    restore[n] = ttft(llm, prompts[n])
                    log(f"{rate} GB/s restore {n}: {restore[n]['ttft_s'] * 1e3:.1f} ms")
            cost_cfg = dataclasses.replace(base, restore_policy="cost")
            with _closing(engine(cost_cfg, rate)) as llm:
                # the first forward of each size is set-up, untimed: the second cold prompt
                # (a long forward) and the warm-up restores (short ones) give the fit its line
                cold = min(warmup_cold_tokens, longest)
                before = llm.stats()["recomputed_tokens"]
                for p in (unseen(2 * page_size), unseen(cold), unseen(cold)):
                    llm.generate([p], one)
                computed = llm.stats()["recomputed_tokens"] - before
                served = _warm_up(llm, warm, one, cost_cfg.restore_storage_rate)
                rates = _policy_rates(llm)
                for n in lengths:
                    c = ttft(llm, prompts[n])
                    best = min(recompute[n], restore[n]["ttft_s"])
                    grid.append(
                        {
                            "prompt_tokens": n,
                            "storage_gbps": rate,
                            "recompute_s": recompute[n],
                            "restore_s": restore[n]["ttft_s"],
                            "cost_s": c["ttft_s"],
                            "cost_over_best": c["ttft_s"] / best,
                            "restored_tokens": c["restored_tokens"],
                            "recomputed_tokens": c["recomputed_tokens"],
                            "warmups_served": served,
                            "warmup_computed_tokens": computed,
                            "policy_rates_before": rates,
                        }
                    )
                    log(
                        f"{rate} GB/s cost {n}: {c['ttft_s'] * 1e3:.1f} ms "
                        f"({c['restored_tokens']} restored), {c['ttft_s'] / best:.2f}x the best"
                    )
    _release(dev)
    worst = max(grid, key=lambda g: g["cost_over_best"])
    return {
        "bench": "load_or_recompute",
        "device": str(dev),
        "model": model,
        "page_size": page_size,
        "repeats": repeats,
        "lengths": lengths,
        "rates_gbps": rates_gbps,
        "grid": grid,
        "max_cost_over_best": worst["cost_over_best"],
        "worst": {k: worst[k] for k in ("prompt_tokens", "storage_gbps", "cost_over_best")},
    }


def _warm_up(llm: LLM, warm: list[list[int]], params: Any, prior: float) -> int:
    """Serve warm-up prompts until the engine's storage read rate left its prior (a restore
    was measured) and its prefill fit has a launch time (short forwards were timed as well as
    long ones); how many it took."""
    for i, p in enumerate(warm, 1):
        llm.generate([p], params)
        llm.cache.drain()
        st = llm.stats()
        if (
            st.get("restore_storage_read_bytes_per_s") != prior
            and st.get("restore_prefill_seconds_per_forward", 0.0) > 0
        ):
            return i
    return len(warm)


def _policy_rates(llm: LLM) -> dict[str, float]:
    keys = (
        "restore_storage_read_bytes_per_s",
        "restore_load_bytes_per_s",
        "restore_prefill_tokens_per_s",
        "restore_prefill_seconds_per_forward",
    )
    stats = llm.stats()
    return {k: stats[k] for k in keys if k in stats}


@contextlib.contextmanager
def _closing(llm: LLM) -> Any:
    try:
        yield llm
    finally:
        llm.close()


def _check(
    lengths: Sequence[int],
    rates: Sequence[float],
    page_size: int,
    repeats: int,
    warmup_tokens: int,
    warmups: int,
    warmup_cold_tokens: int,
) -> None:
    if not lengths or not rates:
        raise ConfigError("lengths and rates_gbps must each name at least one value")
    for name, v in (
        ("page_size", page_size),
        ("repeats", repeats),
        ("warmup_tokens", warmup_tokens),
        ("warmups", warmups),
        ("warmup_cold_tokens", warmup_cold_tokens),
        *(("lengths", n) for n in lengths),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must hold positive integers, got {v!r}")
    bad = [r for r in rates if not (isinstance(r, int | float) and 0 < r < math.inf)]
    if bad:
        raise ConfigError(f"rates_gbps must be positive, finite numbers, got {bad!r}")


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags on ``parser`` and ``run`` as its ``func``."""
    parser.add_argument(
        "--model", default="llama-8b", help="llama-8b (default) or a model preset name"
    )
    parser.add_argument("--dtype", default=None, help="model dtype (llama-8b: bfloat16)")
    parser.add_argument(
        "--lengths",
        type=_numbers(int),
        default=list(LENGTHS),
        help="prompt lengths, comma-separated (default " + ",".join(map(str, LENGTHS)) + ")",
    )
    parser.add_argument(
        "--rates",
        type=_numbers(float),
        default=list(RATES_GBPS),
        help="storage read rates in GB/s, comma-separated (default "
        + ",".join(map(str, RATES_GBPS))
        + ")",
    )
    parser.add_argument("--repeats", type=int, default=2, help="best of (default 2)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    with contextlib.suppress(argparse.ArgumentError):
        parser.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the JSON result (and write ``--json``); exit 2 for a bad option."""
    try:
        result = bench_load_or_recompute(
            model=args.model,
            lengths=args.lengths,
            rates_gbps=args.rates,
            page_size=args.page_size,
            repeats=args.repeats,
            device=args.device,
            dtype=args.dtype,
        )
    except ConfigError as e:
        print(f"kvtier bench load-or-recompute: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.load_or_recompute [flags]``."""
    parser = argparse.ArgumentParser(prog="kvtier bench load-or-recompute", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
