"""Context-parallel layout: sequence owners, lanes of logical page ids, per-rank pool sizing and
the translator one rank's pools use at the transfer boundary."""

from __future__ import annotations

import pytest
import torch
from factories import SPEC

from kvtier.errors import ConfigError, IntegrityError
from kvtier.parallel.layout import CPLayout, CPTranslator
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer.translate import IdentityTranslator, PageTranslator, device_view


def test_round_robin_and_zigzag_owners():
    assert CPLayout(3, 0, "round_robin").owners(0, 12) == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert CPLayout(3, 0, "zigzag").owners(0, 12) == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    assert CPLayout(2, 1, "zigzag").owners(0, 8) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert CPLayout(4, 0, "zigzag").owners(5, 11) == [2, 1, 0, 0, 1, 2]
    assert CPLayout(1, 0, "zigzag").owners(0, 4) == [0, 0, 0, 0]
    assert CPLayout().owners(0, 3) == [0, 0, 0]  # defaults: no context parallelism


def test_pages_a_rank_owns_in_a_range():
    zz = CPLayout(3, 1, "zigzag")
    assert zz.owned(0, 12) == [1, 4, 7, 10]
    assert zz.owned(0, 12, rank=2) == [2, 3, 8, 9]
    assert zz.owned(3, 8, rank=0) == [5, 6]
    assert zz.owned(4, 4) == []
    rr = CPLayout(2, 0, "round_robin")
    assert rr.owned(1, 6) == [2, 4]
    with pytest.raises(IntegrityError, match="rank 0: bad sequence page range \\[5, 2\\)"):
        rr.owned(5, 2)
    with pytest.raises(IntegrityError, match="rank 0: no rank 2 in a group of 2"):
        rr.owned(0, 4, rank=2)


def test_per_rank_pool_sizing():
    zz = CPLayout(4, 0, "zigzag")
    # 6 pages: owners 0 1 2 3 3 2 → ranks hold 1, 1, 2, 2; every pool needs the largest share.
    assert [zz.rank_pages(6, r) for r in range(4)] == [1, 1, 2, 2]
    assert zz.pool_pages(6) == 2
    assert [zz.pool_pages(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    rr = CPLayout(3, 2, "round_robin")
    assert [rr.rank_pages(7, r) for r in range(3)] == [3, 2, 2]
    assert rr.pool_pages(7) == 3 and rr.logical_pages(3) == 9
    for n in range(20):  # balanced: the largest share is ceil(n / cp_size) for both patterns
        for layout in (zz, rr):
            assert max(layout.rank_pages(n, r) for r in range(layout.cp_size)) == layout.pool_pages(
                n
            )


def test_lanes_of_logical_page_ids():
    layout = CPLayout(3, 1)
    ids = torch.arange(12)
    assert layout.lanes(ids).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert layout.owned_mask(ids).nonzero().reshape(-1).tolist() == [1, 4, 7, 10]
    assert layout.physical(torch.tensor([10, 1, 7])).tolist() == [3, 0, 2]
    assert layout.logical(torch.tensor([3, 0, 2])).tolist() == [10, 1, 7]
    assert layout.logical(torch.tensor([0, 1]), rank=2).tolist() == [2, 5]
    with pytest.raises(IntegrityError, match="rank 1: logical page 6 lives on rank 0, not here"):
        layout.physical(torch.tensor([4, 6]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cp_size": 0}, "CPLayout cp_size must be a positive integer, got 0"),
        ({"cp_size": True}, "CPLayout cp_size must be a positive integer, got True"),
        ({"cp_size": 2, "rank": 2}, r"CPLayout rank must be an integer in \[0, cp_size=2\), got 2"),
        ({"cp_size": 2, "rank": -1}, r"CPLayout rank must be .*got -1"),
        ({"pattern": "ring"}, "CPLayout pattern='ring' is not one of round_robin, zigzag"),
    ],
)
def test_bad_layout_options_name_the_option(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CPLayout(**kwargs)


def test_translator_maps_only_this_ranks_lane():
    t = CPLayout(2, 1, "zigzag").translator(device_pages=4, host_pages=3)
    assert isinstance(t, CPTranslator)
    typed: PageTranslator = t  # the transfer boundary's protocol
    assert typed.device_physical(torch.tensor([1, 7, 3, 5])).tolist() == [0, 3, 1, 2]
    # Host ids use lanes too: a host copy stays on the rank of the device copy it came from.
    assert typed.host_physical(torch.tensor([5, 1])).tolist() == [2, 0]
    assert typed.device_owned(torch.tensor([1, 2, 7])).tolist() == [True, False, True]
    with pytest.raises(IntegrityError, match="rank 1: logical page 2 lives on rank 0"):
        t.device_physical(torch.tensor([1, 2]))
    with pytest.raises(
        IntegrityError, match="rank 1: logical device page 9 is beyond this rank's 4"
    ):
        t.device_physical(torch.tensor([9]))
    with pytest.raises(IntegrityError, match="rank 1: logical host page 7 is beyond this rank's 3"):
        t.host_physical(torch.tensor([7]))
    with pytest.raises(IntegrityError, match="rank 1: logical page 2 lives on rank 0"):
        t.host_physical(torch.tensor([2]))
    t.check(4, 3)
    with pytest.raises(ConfigError, match="built for device_pages=4, host_pages=3, but the pools"):
        t.check(8, 3)
    with pytest.raises(ConfigError, match="CPTranslator host_pages must be an integer >= 0"):
        CPTranslator(CPLayout(), 4, -1)


def test_device_view_addresses_a_ranks_pool_through_the_translator():
    ps = 4
    device = DevicePool([SPEC], num_pages=4, page_size=ps, device=torch.device("cpu"))
    host = HostPool([SPEC], num_pages=3, page_size=ps)
    _, kv = device_view(CPLayout(2, 1).translator(4, 3), device, host)
    # Logical pages 3 and 7 are this rank's physical pages 1 and 3.
    locs = torch.tensor([12, 13, 28, 31])
    assert kv.slots(locs).tolist() == [4, 5, 12, 15]
    with pytest.raises(ConfigError, match="built for device_pages=8, .* have device_pages=4"):
        device_view(CPLayout(2, 1).translator(8, 3), device, host)


def test_one_rank_layout_is_the_identity():
    layout = CPLayout(1, 0)
    pages = torch.tensor([5, 0, 3])
    t = layout.translator(device_pages=8, host_pages=16)
    ident = IdentityTranslator()
    assert torch.equal(t.device_physical(pages), ident.device_physical(pages))
    assert torch.equal(t.host_physical(pages), ident.host_physical(pages))
    assert layout.owned_mask(pages).tolist() == [True, True, True]
    assert layout.pool_pages(7) == 7 and layout.logical_pages(8) == 8
