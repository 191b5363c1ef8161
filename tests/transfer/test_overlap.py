"""Per-layer overlap of host → device loads with the forward pass.

The hook order is checked on CPU; the overlapped load itself needs CUDA (skipped elsewhere;
``scripts/gpu_checks.sh`` runs it on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams, SeqSlots
from kvtier.engine.families import build_model, preset
from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.transfer import Mover

cuda = pytest.mark.gpu


@pytest.mark.parametrize(("family", "expect"), [("tiny", [0, 1, 2, 3]), ("hybrid", [0, 0, 0, 1])])
def test_forward_waits_for_the_anchor_layer_each_layer_reads(family, expect):
    model = build_model(preset(family))
    pool = DevicePool(model.pool_specs(), 4, 16, torch.device("cpu"))
    locs = torch.arange(8)
    seq = SeqSlots(8, locs, locs)
    if model.stateful:
        seq.state = model.zero_state()
    seen: list[int] = []
    model(torch.arange(8), torch.arange(8), [seq], pool, before_layer=seen.append)
    assert seen == expect


def cuda_pools(
    kv_layers: int, num_pages: int, layout: str
) -> tuple[PoolSpec, PoolSpec, DevicePool, HostPool]:
    """A KV pool and a state pool on CUDA, with random host contents."""
    spec = PoolSpec("kv", kv_layers, (2, 2, 8), torch.bfloat16)
    side = PoolSpec("state", 2, (16,), torch.float32, kind="state")
    dev = DevicePool([spec, side], num_pages, 16, torch.device("cuda"))
    host = HostPool([spec, side], num_pages, 16, layout, pin=True)
    for buf in host.buffers.values():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    return spec, side, dev, host


@cuda
def test_layer_by_layer_load_is_byte_exact():
    spec, side, dev, host = cuda_pools(4, 8, "page_first")
    op = Mover(dev, host).host_to_device(torch.tensor([5, 2]), torch.tensor([1, 6]), overlap=True)
    assert op.layer_events is not None and len(op.layer_events) == 4
    op.layer_events[-1].synchronize()
    for s in (spec, side):
        got = dev.page_bytes_view(s.name)[:, [1, 6]].cpu()
        want = host.page_bytes_view(s.name)[:, [5, 2]]
        assert torch.equal(got, want), s.name


@cuda
@pytest.mark.parametrize("family", ["tiny", "hybrid"])
def test_overlapped_host_restore_matches_cold(family):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 200))
    cfg = CacheConfig(page_size=16, device_pages=64, device="cuda")
    cold = LLM(preset(family), cfg).generate([prompt], params)[0].output_ids
    llm = LLM(preset(family), cfg, overlap_loads=True)
    llm.generate([prompt], params)
    llm.cache.flush(host=False)
    warm = llm.generate([prompt], params)[0]
    assert warm.cached_host > 0 and warm.output_ids == cold


@cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_layer_first_load_of_page_runs_is_byte_exact(overlap):
    spec, side, dev, host = cuda_pools(3, 32, "layer_first")
    mover = Mover(dev, host)
    hp, dp = torch.arange(4, 20), torch.cat([torch.arange(0, 8), torch.arange(16, 24)])
    op = mover.host_to_device(hp, dp, overlap=overlap)
    assert (op.layer_events is not None) == overlap
    assert op.paths["state"] == "kernel"  # 64-byte rows
    assert op.paths["kv"].startswith("kernel")  # 8-page runs of 1 KiB rows: 8 KiB blocks
    op.wait()
    for s in (spec, side):
        got = dev.page_bytes_view(s.name)[:, dp].cpu()
        assert torch.equal(got, host.page_bytes_view(s.name)[:, hp]), s.name
