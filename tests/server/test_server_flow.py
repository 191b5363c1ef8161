"""``kvtier serve`` under load and faults: API keys, overload (429), clients that go away
(their requests aborted, no page left locked), a storage outage (degraded but serving), a
restart on the same L3 directory, and chat through a checkpoint's tokenizer and template."""

from __future__ import annotations

import json
import os
import re
import threading

import openai
import pytest

# The server extra (pip install -e ".[server]") and the official client the tests drive it with.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from server_harness import (
    cache_config,
    client,
    cold,
    engine_held,
    http,
    idle,
    metric,
    start,
    wait_until,
)

pytestmark = pytest.mark.slow  # a live server per test

from kvtier.engine import SamplingParams
from kvtier.engine.families import build_model, preset
from kvtier.engine.weights import save_hf_checkpoint
from kvtier.server.lifecycle import build_llm

P = [7, 3, 9, 12, 44, 101, 5, 6, 200, 13, 17]


def test_api_key_guards_v1_but_not_health_or_metrics() -> None:
    server = start(api_key="s3cret")
    try:
        body = {"model": "tiny", "prompt": P, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = http().post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert http().get(f"{server.url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()
        r = client(server, api_key="s3cret").completions.create(
            model="tiny", prompt=P, max_tokens=2
        )
        assert r.usage.completion_tokens == 2
        assert http().get(f"{server.url}/health").status_code == 200
        assert http().get(f"{server.url}/metrics").status_code == 200
    finally:
        server.stop()


def test_overload_is_429_and_the_queued_request_is_still_served() -> None:
    server = start(max_queue=1)
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": P, "max_tokens": 3, "temperature": 0}
    results: dict[str, object] = {}
    try:
        with engine_held(server):
            first = threading.Thread(target=lambda: results.update(a=http().post(url, json=body)))
            first.start()
            # the held engine took nothing: the first request is the queue's one place
            wait_until(lambda: server.loop.queue_depth()["queued"] == 1, "the first request")
            r = http().post(url, json=body)
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            with pytest.raises(openai.RateLimitError):
                client(server).completions.create(model="tiny", prompt=P, max_tokens=1)
        first.join()
        a = results["a"]
        assert a.status_code == 200  # type: ignore[attr-defined]
        want = cold(P, SamplingParams(max_tokens=3))
        assert a.json()["choices"][0]["token_ids"] == want.output_ids  # type: ignore[attr-defined]
        assert metric(server, 'kvtier_rejected_requests_total{reason="overload"}') == 2
        r = http().post(url, json=body)  # the queue has room again
        assert r.status_code == 200
    finally:
        server.stop()


def test_clients_dropping_mid_stream_leave_no_locked_pages() -> None:
    """Two running streams and one still waiting (max_running=2) drop after their first
    chunks: each request is aborted, its lock and pages given back."""
    server = start(max_running=2)
    base = idle(server)
    c = client(server)
    prompts = [[i, *P] for i in (1, 2, 3)]
    streams = [
        c.completions.create(model="tiny", prompt=p, max_tokens=400, temperature=0, stream=True)
        for p in prompts
    ]
    try:
        for s in streams[:2]:
            it = iter(s)
            for _ in range(2):
                assert next(it).choices[0].model_extra["token_ids"]
        with engine_held(server):
            # between two steps: the close lands before any request could finish
            for s in streams:
                s.close()
            wait_until(lambda: server.loop.cancels == 3, "the server to see the closes")
        after = idle(server)  # engine_state checked the cache's integrity
        assert after["locked_nodes"] == 0
        assert after["device_pages_engine"] == base["device_pages_engine"] == 0
        assert metric(server, 'kvtier_requests_total{finish_reason="abort"}') == 3
        assert metric(server, 'kvtier_requests_total{finish_reason="length"}') == 0
        # the engine still serves, and what the aborted requests computed is a cache hit
        r = c.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == (
            cold(prompts[0], SamplingParams(max_tokens=4)).output_ids
        )
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert idle(server)["locked_nodes"] == 0
    finally:
        server.stop()


def test_a_non_streaming_client_that_gives_up_is_cancelled() -> None:
    server = start()
    body = {"model": "tiny", "prompt": P, "max_tokens": 50}
    try:
        with engine_held(server):
            with pytest.raises(openai.APITimeoutError):
                openai.OpenAI(
                    base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=0.3
                ).completions.create(**body)
            wait_until(lambda: server.loop.cancels == 1, "the server to see the disconnect")
        after = idle(server)
        assert after["locked_nodes"] == 0 and after["device_pages_engine"] == 0
        assert metric(server, 'kvtier_requests_total{finish_reason="abort"}') == 1
        assert metric(server, "kvtier_recomputed_tokens_total") == 0  # it never ran
    finally:
        server.stop()


def test_storage_outage_is_degraded_while_requests_are_served(tmp_path) -> None:
    cfg = cache_config(storage="file", storage_dir=str(tmp_path / "l3"))
    server = start(cache=cfg)
    try:
        assert http().get(f"{server.url}/health").json()["status"] == "ok"
        root = server.loop.call(lambda llm: llm.cache.storage.dir).result()
        os.rename(root, f"{root}.gone")  # the store's directory disappears ...
        with open(root, "w") as f:  # ... and a plain file takes its name: every write fails
            f.write("not a directory")
        r = client(server).completions.create(model="tiny", prompt=P * 3, max_tokens=3)
        assert r.usage.completion_tokens == 3

        def degraded() -> dict | None:
            h = http().get(f"{server.url}/health")
            return h.json() if h.json()["status"] == "degraded" else None

        h = wait_until(degraded, "/health to report the outage")
        assert h["storage"]["errors_total"] > 0 and h["storage"]["backend"] == "file"
        assert h["storage"]["healthy"] is False and h["storage"]["backend_healthy"] is True
        assert sum(h["storage"]["storage_errors"].values()) == h["storage"]["errors_total"]
        idle(server)  # no write in flight: the counts stop moving

        def same_counts() -> dict | None:
            kinds = http().get(f"{server.url}/health").json()["storage"]["storage_errors"]
            stats = server.loop.call(lambda llm: llm.stats()).result()
            return kinds if kinds and kinds == stats["storage_errors"] else None

        kinds = wait_until(same_counts, "/health to show the cache's storage_errors")
        text = http().get(f"{server.url}/metrics").text
        for kind, n in kinds.items():
            assert f'kvtier_storage_errors_total{{kind="{kind}"}} {float(n)}' in text
        again = client(server).completions.create(
            model="tiny", prompt=P, max_tokens=2, temperature=0
        )
        assert again.choices[0].model_extra["token_ids"] == (
            cold(P, SamplingParams(max_tokens=2)).output_ids
        )
    finally:
        server.stop()


def test_restart_on_the_same_storage_dir_serves_from_storage(tmp_path) -> None:
    """``stop`` flushes storage writes: a new server on the same directory reports the
    storage hit the engine reports for the same history, and the same tokens."""
    cfg = cache_config(storage="file", storage_dir=str(tmp_path / "l3"))
    prompt, greedy = P * 3, SamplingParams(max_tokens=5, temperature=0.0)
    ref = build_llm("tiny", cache_config(storage="file", storage_dir=str(tmp_path / "ref")))
    ref.generate([prompt], greedy)
    ref.close()
    ref = build_llm("tiny", cache_config(storage="file", storage_dir=str(tmp_path / "ref")))
    want = ref.generate([prompt], greedy)[0]
    ref.close()
    assert want.cached_storage > 0
    for restart in (False, True):
        server = start(cache=cfg)
        try:
            r = client(server).completions.create(
                model="tiny", prompt=prompt, max_tokens=5, temperature=0
            )
        finally:
            server.stop()
        summary = server.loop.shutdown_summary
        m = re.fullmatch(
            r"shut down: 0 unfinished request\(s\) ended; at close \d+ host backup page\(s\) "
            r"and \d+ storage page write\(s\) \(.+\) were in flight and landed; storage holds "
            r"(\d+) object\(s\)",
            summary or "",
        )
        assert m and int(m.group(1)) > 0, summary
        assert r.choices[0].model_extra["token_ids"] == want.output_ids
        by_tier = r.usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]
        expect = (
            {"device": want.cached_device, "host": want.cached_host, "storage": want.cached_storage}
            if restart
            else {"device": 0, "host": 0, "storage": 0}
        )
        assert by_tier == expect


def _chat_checkpoint(path) -> str:
    """A tiny checkpoint with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    save_hf_checkpoint(build_model(preset("tiny")), path)
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<unk>"]
    vocab = {f"w{i}": i for i in range(500)} | {t: 500 + j for j, t in enumerate(specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    cfg = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_chat_renders_the_template_and_matches_the_engine(tmp_path) -> None:
    model = _chat_checkpoint(tmp_path / "ckpt")
    server = start(model, served="chat-tiny")
    msgs = [
        {"role": "system", "content": "w1 w2 w3"},
        {"role": "user", "content": [{"type": "text", "text": "w4 w5 w6 w7"}]},
    ]
    llm = build_llm(model, cache_config())
    ids = llm.tokenizer.encode(
        "<s><|system|> w1 w2 w3 <|user|> w4 w5 w6 w7 <|assistant|>", add_special_tokens=False
    )
    assert ids[:2] == [500, 504]  # one bos, from the template
    want = llm.generate([ids], SamplingParams(max_tokens=8))[0]
    text_want = llm.tokenizer.decode(want.output_ids)
    llm.close()
    try:
        c = client(server)
        r = c.chat.completions.create(
            model="chat-tiny", messages=msgs, max_completion_tokens=8, temperature=0
        )
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == text_want and text_want
        assert r.choices[0].model_extra["token_ids"] == want.output_ids
        assert r.usage.prompt_tokens == len(ids)
        stream = c.chat.completions.create(
            model="chat-tiny", messages=msgs, max_tokens=8, temperature=0, stream=True
        )
        parts = [ch.choices[0].delta.content or "" for ch in stream]
        assert "".join(parts) == text_want
        r = c.completions.create(model="chat-tiny", prompt="w4 w5 w6", max_tokens=3, temperature=0)
        assert r.usage.prompt_tokens == 3  # text prompts go through the tokenizer
        r = http().post(
            f"{server.url}/v1/chat/completions",
            json={"model": "chat-tiny", "messages": msgs, "max_tokens": 5000},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()


def test_concurrent_requests_batch_together_and_match_their_cold_runs() -> None:
    """Four requests queued together while the engine is held run side by side; each one's
    tokens are those of its own cold run (greedy and seeded sampling alike)."""
    server = start()
    url = f"{server.url}/v1/completions"
    prompts = [[i, *P, i] for i in range(20, 24)]
    temps = [0.0, 0.0, 0.7, 1.0]
    out: dict[int, object] = {}

    def post(i: int) -> None:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 6, "seed": i}
        out[i] = http().post(url, json={**body, "temperature": temps[i]})

    try:
        threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
        with engine_held(server):
            for t in threads:
                t.start()
            wait_until(lambda: server.loop.queue_depth()["queued"] == 4, "four queued requests")
        for t in threads:
            t.join()
        for i in range(4):
            want = cold(prompts[i], SamplingParams(max_tokens=6, temperature=temps[i], seed=i))
            assert out[i].json()["choices"][0]["token_ids"] == want.output_ids  # type: ignore[attr-defined]
        assert idle(server)["locked_nodes"] == 0
    finally:
        server.stop()


def test_a_request_failing_in_the_engine_is_a_500_and_the_server_goes_on() -> None:
    server = start()
    url = f"{server.url}/v1/completions"
    body = {"model": "tiny", "prompt": P, "max_tokens": 4, "temperature": 0}

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("simulated kernel fault")

    def break_forward(llm) -> object:
        original = llm.runner.forward
        llm.runner.forward = broken
        return original

    try:
        original = server.loop.call(break_forward).result()
        r = http().post(url, json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "simulated kernel fault" in err["message"]
        with http().stream("POST", url, json={**body, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"
        assert "simulated kernel fault" in json.loads(lines[-2][6:])["error"]["message"]
        server.loop.call(lambda llm: setattr(llm.runner, "forward", original)).result()
        r = http().post(url, json=body)
        assert (
            r.json()["choices"][0]["token_ids"] == cold(P, SamplingParams(max_tokens=4)).output_ids
        )
        assert metric(server, 'kvtier_requests_total{finish_reason="error"}') == 2
        assert idle(server)["locked_nodes"] == 0
    finally:
        server.stop()


def test_the_shutdown_line_counts_what_the_close_drained() -> None:
    from kvtier.server.engine_loop import shutdown_summary

    before = {"host_backup_pages": 4, "storage_backup_pages": 10, "storage_write_bytes": 1024}
    after = {"host_backup_pages": 6, "storage_backup_pages": 13, "storage_write_bytes": 4096}
    assert shutdown_summary(
        2, {**before, "storage_objects": 9}, {**after, "storage_objects": 12}
    ) == (
        "shut down: 2 unfinished request(s) ended; at close 2 host backup page(s) and 3 storage "
        "page write(s) (3.00 KiB) were in flight and landed; storage holds 12 object(s)"
    )
    no_storage = {**after, "storage_objects": -1}
    assert shutdown_summary(0, {**before, "storage_objects": -1}, no_storage).endswith("landed")
    assert shutdown_summary(1, {}, {}) == "shut down: 1 unfinished request(s) ended"
