"""``kvtier serve``'s OpenAI-style API against a real server: outputs token by token against
the engine's cold run, usage with cached tokens by tier, streaming, and every refusal in
OpenAI's error shape naming the field."""

from __future__ import annotations

import json
import random

import openai
import pytest

# The server extra (pip install -e ".[server]") and the official client the tests drive it with.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from server_harness import cache_config, client, cold, http, idle, metric, start

pytestmark = pytest.mark.slow  # a live server per test

from kvtier.engine import SamplingParams
from kvtier.engine.families import build_model, preset
from kvtier.server.lifecycle import build_llm


@pytest.fixture(scope="module")
def srv():
    server = start()
    yield server
    server.stop()


def prompt(seed: int, n: int = 23) -> list[int]:
    """A prompt of its own: its first token differs from every other test's."""
    rng = random.Random(seed)
    return [seed, *(rng.randrange(512) for _ in range(n - 1))]


def test_greedy_completion_matches_cold_run(srv) -> None:
    p = prompt(1)
    want = cold(p, SamplingParams(max_tokens=12, temperature=0.0))
    r = client(srv).completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == want.output_ids
    # the preset's byte tokenizer decodes every id
    assert choice.finish_reason == "length" and choice.text == want.text and want.text
    assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(p) + 12

    stream = client(srv).completions.create(
        model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True
    )
    streamed, reasons = [], []
    for ch in stream:
        streamed += ch.choices[0].model_extra["token_ids"]
        reasons.append(ch.choices[0].finish_reason)
    assert streamed == want.output_ids
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_sampled_completion_reproduces_the_engine_seed(srv) -> None:
    p = prompt(2)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, top_k=50, seed=1234)
    want = cold(p, params)
    body = dict(model="tiny", prompt=p, max_tokens=10, temperature=0.9, top_p=0.8, seed=1234)
    r = client(srv).completions.create(**body, extra_body={"top_k": 50})
    assert r.choices[0].model_extra["token_ids"] == want.output_ids
    other = client(srv).completions.create(**{**body, "seed": 99}, extra_body={"top_k": 50})
    assert other.choices[0].model_extra["token_ids"] != want.output_ids


def test_repeated_prompt_reports_cached_tokens_by_tier() -> None:
    """The same figures the engine's ``RequestOutput`` gives for the same history."""
    cfg = cache_config(device_pages=8, host_pages=64)  # 32 device tokens: the first prompt
    a, b = prompt(3, 26), prompt(4, 26)  # ... is pushed to the host tier by the second
    llm = build_llm("tiny", cfg)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    want = [llm.generate([x], greedy)[0] for x in (a, a, b, a)]
    llm.close()
    assert want[1].cached_device > 0 and want[3].cached_host > 0  # both tiers are exercised
    server = start(cache=cfg)
    try:
        c = client(server)
        for x, w in zip((a, a, b, a), want, strict=True):
            r = c.completions.create(model="tiny", prompt=x, max_tokens=4, temperature=0)
            assert r.choices[0].model_extra["token_ids"] == w.output_ids
            details = r.usage.prompt_tokens_details
            assert details.cached_tokens == w.cached_tokens
            assert details.model_extra["cached_tokens_by_tier"] == {
                "device": w.cached_device,
                "host": w.cached_host,
                "storage": w.cached_storage,
            }
            assert details.model_extra["recomputed_tokens"] == w.recomputed
        assert metric(server, 'kvtier_cached_tokens_total{cache_source="device"}') == sum(
            w.cached_device for w in want
        )
        assert metric(server, 'kvtier_cached_tokens_total{cache_source="host"}') == sum(
            w.cached_host for w in want
        )
        assert metric(server, "kvtier_recomputed_tokens_total") == sum(w.recomputed for w in want)
        assert metric(server, 'kvtier_requests_total{finish_reason="length"}') == 4
        assert idle(server)["locked_nodes"] == 0
    finally:
        server.stop()


