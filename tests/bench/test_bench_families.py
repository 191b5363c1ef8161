"""The transfer benchmark moves each family's whole pool set and verifies it byte for byte."""

from __future__ import annotations

import pytest

from kvtier.bench.pool_sets import FAMILIES, family_pool_set
from kvtier.bench.transfer import bench_transfer
from kvtier.errors import ConfigError


@pytest.mark.parametrize("family", FAMILIES)
def test_transfer_bench_reports_each_family_pool_set(family):
    r = bench_transfer(device="cpu", family=family, num_pages=2, repeats=1)
    specs = family_pool_set(family)
    assert r["verified"] and r["sizes"]["family"] == family
    assert r["sizes"]["pool_set"] == [s.describe() for s in specs]
    assert r["sizes"]["page_size"] == (64 if family == "dsa-compressed" else 16)
    assert r["d2h"]["ratio"] > 0 and r["h2d"]["ratio"] > 0


def test_unknown_family():
    with pytest.raises(ConfigError, match="family='rnn'"):
        family_pool_set("rnn")


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_transfer_bench_times_a_coded_host_pool_beside_the_plain_one(codec):
    r = bench_transfer(device="cpu", num_pages=4, num_layers=2, repeats=1, kv_codec=codec)
    c = r["codec"]
    # a bfloat16 page of 16 tokens x K/V x 8 heads x 128 per layer, against one byte each
    # plus a float32 scale per K/V head
    assert c["host_page_bytes_none"] == 2 * 16 * 2 * 8 * 128 * 2
    assert c["host_page_bytes"] == 2 * (16 * 2 * 8 * 128 + 2 * 8 * 4)
    assert c["pages_per_gib_ratio"] == c["host_page_bytes_none"] / c["host_page_bytes"]
    for d in ("d2h", "h2d"):
        assert c[d]["paths"] == {"kv": "cpu"}
        assert c[d]["ratio"] == c[d]["logical_gbps"] / c[d]["none_gbps"] > 0
    assert bench_transfer(device="cpu", num_pages=2, repeats=1)["codec"] is None
