"""The OpenAI parameters users send, through the official client against a live server: ``n``
(streamed and not), ``logprobs``/``top_logprobs`` in both formats, penalties, ``logit_bias``,
``seed`` and ``--seed``, ``--max-model-len``; ``/tokenize``, ``/detokenize``, ``/version``; a
deeply nested body; parameters the server refuses, named."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from server_harness import client, cold, http, start

pytestmark = pytest.mark.slow  # a live server per module

from kvtier.engine import SamplingParams
from kvtier.engine.byte_tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)
P = [7, 3, 9, 12, 44, 101, 5, 6, 200, 13, 17]


def _name(token: int) -> str:
    """How OpenAI names a token in logprobs: its text, or its bytes when they are no text."""
    raw = TOK.token_bytes(token)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@pytest.fixture(scope="module")
def srv():
    server = start()
    yield server
    server.stop()


def test_n_choices_sample_with_consecutive_seeds(srv) -> None:
    r = client(srv).completions.create(
        model="tiny", prompt=P, max_tokens=6, temperature=0.9, n=3, seed=40
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        want = cold(P, SamplingParams(max_tokens=6, temperature=0.9, seed=40 + c.index))
        assert c.model_extra["token_ids"] == want.output_ids and c.text == want.text
    assert r.usage.prompt_tokens == len(P) and r.usage.completion_tokens == 18
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) == 3
    stream = client(srv).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0.9,
        n=2,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    usage = None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            ids[c.index] += c.model_extra["token_ids"]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    whole = client(srv).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0.9,
        n=2,
        seed=7,
    )
    assert ids == {c.index: c.model_extra["token_ids"] for c in whole.choices}
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 10


def test_completion_logprobs(srv) -> None:
    r = client(srv).completions.create(
        model="tiny", prompt=P, max_tokens=5, logprobs=3, temperature=0
    )
    want = cold(P, SamplingParams(max_tokens=5, logprobs=3))
    lp = r.choices[0].logprobs
    # a prefix served from the cache computes the same logits within float32 rounding
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert r.choices[0].model_extra["token_ids"] == want.output_ids
    assert lp.tokens == [_name(t) for t in want.output_ids]
    assert [len(top) for top in lp.top_logprobs] == [3] * 5
    assert all(
        max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs_streamed_and_not(srv) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    kw = dict(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    r = client(srv).chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob == e.logprob for e in content)  # greedy: the best
    assert all(
        bytes(e.bytes) == TOK.token_bytes(t)
        for e, t in zip(content, r.choices[0].model_extra["token_ids"], strict=True)
    )
    streamed = [
        e
        for ch in client(srv).chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    r = http().post(f"{srv.url}/v1/chat/completions", json={**kw, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_penalties_and_logit_bias_reach_the_engine(srv) -> None:
    body = dict(model="tiny", prompt=P, max_tokens=12, temperature=0)
    r = client(srv).completions.create(**body, frequency_penalty=1.5, presence_penalty=0.3)
    want = cold(P, SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.3))
    assert r.choices[0].model_extra["token_ids"] == want.output_ids
    assert want.output_ids != cold(P, SamplingParams(max_tokens=12)).output_ids
    r = client(srv).completions.create(**body, logit_bias={"66": 100})
    assert r.choices[0].model_extra["token_ids"] == [66] * 12 and r.choices[0].text == "B" * 12


def test_server_seed_makes_unseeded_sampling_reproducible() -> None:
    body = {"model": "tiny", "prompt": P, "max_tokens": 8, "temperature": 1.0}
    runs = []
    for _ in range(2):
        server = start(seed=11)
        try:
            runs.append(
                [
                    http()
                    .post(f"{server.url}/v1/completions", json=body)
                    .json()["choices"][0]["token_ids"]
                    for _ in range(2)
                ]
            )
        finally:
            server.stop()
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_max_model_len_refuses_longer_requests() -> None:
    server = start(context_tokens=32)
    try:
        c = client(server)
        assert c.models.list().data[0].model_extra["max_model_len"] == 32
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt=P * 2, max_tokens=16)
        assert e.value.body["code"] == "context_length_exceeded"
        assert "context of 32 tokens" in e.value.body["message"]
        r = c.completions.create(model="tiny", prompt=P, max_tokens=21)
        assert r.usage.total_tokens == 32
    finally:
        server.stop()


def test_tokenize_detokenize_and_version(srv) -> None:
    r = http().post(f"{srv.url}/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert r == {"count": 7, "max_model_len": 512, "tokens": [256, 104, 195, 169, 108, 108, 111]}
    r = http().post(f"{srv.url}/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    assert r.json()["tokens"] == [104, 105]
    msgs = [{"role": "user", "content": "hi"}]
    r = http().post(f"{srv.url}/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == [256, 261, 104, 105, 258, 262]
    r = http().post(f"{srv.url}/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    assert r.json()["tokens"] == [256, 261, 104, 105, 258]
    r = http().post(f"{srv.url}/detokenize", json={"tokens": [104, 195, 169]})
    assert r.json() == {"prompt": "hé"}
    r = http().post(f"{srv.url}/detokenize", json={"tokens": [104, 512]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert http().get(f"{srv.url}/version").json()["version"]


def test_tokenize_needs_the_api_key_but_version_does_not() -> None:
    server = start(api_key="k")
    try:
        assert http().post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
        headers = {"Authorization": "Bearer k"}
        assert (
            http().post(f"{server.url}/tokenize", json={"prompt": "x"}, headers=headers).status_code
            == 200
        )
        assert http().get(f"{server.url}/version").status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_deeply_nested_body_is_a_400(srv, path) -> None:
    deep = '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = http().post(f"{srv.url}{path}", content=deep.encode())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "nested too deeply" in err["message"]
    assert http().get(f"{srv.url}/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
    ],
)
def test_refused_chat_parameters_are_named(srv, extra, param) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = http().post(f"{srv.url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")


def test_accepted_and_ignored_parameters(srv) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
    }
    r = http().post(f"{srv.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["usage"]["completion_tokens"] == 2
