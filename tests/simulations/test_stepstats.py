"""The step figures (step size, round overhead, abandoned rounds by reason) on recorded events, and in the report."""

import json

import pytest

from simulations.__main__ import main as sim_main
from simulations.report import human_lines, step_figures
from simulations.stepstats import (abandon_class, abandoned_by_reason, distinct_abandoned, percentile, round_overhead,
                                   step_size_stats, step_sizes)
from tests.simulations.test_checks import healthy, step
from tests.simulations.test_report import SMOKE, write_record

# reasons as the peers print them: decide_commit's texts, the trainer's "no round formed: ..." wrapper around
# hivemind's and the round's exceptions (the first two as recorded by tests/simulations runs)
REASONS = {
    "group of 2 is not a majority of 4 live trainers": "not a majority",
    "no round formed: AllreduceException: Averaging step failed: could not find a group": "could not find a group",
    "round carries 70 samples, fewer than target_batch_size=80": "fewer than target",
    "my claimed blocks overlapped another participant's": "claims overlapped",
    "no round formed: SwarmMovedOn: the swarm committed this step before a group formed": "swarm moved on",
    "1 of 2 participants did not vote": "did not vote",
    "local all-reduce incomplete: part 1 failed": "all-reduce incomplete",
    "participant abc123 reports an incomplete all-reduce: sender banned": "all-reduce incomplete",
    "participant abc123 holds a different averaged gradient": "different gradient",
    "no round formed: TimeoutError: ": "timed out",
    "no round formed: RuntimeError: something new": "other",
    "": "other",
}


@pytest.mark.parametrize("reason, cls", REASONS.items())
def test_each_recorded_reason_falls_in_its_class(reason, cls):
    assert abandon_class(reason) == cls


def test_abandoned_rounds_are_counted_by_class_most_frequent_first():
    reasons = ["group of 2 is not a majority of 4 live trainers"] * 3 + [
        "no round formed: AllreduceException: Averaging step failed: could not find a group", None]
    assert abandoned_by_reason(reasons) == {"not a majority": 3, "could not find a group": 1, "other": 1}
    assert list(abandoned_by_reason(reasons)) == ["not a majority", "could not find a group", "other"]
    assert abandoned_by_reason([]) == {}


def test_percentile_interpolates_between_ranks_like_numpy():
    assert percentile([], 95) is None
    assert percentile([5], 95) == 5
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(range(1, 101), 95) == pytest.approx(95.05)  # numpy.percentile(range(1, 101), 95)


def test_step_sizes_take_the_first_report_of_each_step_and_their_error_against_the_target():
    events = [step(1, "a", samples=64), step(1, "a", samples=64), step(2, "b", samples=128), step(3, "c", samples=60),
              {"event": "step", "step": 4}]  # a report without samples is left out
    assert step_sizes(events) == {1: 64, 2: 128, 3: 60}
    stats = step_size_stats(step_sizes(events).values(), 64)
    assert (stats["min"], stats["p50"], stats["max"], stats["steps"]) == (60, 64, 128, 3)
    assert stats["p95_error"] == pytest.approx(percentile([0.0, 1.0, 4 / 64], 95))
    assert step_size_stats([], 64)["p95_error"] is None and step_size_stats([64], 0)["p95_error"] is None


def test_round_overhead_is_the_mean_share_of_each_step_after_the_first_per_peer():
    rows = [("a", 10.0, step(1, "x", round_overhead_s=0.5)),  # a peer's first step: no wall time to divide by
            ("a", 12.0, step(2, "y", round_overhead_s=0.5)),  # 0.5 / 2.0
            ("b", 11.0, step(1, "x", round_overhead_s=9.0)),
            ("b", 12.0, step(2, "y", round_overhead_s=0.1)),  # 0.1 / 1.0
            ("b", 20.0, step(5, "z", round_overhead_s=0.1))]  # after a re-sync (2 -> 5): left out
    out = round_overhead(reversed(rows))  # any order
    assert out["share"] == pytest.approx((0.25 + 0.1) / 2) and out["steps"] == 2 and out["reported"]


def test_round_overhead_is_unknown_not_zero_without_the_field():
    out = round_overhead([("a", 1.0, step(1, "x")), ("a", 2.0, step(2, "y"))])
    assert out == dict(share=None, steps=0, reported=False)


