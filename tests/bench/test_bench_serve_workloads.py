"""``bench serve --workload multiturn|longdoc``: ``bench multiturn``'s workloads over HTTP, one
in-process ``kvtier serve tiny`` per cache configuration on the CPU. Every request succeeds, the
tokens ``usage`` says each tier served plus those recomputed are every prompt, what the clients
read is what the engine counted, a later round finds its history cached, and the greedy outputs
are the same token ids in every configuration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

# The server extra (pip install -e ".[server]").
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvtier.bench.commands import serve_failure
from kvtier.bench.multiturn import MultiTurnConfig, Turn, make_workload
from kvtier.bench.serve import (
    LOOP_KEYS,
    LOOP_REQUEST_KEYS,
    Sample,
    ServeBenchConfig,
    _text_history,
    bench_serve,
    loop_result,
    loop_summary,
    request_body,
)
from kvtier.cli import main
from kvtier.errors import ConfigError

TIERS = ("device", "host", "storage")

# 6 clients x 2 rounds over a 32-token system prompt: a working set of 272 tokens against a
# 160-token device pool, which still holds the two requests in flight (72 tokens each at most),
# so no request is preempted and the tokens add up exactly.
MULTITURN = MultiTurnConfig(
    workload="multiturn",
    clients=6,
    rounds=2,
    concurrency=2,
    system_tokens=32,
    new_tokens=16,
    output_tokens=4,
    device_tokens=160,
    small_host_tokens=32,
    page_size=4,
    debug_checks=True,
    progress=False,
)


def _served(rec: dict) -> int:
    return sum(rec[f"cached_{t}"] for t in TIERS)


def _check(r: dict, configs: list[str], requests: int, output_tokens: int) -> None:
    """Every configuration ran every request, all succeeded, and the figures are consistent."""
    assert list(r["configs"]) == configs and r["reference_config"] == configs[0]
    assert r["requests"] == r["requests_ok"] == len(configs) * requests
    assert r["errors_by_status"] == {} and r["first_error"] is None
    assert r["outputs_match"] is True and r["tokens_add_up"] is True
    assert r["workload"]["configs"] == configs and r["workload"]["requests"] == requests
    for name, c in r["configs"].items():
        assert set(c) == set(LOOP_KEYS), name
        assert c["num_requests"] == c["requests_ok"] == requests, name
        assert (c["mismatched_requests"], c["outputs_match"]) == (0, True), name
        assert c["output_tokens"] == requests * output_tokens
        for rec in c["requests"]:
            assert set(rec) == set(LOOP_REQUEST_KEYS)
            assert rec["status"] == "200" and rec["output_tokens"] == output_tokens
            assert _served(rec) + rec["recomputed"] == rec["prompt_tokens"], (name, rec)
            assert rec["ttft_s"] > 0
        t = c["tokens"]
        assert t["prompt"] == c["input_tokens"] == sum(t[k] for k in (*TIERS, "recomputed"))
        assert c["recomputed_again"] == 0
        ttft = c["ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
        assert c["requests_per_s"] == pytest.approx(requests / c["wall_s"])
        assert c["input_tokens_per_s"] == pytest.approx(t["prompt"] / c["wall_s"])
        # the engine's own counters are what the clients read from ``usage``
        st = c["server_stats"]
        assert [st[f"{k}_hit_tokens"] for k in TIERS] == [t[k] for k in TIERS], name
        assert st["recomputed_tokens"] == t["recomputed"], name
        assert c["cache"]["device_tokens"] == st["device_pages_total"] * 4


@pytest.mark.slow  # five servers in turn
def test_multiturn_over_http_on_every_configuration() -> None:
    r = bench_serve(ServeBenchConfig(workload="multiturn", device="cpu", closed_loop=MULTITURN))
    configs = ["device", "host", "host+file", "file-prepopulated"]
    _check(r, configs, requests=12, output_tokens=4)
    assert (r["url"], r["model"], r["device"]) == (None, "tiny", "cpu")
    c = r["configs"]
    for name in configs:
        second = [rec for rec in c[name]["requests"] if rec["round"] == 1]
        assert len(second) == 6 and all(_served(rec) > 0 for rec in second), name
        # a second turn's prompt is the first one's, its answer and a new user turn
        first = {rec["conversation"]: rec for rec in c[name]["requests"] if rec["round"] == 0}
        for rec in second:
            assert rec["prompt_tokens"] == first[rec["conversation"]]["prompt_tokens"] + 4 + 16
    dev, host = c["device"]["tokens"], c["host"]["tokens"]
    assert dev["host"] == dev["storage"] == host["storage"] == 0
    assert host["host"] > 0 and host["recomputed"] < dev["recomputed"]
    assert c["host+file"]["cache"]["storage"] == "file" and c["device"]["cache"]["host_tokens"] == 0
    # an L3 an earlier server filled serves the first round of a server that starts empty
    assert c["file-prepopulated"]["first_round_tokens"]["storage"] > 0


@pytest.mark.slow  # two servers in turn
def test_longdoc_command_on_two_configurations(tmp_path) -> None:
    path = tmp_path / "longdoc.json"
    argv = ["bench", "serve", "--workload", "longdoc", "--device", "cpu", "--json", str(path)]
    sizes = ["--documents", "3", "--document-tokens", "64", "--question-tokens", "8"]
    loop = ["--rounds", "3", "--output-tokens", "4", "--concurrency", "2", "--page-size", "4"]
    cache = ["--device-tokens", "256", "--configs", "device,host"]
    assert main([*argv, *sizes, *loop, *cache]) == 0
    r = json.loads(path.read_text())
    _check(r, ["device", "host"], requests=9, output_tokens=4)
    for c in r["configs"].values():
        # the warm-up asks every document once; each later question finds its document cached
        assert c["first_round_tokens"]["prompt"] == 3 * 72
        later = [rec for rec in c["requests"] if rec["round"] > 0]
        assert len(later) == 6 and all(_served(rec) >= 64 for rec in later)


def test_flags_of_another_workload_or_of_in_process_servers_are_refused(capsys) -> None:
    assert main(["bench", "serve", "--rounds", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier bench serve: --rounds: for --workload multiturn and longdoc, not chat"
    )
    assert main(["bench", "serve", "--workload", "longdoc", "--turns", "2"]) == 2
    assert "--turns: for --workload chat, not longdoc" in capsys.readouterr().err
    argv = ["bench", "serve", "--workload", "multiturn", "--url", "http://127.0.0.1:9"]
    assert main([*argv, "--configs", "device", "--device-tokens", "64"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier bench serve: --configs, --device-tokens: for the in-process servers, not with --url"
    )


def test_a_workload_that_cannot_fit_is_refused_before_a_server_starts() -> None:
    with pytest.raises(ConfigError, match="closed_loop describes the 'multiturn' workload"):
        ServeBenchConfig(workload="longdoc", closed_loop=MULTITURN)
    with pytest.raises(ConfigError, match="workload must be one of chat, multiturn, longdoc"):
        ServeBenchConfig(workload="qa")
    small = ServeBenchConfig(
        workload="multiturn",
        model="no-such-model",  # never built: the sizes are checked first
        closed_loop=MultiTurnConfig(
            workload="multiturn", clients=1, rounds=2, system_tokens=32, device_tokens=64
        ),
    )
    with pytest.raises(ConfigError, match=r"device_tokens=64 cannot hold one request of up to"):
        bench_serve(small, quiet=True)


def test_outputs_that_differ_from_the_first_runs_fail_the_run() -> None:
    loop = MultiTurnConfig(workload="longdoc", documents=1, document_tokens=2, rounds=1)
    workload = make_workload(loop, 16)
    (turn,) = workload.initial()

    def run(reply: list[int]) -> tuple[dict, dict]:
        by_tier = {"device": 0, "host": 0, "storage": 0}
        s = Sample(0, 0, "200", 0.1, len(turn.prompt), len(reply), by_tier, len(turn.prompt))
        s.reply = reply
        return loop_result([(turn, s)], 0.5)

    (a, out_a), (b, out_b) = run([4, 5]), run([4, 6])
    assert out_a == {(0, 0): [4, 5]} and a["tokens_add_up"] and a["requests_per_s"] == 2.0
    cfg = ServeBenchConfig(workload="longdoc", closed_loop=loop)
    results, outputs = {"device": a, "host": b}, {"device": out_a, "host": out_b}
    r = loop_summary(cfg, loop, workload, results, outputs, "tiny", "cpu")
    assert [c["mismatched_requests"] for c in r["configs"].values()] == [0, 1]
    assert r["outputs_match"] is False and r["requests"] == r["requests_ok"] == 2
    assert serve_failure(r) == "host: 1 request(s) differ from device"


@pytest.mark.slow  # two servers in turn
def test_text_prompts_grow_by_the_answers_text_and_find_their_history() -> None:
    cfg = ServeBenchConfig(
        workload="multiturn",
        device="cpu",
        prompt_format="text",
        closed_loop=replace(MULTITURN, configs=("device", "host")),
    )
    r = bench_serve(cfg)
    _check(r, ["device", "host"], requests=12, output_tokens=4)
    for name, c in r["configs"].items():
        first = {rec["conversation"]: rec for rec in c["requests"] if rec["round"] == 0}
        assert all(rec["prompt_tokens"] == 32 + 16 for rec in first.values())
        for rec in (rec for rec in c["requests"] if rec["round"] == 1):
            # the history grew by the answer's text: 4 tokens, each at most one byte that may
            # read as a 3-byte replacement character (a special token reads as nothing)
            grown = rec["prompt_tokens"] - first[rec["conversation"]]["prompt_tokens"] - 16
            assert 0 <= grown <= 12, (name, rec)
            # the first prompt's text is sent byte for byte: with the host tier holding every
            # page, all of it is found (without, the device pool may have let it go)
            assert _served(rec) >= (48 if name == "host" else 32), (name, rec)


def test_a_text_prompt_is_its_ids_bytes_and_a_miscounting_server_fails_the_request() -> None:
    body = request_body("tiny", [104, 105], 4, text=True)
    assert (body["prompt"], body["add_special_tokens"]) == ("hi", False)
    assert "add_special_tokens" not in request_body("tiny", [104, 105], 4)
    turn = Turn(0, 0, [104, 105])
    ok = Sample(0, 0, "200", prompt_tokens=2, reply_text="\ufffdx")
    assert _text_history(turn, ok) == [0xEF, 0xBF, 0xBD, ord("x")] and ok.status == "200"
    bos = Sample(0, 0, "200", prompt_tokens=3, reply_text="x")
    assert _text_history(turn, bos) is None
    assert bos.status == "tokenizer" and "3 tokens in a text prompt of 2 bytes" in bos.error
    with pytest.raises(ConfigError, match="prompt_format='text' is for the multiturn"):
        ServeBenchConfig(prompt_format="text")
    with pytest.raises(ConfigError, match="prompt_format must be one of ids, text"):
        ServeBenchConfig(workload="multiturn", prompt_format="bytes")
