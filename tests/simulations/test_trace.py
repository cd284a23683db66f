"""Traces: parsing, validation with clear messages, seeded generators (deterministic for a seed)."""

import json

import pytest

from simulations.trace import TraceError, expand, load_trace, parse_trace
from simulations.__main__ import main as sim_main

GENERATED = {
    "seed": 3, "peers": 8, "duration": 600,
    "generators": [
        {"kind": "mtbf", "mtbf": 120, "replace_after": 10, "leave_fraction": 0.3},
        {"kind": "spot", "every": 90, "fraction": 0.34, "replace_after": 15, "peers": ["peer1", "peer2", "peer3"]},
        {"kind": "diurnal", "workstations": 3, "period": 200, "on_fraction": 0.5, "jitter": 20},
        {"kind": "flash_crowd", "time": 100, "count": 5, "spread": 10},
    ],
}


def test_generators_are_deterministic_for_a_seed_and_differ_across_seeds():
    a = expand(parse_trace(GENERATED))
    b = expand(parse_trace(json.loads(json.dumps(GENERATED))))
    c = expand(parse_trace({**GENERATED, "seed": 4}))
    assert [e.to_dict() for e in a] == [e.to_dict() for e in b]
    assert [e.to_dict() for e in a] != [e.to_dict() for e in c]
    assert {e.source for e in a} == {f"generators[{i}]" for i in range(4)}


def test_generated_events_are_ordered_and_within_the_window():
    events = expand(parse_trace(GENERATED))
    times = [e.time for e in events]
    assert times == sorted(times)
    assert all(0 <= t < 600 + 20 for t in times)  # diurnal jitter may push a leave past a day, not the end


def test_mtbf_lifetimes_have_the_given_mean():
    trace = parse_trace({"seed": 1, "peers": 101, "duration": 10**9,
                         "generators": [{"kind": "mtbf", "mtbf": 50}]})
    kills = [e.time for e in expand(trace)]
    assert len(kills) == 100  # one crash per peer (no replacement), peer0 spared
    assert 40 < sum(kills) / len(kills) < 60  # exponential with mean 50: the sample mean of 100 is near it


def test_spot_waves_kill_a_fraction_and_replace_them():
    trace = parse_trace({"seed": 5, "peers": 7, "duration": 100,
                         "generators": [{"kind": "spot", "every": 30, "fraction": 0.5, "replace_after": 5}]})
    events = expand(trace)
    waves = sorted({e.time for e in events if e.kind == "kill"})
    assert waves == [30.0, 60.0, 90.0]
    assert all(sum(1 for e in events if e.kind == "kill" and e.time == w) == 3 for w in waves)
    joins = [e for e in events if e.kind == "join"]
    assert len(joins) == 9 and len({e.peer for e in joins}) == 9


def test_diurnal_workstations_rejoin_with_their_identity():
    trace = parse_trace({"seed": 2, "duration": 300,
                         "generators": [{"kind": "diurnal", "workstations": 2, "period": 100, "on_fraction": 0.5}]})
    events = expand(trace)
    for ws in ("g0ws0", "g0ws1"):
        kinds = [e.kind for e in events if e.peer == ws]
        assert kinds == ["join", "leave"] * 3


def test_step_events_come_first_and_explicit_events_are_kept():
    trace = parse_trace({"seed": 0, "events": [{"time": 5, "peer": "peer1", "kind": "kill"},
                                               {"step": 3, "kind": "join"}]})
    assert [(e.kind, e.step, e.time) for e in trace.expanded()] == [("join", 3, None), ("kill", None, 5.0)]


def test_latency_puts_every_peer_behind_a_proxy_without_namespaces():
    assert not parse_trace({"seed": 0}).proxied
    assert parse_trace({"seed": 0, "latency_ms": 0}).proxied  # 0 ms: proxies that delay nothing, still audited
    trace = parse_trace({"seed": 0, "events": [{"time": 3, "peer": "peer1", "kind": "latency", "ms": 80,
                                                "duration": 10}]})
    assert trace.proxied and not trace.links and trace.latency_ms is None
    assert trace.expanded()[0].to_dict() == dict(kind="latency", time=3.0, peer="peer1", ms=80.0, duration=10.0,
                                                 source="events[0]")


