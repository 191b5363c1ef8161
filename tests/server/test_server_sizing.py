"""How ``kvtier serve`` sizes its pools: byte sizes as flags write them, the device pool from a
free-memory figure, the CPU default, the host tier's default and its cap, and the sizes a
built engine really has."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.server.sizing import (
    CPU_DEVICE_TOKENS,
    WORKSPACE_FIXED_BYTES,
    SizeRequest,
    device_pages_from_memory,
    format_bytes,
    parse_bytes,
    plan_pools,
    workspace_bytes,
)

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("10G", 10 * GiB),
        ("10g", 10 * GiB),
        ("1GiB", GiB),
        ("512M", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("1.5G", 3 * GiB // 2),
        ("1GB", 10**9),
        ("2 TB", 2 * 10**12),
        ("64k", 65536),
        ("100B", 100),
        ("1e9", 10**9),
        (".5K", 512),
    ],
)
def test_byte_sizes_take_suffixes(text, value) -> None:
    assert parse_bytes(text, "--host-bytes") == value


@pytest.mark.parametrize("text", ["", "G", "10X", "ten", "-1G", "1.2.3G", "10 G B", "0", "0.4"])
def test_bad_byte_sizes_name_the_flag(text) -> None:
    with pytest.raises(ConfigError) as e:
        parse_bytes(text, "--storage-bytes")
    msg = str(e.value)
    assert msg.startswith(f"--storage-bytes {text!r} ")
    assert "byte size" in msg or "at least one byte" in msg


def test_byte_sizes_read_back() -> None:
    assert [format_bytes(n) for n in (512, 32 * MiB, 1536 * MiB, 200 * GiB)] == [
        "512 B",
        "32.0 MiB",
        "1.50 GiB",
        "200.0 GiB",
    ]


def test_device_pages_from_a_free_memory_figure() -> None:
    # 0.9 of (10 GiB - 1 GiB) in pages of 32 KiB: floor(8697308774.4) // 32768
    assert device_pages_from_memory(10 * GiB, GiB, 0.9, 32768) == 265420
    assert device_pages_from_memory(10 * GiB, GiB, 1.0, 32768) == 9 * GiB // 32768
    assert device_pages_from_memory(GiB, 2 * GiB, 0.9, 32768) == 0  # the workspace ate it


class _Llama8B:
    """Llama-3-8B's shapes as a model config (what ``workspace_bytes`` reads)."""

    hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim = 4096, 14336, 32, 8, 128
    vocab_size, dtype = 128256, "bfloat16"


def test_the_workspace_estimate() -> None:
    per_token = 4 * 4096 + 3 * 14336 + 2 * 32 * 128 + 2 * 8 * 128  # 69632 elements
    want = WORKSPACE_FIXED_BYTES + 2 * 4096 * per_token * 2 + 2 * (16 + 8) * 128256 * 4
    assert workspace_bytes(_Llama8B, 4096, 16) == want
    assert 1.5 * GiB < want < 2 * GiB


def _plan(req: SizeRequest, **kw):  # noqa: ANN202 - a PoolPlan
    args = dict(
        page_bytes=32768,
        page_tokens=16,
        cuda=True,
        free_bytes=10 * GiB,
        workspace=GiB,
        host_tier=True,
        host_available=None,
    )
    return plan_pools(req, **{**args, **kw})


def test_cuda_sizes_the_device_pool_from_free_memory() -> None:
    plan = _plan(SizeRequest())
    assert plan.device_pages == 265420 and plan.host_pages == 2 * 265420
    assert "--mem-fraction 0.9 of the 10.0 GiB free after the weights" in plan.device_reason
    assert _plan(SizeRequest(mem_fraction=0.5)).device_pages == 9 * GiB // 2 // 32768


def test_flags_override_the_sizing() -> None:
    assert _plan(SizeRequest(device_pages=100)).device_pages == 100
    assert _plan(SizeRequest(device_bytes=GiB)).device_pages == GiB // 32768
    plan = _plan(SizeRequest(host_bytes=GiB))
    assert (plan.host_pages, plan.host_bytes, plan.host_ratio) == (None, GiB, None)
    plan = _plan(SizeRequest(host_ratio=0.5))
    assert (plan.host_pages, plan.host_ratio) == (None, 0.5)
    assert _plan(SizeRequest(host_pages=7)).host_pages == 7
    assert _plan(SizeRequest(), host_tier=False).host_pages is None


def test_the_cpu_default_and_the_host_cap() -> None:
    plan = _plan(SizeRequest(), cuda=False, free_bytes=None, page_tokens=4)
    assert plan.device_pages == CPU_DEVICE_TOKENS // 4 and plan.host_pages == 2 * plan.device_pages
    capped = _plan(SizeRequest(), host_available=8 * GiB)
    assert capped.host_pages == 4 * GiB // 32768  # half of what the host has, not 2 x device
    assert "50% of the 8.00 GiB of host memory available" in capped.host_reason
    assert _plan(SizeRequest(), host_available=1 << 50).host_pages == 2 * 265420


def test_no_room_left_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no device memory left for the KV cache"):
        _plan(SizeRequest(), free_bytes=GiB // 2)
    with pytest.raises(ConfigError, match="--device-bytes 100 holds no page"):
        _plan(SizeRequest(device_bytes=100))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mem_fraction": 0}, "--mem-fraction must be a number in (0, 1]"),
        ({"mem_fraction": 1.1}, "--mem-fraction must be a number in (0, 1]"),
        ({"device_pages": 4, "device_bytes": GiB}, "--device-pages and --device-bytes both"),
        ({"host_ratio": 1.0, "host_pages": 3}, "--host-pages and --host-ratio all size"),
    ],
)
def test_conflicting_size_flags(kw, message) -> None:
    with pytest.raises(ConfigError) as e:
        SizeRequest(**kw)
    assert message in str(e.value)


def test_a_built_engine_has_the_planned_pools() -> None:
    from kvtier.server.lifecycle import EngineSpec, build_engine

    spec = EngineSpec("tiny", {"device": "cpu", "page_size": 4}, SizeRequest(host_ratio=0.5))
    engine = build_engine(spec)
    try:
        st = engine.llm.stats()
        pages = CPU_DEVICE_TOKENS // 4
        page_bytes = 4 * 2 * 2 * 32 * 4 * 4  # layers x (k, v) x kv heads x head_dim x tokens x 4
        assert (st["device_pages_total"], st["device_bytes_total"]) == (pages, pages * page_bytes)
        assert st["host_pages_total"] == pages // 2
        assert engine.context_tokens == 4096
        assert any(
            f"device tier: {pages} pages, {CPU_DEVICE_TOKENS} tokens" in ln for ln in engine.summary
        )
        assert any(
            f"host tier: {pages // 2} pages" in ln and "--host-ratio 0.5" in ln
            for ln in engine.summary
        )
    finally:
        engine.llm.close()


def test_max_model_len_bounds_the_context() -> None:
    from kvtier.server.lifecycle import EngineSpec, build_engine

    spec = EngineSpec("tiny", {"device": "cpu"}, SizeRequest(device_pages=64), max_model_len=512)
    engine = build_engine(spec)
    engine.llm.close()
    assert engine.context_tokens == 512
    with pytest.raises(ConfigError, match="exceeds the 1024 tokens the device pool holds"):
        build_engine(EngineSpec("tiny", {"device": "cpu"}, SizeRequest(64), max_model_len=2048))
