"""Content oracle for every model family: greedy outputs after a device hit, a host restore and
a storage restore in a fresh process are token-identical to a cold run and their logits equal
the cold run's within the float32 tolerance (``kvtier.demo.oracle``), for prompts cut at 10%, 20%,
..., 90% and 95% of a context that crosses many storage objects; rows of every component
restored from the host and from storage equal the originals byte for byte."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from childproc import run_json

from kvtier.config import CacheConfig
from kvtier.demo.oracle import Expected, compare, default_tolerance
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset

FAMILIES = ["tiny", "mla", "dsa", "dsa-compressed", "hybrid", "swa", "swa+eager"]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
CONTEXT = 384
CUTS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]


def make_llm(family: str, storage_dir: str | None = None, host_layout: str = "page_first") -> LLM:
    """``family`` names a preset; ``swa+eager`` is the window family with both arenas (device
    and a relocatable host pool) compacting before every allocation."""
    name, _, compaction = family.partition("+")
    cfg = CacheConfig(
        page_size=16,
        device_pages=96,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        storage="file" if storage_dir else None,
        storage_dir=storage_dir or "unused",
        prefetch_policy="wait_complete",
        debug_checks=True,
        host_layout=host_layout,
        compaction=compaction or "auto",
        host_compaction=compaction or "off",
    )
    return LLM(preset(name), cfg, max_running=1)


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
    if cache.window:
        out = arena_rows(cache, pages)
    for spec in () if cache.window else cache.specs:
        buf = cache.device_pool.buffers[spec.name]
        r = spec.rows_per_page(ps)
        rows = (pages.unsqueeze(1) * r + torch.arange(r)).reshape(-1)
        if not spec.token_indexed:
            rows = pages[flags[: pages.numel()]]
        out[spec.name] = buf[:, rows.to(buf.device)].cpu()
    cache.unlock(m.handle)
    cache.poll()
    return out


def arena_rows(cache, pages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every component's rows of device ``pages`` in a window pool's arena, through the
    engine's view (window rows of the pages that have them)."""
    kv, ps = cache.kv_buffers, cache.page_size
    out = {}
    for spec in cache.specs:
        have = pages
        if spec.kind == "window":
            present = cache.device_pool.has_window(pages)
            have = pages[present]
            out[f"{spec.name}.present"] = present
        locs = (have.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
        slots = kv.slots(locs, spec.name).to(kv.device)
        rows = torch.stack([kv.layer(i, spec.name)[slots] for i in range(spec.num_layers)])
        if spec.kind == "window":  # every page's rows, zeros where the page has none
            full = rows.new_zeros((rows.shape[0], pages.numel() * ps, *rows.shape[2:]))
            full[:, (present.nonzero().reshape(-1, 1) * ps + torch.arange(ps)).reshape(-1)] = rows
            rows = full
        out[spec.name] = rows.cpu()
    return out


def cold(family: str, ps: list[list[int]]) -> list[Expected]:
    """Outputs with nothing cached: one engine, emptied before every prompt."""
    llm = make_llm(family)
    outs = []
    for p in ps:
        llm.cache.flush()
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_tokens == 0
        outs.append(Expected(list(out.output_ids), out.logits))
    llm.close()
    return outs


def host_restores(llm: LLM, ps: list[list[int]]) -> list:
    """Each prompt's output with the device tier emptied before it: restored from the host."""
    outs = []
    for p in ps:
        llm.cache.flush(host=False)
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_device == 0
        outs.append(out)
    return outs


def max_logit_diff(outs, expected: list[Expected]) -> float:
    """The largest |logit difference| of ``outs`` to their cold runs; tokens must be equal."""
    checks = [compare(o.output_ids, o.logits, e) for o, e in zip(outs, expected, strict=True)]
    assert [same for same, _ in checks] == [True] * len(expected)
    return max(diff for _, diff in checks)


def rows_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> tuple[bool, dict[str, int]]:
    """Whether every component's rows equal byte for byte over the rows both have, and how
    many rows of each were compared."""
    same = got.keys() == want.keys()
    compared = {}
    for k in got:
        if k.endswith(".present"):
            continue
        n = min(got[k].shape[1], want[k].shape[1])
        a, b = got[k][:, :n], want[k][:, :n]
        if f"{k}.present" in got:  # a window pool's rows: pages holding them on both sides
            both = got[f"{k}.present"], want[f"{k}.present"]
            m = min(both[0].numel(), both[1].numel())
            rows = (both[0][:m] & both[1][:m]).repeat_interleave(n // max(m, 1))
            a, b = a[:, rows], b[:, rows]
        compared[k] = a.shape[1]
        same = same and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return same, compared


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

    tol = default_tolerance(llm.model_config.dtype)
    assert tol == 1e-4  # every preset is float32
    if llm.cache.window:
        # A window pool keeps a finished request's window rows only near its end, so a
        # prompt cut inside the base finds none: every prompt runs once, then hits itself.
        warm = [llm.generate([p], GREEDY)[0] for p in ps_]
        assert max_logit_diff(warm, expected) <= tol
    device = [llm.generate([p], GREEDY)[0] for p in ps_]
    assert max_logit_diff(device, expected) <= tol
    assert sum(o.cached_device for o in device) > 0
    page = llm.cache.page_size
    whole = [(len(p) - 2) // page * page for p in ps_]  # the base's whole pages before the cut
    if llm.cache.window:
        # each hits its own last whole page: the cut plus its question tokens
        assert [o.cached_device for o in device] == [(len(p) - 1) // page * page for p in ps_]
    elif llm.cache.stateful:
        # Checkpoints sit every other page: some prompts resume from an earlier one instead of
        # missing, recomputing only the pages after it.
        assert any(0 < o.cached_device < w for o, w in zip(device, whole, strict=True))
    else:
        assert [o.cached_device for o in device] == whole

    host = host_restores(llm, ps_)
    assert max_logit_diff(host, expected) <= tol
    assert sum(o.cached_host for o in host) > 0
    llm.cache.flush(host=False)
    same, compared = rows_equal(snapshot(llm, base), rows)  # restored from the host tier
    assert same
    assert compared[llm.cache.specs[0].name] == rows[llm.cache.specs[0].name].shape[1]
    relocated = _relocated(llm)
    llm.close()

    case = tmp_path / "case.pt"
    torch.save(
        {
            "prompts": ps_,
            "base": base,
            "rows": rows,
            "cold_tokens": [e.tokens for e in expected],
            "cold_logits": [e.logits for e in expected],
        },
        case,
    )
    result = run_json("e2e/family_oracle_child.py", family, storage, str(case))
    assert result["outputs"] == [e.tokens for e in expected]
    assert result["max_logit_diff"] <= tol
    assert result["rows_equal"]
    anchor = llm.cache.specs[0].name
    assert result["rows_compared"][anchor] >= 0.9 * CONTEXT - 2 * llm.cache.page_size
    assert sum(result["storage_tokens"]) > 0
    if "+" in family:  # the device arena moved pages while the tiers above were checked
        assert relocated[0] > 0, relocated


def _relocated(llm: LLM) -> tuple[int, int]:
    """Pages the device and the host arena relocated (0 where a pool is not an arena)."""
    st = llm.cache.stats()
    return st.get("device_pages_relocated", 0), st.get("host_pages_relocated", 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_host_restore_through_a_layer_first_host(family: str) -> None:
    """A layer-first host pool (on CUDA: staged copies laid out layer-major) restores every
    family's rows byte for byte and the outputs of a cold run."""
    llm = make_llm(family, host_layout="layer_first")
    vocab = llm.model_config.vocab_size
    ps_ = prompts(vocab)[3::3]  # cuts at 40%, 70% and 95%
    expected = cold(family, ps_)
    base = base_tokens(vocab)
    llm.generate([base], GREEDY)
    rows = snapshot(llm, base)
    if llm.cache.window:  # a finished request keeps window rows near its end only (above)
        llm.generate(ps_, GREEDY)
    host = host_restores(llm, ps_)
    assert max_logit_diff(host, expected) <= default_tolerance(llm.model_config.dtype)
    assert sum(o.cached_host for o in host) > 0
    llm.cache.flush(host=False)
    same, compared = rows_equal(snapshot(llm, base), rows)
    assert same and compared[llm.cache.specs[0].name] == rows[llm.cache.specs[0].name].shape[1]
    llm.cache.check_integrity()
    llm.close()