def test_a_group_event_waits_for_a_round_of_that_many_peers():
    from simulations.runner import is_due

    trace = parse_trace({"seed": 0, "alone_after": 3, "links": True, "events": [
        {"step": 5, "group": 3, "kind": "partition", "peers": ["peer2"], "duration": 25}]})
    assert trace.alone_after == 3.0
    ev = trace.expanded()[0]
    assert ev.group == 3
    assert not is_due(ev, front=4, t_run=60.0, largest_round=3)  # its step not reached
    assert not is_due(ev, front=400, t_run=60.0, largest_round=2)  # no round of three yet, however far the steps
    assert is_due(ev, front=5, t_run=0.0, largest_round=3)
    plain = parse_trace({"seed": 0, "events": [{"time": 2, "peer": "peer1", "kind": "kill"}]}).expanded()[0]
    assert plain.group is None and is_due(plain, front=0, t_run=2.0, largest_round=0)
    assert parse_trace({"seed": 0}).alone_after is None  # the CLI's default


@pytest.mark.parametrize("data, words", [
    ([], "JSON object"),
    ({"peers": 3}, "seed: missing"),
    ({"seed": 1, "bogus": 1}, "unknown trace key(s) bogus"),
    ({"seed": 1, "peers": 0}, "peers: must be >= 1"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "explode"}]}, "events[0].kind: 'explode'"),
    ({"seed": 1, "events": [{"peer": "peer1", "kind": "kill"}]}, "exactly one of time"),
    ({"seed": 1, "events": [{"time": 1, "step": 2, "peer": "peer1", "kind": "kill"}]}, "exactly one of time"),
    ({"seed": 1, "events": [{"time": 1, "kind": "kill"}]}, "events[0].peer"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "stall"}]}, "stall needs a duration"),
    ({"seed": 1, "events": [{"time": -1, "peer": "peer1", "kind": "kill"}]}, "events[0].time: must be >= 0"),
    ({"seed": 1, "events": [{"time": 1, "peer": "a b", "kind": "kill"}]}, "events[0].peer"),
    ({"seed": 1, "links": True, "events": [{"time": 1, "peer": "peer1", "kind": "slow", "rate": "fast"}]}, "rate"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "slow", "rate": "1mbit"}]}, "needs \"links\": true"),
    ({"seed": 1, "events": [{"time": 1, "kind": "pause", "peers": 2}]}, "pause needs a duration"),
    ({"seed": 1, "events": [{"time": 1, "kind": "partition", "peers": []}]}, "partition needs"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "latency"}]}, "events[0].ms: a number"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "latency", "ms": -5}]}, "events[0].ms: must be >= 0"),
    ({"seed": 1, "latency_ms": "fast"}, "latency_ms: a number"),
    ({"seed": 1, "alone_after": -1}, "alone_after: must be >= 0"),
    ({"seed": 1, "events": [{"time": 1, "peer": "peer1", "kind": "kill", "group": 0}]}, "events[0].group: must be >= 1"),
    ({"seed": 1, "generators": [{"kind": "mtbf"}]}, "generators[0].mtbf: a number"),
    ({"seed": 1, "generators": [{"kind": "spot", "every": 10, "wave": 1}]}, "unknown key(s) wave"),
    ({"seed": 1, "generators": [{"kind": "meteor"}]}, "generators[0].kind"),
    ({"seed": 1, "generators": [{"kind": "mtbf", "mtbf": 10, "start": 5, "end": 5}]}, "end must be after start"),
])
def test_bad_traces_are_refused_with_the_field_named(data, words):
    with pytest.raises(TraceError) as e:
        parse_trace(data)
    assert words in str(e.value)
    assert e.value.exit_code == 2


def test_the_cli_refuses_a_bad_trace_with_exit_code_2_and_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1, "events": [{"time": 1, "kind": "kill"}]}')
    assert sim_main(["run", str(bad), "--json"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["message"].startswith("events[0].peer")
    (tmp_path / "nojson.json").write_text("{")
    assert sim_main(["run", str(tmp_path / "nojson.json")]) == 2
    assert sim_main(["run", str(tmp_path / "missing.json")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_shipped_traces_parse(capsys):
    from pathlib import Path

    from simulations.pooltrace import is_pool_trace, load_pool_trace

    traces = sorted((Path(__file__).parents[2] / "simulations" / "traces").glob("*.json"))
    assert any(p.stem == "smoke" for p in traces)
    for path in traces:
        if is_pool_trace(path):  # a pool trace has its own format (tests/simulations/test_pool_checks.py)
            assert load_pool_trace(path).events, path
        else:
            assert load_trace(path).expanded(), path
        assert sim_main(["expand", str(path)]) == 0
    assert capsys.readouterr().out.count("\n") > len(traces)
