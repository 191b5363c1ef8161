from __future__ import annotations

import json

import pytest
import torch

from kvtier.bench import transfer
from kvtier.bench.transfer import bench_transfer
from kvtier.bench.tree import bench_tree
from kvtier.errors import ConfigError

STAT_KEYS = {"ops", "mean_us", "p50_us", "p99_us"}


def test_bench_tree_tiny() -> None:
    out = bench_tree(num_pages=2000, page_size=16, prompt_tokens=1024, seed=1)
    json.dumps(out)
    assert out["bench"] == "tree"
    assert (out["num_pages"], out["page_size"], out["prompt_tokens"]) == (2000, 16, 1024)
    assert out["tree"]["pages"] >= 2000
    assert out["tree"]["final_pages"] == pytest.approx(2000, rel=0.1)
    tree_ops = {
        "match_hit",
        "match_diverge",
        "match_miss",
        "insert",
        "lock_unlock",
        "evict_device",
        "evict_host",
        "prompt_cold_match",
        "prompt_cold_insert",
        "prompt_hit_match",
        "prompt_diverge_match",
        "prompt_diverge_insert",
    }
    assert set(out["ops"]) == tree_ops
    assert set(out["flat_table"]) == tree_ops - {"lock_unlock", "evict_device", "evict_host"}
    assert set(out["ratio"]) == set(out["flat_table"])
    for stats in (*out["ops"].values(), *out["flat_table"].values()):
        assert set(stats) >= STAT_KEYS
        assert stats["ops"] > 0 and stats["mean_us"] > 0
        assert stats["p50_us"] <= stats["p99_us"]
    assert all(r > 0 for r in out["ratio"].values())
    assert out["ops"]["prompt_hit_match"]["pages_per_op"] == 1024 // 16
    assert out["ops"]["prompt_diverge_match"]["pages_per_op"] == 1024 // 16 // 2
    assert "us_per_page" not in out["ops"]["match_miss"]
    assert out["ops"]["evict_device"]["pages_per_op"] >= 16
    assert out["ops"]["evict_host"]["pages_per_op"] >= 16


def test_bench_tree_rejects_short_prompt() -> None:
    with pytest.raises(ConfigError, match="prompt_tokens"):
        bench_tree(num_pages=100, prompt_tokens=16)


def test_bench_transfer_tiny() -> None:
    out = bench_transfer(
        num_layers=2, num_kv_heads=2, head_dim=16, num_pages=16, repeats=1, dtype="float16"
    )
    json.dumps(out)
    assert out["bench"] == "transfer"
    assert out["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert out["verified"] is True
    sizes = out["sizes"]
    assert (sizes["num_pages"], sizes["num_layers"], sizes["dtype"]) == (16, 2, "float16")
    assert sizes["page_bytes"] == 2 * 16 * 2 * 2 * 16 * 2
    assert sizes["total_bytes"] == 16 * sizes["page_bytes"]
    assert sizes["reduced"] is False
    for direction in ("d2h", "h2d"):
        d = out[direction]
        expect_paths = {"kv": "cpu"} if out["device"] == "cpu" else {"kv": "kernel"}
        assert d.pop("paths") == expect_paths  # 1 KiB rows: kernels on CUDA
        assert set(d) == {
            "gbps",
            "median_gbps",
            "contiguous_gbps",
            "contiguous_median_gbps",
            "ratio",
            "median_ratio",
        }
        assert all(v > 0 for v in d.values())
        assert d["ratio"] == pytest.approx(d["gbps"] / d["contiguous_gbps"])
    assert (out["both"] is None) == (out["device"] == "cpu")


def test_bench_transfer_layer_first_host() -> None:
    out = bench_transfer(
        num_layers=2, num_kv_heads=1, head_dim=8, num_pages=4, repeats=2, host_layout="layer_first"
    )
    assert out["verified"] is True
    assert out["sizes"]["host_layout"] == "layer_first"
    assert out["d2h"]["ratio"] > 0 and out["h2d"]["ratio"] > 0


def test_bench_transfer_shrinks_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CPU_TRANSFER_BYTES", 1 << 20)
    # 8 layers x 16 KiB pages: 8 pages would fit, fewer than MIN_CPU_PAGES, so layers halve.
    out = bench_transfer(
        device="cpu", num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16", repeats=1
    )
    sizes = out["sizes"]
    assert sizes["reduced"] is True
    assert sizes["requested"] == {"num_pages": 512, "num_layers": 8}
    assert (sizes["num_layers"], sizes["num_pages"]) == (4, transfer.MIN_CPU_PAGES)
    assert sizes["total_bytes"] == 1 << 20
    assert out["verified"] is True


def test_bench_transfer_rejects_unknown_dtype() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        bench_transfer(dtype="bfloat17", num_pages=1)


def test_plot_draws_one_bar_per_direction_and_configuration(tmp_path) -> None:
    import xml.etree.ElementTree as ET

    from kvtier.bench.plot import plot

    out = bench_transfer(num_layers=2, num_kv_heads=1, head_dim=8, num_pages=4, repeats=1)
    src = tmp_path / "t.json"
    src.write_text(json.dumps(out))
    svg = tmp_path / "t.svg"
    plot(svg, [src, src])
    root = ET.parse(svg).getroot()
    bars = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("height") != "10"]
    per_file = 3 if out["both"] is not None else 2  # d2h, h2d and, on CUDA only, both
    assert len(bars) == 2 * per_file
    with pytest.raises(ValueError, match="at least one result file"):
        plot(tmp_path / "x.svg", [])


def test_bench_transfer_target_mib_sets_the_page_count() -> None:
    out = bench_transfer(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", repeats=1, target_mib=1
    )
    assert out["sizes"]["page_bytes"] == 4096 and out["sizes"]["num_pages"] == 256
    with pytest.raises(ConfigError, match="target_mib=0"):
        bench_transfer(target_mib=0)


def test_bench_transfer_host_pages_option() -> None:
    kw = dict(num_layers=2, num_kv_heads=1, head_dim=8, num_pages=64, repeats=1)
    churn = bench_transfer(page_size=1, **kw)
    assert churn["sizes"]["host_pages"] == "churned" and churn["verified"] is True
    assert churn["sizes"]["host_pool_pages"] == 4 * 64
    rand = bench_transfer(page_size=1, host_pages="random", **kw)
    assert rand["sizes"]["host_pages"] == "random" and rand["verified"] is True
    # One tree node's pages are consecutive host pages; a random subset rarely is.
    assert churn["sizes"]["mean_host_run"] > 4 * rand["sizes"]["mean_host_run"]
    with pytest.raises(ConfigError, match="host_pages='sorted' is not one of churned, random"):
        bench_transfer(host_pages="sorted", **kw)


def test_cli_transfer_repeats_reach_the_bench(tmp_path, capsys) -> None:
    from kvtier.cli import main

    out = tmp_path / "t.json"
    args = ["bench", "transfer", "--device", "cpu", "--num-pages", "4", "--repeats", "2"]
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["repeats"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "transfer", "--device", "cpu", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err
