"""Pool sets through every tier: sidecars and state pools, span-mode storage objects, per-pool
strides, capability gating, checkpoint-aware hits and backup accounting."""

from __future__ import annotations

import os

import pytest
import torch
from factories import make_cache

from kvtier import PoolSpec, TieredCache
from kvtier.errors import ConfigError, IntegrityError
from kvtier.keys import chain_keys, state_key
from kvtier.storage.base import StorageCapabilities
from kvtier.storage.file import FileBackend
from kvtier.storage.registry import register_backend
from kvtier.transfer.objects import ObjectCodec

PS = 4  # KV page
KV = PoolSpec("kv", 2, (2, 1, 4), torch.float32)
IDX = PoolSpec("index_rows", 2, (8,), torch.bfloat16, kind="sidecar", tokens_per_row=16)
STATE = PoolSpec("state", 3, (6,), torch.float32, kind="state")


def make(tmp_path, specs, **kw) -> TieredCache:
    return make_cache(
        tmp_path, specs, **{"device_pages": 16, "host_pages": 32, "debug_checks": True, **kw}
    )


def fill(cache: TieredCache, tokens: list[int], ckpt: list[bool] | None = None, seed: int = 0):
    """Compute ``tokens`` as a request would: random rows for every component of the pages
    after the cached prefix; returns the rows written per component (state: one per page)."""
    m = cache.match(tokens)
    cache.lock(m.handle)
    prefix = cache.load(m).locs
    new = cache.alloc(len(tokens) - prefix.numel())
    locs = torch.cat([prefix, new])
    ps = cache.page_size
    pages = new[::ps] // ps
    g = torch.Generator().manual_seed(seed)
    written = {}
    for spec in cache.specs:
        buf = cache.device_pool.buffers[spec.name]
        rows = pages_rows(spec, pages, ps)
        data = torch.randn((spec.num_layers, rows.numel(), *spec.row_shape), generator=g)
        buf[:, rows.to(buf.device)] = data.to(spec.dtype).to(buf.device)
        written[spec.name] = data.to(spec.dtype)
    flags = torch.tensor(ckpt) if ckpt is not None else None
    cache.finish(tokens, locs, prefix.numel(), m.handle, flags)
    return written


def pages_rows(spec: PoolSpec, pages: torch.Tensor, ps: int) -> torch.Tensor:
    r = spec.rows_per_page(ps)
    return (pages.unsqueeze(1) * r + torch.arange(r)).reshape(-1)


def restore(cache: TieredCache, tokens: list[int]):
    """Prefetch from storage (the tree must not hold ``tokens``) and load to the device."""
    m = cache.match(tokens)
    assert m.cached_len == 0 and m.storage_len > 0
    pf = cache.prefetch(m)
    pf.future.result()
    cache.finish_prefetch(pf)
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    return m, ld


def rows_of(cache: TieredCache, spec: PoolSpec, locs: torch.Tensor) -> torch.Tensor:
    ps = cache.page_size
    pages = locs[::ps] // ps
    return cache.device_pool.buffers[spec.name][:, pages_rows(spec, pages, ps)].cpu()


def wipe(cache: TieredCache) -> None:
    cache.flush()
    for buf in cache.host_pool.buffers.values():
        buf.zero_()
    for buf in cache.device_pool.buffers.values():
        buf.zero_()


def test_tree_page_is_the_lcm_of_component_granularities(tmp_path):
    c = make(tmp_path, [KV, IDX], storage=None)
    assert (c.kv_page_size, c.page_size) == (4, 16)
    assert c.device_pool.buffers["kv"].shape == (2, 16 * 16, 2, 1, 4)
    assert c.device_pool.buffers["index_rows"].shape == (2, 16, 8)
    s = make(tmp_path, [KV, STATE], storage=None)
    assert s.page_size == 4 and s.device_pool.buffers["state"].shape == (3, 16, 6)


