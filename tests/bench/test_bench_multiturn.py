"""``bench multiturn``: every configuration serves the same greedy tokens as device memory alone,
the tokens it served per tier and recomputed add up to the prompts, a prepopulated L3 serves the
first round, the bound is the documented sum, the closed loop keeps its concurrency and the JSON,
the command line and the plot carry every documented key."""

from __future__ import annotations

import argparse
import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import mooncake_harness
import pytest

from kvtier.bench import multiturn as mt
from kvtier.bench.plot import kind_of, plot
from kvtier.engine import RequestOutput
from kvtier.errors import ConfigError

mooncake_cluster = mooncake_harness.mooncake_cluster

TINY = mt.MultiTurnConfig(
    model="tiny",
    clients=6,
    rounds=3,
    concurrency=2,
    system_tokens=64,
    new_tokens=32,
    output_tokens=8,
    device_tokens=384,  # the working set is 784 tokens: pages go down the tiers
    small_host_tokens=128,
    decode_steps=2,
    device="cpu",
    progress=False,
)


@pytest.fixture(scope="module")
def result() -> dict:
    return mt.bench_multiturn(replace(TINY, debug_checks=True))


def test_every_configuration_gives_the_device_only_tokens(result) -> None:
    assert list(result["configs"]) == list(mt.DEFAULT_CONFIGS)
    assert result["reference_config"] == "device"
    assert result["outputs_match"] is True and result["outputs_agree"] is True
    for c in result["configs"].values():
        assert c["outputs_match"] is True and c["mismatched_requests"] == 0
        div = c["divergences"]
        assert (div["requests"], div["judged"], div["unjudged_prompts"]) == (0, 0, 0)
        assert div["tolerance"] == 1e-3 and c["outputs_agree"] is True  # float32
        # rounds end in the order they started: the first round is over before the run
        assert 0 < c["first_round"]["wall_s"] <= c["wall_s"]
        assert c["num_requests"] == 18 and len(c["requests"]) == 18
        assert c["output_tokens"] == 18 * 8
    assert mt.failure(result) is None


def test_tokens_served_per_tier_and_recomputed_add_up_to_the_prompts(result) -> None:
    assert result["tokens_add_up"] is True
    for name, c in result["configs"].items():
        assert c["preemptions"] == 0, name  # the pool holds both requests in flight
        for r in c["requests"]:
            served = r["cached_device"] + r["cached_host"] + r["cached_storage"]
            assert served + r["recomputed"] == r["prompt_tokens"], (name, r)
        t, st = c["tokens"], c["stats"]
        assert (
            t["prompt"]
            == c["input_tokens"]
            == t["device"] + t["host"] + t["storage"] + t["recomputed"]
        )
        # the engine's per-request counts are the cache's counters
        assert (st["device_hit_tokens"], st["host_hit_tokens"]) == (t["device"], t["host"])
        assert (st["storage_hit_tokens"], st["recomputed_tokens"]) == (
            t["storage"],
            t["recomputed"],
        )
    dev, host = result["configs"]["device"]["tokens"], result["configs"]["host"]["tokens"]
    assert dev["host"] == dev["storage"] == host["storage"] == 0
    assert host["host"] > 0 and host["recomputed"] < dev["recomputed"]
    assert result["configs"]["host+file"]["tokens"]["storage"] > 0


def test_the_prepopulated_l3_serves_the_first_round(result) -> None:
    c = result["configs"]["file-prepopulated"]
    first = [r for r in c["requests"] if r["round"] == 0]
    assert len(first) == 6 and all(r["cached_storage"] > 0 for r in first)
    # the first request finds nothing but storage: every whole page of its prompt comes from it
    assert max(r["cached_storage"] for r in first) == (96 - 1) // 16 * 16
    assert c["first_round_tokens"]["storage"] == sum(r["cached_storage"] for r in first)
    # the same engine run on a cold L3 serves its first round from no tier below the device
    assert result["configs"]["host+file"]["first_round_tokens"]["storage"] == 0


