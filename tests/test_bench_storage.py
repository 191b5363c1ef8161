from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.storage import bench_storage


def test_bench_storage_tiny(tmp_path: Path) -> None:
    out = bench_storage(str(tmp_path), page_bytes=64 << 10, num_pages=8, repeats=1)
    assert out["bench"] == "storage"
    assert out["page_bytes"] == 64 << 10
    assert out["num_pages"] == 8
    assert out["total_bytes"] == 8 * (64 << 10)
    for part in ("file_backend", "plain_io"):
        assert set(out[part]) == {"write_gbps", "read_gbps"}
        assert all(v > 0 for v in out[part].values())
    assert set(out["ratio"]) == {"write", "read"}
    assert out["ratio"]["write"] > 0 and out["ratio"]["read"] > 0
    assert list(tmp_path.iterdir()) == []  # the bench removed what it wrote


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