def test_span_roundtrip_through_file_backend(tmp_path):
    """2 keys x 4 KV pages each, byte-exact after wiping the host and device pools."""
    c = make(tmp_path, [KV, IDX])
    tokens = list(range(1000, 1032))
    written = fill(c, tokens)
    c.drain()
    assert c.stats()["storage_backup_pages"] == 2
    assert c.stats()["storage_backup_tokens"] == 32
    wipe(c)
    m, ld = restore(c, tokens)
    assert ld.storage_tokens == 32
    for spec in (KV, IDX):
        got = rows_of(c, spec, ld.locs)
        assert torch.equal(got.view(torch.uint8), written[spec.name].view(torch.uint8)), spec.name
    c.unlock(m.handle)
    c.drain()
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("specs", [[KV, STATE], [KV, IDX, STATE]], ids=["degenerate", "span4x"])
def test_mixed_kv_and_state_pool_roundtrip(tmp_path, specs):
    c = make(tmp_path, specs)
    ps = c.page_size
    tokens = list(range(7, 7 + 4 * ps))
    ckpt = [True, False, True, False]
    written = fill(c, tokens, ckpt)
    c.drain()
    keys = chain_keys(c.namespace, tokens, ps)
    assert [c.storage.batch_exists([state_key(k)]) for k in keys] == [1, 0, 1, 0]
    wipe(c)
    m, ld = restore(c, tokens)
    # The resume point is the deepest checkpoint: page 2 of 4.
    assert ld.locs.numel() == 3 * ps and m.cached_len == 3 * ps
    for spec in specs:
        got = rows_of(c, spec, ld.locs)
        want = written[spec.name]
        if spec.kind == "state":
            got, want = got[:, [0, 2]], want[:, [0, 2]]  # only checkpoints are kept
        else:
            want = want[:, : got.shape[1]]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), spec.name
    node = m.handle.locked.path[0]
    assert node.ckpt.tolist()[:3] == [True, False, True]
    c.unlock(m.handle)
    c.drain()
    c.check_integrity()
    c.close()


class FailingStates(FileBackend):
    def batch_set(self, keys, buffers):
        if keys and keys[0].endswith("-state"):
            self.fault("io", "simulated state write failure")
            return 0
        return super().batch_set(keys, buffers)


@pytest.mark.parametrize("state_ok", [True, False], ids=["state-ok", "state-failed"])
def test_backup_skip_accounting_on_both_state_branches(tmp_path, state_ok):
    tokens = list(range(50, 50 + 3 * PS))
    first = make(tmp_path, [KV, STATE])
    fill(first, tokens, [False, False, False])  # page objects only
    first.close()
    c = make(tmp_path, [KV, STATE])
    if not state_ok:
        c.controller.io.backend = FailingStates(c.storage.root, c.namespace, c.config.storage_bytes)
    fill(c, tokens, [True, True, True])  # page objects exist: skipped; states are new
    c.drain()
    s = c.stats()
    if state_ok:
        assert (s["storage_backup_pages"], s["storage_backup_tokens"]) == (3, 3 * PS)
        assert s["dropped_storage_backups"] == 0
    else:
        assert (s["storage_backup_pages"], s["storage_backup_tokens"]) == (0, 0)
        assert s["dropped_storage_backups"] == 3
        assert s["storage_errors"] == {"io": 1}
    c.close()


def test_batch_exists_prefix_semantics_under_spans(tmp_path):
    c = make(tmp_path, [KV, IDX])
    tokens = list(range(300, 300 + 48))  # 3 span objects of 16 tokens
    fill(c, tokens)
    c.drain()
    keys = chain_keys(c.namespace, tokens, 16)
    assert c.storage.batch_exists(keys) == 3
    c.close()
    os.remove(c.storage._path(keys[1]))
    fresh = make(tmp_path, [KV, IDX])  # the backend's index is rebuilt from the directory
    assert fresh.storage.batch_exists(keys) == 1
    assert fresh.storage.batch_exists(keys[2:]) == 1
    assert fresh.match(tokens).storage_len == 16
    fresh.close()


def test_transfer_length_mismatch_guard(tmp_path):
    c = make(tmp_path, [KV, IDX, STATE], storage=None)
    pages = torch.tensor([3, 5])
    token_codec = ObjectCodec(c.host_pool, [KV, IDX])
    slots = token_codec.slots(pages)
    assert token_codec.strides(2, slots) == {"kv": 16, "index_rows": 1}
    short = {**slots, "kv": slots["kv"][:-4]}
    with pytest.raises(IntegrityError, match="pool 'kv': 28 rows for 2 keys, expected exactly 16"):
        token_codec.gather(2, short)
    state_codec = ObjectCodec(c.host_pool, [STATE])
    assert state_codec.strides(2, {"state": torch.tensor([1, 2, 3, 4])}) == {"state": 2}
    with pytest.raises(IntegrityError, match="state pool 'state': 3 rows is not divisible by 2"):
        state_codec.strides(2, {"state": torch.tensor([1, 2, 3])})