def test_the_json_has_every_documented_key(result) -> None:
    json.loads(json.dumps(result))
    assert set(result) == set(mt.RESULT_KEYS)
    assert set(result["rates"]) == set(mt.RATE_KEYS)
    w = result["workload"]
    assert (w["requests"], w["working_set_tokens"], w["max_prompt_tokens"]) == (18, 784, 176)
    assert w["working_set_over_device"] == pytest.approx(784 / 384)
    for name, c in result["configs"].items():
        assert set(c) == set(mt.CONFIG_KEYS), name
        assert all(set(r) == set(mt.REQUEST_KEYS) for r in c["requests"])
        q = c["ttft_s"]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"]
        assert c["requests_per_s"] == pytest.approx(18 / c["wall_s"])
        assert c["input_tokens_per_s"] == pytest.approx(c["input_tokens"] / c["wall_s"])
        assert set(result["summary"][name]) >= {"wall_s", "speedup", "ttft_p50_s", "bound_s"}
    assert result["configs"]["device"]["cache"]["host_tokens"] == 0
    assert result["configs"]["host"]["cache"]["host_tokens"] >= 784
    assert result["configs"]["host+file"]["cache"]["host_tokens"] == 128
    assert result["configs"]["device"]["speedup"] == 1.0


def test_the_bound_is_the_sum_of_the_requests_bounds(result) -> None:
    rates, bpt = result["rates"], result["kv_bytes_per_token"]
    assert bpt == 4 * 2 * 2 * 32 * 4  # layers x (k, v) x kv heads x head_dim x float32
    assert rates["prefill_tokens_per_s"] > 0 and rates["decode_step_s"] > 0
    assert rates["link_gbps"] > 0 and rates["storage_read_gbps"] > 0
    assert rates["decode_batch"] == 2
    for c in result["configs"].values():
        for r in c["requests"]:
            want = mt.request_bound(r, rates, bpt, rates["storage_read_gbps"])
            assert r["bound_s"] == pytest.approx(want)
        assert c["bound_s"] == pytest.approx(sum(r["bound_s"] for r in c["requests"]))
        # wall >= bound does not hold robustly on a CPU (module docstring)
        assert 0 < c["bound_s"] < math.inf
        assert c["wall_over_bound"] == pytest.approx(c["wall_s"] / c["bound_s"])


def test_request_bound_is_the_slower_of_compute_and_load_plus_decode_share() -> None:
    rates = {"prefill_s_per_token": 1e-3, "prefill_s_per_token_context": 0.0, "link_gbps": 1.0}
    rates.update(decode_step_s=0.01, decode_batch=4, prefill_s_per_forward=0.0)
    rec = {"recomputed": 100, "cached_device": 0, "cached_host": 0, "cached_storage": 0}
    rec["output_tokens"] = 9
    decode = 8 * 0.01 / 4
    assert mt.request_bound(rec, rates, 1000.0, None) == pytest.approx(0.1 + decode)
    # 100 tokens after 300 cached attend to 350 on average: 100 x 350 x 1e-6 more
    with_context = {**rates, "prefill_s_per_token_context": 1e-6}
    rec300 = {**rec, "cached_device": 300}
    assert mt.request_bound(rec300, with_context, 1000.0, None) == pytest.approx(
        0.1 + 0.035 + decode
    )
    # a forward's own cost comes once per request
    with_forward = {**rates, "prefill_s_per_forward": 0.02}
    assert mt.request_bound(rec, with_forward, 1000.0, None) == pytest.approx(0.12 + decode)
    # 1e6 tokens x 1000 bytes over 1 GB/s: 1 s of link beats 0.1 s of compute
    rec.update(cached_host=400_000, cached_storage=600_000)
    assert mt.request_bound(rec, rates, 1000.0, None) == pytest.approx(1.0 + decode)
    # storage at 0.5 GB/s: its 6e8 bytes take 1.2 s, longer than the link
    assert mt.request_bound(rec, rates, 1000.0, 0.5) == pytest.approx(1.2 + decode)


def test_the_prefill_cost_model_fits_three_probes_exactly() -> None:
    c, a, b = 0.02, 1e-4, 1e-8

    def t(r: int, h: int) -> float:
        return c + r * (a + b * (h + r / 2))

    got = mt.prefill_cost_model(1000, t(1000, 0), 900, 100, t(100, 900), t(100, 0))
    assert got == pytest.approx((c, a, b))
    # an extend no dearer than the short cold prompt: attention costs nothing measurable
    assert mt.prefill_cost_model(1000, 0.12, 900, 100, 0.03, 0.03) == pytest.approx(
        (0.03 - 100 * 0.09 / 900, 0.09 / 900, 0.0)
    )
    # a short prompt dearer than its share of the cold one: no per-token cost is left, the
    # short prompt's time is the forward's
    assert mt.prefill_cost_model(1000, 0.1, 900, 100, 0.2, 0.15) == pytest.approx(
        (0.15 - 0.05 / 90_000 * 100 * 100 / 2, 0.0, 0.05 / 90_000)
    )


