"""Logical → physical translation at the transfer boundary (contract 1).

A fixed permutation of physical pages on both sides: the tree and the caller see only logical
slots, the pools hold the bytes at the permuted physical pages, and KV round-trips byte-exact
through every tier (device → host → storage → a fresh cache's host → device).
"""

from __future__ import annotations

import pytest
import torch
from factories import DEVICE, PS, SPEC, cache_config, engine_config

from kvtier import CacheConfig, TieredCache
from kvtier.errors import ConfigError
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer import Mover, PermutationTranslator
from kvtier.transfer.objects import ObjectCodec

DEVICE_MAP = [3, 7, 0, 5, 1, 6, 2, 4]
HOST_MAP = [9, 4, 15, 0, 12, 1, 14, 2, 11, 3, 13, 5, 10, 6, 8, 7]
OTHER_HOST_MAP = [6, 13, 2, 10, 0, 15, 7, 11, 1, 9, 3, 14, 4, 12, 5, 8]
TOKENS = list(range(200, 212))  # three whole pages


def rows_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((SPEC.num_layers, n, *SPEC.row_shape), generator=g)


def write_kv(cache: TieredCache, locs: torch.Tensor, rows: torch.Tensor) -> None:
    """What an engine does: write through the device mapping, never at logical slots."""
    kv = cache.kv_buffers
    phys = kv.slots(locs)
    for layer in range(SPEC.num_layers):
        kv.layer(layer)[phys.to(kv.device)] = rows[layer].to(kv.device)


def read_kv(cache: TieredCache, locs: torch.Tensor) -> torch.Tensor:
    kv = cache.kv_buffers
    phys = kv.slots(locs).to(kv.device)
    return torch.stack([kv.layer(i)[phys].cpu() for i in range(SPEC.num_layers)])


def host_page(cache: TieredCache, physical: int) -> torch.Tensor:
    """Host bytes of one physical page as ``[layers, tokens, *row]`` (either layout)."""
    assert cache.host_pool is not None
    return cache.host_pool.read_pages("kv", torch.tensor([physical]))[0]


# On CUDA each forced mechanism (kernel; copy engines: staged in either host layout).
MECHANISMS = ["auto", "kernel", "copy_engine"] if DEVICE.startswith("cuda") else ["auto"]


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])  # zero-copy and staged objects
def test_permuted_pages_roundtrip_through_every_tier(tmp_path, layout, mechanism):
    t = PermutationTranslator(device=DEVICE_MAP, host=HOST_MAP)
    options = {"host_layout": layout, "transfer_mechanism": mechanism}
    c = TieredCache(cache_config(tmp_path / "l3", **options), [SPEC], translator=t)
    m = c.match(TOKENS)
    c.lock(m.handle)
    ld = c.load(m)
    locs = c.alloc(len(TOKENS))
    assert locs.tolist() == list(range(12))  # logical: the allocator's pages 0, 1, 2
    orig = rows_for(12, seed=1)
    write_kv(c, locs, orig)
    c.finish(TOKENS, locs, ld.locs.numel(), m.handle)
    c.drain()
    c.check_integrity()

    # The bytes sit at the physical pages; the tree only knows logical ones.
    dev = c.device_pool.anchor.cpu()
    for logical, physical in enumerate(DEVICE_MAP[:3]):
        span = slice(physical * PS, (physical + 1) * PS)
        assert torch.equal(dev[:, span], orig[:, logical * PS : (logical + 1) * PS])
    (node,) = c.tree.nodes()
    assert node.device.tolist() == [0, 1, 2] and node.host.tolist() == [0, 1, 2]
    for logical, physical in enumerate(HOST_MAP[:3]):
        assert torch.equal(host_page(c, physical), orig[:, logical * PS : (logical + 1) * PS])
    assert torch.equal(host_page(c, 0), torch.zeros_like(host_page(c, 0)))  # logical 0 ≠ phys 0

    # Host → device into fresh logical pages (3, 4, 5 → physical 5, 1, 6).
    c.flush(host=False)
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len) == (0, 12)
    c.lock(m.handle)
    ld = c.load(m)
    assert ld.locs.tolist() == list(range(12, 24))
    assert torch.equal(read_kv(c, ld.locs), orig)
    phys = c.kv_buffers.slots(ld.locs)
    assert phys.tolist() == [*range(20, 24), *range(4, 8), *range(24, 28)]
    c.unlock(m.handle)
    c.close()

    # A fresh cache with another host permutation restores the storage objects.
    t2 = PermutationTranslator(device=DEVICE_MAP[::-1], host=OTHER_HOST_MAP)
    c2 = TieredCache(cache_config(tmp_path / "l3", **options), [SPEC], translator=t2)
    m = c2.match(TOKENS)
    assert m.storage_len == 12
    pf = c2.prefetch(m)
    while not c2.prefetch_ready(pf):
        c2.wait_prefetch([pf], timeout=1.0)
    c2.finish_prefetch(pf)
    c2.drain()
    (node,) = c2.tree.nodes()
    assert node.host.tolist() == [0, 1, 2]
    for logical, physical in enumerate(OTHER_HOST_MAP[:3]):
        assert torch.equal(host_page(c2, physical), orig[:, logical * PS : (logical + 1) * PS])
    m = c2.match(TOKENS)
    assert (m.device_len, m.host_len) == (0, 12)
    c2.lock(m.handle)
    ld = c2.load(m)
    assert ld.locs.tolist() == list(range(12))
    assert torch.equal(read_kv(c2, ld.locs), orig)
    dev = c2.device_pool.anchor.cpu()
    for logical, physical in enumerate(DEVICE_MAP[::-1][:3]):
        span = slice(physical * PS, (physical + 1) * PS)
        assert torch.equal(dev[:, span], orig[:, logical * PS : (logical + 1) * PS])
    c2.unlock(m.handle)
    c2.check_integrity()
    c2.close()


