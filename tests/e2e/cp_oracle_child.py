"""What each rank of the multi-process CP oracle runs (``test_cp_oracle``, via
``kvtier.parallel.launch``): module-level functions, so spawned ranks can import them."""

from __future__ import annotations

import os

import torch

from kvtier import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset

PAGE = 16
# The compressed indexer's groups shrunk to one page (8-token index pages, 2 per group) so
# every family shares PAGE; each query still sees only 3 earlier groups besides its own.
FAMILY = {"dsa-compressed": {"index_page_size": 8, "index_kpool": 2}}
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)


def cache_config(storage_dir: str | None, cp: int, rank: int, codec: str = "none") -> CacheConfig:
    """``storage_dir`` is a directory (file L3), a ``mooncake://`` URL or ``None`` (no L2/L3);
    ``codec`` is ``kv_codec`` (it needs the host tier)."""
    mooncake = storage_dir is not None and storage_dir.startswith("mooncake://")
    return CacheConfig(
        page_size=PAGE,
        device_pages=48,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        host_pages=96,
        storage=("mooncake" if mooncake else "file") if storage_dir else None,
        storage_url=storage_dir if mooncake else None,
        storage_dir="unused" if mooncake or not storage_dir else storage_dir,
        enable_host=storage_dir is not None,
        prefetch_policy="wait_complete",
        cp_size=cp,
        cp_rank=rank,
        cp_pattern="zigzag" if cp > 2 else "round_robin",
        debug_checks=True,
        kv_codec=codec,
    )


def make_llm(family: str, storage_dir: str | None, group=None, codec: str = "none") -> LLM:
    cp, rank = (group.size, group.rank) if group is not None else (1, 0)
    cfg = cache_config(storage_dir, cp, rank, codec)
    return LLM(
        preset(family, **FAMILY.get(family, {})),
        cfg,
        max_running=2,
        group=group if cp > 1 else None,
    )


def snapshot(llm: LLM, tokens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The rows this rank holds of every cached page of ``tokens``, by sequence page (loading
    from host first where needed)."""
    cache = llm.cache
    ps = cache.page_size
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    kv = cache.kv_buffers
    pages = ld.locs[::ps] // ps
    owned = kv.owned(ld.locs[::ps])
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i, page in enumerate(pages.tolist()):
        if owned is not None and not bool(owned[i]):
            continue
        phys = int(kv.slots(torch.tensor([page * ps]))[0]) // ps
        rows = {}
        for spec in cache.specs:
            r = spec.rows_per_page(ps)
            buf = cache.device_pool.buffers[spec.name]
            rows[spec.name] = buf[:, phys * r : (phys + 1) * r].cpu().clone()
        out[i] = rows
    cache.unlock(m.handle)
    cache.poll()
    return out


def _gen(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    outs = llm.generate(prompts, GREEDY)
    return [
        {
            "tokens": list(o.output_ids),
            "logits": o.logits.clone(),
            "cached": (o.cached_device, o.cached_host, o.cached_storage),
        }
        for o in outs
    ]


def cold(family: str, prompts: list[list[int]]) -> list[dict]:
    """CP=1 reference: every prompt with nothing cached."""
    llm = make_llm(family, None)
    outs = []
    for p in prompts:
        llm.cache.flush()
        outs += _gen(llm, [p])
    llm.close()
    return outs


def live(
    group,
    family: str,
    storage_dir: str,
    prompts: list[list[int]],
    base: list[int],
    follow: list[list[int]],
    codec: str = "none",
) -> dict:
    """Cold at CP, then a device hit, then a host restore (device flushed); the bytes of the
    shared prefix as first written and after the host restore. Then, device flushed again,
    the follow-up turns (``follow``: each prompt, its answer and a question): each resumes
    from the valid partial tail its first turn cached, restored from host and continued
    through a tail copy on the tail page's owner. ``codec``: the host and storage tiers'
    ``kv_codec``."""
    llm = make_llm(family, storage_dir, group, codec)
    first = _gen(llm, prompts)
    llm.cache.drain()
    rows = snapshot(llm, base)
    device = _gen(llm, prompts)
    llm.cache.drain()
    llm.cache.flush(host=False)
    restored = snapshot(llm, base)
    llm.cache.flush(host=False)
    host = _gen(llm, prompts)
    llm.cache.drain()
    llm.cache.flush(host=False)
    later = _gen(llm, follow)
    llm.cache.drain()
    llm.cache.check_integrity()
    llm.close()
    return {
        "first": first,
        "device": device,
        "host": host,
        "follow": later,
        "rows": rows,
        "restored": restored,
    }


def restore(
    group,
    family: str,
    storage_dir: str,
    prompts: list[list[int]],
    base: list[int],
    follow: list[list[int]],
    codec: str = "none",
):
    """A fresh group (any CP size) on the storage ``live`` filled: the shared prefix from
    storage alone (its bytes), then the follow-up turns (resuming from the partial tails
    ``live`` stored), then the prompts."""
    llm = make_llm(family, storage_dir, group, codec)
    m = llm.cache.match(base)
    pf = llm.cache.prefetch(m)
    llm.cache.drain()
    llm.cache.finish_prefetch(pf)
    rows = snapshot(llm, base)
    later = _gen(llm, follow)
    llm.cache.drain()
    outs = _gen(llm, prompts)
    llm.cache.drain()
    llm.cache.check_integrity()
    llm.close()
    return {"outs": outs, "follow": later, "rows": rows}


def restore_solo(
    family: str,
    storage_dir: str,
    prompts: list[list[int]],
    base: list[int],
    follow: list[list[int]],
    codec: str = "none",
):
    return restore(None, family, storage_dir, prompts, base, follow, codec)


def die_mid_write(group, storage_dir: str, prompts: list[list[int]]) -> str:
    """Rank 1 dies inside its first storage write; rank 0 must fail naming it."""
    llm = make_llm("tiny", storage_dir, group)
    if group.rank == 1:
        backend = llm.cache.storage

        def dying(keys, buffers):
            os._exit(17)

        backend.batch_set = dying  # type: ignore[method-assign]
    llm.generate(prompts, GREEDY)
    llm.cache.drain()
    llm.generate(prompts, GREEDY)
    return "finished"
