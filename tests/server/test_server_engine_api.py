"""The engine's step-wise API the server drives: tokens as steps produce them, ``abort`` of a
running or a waiting request (its lock, pages and prefetch given back), request counts."""

from __future__ import annotations

import pytest

# The server extra (pip install -e ".[server]") and the official client the tests drive it with.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from server_harness import cache_config

pytestmark = pytest.mark.slow  # a live server per test

from kvtier.engine import SamplingParams
from kvtier.errors import RequestError
from kvtier.server.engine_loop import engine_state
from kvtier.server.lifecycle import build_llm

P = list(range(40, 63))  # 23 tokens: 5 whole pages and a tail of 3
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_output_ids_grow_step_by_step_to_the_finished_output() -> None:
    llm = build_llm("tiny", cache_config())
    rid = llm.add_request(P, GREEDY)
    assert llm.output_ids(rid) == [] and llm.counts() == {"waiting": 1, "running": 0}
    seen: list[list[int]] = []
    done = []
    while not done:
        done = llm.step()
        if not done:
            seen.append(llm.output_ids(rid))
            assert llm.counts() == {"waiting": 0, "running": 1}
    assert [len(s) for s in seen] == [1, 2, 3, 4, 5]
    assert seen[-1] == done[0].output_ids[:5]
    assert (
        done[0].output_ids == build_llm("tiny", cache_config()).generate([P], GREEDY)[0].output_ids
    )
    with pytest.raises(RequestError, match="unknown or already finished"):
        llm.output_ids(rid)
    with pytest.raises(RequestError, match="unknown or already finished"):
        llm.abort(rid)
    llm.close()


def test_abort_of_a_running_request_gives_back_its_pages_and_caches_its_kv() -> None:
    llm = build_llm("tiny", cache_config())
    rid = llm.add_request(P, SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):
        assert llm.step() == []
    out = llm.abort(rid)
    assert out.finish_reason == "abort" and len(out.output_ids) == 3
    s = engine_state(llm)
    assert (s["running"], s["waiting"], s["locked_nodes"], s["device_pages_engine"]) == (0, 0, 0, 0)
    again = llm.generate([P], GREEDY)[0]
    assert again.cached_device == (len(P) - 1) // 4 * 4  # its whole pages, from the abort
    assert again.output_ids[:3] == out.output_ids
    assert engine_state(llm)["locked_nodes"] == 0
    llm.close()


def test_abort_of_a_waiting_request_releases_its_prefetch(tmp_path) -> None:
    cfg = cache_config(
        storage="file", storage_dir=str(tmp_path / "l3"), prefetch_policy="wait_complete"
    )
    first = build_llm("tiny", cfg)
    want = first.generate([P], GREEDY)[0]
    first.close()
    llm = build_llm("tiny", cfg)
    rid = llm.add_request(P, GREEDY)  # storage holds its prefix: a fetch starts now
    assert llm.counts()["waiting"] == 1
    assert llm.abort(rid).finish_reason == "abort"
    llm.cache.drain()
    llm.cache.poll()
    s = engine_state(llm)
    assert (s["waiting"], s["locked_nodes"], s["device_pages_engine"]) == (0, 0, 0)
    out = llm.generate([P], GREEDY)[0]
    assert out.output_ids == want.output_ids
    assert out.cached_host + out.cached_storage > 0  # what the aborted fetch brought is kept
    llm.close()