def test_divergences_cut_at_the_first_differing_token_and_skip_other_prompts() -> None:
    ref_p = {(0, 0): [9, 9], (0, 1): [9, 9, 1, 2, 7], (1, 0): [8]}
    ref_o = {(0, 0): [1, 2, 3], (0, 1): [4, 5, 6], (1, 0): [1, 1, 1]}
    p = dict(ref_p)
    o = {(0, 0): [1, 5, 5], (0, 1): [4, 5, 6], (1, 0): [1, 1, 1]}
    p[(0, 1)] = [9, 9, 1, 5, 7]  # the conversation's answer differed before this turn
    found, unjudged = mt.divergences(ref_p, ref_o, p, o)
    assert found == [mt.Divergence((0, 0), [9, 9, 1], 2, 5)]
    assert unjudged == 1
    assert mt.divergences(ref_p, ref_o, ref_p, ref_o) == ([], 0)


def test_a_near_tie_is_within_the_tolerance_and_an_unlikely_token_is_not() -> None:
    """The judge's gaps are its own log-probabilities: the runner-up's gap to the greedy token,
    and infinity for a token outside its top 20 (what a wrong restore produces)."""
    import torch

    from kvtier.config import CacheConfig
    from kvtier.engine import LLM, SamplingParams

    cfg = replace(TINY, concurrency=1)
    model = mt.build_bench_model(cfg, torch.device("cpu"), 256)
    prompt = list(range(3, 40))
    llm = LLM(model, CacheConfig(page_size=16, device_pages=16, device="cpu", enable_host=False))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=20))
    llm.close()
    (first, lp1), (second, lp2) = out.logprobs[0].top[:2]
    worst = out.logprobs[0].top[-1][1]
    unlikely = next(t for t in range(512) if t not in dict(out.logprobs[0].top))
    found = [
        mt.Divergence((0, 0), prompt, first, second),
        mt.Divergence((1, 0), prompt, first, unlikely),
    ]
    gaps = mt.judge_divergences(model, cfg, torch.device("cpu"), found)
    assert gaps[0] == pytest.approx(lp1 - lp2) and gaps[1] == math.inf
    assert lp1 - worst > 0  # the tiny model's top 20 are not all tied


def test_mismatches_count_requests_that_differ_or_are_missing() -> None:
    ref = {(0, 0): [1, 2], (0, 1): [3], (1, 0): [4]}
    assert mt.mismatches(ref, dict(ref)) == 0
    assert mt.mismatches(ref, {**ref, (0, 1): [3, 0]}) == 1
    assert mt.mismatches(ref, {(0, 0): [1, 2], (2, 0): [4]}) == 3  # (0, 1), (1, 0), (2, 0)


def test_percentile_is_linear_between_ranks() -> None:
    assert mt.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert mt.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert mt.percentile([7.0], 99) == 7.0
    assert math.isnan(mt.percentile([], 50))


def test_multiturn_histories_grow_by_the_answer_and_a_new_user_turn() -> None:
    w = mt.MultiTurnWorkload(TINY, vocab=512)
    first = w.initial()
    assert [t.conversation for t in first] == list(range(6))
    assert all(t.prompt[:64] == first[0].prompt[:64] for t in first)  # the shared system prompt
    assert len({tuple(t.prompt[64:]) for t in first}) == 6
    (nxt,) = w.after(first[2], [1, 2, 3])
    assert (nxt.conversation, nxt.round) == (2, 1)
    assert nxt.prompt == first[2].prompt + [1, 2, 3] + w.user[2][1]
    last = mt.Turn(2, 2, [0])
    assert w.after(last, [5]) == []
    assert (w.max_prompt, w.working_set, w.num_requests) == (64 + 3 * 32 + 2 * 8, 784, 18)


def test_each_client_brings_its_own_context_after_the_system_prompt() -> None:
    cfg = replace(TINY, system_tokens=0, context_tokens=100)
    w = mt.MultiTurnWorkload(cfg, vocab=512)
    first = w.initial()
    assert [t.prompt for t in first] == [w.context[c] + w.user[c][0] for c in range(6)]
    assert all(len(c) == 100 for c in w.context) and len({tuple(c) for c in w.context}) == 6
    assert w.max_prompt == 100 + 3 * 32 + 2 * 8
    assert w.working_set == 6 * (100 + 3 * (32 + 8))
    assert w.mean_prompt == 100 + 2 * 32 + 1 * 8


