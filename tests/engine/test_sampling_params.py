"""The OpenAI sampling parameters in the engine: presence and frequency penalties and logit
biases shape the logits before a token is picked (greedy too), per-token log-probabilities are
the log-softmax of the very logits a token came from, and none of it changes a request that
does not ask for it."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset
from kvtier.engine.sampling import sample, shaped_logits, token_logprob
from kvtier.errors import RequestError

CACHE = CacheConfig(page_size=4, device_pages=64, device="cpu")
PROMPT = [5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(preset("tiny"), CACHE)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"stop": ["x"]}, "stop must be a tuple of non-empty strings"),
        ({"stop": ("",)}, "stop must be a tuple of non-empty strings"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias must be (token id >= 0, bias in [-100, 100])"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias must be (token id >= 0"),
        ({"logprobs": -1}, "logprobs must be None or an integer >= 0"),
        ({"logprobs": True}, "logprobs must be None or an integer >= 0"),
    ],
)
def test_bad_values_name_the_field(kw, message) -> None:
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(message)


def test_penalties_and_biases_as_openai_defines_them() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((0, 10.0),))
    # token 2 twice: - 2 * 0.25 - 0.5; token 3 once: - 0.25 - 0.5; token 0: + 10
    assert shaped_logits(logits, p, [2, 2, 3]).tolist() == [11.0, 2.0, 2.0, 3.25]
    assert shaped_logits(logits, SamplingParams(), [2, 2, 3]).tolist() == [1.0, 2.0, 3.0, 4.0]
    greedy = SamplingParams(frequency_penalty=2.0)
    assert sample(logits, greedy, None, [3]) == 2  # 4 - 2 < 3
    assert sample(logits, SamplingParams(), None, [3]) == 3
    assert (p.argmax_only, greedy.argmax_only, SamplingParams().argmax_only) == (False, False, True)


def test_a_token_logprob_is_the_log_softmax() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.0])
    lp = torch.log_softmax(logits.double(), -1)
    entry = token_logprob(logits, 4, 3)
    assert entry.token == 4 and entry.logprob == float(lp[4])
    assert [t for t, _ in entry.top][0] in (1, 3) and len(entry.top) == 3
    assert [v for _, v in entry.top] == sorted(lp.tolist(), reverse=True)[:3]
    assert token_logprob(logits, 2, 0).top == ()


def test_logprobs_are_those_of_the_logits_each_token_came_from(llm) -> None:
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=10))[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, logprobs=2, return_logits=True))[0]
    assert out.output_ids == plain.output_ids and plain.logprobs is None
    assert [e.token for e in out.logprobs] == out.output_ids
    for row, e in zip(out.logits, out.logprobs, strict=True):
        lp = torch.log_softmax(row.double(), -1)
        assert e.logprob == float(lp[e.token])
        assert e.top == tuple(zip(*(x.tolist() for x in reversed(torch.topk(lp, 2))), strict=True))


def test_greedy_penalties_pick_the_penalised_argmax_every_step(llm) -> None:
    params = SamplingParams(
        max_tokens=16, frequency_penalty=2.0, presence_penalty=0.5, return_logits=True
    )
    out = llm.generate([PROMPT], params)[0]
    for i, row in enumerate(out.logits):
        assert out.output_ids[i] == int(
            torch.argmax(shaped_logits(row, params, out.output_ids[:i]))
        )
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=16))[0]
    # the plain greedy output repeats itself; the penalised one moves on
    assert len(set(plain.output_ids)) < len(set(out.output_ids))


def test_logit_bias_steers_greedy_decoding(llm) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, logit_bias=((65, 100.0),)))[0]
    assert out.output_ids == [65] * 6
    with pytest.raises(RequestError, match="logit_bias token 512 is outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias=((512, 1.0),)))


def test_seeded_sampling_with_penalties_reproduces(llm) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, presence_penalty=1.0)
    a, b = (llm.generate([PROMPT], params)[0].output_ids for _ in range(2))
    assert a == b
    assert (
        a
        != llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.8, seed=4))[
            0
        ].output_ids
    )


def test_stop_strings_need_a_tokenizer(llm) -> None:
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        llm.generate([PROMPT], SamplingParams(stop=("x",)))


def test_requests_asking_for_logprobs_do_not_speculate() -> None:
    """A draft is verified against the raw argmax: a request that asks for log-probabilities
    or shapes its logits decodes one token a step, with the same tokens."""
    with LLM(preset("tiny-mtp"), CACHE, speculative_tokens=2) as spec:
        drafted = spec.generate([PROMPT], SamplingParams(max_tokens=8))[0]
        assert drafted.draft_proposed > 0
        out = spec.generate([PROMPT], SamplingParams(max_tokens=8, logprobs=1))[0]
        assert out.draft_proposed == 0 and out.output_ids == drafted.output_ids
        biased = spec.generate([PROMPT], SamplingParams(max_tokens=4, logit_bias=((7, 50.0),)))[0]
        assert biased.draft_proposed == 0 and biased.output_ids == [7] * 4
