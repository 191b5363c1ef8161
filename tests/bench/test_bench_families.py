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