def test_stream_with_usage_ends_with_usage_then_done(srv) -> None:
    p = prompt(5)
    body = {
        "model": "tiny",
        "prompt": p,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http().stream("POST", f"{srv.url}/v1/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    ids = [t for ch in chunks[:-1] for t in ch["choices"][0]["token_ids"]]
    assert ids == cold(p, SamplingParams(max_tokens=5)).output_ids


def test_models_and_health(srv) -> None:
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # the tree page, which KV events call block_size: a router hashes prompts with it
    card = http().get(f"{srv.url}/v1/models").json()["data"][0]
    assert card["page_size"] == srv.loop.llm.cache.tree_page_tokens == 4
    # the device pool's size: a router tells from it whether a request fits beside others
    assert card["device_tokens"] == 128 * 4
    h = http().get(f"{srv.url}/health").json()
    assert h["status"] == "ok" and h["storage"] is None


def test_metrics_expose_the_server_families(srv) -> None:
    client(srv).completions.create(model="tiny", prompt=prompt(6), max_tokens=3)
    text = http().get(f"{srv.url}/metrics").text
    for name in (
        'kvtier_cached_tokens_total{cache_source="storage"}',
        "kvtier_recomputed_tokens_total",
        'kvtier_pool_pages{state="total",tier="device"} 128.0',
        'kvtier_transfer_bytes_total{direction="device_to_host"}',
        'kvtier_transfer_seconds_total{direction="host_to_device"}',
        "kvtier_queue_depth 0.0",
        "kvtier_running_requests",
        "kvtier_time_to_first_token_seconds_count",
        "kvtier_inter_token_latency_seconds_count",
        "kvtier_cache_device_pages_total 128.0",
    ):
        assert name in text, name


PROMPT = [1, 2, 3, 4, 5]
BAD = [
    ({"model": "nope", "prompt": PROMPT}, 404, "model", "model_not_found"),
    ({"prompt": PROMPT}, 400, "model", "missing_required_parameter"),
    ({"model": "tiny"}, 400, "prompt", "missing_required_parameter"),
    ({"model": "tiny", "prompt": []}, 400, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": [1, "a"]}, 400, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": [[1, 2], [3]]}, 400, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": [1, 9999]}, 400, "prompt", "invalid_value"),
    ({"model": "tiny", "prompt": "x" * 600}, 400, "prompt", "context_length_exceeded"),
    ({"model": "tiny", "prompt": [1] * 600}, 400, "prompt", "context_length_exceeded"),
    ({"model": "tiny", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "top_k": -2}, 400, "top_k", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "seed": "x"}, 400, "seed", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "n": 0}, 400, "n", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "n": 17}, 400, "n", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "stream": "yes"}, 400, "stream", "invalid_value"),
    (
        {"model": "tiny", "prompt": PROMPT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    ({"model": "tiny", "prompt": PROMPT, "stop": [1]}, 400, "stop", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "logprobs": True}, 400, "logprobs", "invalid_value"),
    ({"model": "tiny", "prompt": PROMPT, "echo": True}, 400, "echo", "unsupported_parameter"),
    ({"model": "tiny", "prompt": PROMPT, "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    (
        {"model": "tiny", "prompt": PROMPT, "best_of": 2},
        400,
        "best_of",
        "unsupported_parameter",
    ),
    (
        {"model": "tiny", "prompt": PROMPT, "presence_penalty": 2.5},
        400,
        "presence_penalty",
        "invalid_value",
    ),
    (
        {"model": "tiny", "prompt": PROMPT, "logit_bias": {"9999": 1}},
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        {"model": "tiny", "prompt": PROMPT, "logit_bias": {"a": 1}},
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        {"model": "tiny", "prompt": PROMPT, "stop_token_ids": [1.5]},
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    (
        {"model": "tiny", "prompt": "hi", "add_special_tokens": "no"},
        400,
        "add_special_tokens",
        "invalid_value",
    ),
]


def test_a_text_prompt_takes_a_bos_unless_told_not_to(srv) -> None:
    c = client(srv)
    text = "text prompts"
    ids = list(text.encode())
    want = cold(ids, SamplingParams(max_tokens=3, temperature=0.0)).output_ids
    plain = c.completions.create(
        model="tiny",
        prompt=text,
        max_tokens=3,
        temperature=0,
        extra_body={"add_special_tokens": False},
    )
    assert plain.usage.prompt_tokens == len(ids)
    assert plain.choices[0].model_extra["token_ids"] == want
    with_bos = c.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    assert with_bos.usage.prompt_tokens == len(ids) + 1


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD)
def test_bad_completion_requests_name_the_field(srv, body, status, param, code) -> None:
    r = http().post(f"{srv.url}/v1/completions", json=body, timeout=20)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error" and err["message"]
    if param not in ("model", "prompt"):
        assert param in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_refused_before_streaming(srv, stream) -> None:
    """A prompt the engine refuses is a 400, streaming or not (no 200 with an error inside)."""
    body = {"model": "tiny", "prompt": [1] * 600, "stream": stream}
    r = http().post(f"{srv.url}/v1/completions", json=body, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff", "not valid JSON")],
)
def test_malformed_bodies_are_400_in_openai_shape(srv, raw, message) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = http().post(f"{srv.url}{path}", content=raw, timeout=20)
        assert r.status_code == 400
        err = r.json()["error"]
        assert message in err["message"] and err["code"] == "invalid_json"


def test_chat_needs_valid_messages(srv) -> None:
    url = f"{srv.url}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    r = http().post(url, json={"model": "tiny", "messages": [{"role": "bot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
    r = http().post(url, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http().post(url, json={"model": "other", "messages": msgs})
    assert r.status_code == 404


def test_unknown_routes_and_methods_answer_in_openai_shape(srv) -> None:
    r = http().get(f"{srv.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = http().get(f"{srv.url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_the_status_errors(srv) -> None:
    c = client(srv)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-x", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=PROMPT, temperature=-0.5)
    assert e.value.body["param"] == "temperature"


def test_the_engine_model_of_the_preset_is_the_cold_one() -> None:
    """The cold runs above build the preset the server builds: same seeded weights."""
    a, b = build_model(preset("tiny")), build_model(preset("tiny"))
    assert all((pa == pb).all() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_routers_built_on_sglangs_api_learn_the_served_model(srv) -> None:
    info = http().get(f"{srv.url}/server_info").json()
    assert (info["served_model_name"], info["model_path"]) == ("tiny", "tiny")
    assert info["context_length"] == client(srv).models.list().data[0].model_extra["max_model_len"]
    model = http().get(f"{srv.url}/model_info").json()
    assert (model["model_path"], model["is_generation"]) == ("tiny", True)


def test_the_model_card_names_the_byte_tokenizer_for_routers_to_encode_with(srv) -> None:
    card = client(srv).models.list().data[0].model_extra
    assert (card["tokenizer"], card["vocab_size"]) == ("bytes", preset("tiny").vocab_size)
