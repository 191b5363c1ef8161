"""Padded valid tails through the engine: a follow-up request restored from the device, host or
storage tier with its tail cached gives the cold run's tokens and logits, and recomputes the
tail's tokens fewer."""

from __future__ import annotations

import pytest
from factories import make_llm


def _llm(storage_dir: str | None, **kw):
    from kvtier.engine import ModelConfig

    model = ModelConfig(num_layers=3, max_position=1024, seed=7)
    return make_llm(model, storage_dir, max_running=1, **kw)


@pytest.mark.parametrize("where", ["device", "host", "storage"])
def test_engine_outputs_equal_cold_and_recompute_less(tmp_path, where):
    import random

    from kvtier.demo.oracle import Expected, compare, default_tolerance
    from kvtier.engine import SamplingParams

    greedy = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
    rng = random.Random(3)
    lengths = (17, 30, 37, 47)  # tails of 6, 3, 10 and 4 tokens after the first request
    prompts = [[rng.randrange(200) for _ in range(n)] for n in lengths]
    recomputed = {}
    for tails in (True, False):
        store = str(tmp_path / f"l3-{tails}")
        llm = _llm(store, cache_partial_pages=tails)
        tol = default_tolerance(llm.model_config.dtype)
        got, cold, saved = [], [], []
        for prompt in prompts:
            first = llm.generate([prompt], greedy)[0]
            # The follow-up continues the first request's whole sequence: its cached prefix
            # is the first request's computed tokens, n + 5 (the last output was not computed).
            follow = prompt + list(first.output_ids) + [7, 9]
            if where == "host":
                llm.cache.flush(host=False)
            elif where == "storage":
                llm.cache.drain()
                llm.close()
                llm = _llm(store, cache_partial_pages=tails)
            out = llm.generate([follow], greedy)[0]
            got.append(out)
            saved.append(out.cached_tokens)
            ref = _llm(None)
            c = ref.generate([follow], greedy)[0]
            cold.append(Expected(list(c.output_ids), c.logits))
            ref.close()
        for o, want in zip(got, cold, strict=True):
            ok, diff = compare(o.output_ids, o.logits, want)
            assert ok and diff <= tol
        recomputed[tails] = [o.recomputed for o in got]
        if tails:
            assert saved == [n + 5 for n in lengths]
        llm.cache.check_integrity()
        llm.close()
    # Each follow-up recomputes its tail fewer tokens: (n + 5) % 16.
    drop = [a - b for a, b in zip(recomputed[False], recomputed[True], strict=True)]
    assert drop == [(n + 5) % 16 for n in lengths]
