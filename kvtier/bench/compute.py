"""What the reference engine's compute achieves against the device's own limits, in one run.

Limits, measured in the same process: the matmul rate (a large square ``torch.matmul`` in the
model's dtype, TFLOP/s) and the copy rate (a large device-to-device copy: bytes read plus bytes
written per second, GB/s, the memory traffic the device sustains).

- **Cold prefill** of ``prompt_tokens`` fresh tokens (best of ``repeats``, each its own prompt;
  its TTFT through ``LLM.generate``) on the Llama-8B-sized config ``bench ttft`` uses. Its FLOP
  count is ``2 x params x tokens + 2 x 2 x layers x heads x head_dim x tokens^2 / 2``: ``params``
  are the decoder layers' matmul weights (q, k, v, o, gate, up, down; the embedding is a lookup
  and the LM head runs for the last token only, which the formula leaves out), and attention is
  two matmuls (QK^T, PV) of two FLOPs per multiply-add over the causal half of the
  ``tokens x tokens`` scores. ``prefill.ratio_to_matmul`` is its TFLOP/s over the matmul rate.
- **Decode step** of ``batch`` requests at a context of ``decode_context`` tokens (median over
  ``decode_steps`` steps, contexts growing by one each; the mean and the slowest step, which
  records a CUDA graph where one is new, are reported beside it). Its bound is the bytes a step must
  read, every weight once (embedding table excluded: only a row per request is read) plus every
  request's K/V rows of every layer at its context, over the copy rate. ``decode.ratio_to_bound``
  is the step time over that bound (1 is the limit; larger is slower).

The engine uses only the public API (``LLM``, ``CacheConfig``); the host tier is off so no
backup traffic shares the device with the timed work.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.bench.decode_stall import release_pools
from kvtier.bench.helpers import logger
from kvtier.bench.ttft import _DeviceInitLM
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams

_log = logger("compute")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_seconds(dev: torch.device, fn, iters: int, repeats: int = 3) -> float:  # noqa: ANN001
    """Best over ``repeats`` of the mean seconds of ``iters`` calls of ``fn`` (after one)."""
    fn()
    _sync(dev)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def matmul_tflops(dev: torch.device, dtype: torch.dtype, size: int, iters: int = 20) -> float:
    """TFLOP/s of ``[size, size] @ [size, size]`` in ``dtype`` (``2 size^3`` FLOPs each)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(size, size, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=dev, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    s = _best_seconds(dev, lambda: torch.matmul(a, b, out=out), iters)
    return 2.0 * size**3 / s / 1e12


def copy_gbps(dev: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy of ``nbytes``: bytes read plus bytes written per second, GB/s."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    s = _best_seconds(dev, lambda: dst.copy_(src), iters)
    return 2.0 * nbytes / s / 1e9


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights of the decoder layers (biases and norms left out)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * h * cfg.intermediate_size)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """``2 x params x tokens + 2 x 2 x layers x heads x head_dim x tokens^2 / 2``."""
    dense = 2.0 * layer_matmul_params(cfg) * tokens
    attention = 2.0 * 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens**2 / 2
    return dense + attention


def decode_read_bytes(model: torch.nn.Module, cfg: ModelConfig, batch: int, context: float) -> dict:
    """Bytes one decode step reads: every weight but the embedding table, and each request's
    K/V rows (``context`` positions, every layer)."""
    embed = model.model.embed_tokens.weight
    weights = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if p is not embed or model.lm_head is None  # a tied LM head reads the table whole
    )
    row = 2 * cfg.num_kv_heads * cfg.head_dim * embed.element_size()
    kv = int(batch * context * cfg.num_layers * row)
    return {"weights_bytes": weights, "kv_bytes": kv}


