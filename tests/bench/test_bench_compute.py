"""The compute benchmark reports its limits, a cold prefill and a decode step against them."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.compute import bench_compute, layer_matmul_params, prefill_flops
from kvtier.cli import main
from kvtier.engine import ModelConfig

TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "dtype": "float32",
    "matmul_size": 64,
    "copy_bytes": 1 << 16,
    "repeats": 1,
    "device": "cpu",
}


def test_flop_count_formula() -> None:
    cfg = ModelConfig(**{k: TINY[k] for k in ("num_layers", "hidden_size", "num_heads")})
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    assert layer_matmul_params(cfg) == cfg.num_layers * per_layer
    t = 10
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * d * t * t / 2
    assert prefill_flops(cfg, t) == 2 * cfg.num_layers * per_layer * t + attention


def test_bench_compute_tiny_cpu() -> None:
    r = bench_compute(prompt_tokens=96, batch=3, decode_context=40, decode_steps=2, **TINY)
    assert r["bench"] == "compute" and r["device"] == "cpu"
    assert r["matmul_tflops"] > 0 and r["copy_gbps"] > 0
    p, d = r["prefill"], r["decode"]
    assert p["prompt_tokens"] == 96 and p["ttft_s"] > 0 and p["flops"] > 0
    assert p["tflops"] > 0 and p["ratio_to_matmul"] > 0
    assert d["batch"] == 3 and d["context"] == 40 and d["mean_context"] == 40.5
    assert d["kv_bytes"] == 3 * 40.5 * 2 * (2 * 2 * 16 * 4)
    assert d["weights_bytes"] > 0 and d["step_s"] > 0
    assert d["bound_s"] > 0 and d["ratio_to_bound"] > 0
    json.dumps(r)


def test_bench_compute_rejects_a_too_short_context() -> None:
    with pytest.raises(ValueError, match="decode_context"):
        bench_compute(decode_context=2, **TINY)


def test_cli_parses_compute() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "compute", "--batch", "0"])
