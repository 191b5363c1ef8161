"""Page codecs (``CacheConfig.kv_codec``): a lossy component is coded on its way to the host and
decoded on its way back, within the format's bound; every other component moves byte for
byte; host pages take the bytes the arithmetic says; storage objects hold the coded host bytes
unchanged, and objects of one codec are never read under another (namespace).

Bounds per element ``x`` of a scale group with scale ``s = amax / qmax`` (``kvtier.pools.codec``),
computed in float32 (a ``RTOL`` of float32 rounding on top):

    fp8_e4m3   |x - x'| <= 2**-4 |x| + 2**-10 s    (3 mantissa bits; half a subnormal step)
    int8       |x - x'| <= s / 2
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import SPEC, kv_of, make_cache, run_request

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import cache_namespace
from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.pools.codec import SCALE_SUFFIX, get_codec, host_page_bytes, host_specs
from kvtier.transfer import Mover

RTOL = 1e-6
"""float32 rounding of the scaling on top of the format's bound."""

KV = PoolSpec("kv", 3, (2, 2, 8), torch.float32, lossy=True)
"""A lossy anchor: one scale per page, layer, K/V and head (4 groups of 8)."""
INDEX = PoolSpec("index", 3, (4,), torch.float32, "sidecar")
"""An exact sidecar (indexer keys)."""
HIDDEN = PoolSpec("hidden", 1, (6,), torch.bfloat16, "sidecar")
"""An exact one-layer sidecar in another element type (draft hidden states)."""
LOSSY = dataclasses.replace(SPEC, lossy=True)
"""The tier tests' anchor, lossy."""


