"""The pool trace's checks and figures on hand-written records (no process), and its trace format."""

import json

import pytest

from simulations.checks import Life
from simulations.poolchecks import (
    PoolRecord, as_jsonable, committed_steps_lost, from_jsonable, handbacks, one_run_per_worker, preemptions,
    priorities_respected, restarts_lost_nothing, utilisation,
)
from simulations.pooltrace import is_pool_trace, load_pool_trace, parse_pool_trace
from simulations.trace import TraceError

RUNS = {"big": dict(priority=0, min_peers=1, max_peers=2), "exp": dict(priority=2, min_peers=1, max_peers=1)}


def _ev(t, kind, run=None, worker=None, **detail):
    return dict(t=t, time=t, kind=kind, run_id=run, worker_id=worker, detail=detail)


def _record(**kw) -> PoolRecord:
    """Two workers; big from 0 on both; exp submitted at 50 takes w2 (assigned at 52), first step at 60; end 100."""
    rec = PoolRecord(workers=["w1", "w2"], runs=RUNS, end=100.0, cleaned=True)
    rec.coord_events = [
        _ev(0, "submit", "big"), _ev(0.5, "state", "big", state="running", reason="starts"),
        _ev(1, "assign", "big", "w1", reason="a free worker"), _ev(1, "assign", "big", "w2", reason="a free worker"),
        _ev(50, "submit", "exp"), _ev(52, "unassign", "big", "w2", reason="preempted by run exp"),
        _ev(52, "state", "exp", state="running", reason="starts"),
        _ev(52, "assign", "exp", "w2", reason="preempted from run big (priority 0 under 2)"),
        _ev(90, "state", "exp", state="finished"), _ev(90, "unassign", "exp", "w2", reason="run finished"),
        _ev(91, "assign", "big", "w2", reason="a free worker"), _ev(100, "state", "big", state="finished"),
    ]
    rec.lives = {k: Life(key=k, peer=k.split("/")[0], start=s, end=e, ended_by="x") for k, s, e in
                 (("w1/big/0", 2, 100), ("w2/big/0", 2, 53), ("w2/exp/0", 54, 90), ("w2/big/1", 92, 100))}
    rec.peer_events = [(10, "w1/big/0", {"event": "step", "step": 1}), (60, "w2/exp/0", {"event": "step", "step": 1})]
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec


def test_utilisation_counts_assigned_seconds_over_idle_seconds_from_the_first_start():
    u = utilisation(_record())
    assert u["window"] == [0.5, 100.0]
    # idle 2 x 99.5; assigned: w1 99, w2 51 + 38 + 9
    assert u["utilisation"] == pytest.approx((99 + 51 + 38 + 9) / 199, abs=1e-4)
    # a resident present on w1 from 20 to 40 takes those seconds out of both
    rec = _record(faults=[dict(t=20, kind="resident", worker="w1"), dict(t=40, kind="resident_leaves", worker="w1")])
    assert utilisation(rec)["idle_worker_seconds"] == pytest.approx(199 - 20)


def test_preemption_seconds_run_from_the_submission_to_the_first_step():
    (row,) = preemptions(_record())
    assert row["run"] == "exp" and row["from_runs"] == ["big"] and row["workers"] == ["w2"]
    assert row["seconds"] == pytest.approx(10.0)


def test_handback_is_the_time_from_the_residents_return_to_the_peer_stopped():
    rec = _record(faults=[dict(t=20, kind="resident", worker="w1"), dict(t=30, kind="resident", worker="w2")],
                  agent_events=[(27.5, "w1", {"event": "peer_stopped", "reason": "resident returned", "killed": False})])
    rec.lives["w1/big/0"].end = 27.5
    rows = handbacks(rec)
    assert rows[0]["seconds"] == pytest.approx(7.5) and rows[0]["run"] == "big"
    assert rows[1]["seconds"] == pytest.approx(23.0)  # never reported stopped: until the peer's end


def test_a_lower_run_holding_a_worker_a_higher_one_could_use_is_an_inversion():
    assert priorities_respected(_record(), min_residence=5)[0]
    rec = _record()
    rec.coord_events = [e for e in rec.coord_events if not (e["kind"] in ("assign", "unassign") and e["t"] == 52)]
    ok, problems = priorities_respected(rec, min_residence=5)
    assert not ok and "w" in problems[0] and "held by big" in problems[0]


def test_a_resume_below_the_committed_step_counts_lost_steps():
    rec = _record()
    rec.peer_events = [(10, "w1/big/0", {"event": "step", "step": 49}), (95, "w2/big/1", {"event": "resumed", "step": 38})]
    rec.lives["w1/big/0"].end = 60
    assert committed_steps_lost(rec)[0] == 11
    rec.lives["w1/big/0"].end = 100  # a live peer still holds step 49: the resumer catches up, nothing lost
    assert committed_steps_lost(rec)[0] == 0


def test_a_worker_in_two_runs_at_once_is_caught():
    assert one_run_per_worker(_record())[0]
    rec = _record()
    rec.lives["w2/exp/0"].start = 40
    assert not one_run_per_worker(rec)[0]


def test_a_restart_that_lost_a_run_or_an_assignment_is_caught():
    run = dict(run_id="big", owner="sim", task="synthetic", priority=0, min_peers=1, max_peers=2, total_steps=9,
               submitted_at=1.0, step=5, snapshot_step=4)
    before = dict(runs=[run], workers=[dict(worker_id="w1", run_id="big")])
    good = dict(killed=10.0, serving=15.0, before=before, after=before)
    assert restarts_lost_nothing(_record(restarts=[good]))[0]
    bad = dict(good, after=dict(runs=[dict(run, step=3)], workers=[dict(worker_id="w1", run_id=None)]))
    ok, problems, _ = restarts_lost_nothing(_record(restarts=[bad]))
    assert not ok and any("run changed" in p for p in problems) and any("assignment lost" in p for p in problems)


def test_the_record_survives_json():
    rec = _record()
    again = from_jsonable(json.loads(json.dumps(as_jsonable(rec))))
    assert utilisation(again) == utilisation(rec) and preemptions(again) == preemptions(rec)


def test_the_shipped_pool_trace_parses_and_bad_ones_say_which_field(tmp_path):
    assert is_pool_trace("simulations/traces/pool.json") and not is_pool_trace("simulations/traces/smoke.json")
    trace = load_pool_trace("simulations/traces/pool.json")
    assert trace.worker_ids == ["w1", "w2", "w3", "w4", "w5", "w6"] and set(trace.runs) == {"big", "exp1", "exp2"}
    base = json.loads(open("simulations/traces/pool.json").read())
    for change, field in (({"workers": 0}, "workers"), ({"stop_timeout": 40}, "stop_timeout"),
                          ({"events": base["events"][1:]}, "submit every run"),
                          ({"events": [dict(base["events"][0], kind="nap")]}, "kind"),
                          ({"events": base["events"] + [{"time": 1, "kind": "resident", "worker": "w9"}]}, "worker")):
        with pytest.raises(TraceError, match=field):
            parse_pool_trace({**base, **change})
