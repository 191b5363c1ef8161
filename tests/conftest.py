"""Shared fixtures: a tiny cache, an empty radix tree with the tree tests' page size, and the
integrity check of every cache a test made, run after the test (``check_integrity()``: free +
used == capacity, lock counts, residency across tiers). A test that breaks a cache on purpose is
marked ``corrupts``."""

from __future__ import annotations

import os

import pytest
import torch
from factories import make_cache

from kvtier import TieredCache

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core: a worker's (and its child processes') torch ops run on one thread,
    # else two workers' thread pools fight over the same cores and every test runs slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Child processes and servers (``tests/e2e/``) and a real Mooncake Store are ``slow``;
    ``gpu`` tests skip without CUDA."""
    cuda = torch.cuda.is_available()
    for item in items:
        if "e2e" in item.path.parts or item.get_closest_marker("mooncake") is not None:
            item.add_marker(pytest.mark.slow)
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture
def cache(tmp_path):
    c = make_cache(tmp_path)
    yield c
    c.close()


@pytest.fixture
def tree():  # noqa: ANN201 - a RadixTree
    from tree_helpers import PS as TREE_PS

    from kvtier.tree import RadixTree

    return RadixTree(TREE_PS)


@pytest.fixture(autouse=True)
def _caches_keep_their_integrity(request, monkeypatch):
    """Every ``TieredCache`` built in this process during the test passes ``check_integrity()``
    once the test is over (closed or not)."""
    made: list[TieredCache] = []
    build = TieredCache.__init__

    def init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        build(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(TieredCache, "__init__", init)
    yield
    if request.node.get_closest_marker("corrupts") is not None:
        return
    for c in made:
        c.check_integrity()
