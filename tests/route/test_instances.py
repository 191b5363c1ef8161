"""``--instance`` parsing: a bad value fails with a message naming the option; an instance's
requests in flight and what the router measures on them."""

from __future__ import annotations

import pytest

from kvtier import cli
from kvtier.route.instances import Instance, InstanceSpec, RouteConfigError, parse_instances
from kvtier.route.scorer import Footprint, Rates
from kvtier.server.load_cost import Ahead, LoadCost


def test_an_instance_with_its_event_endpoints() -> None:
    spec = InstanceSpec.parse("http://h:8000/,events=tcp://h:5557,replay=tcp://h:5558")
    assert spec == InstanceSpec("http://h:8000", "tcp://h:5557", "tcp://h:5558")
    assert InstanceSpec.parse("https://h/v1") == InstanceSpec("https://h")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (None, "--instance is required"),
        (["h:8000"], "must be http"),
        (["http://h:1/x"], "base URL"),
        (["http://h:1,event=tcp://x:1"], "is not events=ENDPOINT"),
        (["http://h:1,events=x:1"], "no ZMQ endpoint"),
        (["http://h:1,replay=tcp://x:1"], "replay= needs events="),
        (["http://h:1", "http://h:1/"], "more than once"),
    ],
)
def test_bad_instances_name_the_option(values, message) -> None:
    with pytest.raises(RouteConfigError, match=message) as e:
        parse_instances(values)
    assert "--instance" in str(e.value)


