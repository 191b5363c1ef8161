"""Every library entry point of ``TieredCache`` and ``LLM`` refuses an argument of the wrong type
or value with a ``KvtierError`` naming the call, the argument and the value: never a raw
``AttributeError``/``TypeError`` from deep inside, never a message about something else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories import SPEC, cache_config, make_cache
from factories import make_llm as _make_llm

from kvtier import TieredCache
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.errors import ConfigError, KvtierError, RequestError

MODEL = ModelConfig(num_layers=2, max_position=512)


@pytest.fixture
def cache(tmp_path):
    c = make_cache(tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="module")
def llm():
    engine = _make_llm(MODEL, page_size=4, device_pages=32, device="cpu", debug_checks=False)
    yield engine
    engine.close()


CACHE_CALLS = [
    ("alloc(-4)", lambda c: c.alloc(-4), r"^alloc: num_tokens must be an integer >= 0, got -4 \(int\)$"),
    ("alloc(2.5)", lambda c: c.alloc(2.5), r"^alloc: num_tokens must be an integer >= 0, got 2.5 \(float\)$"),
    ("alloc('4')", lambda c: c.alloc("4"), r"^alloc: num_tokens must be an integer >= 0, got '4' \(str\)$"),
    ("alloc(True)", lambda c: c.alloc(True), r"^alloc: num_tokens must be .* got True \(bool\)$"),
    ("alloc(at=-4)", lambda c: c.alloc(4, at=-4), r"^alloc: at must be an integer >= 0, got -4 \(int\)$"),
    ("match(5)", lambda c: c.match(5), r"^match: tokens must be a sequence of token ids, got 5 \(int\)$"),
    ("match(None)", lambda c: c.match(None), r"^match: tokens must be a sequence .* got None \(NoneType\)$"),
    ("match('abc')", lambda c: c.match("abc"), r"^match: tokens must be a sequence .* got 'abc' \(str\)$"),
    ("match([1, 2.5])", lambda c: c.match([1, 2.5]), r"^match: token 1 is 2.5 \(float\): token ids are integers$"),
    ("match(2-D)", lambda c: c.match(torch.zeros(2, 2, dtype=torch.long)), r"^match: tokens must be one-dimensional, got 2"),
    ("match(probe_storage=1)", lambda c: c.match([1], probe_storage=1), r"^match: probe_storage must be True or False, got 1 \(int\)$"),
    ("lock('x')", lambda c: c.lock("x"), r"^lock: handle must be the Handle of a match \(m.handle\), got 'x' \(str\)$"),
    ("lock(m)", lambda c: c.lock(c.match([1] * 8)), r"^lock: pass the match's handle \(m.handle\), not the MatchResult$"),
    ("unlock(None)", lambda c: c.unlock(None), r"^unlock: handle must be the Handle of a match .* got None"),
    ("load(None)", lambda c: c.load(None), r"^load: m must be the MatchResult of match\(\), got None"),
    ("load(handle)", lambda c: c.load(c.match([1] * 8).handle), r"^load: pass the MatchResult \(m\), not its handle$"),
    ("load(overlap='yes')", lambda c: c.load(c.match([1]), overlap="yes"), r"^load: overlap must be True or False, got 'yes'"),
    ("record_hits(7)", lambda c: c.record_hits(7), r"^record_hits: handle must be the Handle .* got 7 \(int\)$"),
    ("prefetch('x')", lambda c: c.prefetch("x"), r"^prefetch: m must be the MatchResult of match\(\), got 'x'"),
    ("prefetch_ready('x')", lambda c: c.prefetch_ready("x"), r"^prefetch_ready: op must be prefetch\(\)'s result, got 'x'"),
    ("finish_prefetch(1)", lambda c: c.finish_prefetch(1), r"^finish_prefetch: op must be prefetch\(\)'s result, got 1"),
    ("wait_prefetch('x')", lambda c: c.wait_prefetch("x", 1.0), r"^wait_prefetch: ops must be a list of prefetch\(\) results, got 'x'"),
    ("wait_prefetch(timeout)", lambda c: c.wait_prefetch([], float("nan")), r"^wait_prefetch: timeout must be a finite number >= 0, got nan"),
    ("free([1, 2])", lambda c: c.free([1, 2]), r"^free: locs must be a torch.Tensor of token slots, got \[1, 2\] \(list\)$"),
    ("insert(list)", lambda c: c.insert([1, 2, 3, 4], [0, 1, 2, 3]), r"^insert: locs must be a torch.Tensor .* \(list\)$"),
    ("insert(checkpoints)", lambda c: c.insert([1, 2, 3, 4], torch.arange(4), [True]), r"^insert: checkpoints must be None or a bool tensor"),
    ("finish(locs list)", lambda c: c.finish([1, 2, 3, 4], [0, 1, 2, 3], 0, None), r"^finish: locs must be a torch.Tensor"),
    ("finish(prefix_len='a')", lambda c: c.finish([1, 2, 3, 4], torch.arange(4), "a", None), r"^finish: prefix_len must be an integer >= 0, got 'a' \(str\)$"),
    ("finish(prefix_len=-1)", lambda c: c.finish([1, 2, 3, 4], torch.arange(4), -1, None), r"^finish: prefix_len must be an integer >= 0, got -1 \(int\)$"),
    ("finish(handle='x')", lambda c: c.finish([1, 2, 3, 4], torch.arange(4), 0, "x"), r"^finish: handle must be the Handle of a match"),
    ("release_window([1])", lambda c: c.release_window([1]), r"^release_window: locs must be a torch.Tensor"),
    ("record_prefill(-1)", lambda c: c.record_prefill(-1), r"^record_prefill: recomputed_tokens must be an integer >= 0, got -1"),
    ("flush('no')", lambda c: c.flush("no"), r"^flush: host must be True or False, got 'no' \(str\)$"),
    ("attach_storage('x')", lambda c: c.attach_storage("x"), r"^attach_storage: backend must be StorageBackend, got 'x' \(str\)$"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "needle"), [c[1:] for c in CACHE_CALLS], ids=[c[0] for c in CACHE_CALLS]
)
def test_cache_calls_refuse_bad_arguments_by_name(cache, call, needle) -> None:
    with pytest.raises(KvtierError, match=needle) as e:
        call(cache)
    # a caller's mistake, not a bug in kvtier: RequestError (ConfigError for attaching storage)
    assert isinstance(e.value, RequestError | ConfigError)
    cache.check_integrity()  # refused before anything changed


def test_alloc_refusals_leave_the_pool_as_it_was(cache) -> None:
    free = cache.stats()["device_pages_total"] - cache.stats()["device_pages_used"]
    for bad in (-4, 2.5, "4"):
        with pytest.raises(RequestError):
            cache.alloc(bad)
    assert cache.stats()["device_pages_total"] - cache.stats()["device_pages_used"] == free
    assert cache.alloc(0).numel() == 0  # zero tokens: no page, not an error


def test_integer_scalars_of_numpy_and_torch_are_taken_as_counts(cache) -> None:
    np = pytest.importorskip("numpy")
    assert cache.alloc(np.int64(4)).numel() == 4
    assert cache.alloc(torch.tensor(5), at=np.int32(0)).numel() == 8


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("x", [SPEC]), r"^TieredCache: config must be CacheConfig, got 'x' \(str\)$"),
        ((None, [SPEC]), r"^TieredCache: config must be CacheConfig, got None \(NoneType\)$"),
        ((cache_config(), SPEC), r"^TieredCache: specs must be a list of PoolSpec, got PoolSpec"),
        ((cache_config(), [SPEC, "v"]), r"^TieredCache: specs\[1\] must be PoolSpec, got 'v'"),
    ],
)
def test_the_cache_constructor_names_a_wrong_argument(args, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        TieredCache(*args)


LLM_CALLS = [
    ("generate(params='x')", lambda e: e.generate([[1, 2, 3]], params="x"), r"^generate: params must be SamplingParams, a list of them \(one per prompt\) or None, got 'x' \(str\)$"),
    ("generate(params=['x'])", lambda e: e.generate([[1, 2, 3]], params=["x"]), r"^generate: params\[0\] must be SamplingParams or None, got 'x' \(str\)$"),
    ("generate(params=[p, 3])", lambda e: e.generate([[1], [2]], params=[SamplingParams(), 3]), r"^generate: params\[1\] must be SamplingParams or None, got 3 \(int\)$"),
    ("generate('text')", lambda e: e.generate("hello"), r"^generate: prompts must be a list of prompts, got 'hello' \(str\) \(one prompt: generate\(\[prompt\]\)\)$"),
    ("generate([1, 2, 3])", lambda e: e.generate([1, 2, 3]), r"^generate: prompts must be a list of prompts, got a list whose item 0 is 1 \(int\)"),
    ("generate(5)", lambda e: e.generate(5), r"^generate: prompts must be a list of prompts, got 5 \(int\)"),
    ("generate(2 params, 1 prompt)", lambda e: e.generate([[1]], [SamplingParams()] * 2), r"^1 prompts but 2 SamplingParams$"),
    ("add_request(params=dict)", lambda e: e.add_request([1, 2], {"max_tokens": 3}), r"^add_request: params must be SamplingParams or None, got \{'max_tokens': 3\} \(dict\)$"),
    ("add_request(prompt=7)", lambda e: e.add_request(7), r"prompt must be text or a sequence of token ids, got int"),
    ("abort('x')", lambda e: e.abort("x"), r"^request 'x' is unknown or already finished$"),
    ("output_ids(10**6)", lambda e: e.output_ids(10**6), r"^request 1000000 is unknown or already finished$"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "needle"), [c[1:] for c in LLM_CALLS], ids=[c[0] for c in LLM_CALLS]
)
def test_engine_calls_refuse_bad_arguments_by_name(llm, call, needle) -> None:
    with pytest.raises(RequestError, match=needle):
        call(llm)
    assert not llm.has_unfinished()  # nothing was queued


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"model": 5}, r"^LLM: model must be a model config, a checkpoint directory or a built model, got 5 \(int\)$"),
        ({"model": MODEL, "cache_config": {"page_size": 4}}, r"^LLM: cache_config must be CacheConfig or None, got \{'page_size': 4\} \(dict\)$"),
        ({"model": MODEL, "overlap_loads": "no"}, r"^LLM: overlap_loads must be True or False, got 'no' \(str\)$"),
        ({"model": MODEL, "max_running": 0}, r"^max_running must be a positive integer, got 0$"),
        ({"model": Path("no/such/dir")}, r"no such checkpoint directory"),
    ],
)  # fmt: skip
def test_the_engine_constructor_names_a_wrong_argument(kw, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        LLM(**kw)


@pytest.mark.parametrize("family", ["mla", "dsa-compressed", "hybrid", "swa"])
def test_the_engine_takes_every_familys_config(family) -> None:
    """The type check names a wrong ``model`` but lets every family's config through (they
    are dataclasses of their own, not ``ModelConfig``s)."""
    from kvtier.engine.families import preset

    engine = _make_llm(preset(family), page_size=4, device_pages=32, device="cpu")
    assert engine.model_config == preset(family)
    engine.close()
