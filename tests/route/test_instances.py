"""``--instance`` parsing: a bad value fails with a message naming the option; an instance's
requests in flight."""

from __future__ import annotations

import pytest

from kvtier import cli
from kvtier.route.instances import Instance, InstanceSpec, RouteConfigError, parse_instances
from kvtier.route.scorer import Footprint


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
