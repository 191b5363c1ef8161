"""``host_mode='buffer_only'``: the host tier as a staging buffer smaller than one request.

Exact CPU bookkeeping (chunked backups, release after write and load, the fetch admission and
its write reserve, rollback of failed writes and reads), then an engine oracle: a first run, a
device hit and a storage restore in a fresh process give the cold run's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from childproc import run_json
from factories import engine_config, kv_of, run_request
from factories import make_cache as _make_cache
from factories import make_llm as _make_llm
from workloads import MODEL as ADMISSION_MODEL
from workloads import chat_workload, cold, replay

from kvtier.config import CacheConfig
from kvtier.demo.oracle import Expected, compare, default_tolerance
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.errors import ConfigError
from kvtier.storage.file import FileBackend

TOKENS = list(range(100, 148))  # 48 tokens: 12 whole pages of 4
OTHER = list(range(300, 316))  # 16 tokens: 4 whole pages


def make_cache(tmp_path, **kw):
    return _make_cache(
        tmp_path, **{"device_pages": 16, "host_pages": 4, "host_mode": "buffer_only", **kw}
    )


def stored_pages(c, tokens: list[int]) -> int:
    """Leading pages of ``tokens`` whose objects storage holds."""
    m = c.match(tokens)
    return len(m.handle.storage_keys) + m.handle.match.matched_len // 4


def shape(c) -> list[tuple[int, bool, bool, bool]]:
    """Per node of the tree's one chain, in order: (pages, device, host, stored)."""
    out, node = [], c.tree.root
    while node.children:
        (node,) = node.children.values()
        out.append((len(node.tokens) // 4, node.on_device, node.on_host, node.in_storage))
    return out


def shape_of(c, tokens: list[int]) -> list[tuple[int, bool, bool, bool]]:
    """``shape`` of the nodes on the path of ``tokens``."""
    path = c.tree.match(tokens).path
    return [(len(n.tokens) // 4, n.on_device, n.on_host, n.in_storage) for n in path]


class FailingWrites(FileBackend):
    """File backend whose writes all fail (a storage fault: counted, a dropped backup)."""

    def batch_set(self, keys, buffers):
        self.fault("io", "injected write fault")
        return 0


class FailingReadsOnce(FileBackend):
    """File backend whose first read fails (a miss), later reads succeed."""

    failed = False

    def batch_get(self, keys, buffers):
        if not self.failed:
            self.failed = True
            self.fault("io", "injected read fault")
            return 0
        return super().batch_get(keys, buffers)


def swap_backend(c, cls: type[FileBackend]) -> FileBackend:
    backend = cls(c.storage.root, c.namespace, c.config.storage_bytes)
    c.controller.io.backend = backend
    return backend


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"enable_host": False, "storage": None}, "enable_host=True"),
        ({"storage": None}, "requires storage"),
        ({"write_policy": "write_back"}, "write_policy='write_back'"),
        ({"backup_timing": "per_layer"}, "backup_timing='per_layer'"),
        ({"cp_size": 2}, "cp_size=2"),
        ({"host_mode": "buffer"}, "host_mode='buffer'"),
    ],
)
def test_config_refuses_what_cannot_work(kw, words):
    base = {"storage": "file", "model_fingerprint": "m", "host_mode": "buffer_only"}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        CacheConfig(**{**base, **kw})


def test_cache_mode_reports_no_staging(tmp_path):
    c = _make_cache(tmp_path)
    assert c.controller.staging is None and "host_staged_write_pages" not in c.stats()
    c.close()


def test_request_larger_than_host_goes_to_storage_in_chunks(tmp_path):
    c = make_cache(tmp_path)
    run_request(c, TOKENS)
    # The host pool takes the first 4 pages now; the other 8 wait with their device copy.
    assert shape(c) == [(4, True, False, False), (8, True, False, False)]
    s = c.stats()
    assert (s["host_pages_used"], s["host_staged_write_pages"]) == (4, 4)
    page = c.host_pool.page_bytes
    assert (s["host_backup_waiting_pages"], s["host_write_reserve_bytes"]) == (8, 2 * page)
    assert c.controller.evict_device(100) == 0  # not stored yet: the device copy stays
    c.check_integrity()
    c.drain()
    c.check_integrity()
    assert shape(c) == [(4, True, False, True)] * 3
    s = c.stats()
    assert (s["host_pages_used"], s["host_staged_write_pages"], s["host_staged_read_pages"]) == (
        0,
        0,
        0,
    )
    assert (s["host_backup_pages"], s["storage_backup_pages"]) == (12, 12)
    assert (s["host_staging_released_pages"], s["host_backup_waiting_pages"]) == (12, 0)
    assert stored_pages(c, TOKENS) == 12
    assert c.controller.evict_device(100) == 12  # stored: now evictable, the tree empties
    assert list(c.tree.nodes()) == []
    c.check_integrity()
    c.close()


