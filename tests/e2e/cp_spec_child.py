"""What each rank of the multi-process CP speculative-decoding test runs
(``test_cp_spec_oracle``, via ``kvtier.parallel.launch``): module-level functions, so the
forked ranks can import them."""

from __future__ import annotations

import os
import random

from kvtier import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset
from kvtier.engine.mtp import DRAFT_HIDDEN, DRAFT_KV

MODEL = preset("tiny-mtp", max_position=512)
GREEDY = SamplingParams(max_tokens=16, return_logits=True)
_rng = random.Random(11)
SHARED = [_rng.randrange(512) for _ in range(45)]
FIRST, SECOND = SHARED + [1, 2, 3], SHARED + [9, 8, 7, 6]


def make_llm(group=None, store: str | None = None, spec: int = 3) -> LLM:  # noqa: ANN001
    cp, rank = (group.size, group.rank) if group is not None else (1, 0)
    cfg = CacheConfig(
        page_size=4,
        device_pages=96 // cp,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        storage="file" if store else None,
        storage_dir=store or "unused",
        prefetch_policy="wait_complete",
        cp_size=cp,
        cp_rank=rank,
        cp_pattern="zigzag" if cp > 2 else "round_robin",
        debug_checks=True,
    )
    return LLM(MODEL, cfg, speculative_tokens=spec, group=group)


def record(out) -> dict:  # noqa: ANN001
    return {
        "tokens": list(out.output_ids),
        "logits": out.logits.clone(),
        "drafts": (out.draft_proposed, out.draft_accepted),
        "cached": (out.cached_device, out.cached_host, out.cached_storage),
    }


def scrub(llm: LLM) -> None:
    """This rank's device draft rows become noise: a restore must bring them back."""
    for name in (DRAFT_KV, DRAFT_HIDDEN):
        llm.cache.device_pool.buffers[name].normal_()


def cold(prompt: list[int], spec: int = 0) -> dict:
    """CP=1 greedy decoding (without speculation: the oracle)."""
    return record(make_llm(spec=spec).generate([prompt], GREEDY)[0])


def live(group, store: str) -> dict:  # noqa: ANN001
    """A cold speculative run of SECOND, a device hit and a host restore of it after FIRST;
    FIRST's pages end in storage at ``store``."""
    out = {"cold": record(make_llm(group).generate([SECOND], GREEDY)[0])}
    llm = make_llm(group)
    llm.generate([FIRST], GREEDY)
    out["device"] = record(llm.generate([SECOND], GREEDY)[0])
    with make_llm(group, store) as llm:
        llm.generate([FIRST], GREEDY)
        llm.cache.flush(host=False)
        scrub(llm)
        out["host"] = record(llm.generate([SECOND], GREEDY)[0])
    return out


def restore(group, store: str) -> dict:  # noqa: ANN001
    """Fresh ranks: SECOND from storage alone."""
    with make_llm(group, store) as llm:
        scrub(llm)
        return record(llm.generate([SECOND], GREEDY)[0])
