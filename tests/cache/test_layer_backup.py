"""Per-layer backups (host copies made during the forward), visibility at the match level, and
draft KV moving in lockstep with the target's pages through every tier."""

from __future__ import annotations

import random

import pytest
import torch
from factories import make_cache, make_llm

from kvtier import CacheConfig, PoolSpec, TieredCache
from kvtier.engine import LLM, SamplingParams
from kvtier.errors import ConfigError

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True, return_logits=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    base = [rng.randrange(512) for _ in range(90)]
    return [base[:cut] + [9, cut] for cut in (40, 75, 90)]


def _host_rows(llm: LLM, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """The host rows of every whole cached page of ``tokens``, per component."""
    cache = llm.cache
    m = cache.tree.match(tokens)
    pages = torch.cat([n.host for n in m.path if n.host is not None])
    return tuple(cache.host_pool.read_pages(s.name, pages) for s in cache.specs)


@pytest.mark.parametrize(
    ("model", "spec", "codec"), [("tiny", 0, "none"), ("tiny-mtp", 3, "none"), ("tiny", 0, "int8")]
)
def test_per_layer_copies_equal_backups_at_insert_and_serve_the_oracle(
    tmp_path, model, spec, codec
):
    """Also with speculative decoding (draft KV as two sidecars; rejected positions are
    written by the verify forward and must not be what reaches the host), and with a page
    codec (each layer coded on its way: the host holds the codes a backup at insert writes)."""
    ps = _prompts()
    kw = {"speculative_tokens": spec, "kv_codec": codec}
    at_insert = make_llm(model, tmp_path / "at_insert", backup_timing="at_insert", **kw)
    per_layer = make_llm(model, tmp_path / "per_layer", backup_timing="per_layer", **kw)
    # One at a time on both: the shared prefix is then cached, and the batches (hence the
    # float bytes on CUDA) are the same on both sides.
    cold = [at_insert.generate([p], GREEDY)[0].output_ids for p in ps]
    mover = per_layer.cache.controller.mover
    at_insert_copies = []
    real = mover.device_to_host
    mover.device_to_host = lambda d, h: at_insert_copies.append(d) or real(d, h)
    outs = [per_layer.generate([p], GREEDY)[0] for p in ps]
    assert [o.output_ids for o in outs] == cold
    for llm in (at_insert, per_layer):
        llm.cache.drain()
    st = per_layer.stats()
    # the forwards copied every page the tree holds; no copy was made at insert (with a draft
    # only the verified token's page is copied in the forward: a page completed by accepted
    # draft tokens is backed up at insert) ...
    held = per_layer.cache.tree.held_pages("host").numel()
    assert st["host_backup_pages"] == held > 0
    # a cached partial tail page is never full after a forward: it alone is copied at insert
    tails = sum(1 for n in per_layer.cache.tree.nodes() if n.parent and len(n.tokens) % 16)
    late = sum(d.numel() for d in at_insert_copies)
    if not spec:
        assert st["layer_backup_pages"] == held - tails and late == tails
    else:  # a node mixing both gives up its reservations and is copied whole at insert
        assert st["layer_backup_pages"] > 0 and at_insert_copies
    # ... and the shared prefix only once: the insertion prefix is probed before reserving
    assert held < sum((len(p) + 4) // 16 for p in ps)
    # ... and the bytes are those a backup at insert writes.
    for p in ps:
        mine, theirs = _host_rows(per_layer, p), _host_rows(at_insert, p)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        if codec != "none":
            continue  # the host holds codes (their bytes are checked just above)
        # and each host copy holds exactly what its device copy holds
        for node in per_layer.cache.tree.match(p).path:
            for comp in per_layer.cache.specs:
                dev = per_layer.cache.device_pool.buffers[comp.name]
                r = comp.rows_per_page(16)
                rows = (node.device[:, None] * r + torch.arange(r)).reshape(-1)
                want = dev[:, rows.to(dev.device)].cpu()
                got = per_layer.cache.host_pool.read_pages(comp.name, node.host)
                assert torch.equal(got.transpose(0, 1).reshape(want.shape), want)
    per_layer.cache.flush(host=False)  # restore from the per-layer copies
    again = per_layer.generate(ps, GREEDY)
    assert [o.output_ids for o in again] == cold
    assert all(o.cached_host > 0 for o in again)
    for llm in (at_insert, per_layer):
        llm.cache.check_integrity()
        llm.close()


def test_a_failed_forward_releases_its_reservation(tmp_path):
    llm = make_llm("tiny", tmp_path / "per_layer", backup_timing="per_layer")
    ps = _prompts()
    calls = {"n": 0}
    real = llm.model.forward

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:  # fail after the first layer was copied
            after = kw["after_layer"]
            kw["after_layer"] = lambda j: (after(j), (_ for _ in ()).throw(RuntimeError("boom")))
        return real(*a, **kw)

    llm.model.forward = failing
    (out,) = llm.generate([ps[0]], GREEDY)
    assert out.finish_reason == "error" and "boom" in out.error
    llm.cache.drain()
    llm.cache.check_integrity()  # host pages: used == cached + in flight
    assert llm.cache.host_pool.allocator.used == 0  # nothing it reserved is kept
    (ok,) = llm.generate([ps[0]], GREEDY)  # and the next run backs up normally
    llm.cache.drain()
    assert ok.finish_reason == "length" and llm.stats()["host_backup_pages"] > 0
    llm.close()


def test_options_are_checked():
    with pytest.raises(ConfigError, match="backup_timing='per_layer' needs write_policy"):
        CacheConfig(backup_timing="per_layer", write_policy="write_back")
    with pytest.raises(ConfigError, match="backup_timing='sometimes' is not one of"):
        CacheConfig(backup_timing="sometimes")


# ---- visibility at the match level and lockstep of target and draft --------------------------

KV = PoolSpec("kv", 2, (2, 1, 4), torch.float32)
DRAFT = PoolSpec("draft_kv", 1, (2, 1, 4), torch.float32, kind="sidecar")
PS = 4


def _cache(tmp_path, **kw) -> TieredCache:
    return make_cache(tmp_path, (KV, DRAFT), **{"debug_checks": True, **kw})


def _fill(cache: TieredCache, tokens: list[int], seed: int) -> torch.Tensor:
    m = cache.match(tokens)
    cache.lock(m.handle)
    cache.load(m)
    locs = cache.alloc(len(tokens), at=0)
    g = torch.Generator().manual_seed(seed)
    for spec in (KV, DRAFT):
        for layer in range(spec.num_layers):
            buf = cache.kv_buffers.layer(layer, spec.name)
            idx = locs.to(buf.device)
            buf[idx] = torch.randn(buf[idx].shape, generator=g).to(buf.device)
    cache.finish(tokens, locs, 0, m.handle)
    return locs


def _rows(cache: TieredCache, locs: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for s in (KV, DRAFT):
        for layer in range(s.num_layers):
            buf = cache.kv_buffers.layer(layer, s.name)
            out.append(buf[locs.to(buf.device)].cpu())
    return out


def test_a_node_is_not_matchable_on_host_before_its_copy_completed(tmp_path):
    """The copy covers target and draft; until its final event (the draft rows land after the
    target's) the node's host copy is invisible to ``match``, then both become visible at
    once."""
    cache = _cache(tmp_path, storage=None, backup_share=0.0)
    toks = list(range(8))
    real = cache.controller.mover.device_to_host
    landed = {"yes": False}

    class Event:  # the copy's completion event, held back until the test lets it land
        def __init__(self, inner) -> None:
            self.inner = inner

        def query(self) -> bool:
            return landed["yes"] and (self.inner is None or self.inner.query())

        def synchronize(self) -> None:
            if self.inner is not None:
                self.inner.synchronize()

    def in_flight(dev, host):
        op = real(dev, host)
        op.event = Event(op.event)
        return op

    cache.controller.mover.device_to_host = in_flight
    _fill(cache, toks, 1)
    for _ in range(3):
        cache.poll()
        assert all(not n.on_host for n in cache.tree.match(toks).path)
    landed["yes"] = True
    cache.poll()
    assert [n.on_host for n in cache.tree.match(toks).path] == [True]
    cache.check_integrity()


def test_target_and_draft_never_separate(tmp_path):
    toks = list(range(100, 112))
    cache = _cache(tmp_path)
    locs = _fill(cache, toks, 7)
    want = _rows(cache, locs)
    cache.drain()
    for step in ("host", "storage"):
        cache.flush(host=step == "storage")
        m = cache.match(toks)
        if step == "storage":
            op = cache.prefetch(m)
            cache.drain()
            cache.finish_prefetch(op)
            m = cache.match(toks, probe_storage=False)
        assert m.host_len == len(toks), step
        cache.lock(m.handle)
        ld = cache.load(m)
        got = _rows(cache, ld.locs)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
        cache.finish(toks, ld.locs, ld.locs.numel(), m.handle)
        cache.drain()
        cache.check_integrity()
    cache.close()


def test_a_corrupt_draft_payload_makes_the_whole_page_a_miss(tmp_path):
    toks = list(range(200, 212))
    cache = _cache(tmp_path)
    _fill(cache, toks, 3)
    cache.drain()
    keys = cache.tree.match(toks).path[0].keys
    cache.close()
    # flip one byte of the second page's draft rows (its payload's tail) in the stored object
    ns_dir = next(p for p in (tmp_path / "l3").iterdir() if p.is_dir())
    path = ns_dir / keys[1][:2] / keys[1]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = _cache(tmp_path)
    m = fresh.match(toks)
    op = fresh.prefetch(m)
    fresh.drain()
    fresh.finish_prefetch(op)
    m = fresh.match(toks, probe_storage=False)
    # page 0 restores whole; page 1 (target fine, draft corrupt) is a miss, and so is page 2
    assert m.host_len == PS
    assert fresh.stats()["storage_errors"].get("checksum", 0) == 1
    fresh.check_integrity()
    fresh.close()
