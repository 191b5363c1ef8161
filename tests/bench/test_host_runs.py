"""The churned host pages of the transfer benchmarks (``kvtier.bench.host_runs``)."""

from __future__ import annotations

import pytest
import torch

from kvtier.bench.host_runs import churned, mean_run


def test_mean_run_of_page_lists():
    assert mean_run(torch.tensor([4, 5, 6, 9, 10, 2])) == 2.0
    assert mean_run(torch.tensor([3])) == 1.0
    assert mean_run(torch.tensor([], dtype=torch.int64)) == 0.0


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_churned_batches_are_disjoint_pool_pages_in_node_runs(page_size):
    a, b = churned(4096, [1000, 900], page_size, seed=3)
    assert a.numel() == 1000 and b.numel() == 900
    both = torch.cat([a, b])
    assert both.unique().numel() == 1900  # no page in two places
    assert int(both.min()) >= 0 and int(both.max()) < 4096
    # Nodes of ~512 tokens: runs of many pages at page size 1, a few at 64.
    assert mean_run(a) > (100 if page_size == 1 else 2)
    assert torch.equal(a, churned(4096, [1000, 900], page_size, seed=3)[0])  # deterministic
    assert not torch.equal(a, churned(4096, [1000, 900], page_size, seed=4)[0])


def test_churned_refuses_batches_larger_than_the_pool():
    with pytest.raises(ValueError, match="do not fit 10 pages"):
        churned(10, [6, 5], 16)


def test_the_cache_backs_nodes_up_into_consecutive_host_pages(tmp_path):
    """What ``churned`` models: after many turnovers of a small host tier, a node's host copy
    is still one run of consecutive pages (one allocation per node, freed in order)."""
    import random

    import numpy as np
    from factories import make_cache, run_request

    c = make_cache(
        tmp_path, write_policy="write_through", storage=None, device_pages=64, host_pages=96
    )
    rng = random.Random(0)
    for i in range(300):
        tokens = [rng.randint(0, 50) for _ in range(3)]  # shared first tokens: some splits
        tokens += [rng.randint(0, 10**6) for _ in range(rng.randint(5, 60))]
        run_request(c, tokens, seed=i)
        c.drain()
    c.check_integrity()
    assert c.stats()["host_backup_pages"] > 25 * 96  # the host tier turned over many times
    nodes = [n for n in c.tree.nodes() if n.host is not None and n.host.numel() > 1]
    runs = [bool(np.all(np.diff(n.host.numpy()) == 1)) for n in nodes]
    assert len(nodes) >= 8 and sum(runs) >= len(nodes) - 1
    c.close()
