from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from kvtier.bench.storage import _on_threads, bench_storage
from kvtier.keys import Namespace
from kvtier.storage.file import FileBackend


def _backend_threads(tmp_path: Path) -> int:
    be = FileBackend(tmp_path / "probe", Namespace("probe"), 1 << 20)
    try:
        return be._io.threads
    finally:
        be.close()


def test_bench_storage_tiny(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    top = bench_storage(str(tmp_path), page_bytes=64 << 10, num_pages=8, repeats=1)
    assert torch.get_num_threads() == threads  # one intra-op thread during the bench only
    assert (top["bench"], top["backend"], len(top["runs"])) == ("storage", "file", 1)
    assert "page cache" in top["page_cache"]
    out = top["runs"][0]
    assert out["page_bytes"] == 64 << 10
    assert out["num_pages"] == 8
    assert out["total_bytes"] == 8 * (64 << 10)
    for part in ("file_backend", "plain_io", "parallel_plain_io"):
        assert set(out[part]) == {"write_gbps", "read_gbps"}
        assert all(v > 0 for v in out[part].values())
    assert set(out["ratio"]) == {"write", "read"}
    assert out["ratio"]["write"] > 0 and out["ratio"]["read"] > 0
    assert out["ratio_vs_parallel_plain"] == {
        d: out["file_backend"][f"{d}_gbps"] / out["parallel_plain_io"][f"{d}_gbps"]
        for d in ("write", "read")
    }
    ceiling = out["verified_read_ceiling"]["read_gbps"]
    assert ceiling > 0
    assert out["ratio_vs_verified_ceiling"] == {"read": out["file_backend"]["read_gbps"] / ceiling}
    assert set(out["gb_per_cpu_s"]) == {"file_backend", "plain_io", "parallel_plain_io"}
    for part in out["gb_per_cpu_s"].values():
        assert set(part) == {"write", "read"} and all(v > 0 for v in part.values())
    per_cpu = out["gb_per_cpu_s"]
    assert out["cpu_ratio"] == {
        d: per_cpu["file_backend"][d] / per_cpu["plain_io"][d] for d in ("write", "read")
    }
    assert "cpu_ratio_vs_sglang" not in out and "parallel_plain_vs_sglang" not in out
    assert list(tmp_path.iterdir()) == []  # the bench removed what it wrote


def test_bench_storage_with_encryption_times_the_sealed_backend_too(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    top = bench_storage(str(tmp_path), page_bytes=64 << 10, num_pages=8, repeats=1, encryption=True)
    out = top["runs"][0]
    assert all(v > 0 for v in out["encrypted_file_backend"].values())
    assert out["encryption_ratio"] == {
        d: out["encrypted_file_backend"][f"{d}_gbps"] / out["file_backend"][f"{d}_gbps"]
        for d in ("write", "read")
    }
    assert list(tmp_path.iterdir()) == []
    plain = bench_storage(str(tmp_path), page_bytes=4096, num_pages=2, repeats=1)["runs"][0]
    assert "encrypted_file_backend" not in plain and "encryption_ratio" not in plain


def test_bench_storage_parallel_plain_uses_the_backends_threads(tmp_path: Path) -> None:
    threads = _backend_threads(tmp_path / "probe")
    (tmp_path / "work").mkdir()
    out = bench_storage(str(tmp_path / "work"), page_bytes=4096, num_pages=4, repeats=1)["runs"][0]
    assert out["io_threads"] == threads >= 1


def test_bench_storage_against_a_peer(tmp_path: Path) -> None:
    # A stand-in for the SGLang peer's interpreter: it prints the peer's JSON line.
    line = {
        "sglang": "stub",
        "write_s": 0.5,
        "read_s": 0.25,
        "write_cpu_s": 0.5,
        "read_cpu_s": 0.25,
    }
    stub = tmp_path / "peer-python"
    stub.write_text(f"#!/bin/sh\necho '{json.dumps(line)}'\n")
    stub.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    top = bench_storage(str(work), page_bytes=4096, num_pages=4, repeats=1, peer_python=str(stub))
    out = top["runs"][0]
    peer = out["sglang_hicache_file"]
    assert peer == {
        "version": "stub",
        "write_gbps": 4 * 4096 / 0.5 / 1e9,
        "read_gbps": 4 * 4096 / 0.25 / 1e9,
    }
    assert out["parallel_plain_vs_sglang"] == {
        d: out["parallel_plain_io"][f"{d}_gbps"] / peer[f"{d}_gbps"] for d in ("write", "read")
    }
    assert out["ratio_vs_sglang"] == {
        d: out["file_backend"][f"{d}_gbps"] / peer[f"{d}_gbps"] for d in ("write", "read")
    }
    assert set(out["gb_per_cpu_s"]) == {
        "file_backend",
        "plain_io",
        "parallel_plain_io",
        "sglang_hicache_file",
    }
    assert all(v > 0 for v in out["parallel_plain_vs_sglang"].values())
    assert list(work.iterdir()) == []


def test_on_threads_runs_each_index_once_and_raises_a_threads_error() -> None:
    from concurrent.futures import ThreadPoolExecutor

    seen: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            seen.append(i)

    with ThreadPoolExecutor(1) as pool:
        _on_threads(pool, 2, 64, job)
        assert sorted(seen) == list(range(64))

        def fail(i: int) -> None:
            if i == 3:
                raise OSError("disk gone")

        with pytest.raises(OSError, match="disk gone"):
            _on_threads(pool, 2, 8, fail)
    _on_threads(None, 1, 5, job)
    assert sorted(seen) == sorted([*range(64), *range(5)])


def test_bench_storage_missing_peer_is_reported(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    top = bench_storage(str(tmp_path), page_bytes=4096, num_pages=2, repeats=2, peer_python=missing)
    out = top["runs"][0]
    assert missing in out["sglang_hicache_file"]["error"]
    assert "ratio_vs_sglang" not in out and "cpu_ratio_vs_sglang" not in out
    assert "parallel_plain_vs_sglang" not in out
    assert set(out["gb_per_cpu_s"]) == {"file_backend", "plain_io", "parallel_plain_io"}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.mooncake
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


def test_bench_storage_creates_a_missing_dir(tmp_path: Path) -> None:
    where = tmp_path / "a" / "b"
    top = bench_storage(str(where), page_bytes=4096, num_pages=2, repeats=1)
    assert top["runs"][0]["num_pages"] == 2
    assert where.is_dir() and list(where.iterdir()) == []  # the bench's own temp dir is gone


def test_storage_peer_version_without_sglang_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's version comes from the package, or from its dist-info where the package loads
    without its ``__init__`` (``scripts/peer_file_only.sh``)."""
    import importlib.metadata
    import types

    from kvtier.bench.storage_peer import _version

    assert _version(types.SimpleNamespace(__version__="0.5.23")) == "0.5.23"
    asked: list[str] = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "9.9")
    assert _version(types.ModuleType("sglang")) == "9.9"
    assert asked == ["sglang"]
