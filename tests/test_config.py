"""Bad configuration fails at start-up with an error naming the option."""

from __future__ import annotations

import pytest
import torch

from kvtier import CacheConfig, PoolSpec, TieredCache
from kvtier.errors import ConfigError

SPEC = PoolSpec("kv", 2, (2, 1, 4), torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": -16}, "page_size"),
        ({"device_pages": 0}, "device_pages"),
        ({"host_ratio": 0.0}, "host_ratio"),
        ({"host_pages": -1}, "host_pages"),
        ({"host_bytes": 0}, "host_bytes"),
        ({"storage_bytes": 0}, "storage_bytes"),
        ({"write_threshold": 0}, "write_threshold"),
        ({"prefetch_timeout_s": -1.0}, "prefetch_timeout_s"),
        ({"prefetch_min_pages": 0}, "prefetch_min_pages"),
        ({"host_layout": "row_first"}, "host_layout='row_first'"),
        ({"write_policy": "write_sometimes"}, "write_policy='write_sometimes'"),
        ({"prefetch_policy": "eager"}, "prefetch_policy='eager'"),
        ({"eviction_policy": "random"}, "eviction_policy='random'"),
        ({"rank": 2, "world_size": 2}, "rank=2"),
        ({"enable_host": False, "storage": "file"}, "storage requires enable_host"),
        ({"enable_host": False, "write_policy": "write_back"}, "write_back"),
        ({"backup_share": "yes"}, "backup_share must be a number in [0, 1], got 'yes'"),
        ({"backup_share": 1.5}, "backup_share must be a number in [0, 1], got 1.5"),
        ({"backup_share": True}, "backup_share must be a number in"),
    ],
)
def test_invalid_options_name_the_option(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        CacheConfig(**kwargs)


def test_write_back_needs_a_host_tier_as_big_as_the_device_pool():
    cfg = CacheConfig(device_pages=64, host_pages=32, write_policy="write_back", device="cpu")
    with pytest.raises(ConfigError, match="host_pages gives 32 host pages.*64 pages"):
        TieredCache(cfg, [SPEC])
    cfg = CacheConfig(device_pages=64, host_ratio=0.5, write_policy="write_back", device="cpu")
    with pytest.raises(ConfigError, match="host_ratio"):
        TieredCache(cfg, [SPEC])


def test_host_bytes_too_small_for_one_page():
    cfg = CacheConfig(device_pages=4, host_bytes=10, device="cpu")
    with pytest.raises(ConfigError, match="host_bytes gives a host pool of 0 pages"):
        TieredCache(cfg, [SPEC])


def test_unknown_storage_backend(tmp_path):
    cfg = CacheConfig(device="cpu", storage="s3", storage_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="storage='s3' is not a registered backend"):
        TieredCache(cfg, [SPEC])


def test_unwritable_storage_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = CacheConfig(device="cpu", storage="file", storage_dir=str(blocker / "sub"))
    with pytest.raises(ConfigError, match="storage_dir"):
        TieredCache(cfg, [SPEC])


def test_bad_pool_spec():
    with pytest.raises(ConfigError, match="row_shape"):
        PoolSpec("kv", 2, (2, 0, 4), torch.float32)
    with pytest.raises(ConfigError, match="unique"):
        TieredCache(CacheConfig(device="cpu", enable_host=False), [SPEC, SPEC])


def test_host_sizing_by_ratio_and_bytes():
    page_bytes = SPEC.page_bytes(16)
    c = TieredCache(CacheConfig(device_pages=8, host_ratio=2.5, device="cpu"), [SPEC])
    assert c.host_pool.num_pages == 20
    c = TieredCache(
        CacheConfig(device_pages=8, host_bytes=3 * page_bytes + 1, device="cpu"), [SPEC]
    )
    assert c.host_pool.num_pages == 3
