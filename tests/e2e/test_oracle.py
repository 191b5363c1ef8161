"""The content oracle: for prompts cut at depths sweeping page boundaries, greedy outputs after a
device hit, a host restore and a storage restore in a fresh process equal a cold run token for
token, the logits of every generated step equal the cold run's within the float32 tolerance
(``kvtier.demo.oracle``), and restored KV bytes equal the originals byte for byte."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from childproc import run_json

from kvtier.config import CacheConfig
from kvtier.demo.oracle import Expected, compare, default_tolerance
from kvtier.engine import LLM, ModelConfig, SamplingParams

MODEL = ModelConfig(num_layers=3, max_position=1024, seed=7)
PS = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
TOL = default_tolerance(MODEL.dtype)
BASE_LEN = 6 * PS
DEPTHS = [1, PS - 1, PS, PS + 1, 2 * PS - 1, 2 * PS, 2 * PS + 1, 3 * PS + 7, 5 * PS, BASE_LEN]


def make_llm(
    storage_dir: str | None = None, page_size: int = PS, device_pages: int = 64, **kw
) -> LLM:
    cfg = CacheConfig(
        page_size=page_size,
        device_pages=device_pages,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        storage="file" if storage_dir else None,
        storage_dir=storage_dir or "unused",
        prefetch_policy="wait_complete",
        debug_checks=True,
        **kw,
    )
    return LLM(MODEL, cfg, max_running=1)


def base_tokens() -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(MODEL.vocab_size) for _ in range(BASE_LEN)]


def prompts() -> list[list[int]]:
    base = base_tokens()
    # Each prompt is a cut of the shared base plus a distinct two-token tail, so every cut
    # depth is a fresh request whose cached prefix ends exactly at (or just before) the cut.
    return [base[:d] + [d % 251, 3] for d in DEPTHS]


def prefix_kv(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """KV rows of the cached whole pages of ``tokens`` (loading them to the device if needed)."""
    cache = llm.cache
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    kv = cache.device_pool.anchor[:, ld.locs].cpu()
    cache.unlock(m.handle)
    cache.poll()
    return kv


def cold_outputs() -> list[Expected]:
    outs = []
    for p in prompts():
        llm = make_llm()
        out = llm.generate([p], GREEDY)[0]
        outs.append(Expected(list(out.output_ids), out.logits))
        llm.close()
    return outs


def logit_diffs(outs, cold: list[Expected]) -> list[float]:
    """Each output's max |logit difference| to its cold run (tokens must be equal too)."""
    checks = [compare(o.output_ids, o.logits, want) for o, want in zip(outs, cold, strict=True)]
    assert [same for same, _ in checks] == [True] * len(cold)
    return [diff for _, diff in checks]


def restored_prefix(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """KV bytes of the whole pages of ``prompt[:-1]``: what a request for ``prompt`` restores."""
    return prefix_kv(llm, prompt[:-1]).view(torch.uint8)


def test_content_oracle_device_host_storage(tmp_path: Path) -> None:
    cold = cold_outputs()
    storage = str(tmp_path / "l3")
    llm = make_llm(storage)
    base = base_tokens()
    llm.generate([base], GREEDY)
    kv = prefix_kv(llm, base)
    assert kv.shape[1] == BASE_LEN  # the generated tokens completed the last page

    device, written = [], []
    for p in prompts():
        device.append(llm.generate([p], GREEDY)[0])
        written.append(restored_prefix(llm, p))  # the pages this prompt's later restores read
    assert max(logit_diffs(device, cold)) <= TOL
    assert [o.cached_device for o in device] == [d // PS * PS for d in DEPTHS]

    host_outputs = []
    for p, pages in zip(prompts(), written, strict=True):
        llm.cache.flush(host=False)  # device empty, host keeps everything
        out = llm.generate([p], GREEDY)[0]
        assert out.cached_device == 0
        assert out.cached_host == (len(p) - 1) // PS * PS  # every whole page of p[:-1]
        assert torch.equal(restored_prefix(llm, p), pages)
        host_outputs.append(out)
    assert max(logit_diffs(host_outputs, cold)) <= TOL
    llm.cache.flush(host=False)
    assert torch.equal(prefix_kv(llm, base).view(torch.uint8), kv.view(torch.uint8))
    llm.close()

    case = tmp_path / "case.pt"
    torch.save(
        {
            "prompts": prompts(),
            "base": base,
            "kv": kv,
            "cold_tokens": [c.tokens for c in cold],
            "cold_logits": [c.logits for c in cold],
            "written": written,
        },
        case,
    )
    result = run_json("e2e/oracle_child.py", storage, str(case))
    assert result["outputs"] == [c.tokens for c in cold]
    assert max(result["logit_diffs"]) <= TOL
    assert result["pages_equal"] == [True] * len(DEPTHS)
    assert result["kv_equal"]
    # Every whole page of every prompt comes back (from storage, or from the device once an
    # earlier prompt restored it), and together the prompts fetched every base page.
    assert result["cached"] == [(len(p) - 1) // PS * PS for p in prompts()]
    assert sum(result["storage_tokens"]) >= BASE_LEN


def test_a_storage_restore_through_a_pack_equals_a_cold_run(tmp_path: Path) -> None:
    # Page size 4: the 32 whole pages of the prompt are one round of small objects, one pack.
    def llm_with(storage: str | None) -> LLM:
        return make_llm(storage, page_size=4, device_pages=256)

    rng = random.Random(3)
    prompt = [rng.randrange(MODEL.vocab_size) for _ in range(130)]
    cold_llm = llm_with(None)
    cold = cold_llm.generate([prompt], GREEDY)[0]
    cold_llm.close()
    storage = str(tmp_path / "l3")
    writer = llm_with(storage)
    writer.generate([prompt], GREEDY)
    writer.close()
    assert len(list(Path(storage).glob("*/.packs/*.pack"))) == 1
    reader = llm_with(storage)  # a fresh index, scanned from the directory
    out = reader.generate([prompt], GREEDY)[0]
    reader.close()
    assert (out.cached_device, out.cached_host, out.cached_storage) == (0, 0, 128)
    same, diff = compare(out.output_ids, out.logits, Expected(list(cold.output_ids), cold.logits))
    assert same and diff <= TOL
