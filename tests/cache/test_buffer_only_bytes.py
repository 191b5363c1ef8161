"""``host_mode='buffer_only'`` over a relocatable host arena counts room in bytes: a backup of
pages whose device copies have no window rows takes only their anchors' bytes (so more pages
than the pool's page count stage at once), the write reserve is the waiting backups' bytes, and
a fetch is admitted by the bytes of whole pages."""

from __future__ import annotations

import torch
from factories import PS, WINDOW_SPECS, cache_config

from kvtier import TieredCache

SHAPE = (2, 1, 4)
SPECS = list(WINDOW_SPECS)
TOKENS = list(range(500, 524))  # 6 whole pages
ANCHOR = 2 * PS * 8 * 4  # one page of one component: layers x tokens x 8 floats x 4 bytes


def make(tmp_path, **kw) -> TieredCache:  # noqa: ANN001
    cfg = cache_config(
        tmp_path / "l3",
        host_mode="buffer_only",
        host_compaction="auto",
        host_pages=4,
        device_pages=16,
        debug_checks=True,
        **kw,
    )
    return TieredCache(cfg, SPECS)


def run(c: TieredCache, tokens: list[int], keep_window: int) -> None:
    """One request writing every uncached page; the window rows of all but its last
    ``keep_window`` pages are released first (the engine's queries left them behind)."""
    m = c.match(tokens)
    c.lock(m.handle)
    ld = c.load(m)
    new = c.alloc(len(tokens) - ld.locs.numel())[: len(tokens) - ld.locs.numel()]
    kv = c.kv_buffers
    for name in ("kv", "swa"):
        slots = kv.slots(new, name).to(kv.device)
        for layer in range(2):
            kv.layer(layer, name)[slots] = torch.randn((new.numel(), *SHAPE)).to(kv.device)
    c.release_window(new[: new.numel() - keep_window * PS])
    c.finish(tokens, torch.cat([ld.locs, new]), ld.locs.numel(), m.handle)


def test_pages_without_window_rows_stage_in_their_anchors_bytes(tmp_path):
    c = make(tmp_path)
    host = c.host_pool
    assert host.bytes_total == 4 * 2 * ANCHOR  # room for 4 whole pages
    run(c, TOKENS, keep_window=2)
    # 4 anchor-only pages + 2 whole pages = the room of 4 whole pages: all 6 go at once
    s = c.stats()
    assert (s["host_pages_used"], s["host_backup_waiting_pages"]) == (6, 0)
    assert s["host_bytes_used"] == 4 * ANCHOR + 2 * 2 * ANCHOR
    assert host.window_pages == 2
    c.drain()
    s = c.stats()
    assert (s["storage_backup_pages"], s["host_pages_used"]) == (6, 0)  # stored, then freed
    c.check_integrity()
    c.close()


def test_the_write_reserve_is_the_waiting_backups_bytes(tmp_path):
    c = make(tmp_path)
    run(c, TOKENS, keep_window=6)  # whole pages: 4 go, 2 wait
    s = c.stats()
    assert (s["host_pages_used"], s["host_backup_waiting_pages"]) == (4, 2)
    assert s["host_backup_waiting_bytes"] == 2 * 2 * ANCHOR
    assert s["host_write_reserve_bytes"] == 2 * 2 * ANCHOR  # below half the pool's bytes
    c.drain()
    c.check_integrity()
    c.close()
    c = make(tmp_path)
    m = c.match(TOKENS)
    pf = c.prefetch(m)
    assert pf.pages.numel() == 4  # whole pages until their objects say otherwise
    pf.future.result()
    assert c.finish_prefetch(pf) == 4 * PS
    assert c.host_pool.window_pages == 4  # every stored page had window rows
    c.check_integrity()
    c.close()
