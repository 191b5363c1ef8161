"""Content oracle for every model family: greedy outputs after a device hit, a host restore and
a storage restore in a fresh process are token-identical to a cold run, for prompts cut at
10%, 20%, ..., 90% and 95% of a context that crosses many storage objects; restored rows of
every component equal the originals byte for byte."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from childproc import run_json

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset

FAMILIES = ["tiny", "mla", "dsa", "dsa-compressed", "hybrid", "swa"]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
CONTEXT = 384
CUTS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]


def make_llm(family: str, storage_dir: str | None = None) -> LLM:
    cfg = CacheConfig(
        page_size=16,
        device_pages=96,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        storage="file" if storage_dir else None,
        storage_dir=storage_dir or "unused",
        prefetch_policy="wait_complete",
        debug_checks=True,
    )
    return LLM(preset(family), cfg, max_running=1)


def base_tokens(vocab: int) -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(vocab) for _ in range(CONTEXT)]


def prompts(vocab: int) -> list[list[int]]:
    base = base_tokens(vocab)
    # The "needle" is the cut itself: each prompt ends at a different depth of the shared
    # context followed by its own question tokens, so a hole anywhere before the cut changes
    # the continuation.
    return [base[: int(f * CONTEXT)] + [7, int(f * 100) % vocab] for f in CUTS]


def snapshot(llm: LLM, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Every component's rows for the resumable cached prefix of ``tokens`` (state rows only
    at checkpointed pages)."""
    cache = llm.cache
    ps = cache.page_size
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    pages = ld.locs[::ps] // ps
    flags = torch.cat([n.ckpt for n in m.handle.locked.path]) if cache.stateful else None
    out = {}
    for spec in cache.specs:
        buf = cache.device_pool.buffers[spec.name]
        r = spec.rows_per_page(ps)
        rows = (pages.unsqueeze(1) * r + torch.arange(r)).reshape(-1)
        if not spec.token_indexed:
            rows = pages[flags[: pages.numel()]]
        out[spec.name] = buf[:, rows.to(buf.device)].cpu()
    cache.unlock(m.handle)
    cache.poll()
    return out


def cold(family: str, ps: list[list[int]]) -> list[list[int]]:
    """Outputs with nothing cached: one engine, emptied before every prompt."""
    llm = make_llm(family)
    outs = []
    for p in ps:
        llm.cache.flush()
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == 0
        outs.append(list(out.output_ids))
    llm.close()
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_family_oracle_device_host_storage(tmp_path: Path, family: str) -> None:
    storage = str(tmp_path / "l3")
    llm = make_llm(family, storage)
    vocab = llm.model_config.vocab_size
    ps_ = prompts(vocab)
    expected = cold(family, ps_)
    base = base_tokens(vocab)
    llm.generate([base], GREEDY)
    rows = snapshot(llm, base)
    assert rows[llm.cache.specs[0].name].shape[1] >= CONTEXT - llm.cache.page_size

    device = [llm.generate([p], GREEDY)[0] for p in ps_]
    assert [list(o.output_ids) for o in device] == expected
    assert sum(o.cached_device for o in device) > 0
    page = llm.cache.page_size
    whole = [(len(p) - 2) // page * page for p in ps_]  # the base's whole pages before the cut
    if llm.cache.stateful:
        # Checkpoints sit every other page: some prompts resume from an earlier one instead of
        # missing, recomputing only the pages after it.
        assert any(0 < o.cached_device < w for o, w in zip(device, whole, strict=True))
    else:
        assert [o.cached_device for o in device] == whole

    host = []
    for p in ps_:
        llm.cache.flush(host=False)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_device == 0
        host.append(out)
    assert [list(o.output_ids) for o in host] == expected
    assert sum(o.cached_host for o in host) > 0
    llm.close()

    case = tmp_path / "case.pt"
    torch.save({"prompts": ps_, "base": base, "rows": rows}, case)
    result = run_json("family_oracle_child.py", family, storage, str(case))
    assert result["outputs"] == expected
    assert result["rows_equal"]
    anchor = llm.cache.specs[0].name
    assert result["rows_compared"][anchor] >= 0.9 * CONTEXT - 2 * llm.cache.page_size
    assert sum(result["storage_tokens"]) > 0