def bound(codec: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |error| the format allows per element of ``x`` given its group's scale."""
    if codec == "fp8_e4m3":
        return (2.0**-4 * x.abs() + 2.0**-10 * scale) * (1 + RTOL) + 1e-30
    return scale / 2 * (1 + RTOL) + 1e-30


def group_scales(x: torch.Tensor, spec: PoolSpec, qmax: float) -> torch.Tensor:
    """Per-element scale of ``x`` (``[n, rows, row elements]``): its group's amax / qmax."""
    n, rows, numel = x.shape
    g = x.float().view(n, rows, numel // spec.block, spec.block)
    amax = g.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return s.expand_as(g).reshape(n, rows, numel)


def heads_of_mixed_magnitude(n: int, rows: int, spec: PoolSpec, seed: int) -> torch.Tensor:
    """Random rows whose groups differ in magnitude by up to 1e4 (what per-head scales are
    for), with one all-zero group."""
    g = torch.Generator().manual_seed(seed)
    groups = spec.row_numel // spec.block
    x = torch.randn((n, rows, groups, spec.block), generator=g)
    x = x * torch.logspace(-2, 2, groups)[None, None, :, None]
    x[0, :, 0] = 0
    return x.reshape(n, rows, spec.row_numel)


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_codec_error_is_within_the_format_bound(codec, rows):
    c = get_codec(codec)
    x = heads_of_mixed_magnitude(5, rows, KV, seed=rows)
    codes, scale = c.encode(x, KV)
    assert codes.dtype == c.dtype and scale.shape == (5, 4) and scale.dtype == torch.float32
    assert torch.equal(scale[0, 0], torch.tensor(1.0))  # an all-zero group
    back = c.decode(codes, scale, KV)
    s = group_scales(x, KV, c.qmax)
    assert ((back - x).abs() <= bound(codec, x, s)).all()
    assert torch.equal(back[0, :, :8], torch.zeros(rows, 8))  # zeros stay zeros
    # the largest element of every group is representable at qmax: no clipping
    assert float(codes.float().abs().amax()) == c.qmax


def test_bfloat16_rows_decode_within_the_bound_plus_bfloat16_rounding():
    spec = dataclasses.replace(KV, dtype=torch.bfloat16)
    c = get_codec("fp8_e4m3")
    x = heads_of_mixed_magnitude(3, 16, spec, seed=3).to(torch.bfloat16)
    back = c.decode(*c.encode(x, spec), spec)
    assert back.dtype == torch.bfloat16
    xf = x.float()
    s = group_scales(xf, spec, c.qmax)
    assert ((back.float() - xf).abs() <= bound("fp8_e4m3", xf, s) * (1 + 2.0**-8)).all()


def test_mla_latent_blocks_get_a_scale_each():
    spec = PoolSpec("kv", 2, (40,), torch.float32, lossy=True, scale_block=8)
    (coded, scales) = host_specs([spec], get_codec("int8"), 16)
    assert (coded.dtype, coded.row_shape, coded.lossy) == (torch.int8, (40,), False)
    assert (scales.name, scales.row_shape, scales.rows_per_page(16)) == ("kv.scale", (5,), 1)


def test_spec_refuses_lossy_state_and_a_block_that_does_not_divide_a_row():
    with pytest.raises(ConfigError, match="lossy=True is only allowed for kv and sidecar"):
        PoolSpec("state", 2, (8,), torch.float32, kind="state", lossy=True)
    with pytest.raises(ConfigError, match="does not divide"):
        PoolSpec("kv", 2, (40,), torch.float32, lossy=True, scale_block=16)
    with pytest.raises(ConfigError, match="needs lossy=True"):
        PoolSpec("kv", 2, (40,), torch.float32, scale_block=8)


def test_host_pool_bytes_with_a_codec_are_exact():
    # Per page of 16 tokens and layer: the codes are one byte per element, the scales 4 bytes
    # per group; exact components keep their bytes.
    ps, fp8, none = 16, get_codec("fp8_e4m3"), get_codec("none")
    per_layer_codes, per_layer_scales = 16 * 32, 4 * 4
    kv = 3 * (per_layer_codes + per_layer_scales)
    exact = INDEX.page_bytes(ps) + HIDDEN.page_bytes(ps)
    assert host_page_bytes([KV, INDEX, HIDDEN], fp8, ps) == kv + exact
    assert host_page_bytes([KV, INDEX, HIDDEN], none, ps) == 3 * 16 * 32 * 4 + exact
    # bf16 anchor: fp8 pages take (512 + 16) / 1024 of its bytes; float32: (512 + 16) / 2048
    bf16 = dataclasses.replace(KV, dtype=torch.bfloat16)
    assert host_page_bytes([bf16], fp8, ps) * 1024 == host_page_bytes([bf16], none, ps) * 528
    assert host_page_bytes([KV], fp8, ps) * 2048 == host_page_bytes([KV], none, ps) * 528
    hp = HostPool([KV, INDEX, HIDDEN], 7, ps, codec="fp8_e4m3")
    assert [s.name for s in hp.specs] == ["kv", "kv" + SCALE_SUFFIX, "index", "hidden"]
    assert hp.page_bytes == kv + exact and hp.nbytes == 7 * (kv + exact)
    assert hp.buffers["kv"].dtype == torch.float8_e4m3fn
    assert hp.buffers["kv.scale"].shape == (7, 3, 1, 4)


def test_a_cache_sizes_its_host_pool_by_the_coded_page_bytes(tmp_path):
    budget = 10 * host_page_bytes([LOSSY], get_codec("none"), 4)
    plain = make_cache(tmp_path, [LOSSY], host_pages=None, host_bytes=budget)
    coded = make_cache(tmp_path, [LOSSY], host_pages=None, host_bytes=budget, kv_codec="int8")
    # float32 (k, v) x 1 head x 4 dims per token, 4 tokens, 2 layers: 256 bytes a page; coded
    # 2 layers x (32 codes + 2 scales x 4 bytes) = 80 bytes
    assert (plain.host_pool.page_bytes, coded.host_pool.page_bytes) == (256, 80)
    assert (plain.host_pool.num_pages, coded.host_pool.num_pages) == (10, 32)
    plain.close()
    coded.close()


def _pools(ps: int, layout: str, codec: str) -> tuple[DevicePool, HostPool]:
    dev = DevicePool([KV, INDEX, HIDDEN], 6, ps, torch.device("cpu"))
    return dev, HostPool([KV, INDEX, HIDDEN], 5, ps, layout, codec=codec)


def _fill(dev: DevicePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in dev.specs:
        buf = dev.buffers[s.name]
        if s.lossy:  # groups of very different magnitude
            x = torch.randn(buf.shape, generator=g) * torch.tensor([[0.01], [100.0]]).view(2, 1, 1)
            buf.copy_(x)
        else:  # any bit pattern must survive
            n = buf.numel() * buf.element_size()
            raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
            buf.view(-1).view(torch.uint8).copy_(raw)


def _page_rows(dev: DevicePool, name: str, pages: list[int]) -> torch.Tensor:
    """``[layers, pages, rows, *shape]`` of ``pages`` in the device pool."""
    buf = dev.buffers[name]
    view = buf.view(buf.shape[0], dev.num_pages, -1, *buf.shape[2:])
    return view[:, pages].clone()


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_mover_roundtrip_codes_the_lossy_component_and_keeps_the_rest_exact(codec, layout, ps):
    dev, host = _pools(ps, layout, codec)
    _fill(dev, seed=ps)
    mover = Mover(dev, host, debug_checks=True)
    assert mover.coded == ["kv"]
    src, dst, hp = [4, 1, 2], [0, 5, 3], [3, 0, 4]
    want = {s.name: _page_rows(dev, s.name, src) for s in dev.specs}
    op = mover.device_to_host(torch.tensor(src), torch.tensor(hp))
    assert op.done()
    mover.host_to_device(torch.tensor(hp), torch.tensor(dst))
    for s in (INDEX, HIDDEN):
        assert torch.equal(
            _page_rows(dev, s.name, dst).view(torch.uint8), want[s.name].view(torch.uint8)
        )
    c = get_codec(codec)
    x = want["kv"].reshape(KV.num_layers * 3, ps, KV.row_numel)
    got = _page_rows(dev, "kv", dst).reshape(x.shape)
    err = (got - x).abs()
    assert (err <= bound(codec, x, group_scales(x, KV, c.qmax))).all()
    assert float(err.max()) > 0  # lossy indeed
    # the host holds the codes and the scales of every (page, layer, group)
    scales = host.read_pages("kv.scale", torch.tensor(hp))  # [pages, layers, 1, groups]
    amax = want["kv"].abs().view(9, ps, 4, 8).amax(dim=(1, 3)).view(3, 3, 4)  # layers, pages
    assert torch.allclose(scales[:, :, 0].transpose(0, 1), amax / c.qmax, rtol=0, atol=0)
    # a device page nobody loaded keeps its bytes: the codec writes only the listed pages
    assert torch.equal(_page_rows(dev, "kv", [4]), want["kv"][:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_cuda_coded_copies_write_the_bytes_of_the_cpu_path(codec, layout, ps):
    """On CUDA the pages are coded on the device and the coded rows cross the link: the host
    holds byte for byte what the CPU path writes, and a load decodes to the CPU path's rows."""
    cpu_dev, cpu_host = _pools(ps, layout, codec)
    _fill(cpu_dev, seed=ps)
    dev = DevicePool([KV, INDEX, HIDDEN], 6, ps, torch.device("cuda"))
    for s in dev.specs:
        dev.buffers[s.name].copy_(cpu_dev.buffers[s.name])
    host = HostPool([KV, INDEX, HIDDEN], 5, ps, layout, pin=True, codec=codec, background=False)
    mover = Mover(dev, host, debug_checks=True)
    assert mover.coded == ["kv"]
    src, dst, hp = [4, 1, 2], [0, 5, 3], [3, 0, 4]
    Mover(cpu_dev, cpu_host).device_to_host(torch.tensor(src), torch.tensor(hp))
    op = mover.device_to_host(torch.tensor(src), torch.tensor(hp))
    op.wait()
    assert op.paths["kv"] == "coded"
    for name, buf in host.buffers.items():
        assert torch.equal(buf.view(torch.uint8), cpu_host.buffers[name].view(torch.uint8)), name
    Mover(cpu_dev, cpu_host).host_to_device(torch.tensor(hp), torch.tensor(dst))
    mover.host_to_device(torch.tensor(hp), torch.tensor(dst)).wait()
    for s in dev.specs:
        got = dev.buffers[s.name].cpu().view(torch.uint8)
        assert torch.equal(got, cpu_dev.buffers[s.name].view(torch.uint8)), s.name


def test_a_component_subset_moves_only_those(tmp_path):
    dev, host = _pools(16, "page_first", "int8")
    _fill(dev, seed=1)
    mover = Mover(dev, host)
    mover.device_to_host(torch.tensor([2]), torch.tensor([1]), components=["index"])
    assert not host.buffers["kv.scale"].any() and not host.buffers["kv"].view(torch.uint8).any()
    mover.device_to_host(torch.tensor([2]), torch.tensor([1]), components=["kv"])
    assert host.buffers["kv.scale"][1].all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_per_layer_backup_writes_the_codes_of_a_backup_at_insert(layout):
    """Layer by layer as a forward reports them (the anchor's; the rest at ``finish``), the
    host gets byte for byte what one backup at insert writes."""
    dev, host = _pools(16, layout, "fp8_e4m3")
    _, whole = _pools(16, layout, "fp8_e4m3")
    _fill(dev, seed=3)
    src, hp = torch.tensor([4, 1, 2]), torch.tensor([3, 0, 4])
    Mover(dev, whole).device_to_host(src, hp)
    layered = Mover(dev, host).layered_backup(src, hp)
    for layer in (2, 0):
        layered.layer_done(layer)
    kv = host.buffers["kv"].view(torch.uint8)
    assert kv.any() and not host.buffers["index"].any()  # only the layers reported so far
    op = layered.finish()
    assert op.done() and op.paths["kv"] == "per layer"
    for name, buf in host.buffers.items():
        assert torch.equal(buf.view(torch.uint8), whole.buffers[name].view(torch.uint8)), name


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"enable_host": False}, "needs enable_host=True"),
        ({"host_compaction": "auto"}, "host_compaction='off' or kv_codec='none'"),
        ({"kv_codec": "fp4"}, "kv_codec='fp4' is not one of none, fp8_e4m3, int8"),
    ],
)
def test_config_refuses_what_the_codec_does_not_support(overrides, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig(**{"kv_codec": "fp8_e4m3", **overrides})


def test_namespace_names_the_codec_and_what_it_codes():
    base = CacheConfig()
    ns = {
        c: cache_namespace(dataclasses.replace(base, kv_codec=c), [LOSSY], 4)
        for c in ("none", "fp8_e4m3", "int8")
    }
    assert len(set(ns.values())) == 3
    # without a lossy component the bytes are the same whatever the codec: so is the namespace
    exact = {
        c: cache_namespace(dataclasses.replace(base, kv_codec=c), [SPEC], 4)
        for c in ("none", "int8")
    }
    assert exact["none"] == exact["int8"] == cache_namespace(base, [SPEC], 4)
    # the codec's scale groups are part of it
    other = dataclasses.replace(LOSSY, scale_block=2)
    assert cache_namespace(dataclasses.replace(base, kv_codec="int8"), [other], 4) != ns["int8"]


TOKENS = list(range(300, 333))  # 8 whole pages of 4 tokens and a tail
ROOM = {"device_pages": 16, "host_pages": 32}


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_host_and_storage_restores_decode_the_same_coded_bytes(tmp_path, layout):
    c = make_cache(tmp_path, [LOSSY], kv_codec="fp8_e4m3", host_layout=layout, **ROOM)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][:32])
    c.drain()
    c.flush(host=False)
    m = c.match(TOKENS)
    assert m.host_len == 33  # and the tail
    c.lock(m.handle)
    from_host = kv_of(c, c.load(m).locs[:32])
    c.unlock(m.handle)
    x = orig.permute(1, 0, 2, 3, 4).reshape(8, 4, 2, -1).permute(0, 2, 1, 3)  # page, layer, tok
    x = x.reshape(16, 4, LOSSY.row_numel)
    got = from_host.permute(1, 0, 2, 3, 4).reshape(8, 4, 2, -1).permute(0, 2, 1, 3)
    got = got.reshape(16, 4, LOSSY.row_numel)
    assert ((got - x).abs() <= bound("fp8_e4m3", x, group_scales(x, LOSSY, 448.0))).all()
    assert not torch.equal(got, x)
    c.close()
    # a fresh cache under the same codec restores the same bytes from storage; under another
    # codec (or none) the objects are not found
    for codec, found in (("none", 0), ("int8", 0), ("fp8_e4m3", 32)):
        d = make_cache(tmp_path, [LOSSY], kv_codec=codec, host_layout=layout, **ROOM)
        m = d.match(TOKENS)
        assert m.storage_len // 4 * 4 == found, codec
        if found:
            pf = d.prefetch(m)
            pf.future.result()
            d.finish_prefetch(pf)
            m = d.match(TOKENS)
            d.lock(m.handle)
            from_storage = kv_of(d, d.load(m).locs[:32])
            d.unlock(m.handle)
            assert torch.equal(from_storage, from_host)
        d.close()