def test_the_report_carries_the_step_figures_and_prints_them(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[2])
    rec = healthy()  # target 64; steps at 1.0 / 2.0 / 7.0 (peer0) and 1.1 / 2.1 / 7.0 (peer1)
    for t, key, e in rec.events:
        if e["event"] == "step":
            e.update(time=t, round_overhead_s=0.2, samples={1: 64, 2: 80, 3: 64}[e["step"]])
    rec.events += [(1.5, "peer0.0", {"event": "round_abandoned", "step": 1,
                                     "reason": "group of 1 is not a majority of 2 live trainers"}),
                   (1.6, "peer1.0", {"event": "round_abandoned", "step": 1, "reason": "weird"})]
    figures = step_figures(rec)
    assert figures["rounds_abandoned_by_reason"] == {"not a majority": 1, "other": 1}
    assert figures["step_size"]["max"] == 80 and figures["step_size"]["p50"] == 64
    assert figures["step_size_p95_error"] == pytest.approx(percentile([0, 0.25, 0], 95), abs=1e-4)
    # peer0: 0.2/1.0, 0.2/5.0; peer1: 0.2/1.0, 0.2/4.9; peer2's only consecutive pair is none (bootstrapped at 2)
    assert figures["round_overhead"]["share"] == pytest.approx((0.2 + 0.04 + 0.2 + 0.2 / 4.9) / 4, abs=1e-4)
    write_record(tmp_path / "run", rec)
    assert sim_main(["report", str(tmp_path / "run"), "--trace", SMOKE, "--no-baseline", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("rounds_abandoned_by_reason", "rounds_abandoned_distinct", "step_size", "step_size_p95_error",
                "round_overhead"):
        assert summary[key] == json.loads(json.dumps(figures[key]))
    assert sim_main(["report", str(tmp_path / "run"), "--trace", SMOKE, "--no-baseline"]) == 0
    text = capsys.readouterr().out
    assert "samples per step (target 64): min 64, p50 64, p95" in text and "round overhead: 0.1" in text
    assert "rounds abandoned: 2 reports (not a majority: 1, other: 1)" in text
    assert "rounds abandoned, each counted once: 2 (not a majority: 1, other: 1)" in text


def test_the_human_report_says_when_the_round_overhead_is_unknown():
    summary = dict(step_figures(healthy()), rounds_abandoned=0)
    lines = human_lines(summary)
    assert summary["round_overhead"]["share"] is None
    assert any("unknown (the peers report no round_overhead_s)" in line for line in lines)
    assert lines[-2:] == ["rounds abandoned: 0 reports", "rounds abandoned, each counted once: 0"]


def test_reasons_of_the_planned_round_are_classified():
    from simulations.stepstats import abandon_class

    assert abandon_class("local all-reduce incomplete: round carries 56 samples, fewer than the step's 64") \
        == "fewer than target"
    assert abandon_class("local all-reduce incomplete: group of 1 is not a majority of 3 live trainers") \
        == "not a majority"
    assert abandon_class("local all-reduce incomplete: no accepted samples") == "no accepted samples"


def test_a_round_abandoned_by_all_its_members_counts_once():
    group = ["aaaaaa", "bbbbbb", "cccccc"]
    short = "local all-reduce incomplete: round carries 200 samples, fewer than the step's 256"
    events = [dict(step=7, round="ab12", group=group, reason=short) for _ in group]  # each member reports it
    events += [dict(step=7, round="cd34", group=group[:2], reason="1 of 2 participants did not vote"),
               dict(step=7, round="cd34", group=group[:2], reason="participant aaaaaa reports an incomplete all-reduce"),
               dict(step=8, group=group, reason=short), dict(step=8, group=list(reversed(group)), reason=short),
               dict(step=9, reason="no round formed: SwarmMovedOn: the swarm committed this step before a group formed"),
               dict(step=9, reason="no round formed: SwarmMovedOn: the swarm committed this step before a group formed")]
    # round ab12 once; cd34 once, by its first report; step 8's group (no id: an earlier build's events) once;
    # every attempt in which no group formed is that peer's own
    assert distinct_abandoned(events) == {"total": 5, "fewer than target": 2, "swarm moved on": 2, "did not vote": 1}
    assert abandoned_by_reason(e["reason"] for e in events)["fewer than target"] == 5
    assert distinct_abandoned([]) == {"total": 0}
