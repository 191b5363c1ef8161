"""Bad configuration fails at start-up with an error naming the option."""

from __future__ import annotations

import pytest
import torch
from factories import SPEC

from kvtier import CacheConfig, PoolSpec, TieredCache
from kvtier.errors import ConfigError


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
        ({"backup_share": float("nan")}, r"backup_share must be a number in [0, 1], got nan"),
        ({"host_ratio": float("nan")}, "host_ratio must be a positive finite number, got nan"),
        ({"host_ratio": float("inf")}, "host_ratio must be a positive finite number, got inf"),
        ({"host_ratio": "2"}, "host_ratio must be a positive finite number, got '2'"),
        ({"host_pages": 2.5}, "host_pages must be a positive integer, got 2.5"),
        ({"host_pages": True}, "host_pages must be a positive integer, got True"),
        ({"host_bytes": 4096.0}, "host_bytes must be a positive integer, got 4096.0"),
        ({"host_pages": 4, "host_bytes": 4096}, "host_pages=4 and host_bytes=4096 both size"),
        ({"page_size": 16.0}, "page_size must be a positive integer, got 16.0"),
        ({"storage_bytes": 1e9}, "storage_bytes must be a positive integer, got 1000000000.0"),
        ({"prefetch_timeout_s": float("nan")}, "prefetch_timeout_s must be a positive finite"),
        ({"prefetch_timeout_s": float("inf")}, "prefetch_timeout_s .* got inf"),
        ({"prefetch_min_pages": True}, "prefetch_min_pages must be a positive integer, got True"),
        ({"prefetch_min_pages": 1.5}, "prefetch_min_pages must be a positive integer, got 1.5"),
        ({"enable_host": "no"}, "enable_host must be True or False, got 'no'"),
        ({"enable_host": 0}, "enable_host must be True or False, got 0"),
        ({"pin_host": "yes"}, "pin_host must be True or False or None, got 'yes'"),
        ({"debug_checks": 1}, "debug_checks must be True or False, got 1"),
        ({"world_size": 1.5}, "world_size must be a positive integer, got 1.5"),
        ({"world_size": 0}, "world_size must be a positive integer, got 0"),
        ({"rank": "0"}, "rank must be an integer >= 0, got '0'"),
        ({"rank": -1}, "rank must be an integer >= 0, got -1"),
        ({"rank": 1.0, "world_size": 2}, "rank must be an integer >= 0, got 1.0"),
        ({"storage_dir": ""}, "storage_dir must be a non-empty string, got ''"),
        ({"storage_dir": None}, "storage_dir must be a non-empty string, got None"),
        ({"storage": ""}, "storage must be a non-empty string or None, got ''"),
        ({"storage": 3}, "storage must be a non-empty string or None, got 3"),
        ({"storage_url": 5}, "storage_url must be a non-empty string or None, got 5"),
        ({"write_policy": None}, "write_policy=None is not one of write_through"),
        ({"eviction_policy": ["lru"]}, r"eviction_policy=['lru'] is not one of lru, lfu, cost"),
        ({"prefetch_policy": 1}, "prefetch_policy=1 is not one of best_effort"),
        ({"host_layout": b"page_first"}, "host_layout=b'page_first' is not one of"),
        ({"device": 0}, "device must be a non-empty string or None, got 0"),
        ({"device": ""}, "device must be a non-empty string or None, got ''"),
        ({"tenant_salt": 7}, "tenant_salt must be a string, got 7"),
        ({"tenant_salt": None}, "tenant_salt must be a string, got None"),
        ({"model_fingerprint": b"ab"}, "model_fingerprint must be a string, got b'ab'"),
        ({"extra_namespace": "ab"}, "extra_namespace must be a tuple of strings, got 'ab'"),
        ({"extra_namespace": ["a"]}, r"extra_namespace must be a tuple of strings, got ['a']"),
        ({"extra_namespace": ("a", 1)}, r"extra_namespace must be .* got ('a', 1)"),
    ],
)
def test_invalid_options_name_the_option(kwargs, needle):
    escaped = needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    with pytest.raises(ConfigError, match=escaped):
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


def test_storage_needs_a_model_fingerprint_or_an_explicit_unbound_namespace(tmp_path):
    cfg = CacheConfig(device="cpu", storage="file", storage_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="without model_fingerprint"):
        TieredCache(cfg, [SPEC])
    with pytest.raises(ConfigError, match="unbound_namespace must be True or False"):
        CacheConfig(unbound_namespace="yes")
    TieredCache(
        CacheConfig(
            device="cpu", storage="file", storage_dir=str(tmp_path), unbound_namespace=True
        ),
        [SPEC],
    ).close()
    TieredCache(
        CacheConfig(device="cpu", storage="file", storage_dir=str(tmp_path), model_fingerprint="m"),
        [SPEC],
    ).close()