def test_longdoc_asks_again_only_after_the_warm_up_round() -> None:
    cfg = replace(TINY, workload="longdoc", documents=3, document_tokens=50, rounds=3)
    w = mt.LongDocWorkload(cfg, vocab=512)
    warm = w.initial()
    assert [(t.conversation, t.round) for t in warm] == [(0, 0), (1, 0), (2, 0)]
    assert w.after(warm[0], [1]) == [] and w.after(warm[2], [1]) == []
    later = w.after(warm[1], [1])
    assert sorted((t.conversation, t.round) for t in later) == [
        (d, r) for d in range(3) for r in (1, 2)
    ]
    for t in later:
        assert t.prompt[:50] == w.docs[t.conversation]
        assert t.prompt[50:] == w.questions[t.conversation][t.round]
        assert w.after(t, [1]) == []
    # a reused workload starts over
    assert len(w.initial()) == 3 and w.after(warm[0], [1]) == []


class _FakeLLM:
    """Finishes the oldest running request each step with ``n`` tokens; records in-flight."""

    def __init__(self, n: int) -> None:
        self.n, self.running, self.peak, self.order = n, [], 0, []
        self._id = 0

    def add_request(self, prompt, params) -> int:  # noqa: ANN001
        self._id += 1
        self.running.append((self._id, list(prompt)))
        self.peak = max(self.peak, len(self.running))
        return self._id

    def step(self) -> list[RequestOutput]:
        rid, prompt = self.running.pop(0)
        self.order.append(len(prompt))
        out = [len(prompt) % 7] * self.n
        return [RequestOutput(rid, prompt, out, "length", 0.0, 0, 0, 0, len(prompt))]


def test_the_closed_loop_keeps_at_most_concurrency_in_flight() -> None:
    w = mt.MultiTurnWorkload(TINY, vocab=512)
    llm = _FakeLLM(8)
    done, wall = mt.run_closed_loop(llm, w, 2, "fifo", 0)  # type: ignore[arg-type]
    assert llm.peak == 2 and wall >= 0
    assert len(done) == 18 and sorted((d.turn.conversation, d.turn.round) for d in done) == [
        (c, r) for c in range(6) for r in range(3)
    ]
    # fifo: every first turn before any second one, which follow their first turns' order
    assert [d.turn.round for d in done[:6]] == [0] * 6
    # a client's turn r + 1 extends its turn r by the answer and the next user turn
    by = {(d.turn.conversation, d.turn.round): d for d in done}
    assert by[(3, 1)].turn.prompt[: len(by[(3, 0)].turn.prompt)] == by[(3, 0)].turn.prompt
    assert len(by[(3, 1)].turn.prompt) == len(by[(3, 0)].turn.prompt) + 8 + 32