def test_identity_cache_hands_out_its_slots_unchanged(tmp_path):
    c = TieredCache(cache_config(tmp_path / "l3", storage=None), [SPEC])
    locs = torch.tensor([8, 9, 10, 11])
    assert c.kv_buffers.slots(locs) is locs
    c.close()


def pools(layout: str) -> tuple[DevicePool, HostPool]:
    dev = DevicePool([SPEC], 8, PS, torch.device("cpu"))
    host = HostPool([SPEC], 6, PS, layout)
    return dev, host


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mover_translates_both_sides(layout):
    dev, host = pools(layout)
    dev.anchor.copy_(torch.arange(dev.anchor.numel(), dtype=torch.float32).view_as(dev.anchor))
    t = PermutationTranslator(device=[7, 6, 5, 4, 3, 2, 1, 0], host=[2, 5, 0, 4, 1, 3])
    mover = Mover(dev, host, translator=t)
    mover.device_to_host(torch.tensor([0, 3]), torch.tensor([1, 4])).complete()
    view = host.page_bytes_view("kv")  # [layers, pages, words]
    dview = dev.page_bytes_view("kv")
    assert torch.equal(view[:, 5], dview[:, 7]) and torch.equal(view[:, 1], dview[:, 4])
    assert not view[:, [0, 2, 3, 4]].any()
    mover.host_to_device(torch.tensor([1, 4]), torch.tensor([6, 5])).complete()
    assert torch.equal(dview[:, 1], dview[:, 7]) and torch.equal(dview[:, 2], dview[:, 4])


def test_storage_codec_gathers_and_scatters_physical_pages():
    _, host = pools("layer_first")
    buf = host.buffers["kv"]
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf))
    t = PermutationTranslator(host=[2, 5, 0, 4, 1, 3])
    codec = ObjectCodec(host, [SPEC], translator=t)
    objs = codec.gather(2, codec.slots(torch.tensor([0, 1])))
    plain = ObjectCodec(host, [SPEC])
    assert [o.tolist() for o in objs] == [
        o.tolist() for o in plain.gather(2, plain.slots(torch.tensor([2, 5])))
    ]
    staged = torch.stack(objs)
    codec.scatter(torch.tensor([3, 4]), staged)  # logical 3, 4 → physical 4, 1
    assert torch.equal(
        host.read_pages("kv", torch.tensor([4, 1])), host.read_pages("kv", torch.tensor([2, 5]))
    )


def test_translator_must_be_a_permutation_of_each_pool(tmp_path):
    with pytest.raises(ConfigError, match="device table must be a permutation of the 8"):
        TieredCache(
            cache_config(tmp_path / "l3"), [SPEC], translator=PermutationTranslator(device=[0, 1])
        )
    bad = PermutationTranslator(host=[0] * 16)
    with pytest.raises(ConfigError, match="host table must be a permutation of the 16"):
        TieredCache(cache_config(tmp_path / "l3"), [SPEC], translator=bad)


def test_transfer_mechanism_is_validated():
    with pytest.raises(
        ConfigError, match="transfer_mechanism='dma' is not one of auto, kernel, copy_engine"
    ):
        CacheConfig(transfer_mechanism="dma")
    assert CacheConfig(transfer_mechanism="kernel").transfer_mechanism == "kernel"


DEVICE_PAGES, HOST_PAGES = 16, 32


@pytest.mark.parametrize("family", ["tiny", "dsa-compressed", "hybrid"])  # sidecars, states
def test_engine_addresses_the_device_pool_through_the_translator(tmp_path, monkeypatch, family):
    """The engine writes and reads KV, sidecar rows and state rows at ``kv_buffers.slots``: with
    a permuted cache it gives the identity cache's tokens and logits, bit for bit, cold and after
    a host and a storage restore (which move physical pages: untranslated engine writes would
    restore other pages' bytes)."""
    import random

    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine import llm as llm_mod
    from kvtier.engine.families import preset

    model = preset(family)
    rng = random.Random(3)
    prompt = [rng.randrange(model.vocab_size) for _ in range(101)]
    params = SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True)
    perm = PermutationTranslator(
        device=range(DEVICE_PAGES - 1, -1, -1), host=[5 * i % HOST_PAGES for i in range(HOST_PAGES)]
    )

    def scenarios(translated: bool) -> list[tuple[list[int], torch.Tensor, tuple[int, ...]]]:
        if translated:
            monkeypatch.setattr(
                llm_mod, "TieredCache", lambda c, s: TieredCache(c, s, translator=perm)
            )
        cfg = engine_config(
            tmp_path / ("l3-perm" if translated else "l3-id"),
            device_pages=DEVICE_PAGES,
            host_pages=HOST_PAGES,
        )
        outs = []
        with LLM(model, cfg, max_running=1) as llm:
            for prepare in (lambda: None, lambda: llm.cache.flush(host=False)):
                prepare()
                outs.append(llm.generate([prompt], params)[0])
                llm.cache.drain()
        with LLM(model, cfg, max_running=1) as llm:
            outs.append(llm.generate([prompt], params)[0])
        monkeypatch.undo()
        return [
            (o.output_ids, o.logits, (o.cached_device, o.cached_host, o.cached_storage))
            for o in outs
        ]

    plain, permuted = scenarios(False), scenarios(True)
    assert [hits for _, _, hits in permuted] == [(0, 0, 0), (0, 96, 0), (0, 0, 96)]
    for (ids, logits, hits), (pids, plogits, phits) in zip(plain, permuted, strict=True):
        assert pids == ids and phits == hits
        assert torch.equal(plogits, logits)