def test_restore_stages_the_host_size_and_frees_it_after_the_load(tmp_path):
    c = make_cache(tmp_path)
    orig = kv_of(c, run_request(c, TOKENS)["locs"])
    c.close()
    c = make_cache(tmp_path)
    m = c.match(TOKENS)
    assert m.storage_len == 48
    pf = c.prefetch(m)
    assert pf.pages.tolist() == [0, 1, 2, 3]  # the whole host pool, not the 12 pages
    s = c.stats()
    assert (s["host_staged_read_pages"], s["host_staging_cut_read_pages"]) == (4, 8)
    pf.future.result()
    assert c.finish_prefetch(pf) == 16
    c.check_integrity()
    m = c.match(TOKENS)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 16, 32)
    assert c.prefetch(m) is None  # the buffer is full of the pages about to be loaded
    c.lock(m.handle)
    ld = c.load(m)
    assert (ld.device_tokens, ld.host_tokens, ld.storage_tokens) == (0, 0, 16)
    assert torch.equal(kv_of(c, ld.locs).view(torch.uint8), orig[:, :16].view(torch.uint8))
    assert c.stats()["host_pages_used"] == 4  # the load has not completed before the poll
    c.poll()
    assert shape(c) == [(4, True, False, True)]
    s = c.stats()
    assert (s["host_pages_used"], s["host_staging_released_pages"]) == (0, 4)
    c.unlock(m.handle)
    c.check_integrity()
    c.close()


def test_a_locked_node_is_not_split_until_unlocked(tmp_path):
    c = make_cache(tmp_path, write_policy="write_through_selective", write_threshold=1)
    orig = kv_of(c, run_request(c, TOKENS)["locs"])
    assert shape(c) == [(12, True, False, False)]  # selective: no backup before a hit
    m = c.match(TOKENS)
    c.lock(m.handle)  # the hit queues the backup; the lock holds the path, so no split
    s = c.stats()
    assert (s["host_pages_used"], s["host_backup_waiting_pages"]) == (0, 12)
    ld = c.load(m)
    assert (ld.device_tokens, torch.equal(kv_of(c, ld.locs), orig)) == (48, True)
    c.unlock(m.handle)
    c.poll()  # unlocked: the first 4 pages go now
    assert shape(c) == [(4, True, False, False), (8, True, False, False)]
    assert c.stats()["host_pages_used"] == 4
    c.drain()
    assert shape(c) == [(4, True, False, True)] * 3
    assert (c.stats()["host_pages_used"], stored_pages(c, TOKENS)) == (0, 12)
    c.check_integrity()
    c.close()


def test_failed_writes_drop_their_host_copies(tmp_path):
    c = make_cache(tmp_path)
    swap_backend(c, FailingWrites)
    run_request(c, TOKENS)
    c.drain()
    c.check_integrity()
    assert shape(c) == [(4, True, False, False)] * 3  # every chunk tried, none stored
    s = c.stats()
    assert (s["host_pages_used"], s["host_backup_pages"]) == (0, 12)
    assert (s["dropped_storage_backups"], s["host_staging_dropped_pages"]) == (12, 12)
    assert s["storage_backup_pages"] == 0 and c.storage.errors["io"] == 3
    assert c.controller.evict_device(100) == 12  # a cache miss later, never a stuck page
    c.check_integrity()
    c.close()


def test_write_reserve_and_rollback_of_a_failed_fetch(tmp_path):
    c = make_cache(tmp_path, host_pages=6)
    run_request(c, TOKENS)
    c.close()
    c = make_cache(tmp_path, host_pages=6)
    swap_backend(c, FailingReadsOnce)
    pf = c.prefetch(c.match(TOKENS))
    assert pf.pages.numel() == 6  # nothing waits to be written: the whole pool
    run_request(c, OTHER, seed=1)  # no host room: its 4 pages wait for a backup
    assert c.stats()["host_backup_waiting_pages"] == 4
    pf.future.result()
    assert c.finish_prefetch(pf) == 0  # the read failed: its pages go back
    s = c.stats()
    assert (s["host_pages_used"], s["prefetch_failed_pages"]) == (0, 6)
    assert s["host_write_reserve_bytes"] == 3 * c.host_pool.page_bytes  # min(4 waiting, 6 // 2)
    c.check_integrity()
    pf = c.prefetch(c.match(TOKENS))
    assert pf.pages.numel() == 3  # 6 free minus the reserve
    c.poll()  # the queued backup takes the reserve: 3 pages now, 1 later
    s = c.stats()
    assert (s["host_pages_used"], s["host_backup_waiting_pages"]) == (6, 1)
    pf.future.result()
    assert c.finish_prefetch(pf) == 12
    c.drain()
    c.check_integrity()
    assert stored_pages(c, OTHER) == 4
    s = c.stats()
    # The fetched copy no load used was reclaimable: the last backup chunk took its room.
    assert (s["host_pages_used"], s["evicted_host_pages"]) == (0, 3)
    assert s["host_staging_released_pages"] == 4
    assert shape_of(c, OTHER) == [(3, True, False, True), (1, True, False, True)]
    c.close()