def bench_compute(
    prompt_tokens: int = 32768,
    batch: int = 32,
    decode_context: int = 2048,
    decode_steps: int = 16,
    num_layers: int = 32,
    hidden_size: int = 4096,
    intermediate_size: int = 14336,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    vocab_size: int = 32000,
    dtype: str = "bfloat16",
    page_size: int = 16,
    repeats: int = 2,
    matmul_size: int = 8192,
    copy_bytes: int = 1 << 30,
    device: str | None = None,
) -> dict:
    """The JSON of the module docstring's measurements. The defaults are the Llama-8B-sized
    model of ``bench ttft`` on CUDA; tests pass tiny sizes on the CPU. Raises ``ValueError``
    for a ``decode_context`` under 3 (a prompt of one token and the untimed step's)."""
    if decode_context < 3:
        raise ValueError(f"decode_context={decode_context} must be at least 3")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position=max(prompt_tokens, decode_context + decode_steps) + 64,
        dtype=dtype,
    )
    tflops = matmul_tflops(dev, cfg.torch_dtype, matmul_size)
    copy = copy_gbps(dev, copy_bytes)
    _log(f"{dev}: matmul {tflops:.1f} TFLOP/s, copy {copy:.1f} GB/s (read + write)")
    with dev:
        model = _DeviceInitLM(cfg)
    model.fill_random(0)
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    prompt_pages = -(-prompt_tokens // page_size)
    decode_pages = batch * -(-(decode_context + decode_steps + 2) // page_size)
    release_pools()
    cache = CacheConfig(
        page_size=page_size,
        device_pages=max(prompt_pages, decode_pages) + 8,
        device=str(dev),
        enable_host=False,
    )
    llm = LLM(
        model,
        cache,
        max_running=batch,
        max_prefill_tokens=max(prompt_tokens, batch * decode_context) + 1,
    )
    try:
        prefill = _prefill(llm, cfg, fresh, prompt_tokens, repeats, tflops)
        decode = _decode(llm, model, cfg, fresh, batch, decode_context, decode_steps, copy)
    finally:
        llm.close()
    return {
        "bench": "compute",
        "device": str(dev),
        "torch": torch.__version__,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "num_layers",
                "hidden_size",
                "intermediate_size",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
                "dtype",
            )
        },
        "matmul_size": matmul_size,
        "matmul_tflops": tflops,
        "copy_bytes": copy_bytes,
        "copy_gbps": copy,
        "prefill": prefill,
        "decode": decode,
    }


def _prefill(llm: LLM, cfg: ModelConfig, fresh, tokens: int, repeats: int, peak: float) -> dict:  # noqa: ANN001
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([fresh(min(tokens, 256))], params)  # kernels and allocator warmed up
    best = math.inf
    for _ in range(repeats):
        out = llm.generate([fresh(tokens)], params)[0]
        if out.cached_device:
            raise RuntimeError("a cold prefill hit the cache")
        best = min(best, out.ttft_s)
    flops = prefill_flops(cfg, tokens)
    achieved = flops / best / 1e12
    _log(f"cold prefill of {tokens}: {best:.3f} s, {achieved:.1f} TFLOP/s ({achieved / peak:.0%})")
    return {
        "prompt_tokens": tokens,
        "ttft_s": best,
        "flops": flops,
        "flops_formula": "2*params*tokens + 2*2*layers*heads*head_dim*tokens^2/2",
        "layer_matmul_params": layer_matmul_params(cfg),
        "tflops": achieved,
        "ratio_to_matmul": achieved / peak,
    }


def decode_step_times(
    llm: LLM, fresh: Callable[[int], list[int]], batch: int, context: int, steps: int
) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``batch`` requests whose prompts
    (``fresh(n)`` draws ``n`` tokens) hold ``context - 2`` tokens: one step prefills them all
    (the prefill budget and the pool must hold every prompt), one decodes untimed (its kernels
    warm); the timed steps then read contexts of ``context`` up to ``context + steps - 1``
    positions. Take their median: a step that records a CUDA graph (once per batch and
    context bucket, ``kvtier.engine.graphs``) weighs in the mean of a few steps far more than
    in a long decode."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(fresh(context - 2), params)
    llm.step()
    llm.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    while llm.has_unfinished():
        llm.step()
    return times


def _decode(
    llm: LLM,
    model: torch.nn.Module,
    cfg: ModelConfig,
    fresh,  # noqa: ANN001
    batch: int,
    context: int,
    steps: int,
    copy: float,
) -> dict:
    times = decode_step_times(llm, fresh, batch, context, steps)
    step_s = statistics.median(times)
    graphs = llm.runner.graphs
    mean_ctx = context + (steps - 1) / 2
    read = decode_read_bytes(model, cfg, batch, mean_ctx)
    bound_s = (read["weights_bytes"] + read["kv_bytes"]) / (copy * 1e9)
    _log(
        f"decode step of {batch} at ~{mean_ctx:.0f} tokens: {step_s * 1e3:.2f} ms, "
        f"bound {bound_s * 1e3:.2f} ms ({step_s / bound_s:.2f}x)"
    )
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "mean_context": mean_ctx,
        "step_s": step_s,
        "mean_step_s": sum(times) / steps,
        "max_step_s": max(times),
        "graph_captures": None if graphs is None else graphs.captures,
        "graph_replays": None if graphs is None else graphs.replays,
        "graph_padded": None if graphs is None else graphs.padded,
        **read,
        "bound_s": bound_s,
        "ratio_to_bound": step_s / bound_s,
    }