class NoSpans(FileBackend):
    name = "nospan"
    capabilities = StorageCapabilities(page_spans=False, persistent=True)


def test_capability_lookup_and_both_rejection_paths(tmp_path):
    register_backend("nospan", NoSpans.from_config)
    assert FileBackend.capabilities.page_spans and not NoSpans.capabilities.page_spans
    with pytest.raises(ConfigError, match="'nospan' does not support page spans.*tree page is 16"):
        make(tmp_path, [KV, IDX], storage="nospan")
    plain = make(tmp_path, [KV, STATE], storage="nospan")  # tree page == page: no span needed
    plain.close()
    c = make(tmp_path, [KV, IDX], storage=None)
    backend = NoSpans(str(tmp_path / "attach"), c.namespace, 1 << 20)
    with pytest.raises(ConfigError, match="'nospan' does not support page spans"):
        c.attach_storage(backend)
    c.attach_storage(FileBackend(str(tmp_path / "attach"), c.namespace, 1 << 20))
    fill(c, list(range(16)))
    c.drain()
    assert c.stats()["storage_backup_pages"] == 1
    c.close()


def test_hash_chain_alignment(tmp_path):
    """Chaining at the tree page equals the keys the tree computes per node, across splits."""
    c = make(tmp_path, [KV, IDX], storage=None)
    base = list(range(64))
    fill(c, base)
    fill(c, base[:32] + [999] * 32, seed=1)  # splits the first node after two tree pages
    node_keys = []
    m = c.tree.match(base)
    for node in m.path:
        node_keys += c.tree.ensure_keys(node, c.namespace)
    assert len(m.path) == 2
    assert node_keys == chain_keys(c.namespace, base, 16)
    c.close()


def test_spanned_and_unspanned_deployments_never_share_keys(tmp_path):
    a = make(tmp_path, [KV, IDX], storage=None)
    b = make(
        tmp_path,
        [KV, PoolSpec("index_rows", 2, (8,), torch.bfloat16, kind="sidecar")],
        storage=None,
    )
    assert a.page_size != b.page_size and a.namespace != b.namespace


def test_state_hits_resume_from_the_deepest_checkpoint(tmp_path):
    c = make(tmp_path, [KV, STATE])
    tokens = list(range(500, 500 + 5 * PS))
    fill(c, tokens, [False, True, False, True, False])
    c.drain()
    m = c.match(tokens)
    assert (m.device_len, m.host_len) == (4 * PS, 0)
    assert m.handle.match.matched_len == 5 * PS  # the tree has all five pages
    # Shorter prompts resume from the nearest earlier checkpoint instead of missing.
    assert c.match(tokens[: 3 * PS + 1]).cached_len == 2 * PS
    assert c.match(tokens[: 2 * PS - 1]).cached_len == 0
    c.controller.evict_device(100)
    m = c.match(tokens)
    assert (m.device_len, m.host_len) == (0, 4 * PS)
    c.controller.evict_host(100)
    m = c.match(tokens)
    assert (m.cached_len, m.storage_len) == (0, 4 * PS)  # cut after the state object of page 3
    c.check_integrity()
    c.close()


def test_hit_metrics_by_tier_and_component(tmp_path):
    from prometheus_client import generate_latest

    c = make(tmp_path, [KV, STATE])
    tokens = list(range(900, 900 + 4 * PS))
    fill(c, tokens, [True, True, False, True])
    c.drain()
    c.controller.evict_device(100)
    m = c.match(tokens)
    c.lock(m.handle)
    c.load(m)
    c.record_hits(m.handle)
    c.unlock(m.handle)
    c.drain()
    assert c.stats()["hit_pages"] == {"host/kv": 4, "host/state": 1}
    text = generate_latest(c.prometheus_registry()).decode()
    assert 'kvtier_hit_pages_total{component="state",tier="host"} 1.0' in text
    c.close()
