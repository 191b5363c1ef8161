"""``TieredCache.admit``: one admission call that cannot forget the storage prefetch. An engine
written with it over a storage directory an earlier cache filled is served from storage; a
prefetch the policy waits for makes the admission pending until it lands; misuse is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from factories import SPEC, kv_of, make_cache, run_request

from kvtier.cache.results import Admission
from kvtier.errors import KvtierError, RequestError
from kvtier.storage.file import FileBackend

TOKENS = list(range(200, 233))  # 33 tokens: 8 whole pages of 4 and a partial tail of 1
NEW = [7, 8, 9]


def _cache(tmp_path, **kw):
    return make_cache(tmp_path, **{"device_pages": 16, "host_pages": 32, **kw})


def _seed_storage(tmp_path) -> torch.Tensor:
    """A first cache computes ``TOKENS`` and writes them through to storage; its bytes."""
    c = _cache(tmp_path)
    first = run_request(c, TOKENS)
    orig = kv_of(c, first["locs"][: len(TOKENS)])
    c.close()
    return orig


class GatedFile(FileBackend):
    """File backend whose reads wait for ``gate``: a prefetch stays in flight until it opens."""

    gate: threading.Event

    def batch_get(self, keys, buffers):
        self.gate.wait()
        return super().batch_get(keys, buffers)


def _gated(tmp_path, policy: str):
    c = _cache(tmp_path, prefetch_policy=policy)
    gated = GatedFile(c.storage.root, c.namespace, c.config.storage_bytes)
    gated.gate = threading.Event()
    c.controller.io.backend = gated
    return c, gated


def _serve(c, tokens: list[int], seed: int = 1) -> tuple[Admission, torch.Tensor]:
    """An engine's whole request written with ``admit`` only: wait until ready, allocate the
    rest, count hits, write the computed rows, finish. Returns the admission and the rows."""
    adm = c.admit(tokens)
    while not c.admit_ready(adm, timeout=5.0):
        pass  # each turn blocks on the fetch's I/O, never spins
    new = c.alloc(adm.num_new, at=adm.cached_len)[: adm.num_new]
    c.record_hits(adm.handle)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn((SPEC.num_layers, adm.num_new, *SPEC.row_shape), generator=g)
    c.write_kv(new, rows)
    c.finish(tokens, torch.cat([adm.locs, new]), prefix_len=adm.cached_len, handle=adm.handle)
    return adm, rows


def test_an_engine_loop_of_admit_calls_uses_what_an_earlier_cache_stored(tmp_path) -> None:
    orig = _seed_storage(tmp_path)
    c = _cache(tmp_path)
    assert c.match(TOKENS).storage_len == 33  # a fresh cache: everything is in storage
    adm, rows = _serve(c, TOKENS + NEW)
    assert torch.equal(c.read_kv(torch.tensor([37, 38, 39])).cpu(), rows)  # alloc's slots
    assert (adm.device_tokens, adm.host_tokens, adm.storage_tokens) == (0, 0, 33)
    assert (adm.cached_len, adm.num_new) == (33, 3)
    assert torch.equal(c.read_kv(adm.locs).cpu(), orig)  # restored bytes equal the originals
    assert c.stats()["storage_hit_tokens"] == 33
    assert c.stats()["recomputed_tokens"] == 0  # the loop did not call record_prefill
    assert adm.done and not adm.ready
    # the restored pages are device pages now: a request sharing 20 tokens is served there
    again, _ = _serve(c, TOKENS[:20] + NEW)
    assert (again.device_tokens, again.storage_tokens, again.num_new) == (20, 0, 3)
    assert torch.equal(c.read_kv(again.locs).cpu(), orig[:, :20])
    assert c.stats()["device_hit_tokens"] == 20
    c.check_integrity()
    c.close()


def test_the_fine_grained_sequence_without_prefetch_misses_what_admit_finds(tmp_path) -> None:
    """Why ``admit`` exists: match, lock, load alone reuses none of storage's tokens."""
    _seed_storage(tmp_path)
    c = _cache(tmp_path)
    m = c.match(TOKENS)
    c.lock(m.handle)
    assert (m.storage_len, c.load(m).locs.numel()) == (33, 0)
    c.unlock(m.handle)
    adm = c.admit(TOKENS)
    assert c.admit_ready(adm, timeout=5.0) and adm.storage_tokens == 33
    c.abandon(adm)
    c.check_integrity()
    c.close()


def test_a_waited_for_prefetch_keeps_the_admission_pending_until_it_lands(tmp_path) -> None:
    orig = _seed_storage(tmp_path)
    c, gated = _gated(tmp_path, "wait_complete")
    adm = c.admit(TOKENS)
    assert adm.pending and not adm.ready and not adm.done
    assert not c.admit_ready(adm)  # timeout=0: never blocks
    assert not c.admit_ready(adm, timeout=0.01)  # the gate is shut: nothing can land
    with pytest.raises(RequestError, match=r"Admission.locs: the admission is pending"):
        _ = adm.locs
    gated.gate.set()
    assert c.admit_ready(adm, timeout=30.0)
    assert adm.ready and not adm.pending
    assert (adm.storage_tokens, adm.cached_len) == (33, 33)
    assert torch.equal(c.read_kv(adm.locs).cpu(), orig)
    assert c.admit_ready(adm)  # ready stays ready
    c.abandon(adm)
    c.poll()
    c.check_integrity()
    c.close()