@pytest.mark.parametrize(
    ("ps", "host_pages", "write_policy", "max_running", "seed"),
    [
        (1, 1, "write_through", 2, 1),
        (5, 3, "write_through", 3, 2),
        (7, 2, "write_through_selective", 2, 3),
        (16, 1, "write_through", 4, 4),
    ],
)
def test_engine_under_pressure_finishes_with_cold_outputs(
    tmp_path, ps, host_pages, write_policy, max_running, seed
):
    """Multi-turn conversations over a device pool just large enough for the longest request
    and a buffer of a few pages, replayed in a fresh engine from storage: every request
    finishes within the step budget with the cold outputs, and a drain empties the buffer."""
    w = chat_workload(ps, 40, 3, 2, 4, seed)
    cfg = engine_config(
        tmp_path,
        page_size=ps,
        device_pages=-(-w.longest() // ps) + 1,
        device="cpu",
        prefetch_policy="timeout",
        write_policy=write_policy,
        host_mode="buffer_only",
        host_pages=host_pages,
    )
    live = LLM(ADMISSION_MODEL, cfg, max_running=max_running)
    record = replay(live, w, len(w.turns) - 1)
    live.cache.drain()
    assert live.stats()["host_pages_used"] == 0
    live.close()
    again = LLM(ADMISSION_MODEL, cfg, max_running=max_running)
    record_again = replay(again, w, len(w.turns))
    again.cache.drain()
    again.cache.check_integrity()
    s = again.stats()
    assert s["host_pages_used"] == 0 and s["host_backup_waiting_pages"] == 0
    if write_policy == "write_through":
        assert s["storage_hit_tokens"] > 0
    again.close()
    assert record_again[: len(record)] == record
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    prompts = [p for turn, _ in record_again for p in turn]
    outputs = [o for _, turn in record_again for o in turn]
    assert outputs == cold(prompts, params)


# ---- engine oracle --------------------------------------------------------------------------
MODEL = ModelConfig(num_layers=3, max_position=1024, seed=7)
PS = 16
HOST_PAGES = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
TOL = default_tolerance(MODEL.dtype)


def oracle_prompt() -> list[int]:
    """13 whole pages and a tail: more than three times the host pool."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, MODEL.vocab_size, (13 * PS + 5,), generator=g).tolist()


def make_llm(storage_dir: str | None) -> LLM:
    """The oracle's engine (also ``buffer_oracle_child``'s): with storage, a buffer-only host
    tier of ``HOST_PAGES`` pages."""
    buffer = {"host_mode": "buffer_only", "host_pages": HOST_PAGES} if storage_dir else {}
    return _make_llm(MODEL, storage_dir, max_running=1, **buffer)


def first_pages_bytes(llm: LLM, tokens: list[int], pages: int) -> torch.Tensor:
    """KV bytes of the first ``pages`` cached pages of ``tokens`` (they must be on device)."""
    cache = llm.cache
    m = cache.match(tokens, probe_storage=False)
    assert m.device_len >= pages * PS
    cache.lock(m.handle)
    ld = cache.load(m)
    kv = cache.device_pool.anchor[:, ld.locs[: pages * PS]].cpu().view(torch.uint8)
    cache.unlock(m.handle)
    cache.poll()
    return kv


@pytest.mark.slow
def test_engine_oracle_with_a_buffer_smaller_than_one_request(tmp_path: Path) -> None:
    prompt = oracle_prompt()
    cold_llm = make_llm(None)
    cold = cold_llm.generate([prompt], GREEDY)[0]
    cold_llm.close()

    storage = str(tmp_path / "l3")
    llm = make_llm(storage)
    first = llm.generate([prompt], GREEDY)[0]
    llm.cache.drain()
    llm.cache.check_integrity()
    s = llm.cache.stats()
    assert (s["host_pages_used"], s["host_backup_waiting_pages"]) == (0, 0)
    # prompt + 5 generated tokens computed: 13 whole pages and a tail of 10 tokens
    assert (s["storage_backup_pages"], s["host_staging_released_pages"]) == (14, 14)
    written = first_pages_bytes(llm, prompt, 13)
    device = llm.generate([prompt], GREEDY)[0]
    assert device.cached_device == 13 * PS
    for out in (first, device):
        same, diff = compare(out.output_ids, out.logits, Expected(cold.output_ids, cold.logits))
        assert same and diff <= TOL
    llm.close()

    case = tmp_path / "case.pt"
    torch.save({"prompt": prompt, "tokens": cold.output_ids, "logits": cold.logits}, case)
    torch.save(written[:, : HOST_PAGES * PS], tmp_path / "written.pt")
    result = run_json(
        "cache/buffer_oracle_child.py", storage, str(case), str(tmp_path / "written.pt")
    )
    assert result["outputs"] == list(cold.output_ids)
    assert result["logit_diff"] <= TOL
    # the fallback: the leading pages the buffer stages come from storage, the rest is computed
    assert result["storage_tokens"] == HOST_PAGES * PS
    assert result["stats_storage_hit_tokens"] == HOST_PAGES * PS
    assert result["recomputed"] == len(prompt) - HOST_PAGES * PS
    assert result["restored_equal"]
    assert result["host_pages_used"] == 0
