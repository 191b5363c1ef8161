from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.storage import bench_storage


def test_bench_storage_tiny(tmp_path: Path) -> None:
    top = bench_storage(str(tmp_path), page_bytes=64 << 10, num_pages=8, repeats=1)
    assert (top["bench"], top["backend"], len(top["runs"])) == ("storage", "file", 1)
    assert "page cache" in top["page_cache"]
    out = top["runs"][0]
    assert out["page_bytes"] == 64 << 10
    assert out["num_pages"] == 8
    assert out["total_bytes"] == 8 * (64 << 10)
    for part in ("file_backend", "plain_io"):
        assert set(out[part]) == {"write_gbps", "read_gbps"}
        assert all(v > 0 for v in out[part].values())
    assert set(out["ratio"]) == {"write", "read"}
    assert out["ratio"]["write"] > 0 and out["ratio"]["read"] > 0
    assert set(out["gb_per_cpu_s"]) == {"file_backend", "plain_io"}
    for part in out["gb_per_cpu_s"].values():
        assert set(part) == {"write", "read"} and all(v > 0 for v in part.values())
    per_cpu = out["gb_per_cpu_s"]
    assert out["cpu_ratio"] == {
        d: per_cpu["file_backend"][d] / per_cpu["plain_io"][d] for d in ("write", "read")
    }
    assert "cpu_ratio_vs_sglang" not in out
    assert list(tmp_path.iterdir()) == []  # the bench removed what it wrote


def test_bench_storage_missing_peer_is_reported(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    top = bench_storage(str(tmp_path), page_bytes=4096, num_pages=2, repeats=2, peer_python=missing)
    out = top["runs"][0]
    assert missing in out["sglang_hicache_file"]["error"]
    assert "ratio_vs_sglang" not in out and "cpu_ratio_vs_sglang" not in out
    assert set(out["gb_per_cpu_s"]) == {"file_backend", "plain_io"}
    assert list(tmp_path.iterdir()) == []


def test_bench_storage_mooncake_tiny() -> None:
    from mooncake_harness import IMPORT_ERROR

    if IMPORT_ERROR is not None:
        pytest.skip(IMPORT_ERROR)
    out = bench_storage(backend="mooncake", page_bytes=64 << 10, num_pages=8, repeats=1)
    assert (out["bench"], out["backend"], out["cluster"]) == (
        "storage",
        "mooncake",
        "local cluster",
    )
    assert out["total_bytes"] == 8 * (64 << 10)
    for part in ("mooncake_backend", "raw_client"):
        assert set(out[part]) == {"write_gbps", "read_gbps"}
        assert all(v > 0 for v in out[part].values())
    assert out["ratio"]["write"] > 0 and out["ratio"]["read"] > 0


def test_bench_storage_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend"):
        bench_storage(backend="tape")