def test_the_command_reports_a_bad_option_in_one_line(capsys) -> None:
    assert cli.main(["route", "--instance", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier route: --instance 'nope'") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["route", "--instance", "http://h:1", "--prefill-rate", "0"])
    assert "--prefill-rate: must be a positive number" in capsys.readouterr().err


def test_a_flight_ends_by_its_handle_not_by_an_equal_footprint() -> None:
    """Two requests holding the same footprint: ending the younger leaves the older, with
    its own send time (the router prices the wait for room by it)."""
    inst = Instance(parse_instances(["http://a:1"])[0])
    older = inst.begin(Footprint(own=32, prefix=16))
    younger = inst.begin(Footprint(own=32, prefix=16))
    assert older.sent <= younger.sent and inst.in_flight == 2
    inst.end(younger)
    assert inst.flights == [older] and inst.flights[0] is older and inst.in_flight == 1
    inst.end(older)
    assert (inst.flights, inst.in_flight) == ([], 0)


def test_the_router_measures_the_cost_of_the_requests_ahead_on_its_answers() -> None:
    """Sixteen streamed requests: the eight sent alone, priced 2 ms of own prefill, had their
    first output 12 ms after they were sent; the eight sent behind one other, priced 7 ms, at
    37 ms; so a request ahead costs (37 - 7) - (12 - 2) = 20 ms. Each lasted 50 ms from
    sending to its end. Requests chosen by load, or whose first output was not seen, are no samples. Until
    there are 16, the instance is priced with what it reported."""
    inst = Instance(parse_instances(["http://a:1"])[0])
    reported = Rates(request_cost_s=0.005, request_duration_s=0.2)
    inst.rates = reported
    t = 100.0
    for _ in range(8):
        assert inst.priced_rates(Rates()) == reported
        alone = inst.begin(None, 0.002, now=t)
        inst.first_output(alone, now=t + 0.012)
        inst.end(alone, now=t + 0.050)
        by_load = inst.begin(None, None, now=t + 1)
        behind = inst.begin(None, 0.007, now=t + 1)
        unseen = inst.begin(None, 0.002, now=t + 1)
        inst.first_output(behind, now=t + 1.037)
        inst.end(behind, now=t + 1.050)
        inst.end(by_load, now=t + 1.060)
        inst.end(unseen, now=t + 1.060)
        t += 2
    assert len(inst.observed) == 16
    got = inst.priced_rates(Rates())
    assert got is not None
    assert got.request_cost_s == pytest.approx(0.020, abs=1e-9)
    assert got.request_duration_s == pytest.approx(0.050, abs=1e-9)
    assert got.prefill_tokens_per_s == reported.prefill_tokens_per_s
    # an instance that reports no rates: the router's defaults, with what it measured
    inst.rates = None
    defaults = Rates(prefill_tokens_per_s=123.0)
    assert inst.priced_rates(defaults) == Rates(
        prefill_tokens_per_s=123.0, request_cost_s=got.request_cost_s,
        request_duration_s=got.request_duration_s,
    )  # fmt: skip


def test_the_requests_ahead_are_told_apart_by_where_they_are() -> None:
    """Three requests in flight, one of which had its first output pass: a request sent
    then has two ahead in their prefill and one streaming, and is a sample with them."""
    inst = Instance(parse_instances(["http://a:1"])[0])
    first = inst.begin(None, 0.25, now=9.0)
    inst.begin(None, None, now=9.5)
    streaming = inst.begin(None, 0.1, now=9.9)
    inst.first_output(streaming, now=10.0)
    assert inst.ahead() == Ahead(prefilling=2, decoding=1)
    new = inst.begin(None, 0.01, now=10.1)
    assert new.ahead == Ahead(prefilling=2, decoding=1) and new.ahead.count == 3
    inst.first_output(new, now=10.3)
    inst.end(new, now=10.4)
    (ahead, excess, held), *_ = inst.observed._samples
    assert ahead == new.ahead and excess == pytest.approx(0.19) and held == pytest.approx(0.3)
    inst.end(first, now=10.5)
    assert inst.ahead() == Ahead(prefilling=1, decoding=1)


def test_an_instance_without_samples_of_its_own_is_priced_by_the_fleets() -> None:
    """Sixteen answers on A, eight alone (excess 10 ms) and eight behind one request in its
    prefill (30 ms): the fleet's measurement prices B, which has none, at 20 ms a request
    ahead in its prefill; once B has sixteen of its own (excess 2 and 7 ms), its own 5 ms
    wins. A fleet of one instance is priced by that instance's alone."""
    pooled = LoadCost()
    a, b = (
        Instance(s, fleet_observed=pooled) for s in parse_instances(["http://a:1", "http://b:1"])
    )
    assert b.priced_rates(Rates()) is None

    def answers(inst: Instance, alone: float, behind: float) -> None:
        for t in range(8):
            f = inst.begin(None, 0.0, now=t)
            inst.first_output(f, now=t + alone)
            inst.end(f, now=t + 0.05)
            busy = inst.begin(None, None, now=t + 0.5)
            f = inst.begin(None, 0.0, now=t + 0.5)
            inst.first_output(f, now=t + 0.5 + behind)
            inst.end(f, now=t + 0.55)
            inst.end(busy, now=t + 0.6)

    answers(a, 0.010, 0.030)
    assert len(pooled) == 16 and len(b.observed) == 0
    assert b.priced_rates(Rates()).request_cost_s == pytest.approx(0.020)
    answers(b, 0.002, 0.007)
    assert b.priced_rates(Rates()).request_cost_s == pytest.approx(0.005)
    assert a.priced_rates(Rates()).request_cost_s == pytest.approx(0.020)
    alone = Instance(parse_instances(["http://c:1"])[0])
    answers(alone, 0.010, 0.030)
    assert alone.priced_rates(Rates()).request_cost_s == pytest.approx(0.020)


def test_the_router_runs_without_torch() -> None:
    """What ``kvtier route`` runs on (its app, fleet, scorer and the byte tokenizer it may
    encode prompts with) loads neither torch nor the engine's model code: a lighter process,
    and a heap the garbage collector walks quickly."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvtier.route.proxy, kvtier.route.fleet, kvtier.route.route_command\n"
        "from kvtier.engine.byte_tokenizer import ByteTokenizer\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m == 'kvtier.engine.llm')\n"
        "assert not bad, bad[:5]\n"
        "from kvtier.engine import LLM, SamplingParams\n"  # the package's names still load
        "assert LLM.__module__ == 'kvtier.engine.llm' and 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