def test_best_effort_admits_at_once_and_later_requests_get_the_pages(tmp_path) -> None:
    _seed_storage(tmp_path)
    c, gated = _gated(tmp_path, "best_effort")
    adm = c.admit(TOKENS)
    assert adm.ready and (adm.storage_tokens, adm.num_new) == (0, 33)  # recomputes
    c.abandon(adm)
    gated.gate.set()
    c.drain()
    later = c.admit(TOKENS)
    assert later.ready and (later.host_tokens, later.storage_tokens) == (0, 33)
    c.abandon(later)
    c.check_integrity()
    c.close()


def test_abandoning_a_pending_admission_releases_its_prefetch(tmp_path) -> None:
    _seed_storage(tmp_path)
    c, gated = _gated(tmp_path, "wait_complete")
    adm = c.admit(TOKENS)
    assert adm.pending
    c.abandon(adm)
    assert adm.done and not adm.pending
    with pytest.raises(RequestError, match=r"Admission.handle: the admission is abandoned"):
        _ = adm.handle
    gated.gate.set()
    c.drain()
    assert c.controller.prefetcher.ops == []  # closed: nothing keeps its pages locked
    assert c.match(TOKENS).host_len == 33  # what was in flight still became visible
    c.check_integrity()
    c.close()


def test_without_storage_an_admission_is_ready_at_once(tmp_path) -> None:
    c = make_cache(tmp_path, storage=None, device_pages=16)
    adm, _ = _serve(c, TOKENS)
    assert (adm.cached_len, adm.num_new) == (0, 33)
    again = c.admit(TOKENS[:20])
    assert again.ready and (again.device_tokens, again.num_new) == (20, 0)
    c.abandon(again)
    c.check_integrity()
    c.close()


def test_misuse_of_an_admission_is_refused_by_name(tmp_path) -> None:
    c = make_cache(tmp_path, storage=None, device_pages=16)
    adm = c.admit(TOKENS)
    with pytest.raises(RequestError, match=r"^record_hits: pass the admission's handle"):
        c.record_hits(adm)
    with pytest.raises(RequestError, match=r"^admit_ready: adm must be the Admission of admit"):
        c.admit_ready(c.match(TOKENS))
    with pytest.raises(RequestError, match=r"^admit_ready: timeout must be a finite number"):
        c.admit_ready(adm, timeout=-1)
    with pytest.raises(RequestError, match=r"^admit: overlap must be True or False, got 1"):
        c.admit(TOKENS, overlap=1)
    with pytest.raises(RequestError, match=r"^match: tokens must be a sequence of token ids"):
        c.admit("some text")
    with pytest.raises(RequestError, match=r"^match: token 2 is 2.5 \(float\)"):
        c.admit([1, 2, 2.5])
    c.abandon(adm)
    for call in (c.abandon, c.admit_ready):
        with pytest.raises(RequestError, match="abandoned or finished already"):
            call(adm)
    assert adm.cached_len == 0  # a done admission stays a readable record
    done, _ = _serve(c, TOKENS)
    with pytest.raises(RequestError, match="abandoned or finished already"):
        c.abandon(done)
    c.close()
    with pytest.raises(KvtierError, match=r"TieredCache.admit\(\) after close\(\)"):
        c.admit(TOKENS)


def test_write_kv_and_read_kv_take_logical_slots_and_refuse_bad_ones(tmp_path) -> None:
    c = make_cache(tmp_path, storage=None)
    locs = c.alloc(6)[:6]
    rows = torch.arange(2 * 6 * 8, dtype=torch.float32).reshape(2, 6, 2, 1, 4)
    c.write_kv(locs, rows)
    assert torch.equal(c.read_kv(locs).cpu(), rows)
    assert torch.equal(kv_of(c, locs), rows)  # the same bytes the pool holds
    with pytest.raises(RequestError, match=r"write_kv: rows must have shape \(2, 6, 2, 1, 4\)"):
        c.write_kv(locs, rows[:, :5])
    with pytest.raises(RequestError, match=r"component='v' is not one of the pool set's \(kv\)"):
        c.read_kv(locs, "v")
    with pytest.raises(RequestError, match=r"locs must be a 1-D integer tensor .* torch.float32"):
        c.read_kv(locs.float())
    with pytest.raises(RequestError, match=r"read_kv: locs hold a slot outside .* \[0, 32\)"):
        c.read_kv(torch.tensor([32]))
    with pytest.raises(RequestError, match=r"write_kv: locs must be a torch.Tensor .* \(list\)"):
        c.write_kv([0, 1], rows)
    c.free(locs)
    c.close()