def test_a_request_that_ends_early_fails_the_run() -> None:
    w = mt.MultiTurnWorkload(TINY, vocab=512)
    with pytest.raises(RuntimeError, match="conversation 0 round 0 ended 'length' after 3"):
        mt.run_closed_loop(_FakeLLM(3), w, 1, "fifo", 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"configs": ("device", "disk")}, "unknown 'disk'"),
        ({"configs": ("device", "mooncake")}, "no mooncake_url"),
        ({"configs": ("host", "host")}, "twice"),
        ({"host_tokens": 64, "host_bytes": 1024}, "at most one"),
        ({"concurrency": 0}, "concurrency must be a positive integer"),
        ({"workload": "chat"}, "workload must be one of"),
        ({"ready_policy": "lifo"}, "ready_policy"),
        ({"context_tokens": -1}, "context_tokens must be an integer >= 0"),
        ({"logit_tolerance": -0.5}, "logit_tolerance must be a number >= 0"),
        ({"judge_max": 0}, "judge_max must be a positive integer"),
        ({"configs": ("device", "host-coded")}, "compares host tiers of equal bytes"),
        ({"configs": ("host-coded",), "host_bytes": 1 << 20, "kv_codec": "none"}, "is 'none'"),
    ],
)
def test_bad_options_fail_naming_them(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        replace(TINY, **change)


def test_a_device_pool_smaller_than_a_request_fails_before_any_engine() -> None:
    with pytest.raises(ConfigError, match="device_tokens=128 cannot hold one request of up to 184"):
        mt.bench_multiturn(replace(TINY, device_tokens=128))


def test_a_coded_host_tier_holds_more_of_the_working_set_in_the_same_bytes() -> None:
    # 12 float32 pages of the tiny model (4 layers x 16 tokens x 128 x 4 bytes); coded, a page
    # takes 8,256 bytes, so the same bytes hold 47 of the working set's 49 pages
    cfg = replace(TINY, configs=("host", "host-coded"), host_bytes=12 * 32768, kv_codec="int8")
    r = mt.bench_multiturn(cfg)
    plain, coded = r["configs"]["host"], r["configs"]["host-coded"]
    assert (plain["cache"]["host_tokens"], coded["cache"]["host_tokens"]) == (12 * 16, 47 * 16)
    assert coded["tokens"]["host"] > plain["tokens"]["host"]
    assert coded["tokens"]["recomputed"] < plain["tokens"]["recomputed"]
    assert r["tokens_add_up"]


def test_mooncake_joins_the_configurations_with_a_url() -> None:
    cfg = replace(TINY, configs=("host", "device"), mooncake_url="mooncake://x:1")
    assert cfg.run_configs() == ("device", "host", "mooncake")


def _parser() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", metavar="PATH")
    p = argparse.ArgumentParser(parents=[parent])
    mt.add_arguments(p)  # no second --json
    return p


def test_the_command_runs_longdoc_with_a_filled_l3_and_writes_json_and_plot(
    tmp_path, capsys
) -> None:
    out, svg = tmp_path / "r.json", tmp_path / "r.svg"
    argv = "--workload longdoc --documents 3 --document-tokens 96 --question-tokens 16 "
    argv += "--rounds 2 --concurrency 2 --output-tokens 4 --device-tokens 256 --device cpu "
    argv += f"--configs device,host,file-prepopulated --json {out} --plot {svg} "
    argv += f"--storage-dir {tmp_path}"
    args = _parser().parse_args(argv.split())
    assert args.func is mt.run
    assert mt.run(args) == 0
    r = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == r
    assert r["outputs_match"] and r["tokens_add_up"]
    assert list(r["configs"]) == ["device", "host", "file-prepopulated"]
    assert r["workload"]["working_set_tokens"] == 3 * (96 + 2 * (16 + 4))
    pre = r["configs"]["file-prepopulated"]
    # its L3 came from an untimed engine of its own: the warm-up round's documents are stored
    assert all(x["cached_storage"] >= 96 for x in pre["requests"] if x["round"] == 0)
    assert list(tmp_path.glob("kvtier-multiturn-*")) == []  # the L3 directories are gone
    root = ET.fromstring(svg.read_text())
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"device", "host", "file-prepopulated", "p50 ms", "p90 ms", "bound s"} <= set(texts)
    assert kind_of(r) == "multiturn"
    assert plot(tmp_path / "again.svg", [out]) == svg.read_text()


def test_the_command_exits_2_on_a_bad_option(capsys) -> None:
    args = _parser().parse_args(["--configs", "device,tape", "--device", "cpu"])
    assert mt.run(args) == 2
    assert "unknown 'tape'" in capsys.readouterr().err


def test_a_failed_check_is_named() -> None:
    r = {"reference_config": "device", "configs": {}}
    r["configs"]["host"] = {"outputs_match": False, "mismatched_requests": 2, "tokens_add_up": 0}
    assert mt.failure(r) == (
        "host: 2 request(s) differ from device; host: served + recomputed != prompt tokens"
    )
    # judged divergences: a difference alone is no failure, one beyond the tolerance is
    div = {"judged": 3, "within_tolerance": 3, "tolerance": 0.1, "max_gap": 0.04}
    r["configs"]["host"] = {"outputs_match": False, "mismatched_requests": 3, "tokens_add_up": 1}
    r["configs"]["host"].update(divergences=div, outputs_agree=True)
    assert mt.failure(r) is None
    div.update(within_tolerance=2, max_gap=math.inf)
    r["configs"]["host"]["outputs_agree"] = False
    assert mt.failure(r) == (
        "host: 1 of 3 divergence(s) from device beyond the log-probability tolerance 0.1 "
        "(largest gap inf)"
    )


@pytest.mark.mooncake
def test_mooncake_configuration_serves_from_the_store(mooncake_cluster) -> None:
    cfg = replace(
        TINY, configs=("device",), mooncake_url=mooncake_cluster.url(), small_host_tokens=64
    )
    r = mt.bench_multiturn(cfg)
    assert list(r["configs"]) == ["device", "mooncake"]
    assert r["outputs_match"] and r["tokens_add_up"]
    assert r["configs"]["mooncake"]["tokens"]["storage"] > 0
