"""Benchmarks and the engine use only the public API (DESIGN.md): what a benchmark forces is a
cache or engine option, and the caches they drive keep their integrity throughout."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest

from kvtier.bench.decode_stall import backup_during_decode
from kvtier.config import CacheConfig
from kvtier.engine import ModelConfig
from kvtier.engine.families import build_model

ROOT = Path(__file__).resolve().parents[2]
USERS = sorted([*(ROOT / "kvtier/bench").glob("*.py"), *(ROOT / "kvtier/engine").rglob("*.py")])
INTERNAL = re.compile(r"\.(controller|device_pool|host_pool|allocator|mover|pacer|_cache)\b")


@pytest.mark.parametrize("path", USERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reach_into_cache_internals(path):
    text = path.read_text()
    hits = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if INTERNAL.search(line) and not line.lstrip().startswith(("from ", "import "))
    ]
    assert hits == []


@pytest.mark.parametrize(
    "path",
    sorted([*(ROOT / "kvtier/bench").glob("*.py"), *(ROOT / "kvtier/transfer").glob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_assert_statements(path):
    tree = ast.parse(path.read_text())
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)] == []


def test_backup_during_decode_runs_through_the_public_api_on_cpu(tmp_path):
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position=256,
        dtype="float32",
    )
    model = build_model(cfg)
    base = CacheConfig(page_size=16, device="cpu", debug_checks=True)
    lines: list[str] = []
    out = backup_during_decode(
        model,
        base,
        random.Random(0),
        256,
        4,
        batch=2,
        num_steps=3,
        rounds=2,
        log=lines.append,
        in_flight=2,  # measured, it grows with the host's load (hundreds on a busy one)
    )
    page_bytes = 2 * 16 * 2 * 1 * 16 * 4  # layers x tokens x (k, v) x heads x head_dim x fp32
    assert out["backup_bytes"] == 4 * page_bytes
    assert (out["batch"], out["steps"], out["backups_in_flight"]) == (2, 3, 2)
    assert {k: out[k]["transfer_mechanism"] for k in ("paced", "paced_kernels", "unpaced")} == {
        "paced": "auto",
        "paced_kernels": "kernel",
        "unpaced": "auto",
    }
    assert out["unpaced"]["backup_share"] == 0.0 and out["paced"]["backup_share"] == 0.8
    # Paced: the median of two alternating (alone, paced) pairs; the others against their median.
    alone = out["decode_step_ms_rounds"]
    assert len(alone) == 2 and out["decode_step_ms"] == pytest.approx(sum(alone) / 2)
    ratios = out["paced"]["stall_rounds"]
    assert len(ratios) == 2 and out["paced"]["stall"] == pytest.approx(sum(ratios) / 2)
    kernels = out["paced_kernels"]
    assert kernels["stall"] == pytest.approx(kernels["decode_step_ms"] / out["decode_step_ms"])
    assert len(lines) == 1 and "paced stall" in lines[0]
    for run in ("paced", "paced_kernels", "unpaced"):
        # On CPU backups complete at the poll that follows them: every step completes some.
        assert out[run]["backup_gbps_while_decoding"] > 0
        assert out[run]["decode_step_ms"] > 0
