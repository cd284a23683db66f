"""The invariant checks on hand-written records: each one fails on the violation it names, and only on it."""

from simulations.checks import Life, Record, blocks_per_step, check_all, joiners_reach_current_step, \
    no_committed_step_lost, run_end, state_hash_agrees, work_lost
from simulations.netns import Link, nft_ruleset

CUR = {"blocks_applied": 10, "blocks_pending": 0, "blocks_skipped": 0, "blocks_duplicated": 0, "data_epoch": 1}


def step(s, h, samples=64, **kw):
    return {"event": "step", "step": s, "state_hash": h, "samples": samples, "cursor": CUR,
            "samples_per_second": 100.0, "peers": 2, **kw}


def healthy() -> Record:
    rec = Record(total_steps=3, target_batch_size=64)
    rec.lives = {"peer0.0": Life("peer0.0", "peer0", 0.0, initial=True),
                 "peer1.0": Life("peer1.0", "peer1", 0.0, initial=True),
                 "peer2.0": Life("peer2.0", "peer2", 5.0)}
    rec.events = [(1.0, "peer0.0", step(1, "a")), (1.1, "peer1.0", step(1, "a")),
                  (2.0, "peer0.0", step(2, "b")), (2.1, "peer1.0", step(2, "b")),
                  (6.0, "peer2.0", {"event": "bootstrapped", "step": 2, "state_hash": "b", "seconds": 0.5}),
                  (7.0, "peer0.0", step(3, "c")), (7.0, "peer1.0", step(3, "c")), (7.1, "peer2.0", step(3, "c"))]
    for life in rec.lives.values():
        life.end, life.ended_by = 8.0, "finished"
    rec.end = 8.0
    return rec


def test_a_healthy_record_passes_every_invariant():
    inv, problems = check_all(healthy(), cleaned=True, loss_ok=True)
    assert all(inv.values()), problems
    assert set(inv) == {"state_hash_agrees", "no_committed_step_lost", "joiners_reach_current_step",
                        "blocks_skipped_zero", "blocks_duplicated_zero", "run_finished", "processes_cleaned_up",
                        "final_loss_within_tolerance"}


def test_a_planned_pause_that_never_paused_the_run_fails():
    rec = healthy()
    rec.faults = [{"t": 1.5, "kind": "pause", "peer": None}]
    inv, problems = check_all(rec, cleaned=True, loss_ok=None)
    assert not inv["pauses_carried_out"] and "0 of 1" in problems["pauses_carried_out"][0]
    rec.faults.append({"t": 4.0, "kind": "pause_failed", "peer": None, "message": "run 'r' has no live trainer"})
    assert "no live trainer" in check_all(rec, cleaned=True, loss_ok=None)[1]["pauses_carried_out"][0]
    rec.faults = [{"t": 1.5, "kind": "pause", "peer": None}, {"t": 4.0, "kind": "paused", "peer": None, "step": 2}]
    inv, problems = check_all(rec, cleaned=True, loss_ok=None)
    assert inv["pauses_carried_out"] and all(inv.values()), problems


def test_two_hashes_at_one_step_fail_while_both_holders_live():
    rec = healthy()
    rec.events.append((7.2, "peer2.0", step(3, "X")))
    ok, problems = state_hash_agrees(rec)
    assert not ok and "step 3" in problems[0]
    assert not no_committed_step_lost(rec)[0]


def test_a_step_recommitted_after_all_its_holders_died_is_not_a_fork():
    rec = healthy()
    rec.events = [e for e in rec.events if e[2]["step"] != 3 and e[1] != "peer2.0"]
    del rec.lives["peer2.0"]
    rec.lives["peer0.0"].end = rec.lives["peer1.0"].end = 3.0
    rec.lives["peer3.0"] = Life("peer3.0", "peer3", 4.0, initial=True, end=8.0)
    rec.events.append((7.1, "peer3.0", step(2, "other")))
    assert state_hash_agrees(rec)[0]  # other content at step 2, but nobody who held "b" was alive any more
    assert no_committed_step_lost(rec)[0]
    rec.lives["peer1.0"].end = 7.5  # a holder of "b" lived: the same commit is now a fork
    assert not state_hash_agrees(rec)[0]


def test_a_peer_going_back_is_a_lost_step():
    rec = healthy()
    rec.events.append((7.5, "peer1.0", {"event": "resync", "from_step": 3, "step": 1, "state_hash": "a"}))
    ok, problems = no_committed_step_lost(rec)
    assert not ok and "went back from step 3 to 1" in problems[0]


def test_a_joiner_bootstrapping_an_old_step_fails_while_the_new_one_is_held():
    rec = healthy()
    rec.events[4] = (6.0, "peer2.0", {"event": "bootstrapped", "step": 1, "state_hash": "a", "seconds": 0.5})
    ok, problems, rows = joiners_reach_current_step(rec)
    assert not ok and "bootstrapped step 1 < 2" in problems[0]
    assert rows[0]["swarm_step_at_start"] == 2


def test_a_joiner_that_never_bootstraps_fails_and_a_killed_one_is_exempt():
    rec = healthy()
    rec.events = [e for e in rec.events if e[1] != "peer2.0"]
    assert not joiners_reach_current_step(rec)[0]
    rec.lives["peer2.0"].end, rec.lives["peer2.0"].ended_by = 5.5, "kill"
    assert joiners_reach_current_step(rec)[0]
    rec.lives["peer2.0"].ended_by = "exit"  # it gave up on its own while peer0 and peer1 served step 2
    ok, problems, _ = joiners_reach_current_step(rec)
    assert not ok and "exited without bootstrapping" in problems[0]
    for t, key in ((5.2, "peer0.0"), (5.3, "peer1.0")):  # ...unless they had left: the run was over for it
        rec.events.append((t, key, {"event": "left", "reason": "finished", "step": 2, "state_hash": "b"}))
    assert joiners_reach_current_step(rec)[0]


def test_a_joiner_left_behind_when_the_run_finished_fails_whether_it_leaves_or_is_stopped():
    rec = healthy()
    rec.events = [e for e in rec.events if not (e[1] == "peer2.0" and e[2]["event"] == "step")]  # it stays at 2
    rec.lives["peer2.0"].end, rec.lives["peer2.0"].ended_by = 70.0, "cleanup"  # never left: the runner stopped it
    ok, problems, rows = joiners_reach_current_step(rec)
    assert not ok and "stayed at step 2 < 3 until the runner stopped it" in problems[0]
    assert rows[0]["last_step"] == 2
    rec.lives["peer2.0"].ended_by = "finished"  # it left behind
    ok, problems, _ = joiners_reach_current_step(rec)
    assert not ok and "stopped at step 2 < 3" in problems[0]
    rec.lives["peer2.0"].ended_by = "kill"  # the trace killed it: exempt
    assert joiners_reach_current_step(rec)[0]
    rec.lives["peer2.0"].ended_by = "cleanup"  # a run that never finished (duration over): not this check's business
    rec.events = [e for e in rec.events if e[2]["step"] != 3]
    assert joiners_reach_current_step(rec)[0]


def test_cursor_and_finish_and_cleanup_invariants():
    rec = healthy()
    rec.events[-1] = (7.1, "peer2.0", step(3, "c", cursor={**CUR, "blocks_skipped": 2}))
    inv, problems = check_all(rec, cleaned=False, loss_ok=None)
    assert not inv["blocks_skipped_zero"] and inv["blocks_duplicated_zero"]
    assert not inv["processes_cleaned_up"] and "final_loss_within_tolerance" not in inv
    rec.total_steps = 4
    assert not check_all(rec, cleaned=True, loss_ok=None)[0]["run_finished"]


def test_a_sample_budget_run_ends_where_its_peers_left_finished():
    """Under total_samples or epochs the last step is not total_steps: the harness takes it from the peers'
    ``left`` events (it once judged every run by total_steps alone)."""
    rec = healthy()
    rec.total_steps, rec.sample_budget = 0, True
    assert run_end(rec) is None and not check_all(rec, cleaned=True, loss_ok=None)[0]["run_finished"]
    left = {"event": "left", "reason": "finished", "step": 3, "state_hash": "c", "cursor": CUR}
    rec.events += [(7.5, "peer0.0", left), (7.5, "peer1.0", left), (7.6, "peer2.0", left)]
    assert run_end(rec) == (7.0, 3)
    inv, problems = check_all(rec, cleaned=True, loss_ok=None)
    assert all(inv.values()), problems
    # a peer that stayed behind at step 2 until the runner stopped it fails the joiners' check, as under total_steps
    rec.events = [e for e in rec.events if e[1] != "peer2.0" or e[2]["event"] == "bootstrapped"]
    rec.lives["peer2.0"].ended_by = "cleanup"
    assert not joiners_reach_current_step(rec)[0]
    # a peer that left stopped (a pause, a signal) does not end the run
    rec.events = [e for e in rec.events if e[2]["event"] != "left"]
    rec.events.append((7.5, "peer0.0", {**left, "reason": "stopped"}))
    assert run_end(rec) is None


def test_work_lost_counts_kills_and_resyncs_and_prefers_a_reported_accumulator():
    rec = healthy()
    rec.lives["peer1.0"].end, rec.lives["peer1.0"].ended_by = 7.5, "kill"
    rec.events.append((7.3, "peer1.0", {"event": "progress", "samples_per_second": 100.0, "peers": 2,
                                        "samples_accumulated": 40}))
    rows = work_lost(rec)
    assert rows == [dict(t=7.5, peer="peer1.0", kind="kill", samples_lost=40, method="reported")]


def test_nft_rules_follow_the_link_state():
    link = Link(ns="n", host_if="h", peer_if="p", ip="10.0.0.2")
    assert "drop" not in nft_ruleset(link)
    link.loss_percent, link.blocked = 12.5, {"10.0.0.4", "10.0.0.3"}
    rules = nft_ruleset(link)
    assert "ip saddr { 10.0.0.3, 10.0.0.4 } drop" in rules
    assert "numgen random mod 1000 < 125 drop" in rules


def test_blocks_per_step_keeps_the_steps_whose_reports_agree():
    rec = healthy()
    rec.events[0][2]["blocks"] = [[0, 4], [9, 10]]
    rec.events[1][2]["blocks"] = [[0, 4], [9, 10]]
    rec.events[2][2]["blocks"] = [[4, 9]]
    rec.events[3][2]["blocks"] = [[4, 9]]
    assert blocks_per_step(rec) == {1: [[0, 4], [9, 10]], 2: [[4, 9]]}  # step 3 reported none
    rec.events[3][2]["blocks"] = [[10, 12]]  # another history's step 2
    assert blocks_per_step(rec) == {1: [[0, 4], [9, 10]]}


def test_the_runner_tells_a_sample_budget_from_the_trace_and_the_task():
    from simulations.trace import sample_budget_of

    assert not sample_budget_of("synthetic", {}) and not sample_budget_of("synthetic", {"total_steps": 8})
    assert sample_budget_of("synthetic", {"epochs": 1}) and sample_budget_of("synthetic", {"total_samples": 640})


def test_a_history_its_peer_discarded_at_a_reunion_is_not_the_runs():
    """A split's minority stepped alone (steps 2-3 of its own) and re-synced to the majority's history, discarding
    them: its events at those steps are not the run's; without the resync's ``discarded`` they are a fork."""
    rec = healthy()
    rec.lives["peer2.0"].start = 1.4
    rec.events[4:5] = [(1.5, "peer2.0", {"event": "bootstrapped", "step": 1, "state_hash": "a", "seconds": 0.5}),
                       (2.6, "peer2.0", step(2, "minority2")), (2.7, "peer2.0", step(3, "minority3"))]
    assert not state_hash_agrees(rec)[0] and not no_committed_step_lost(rec)[0]
    rec.events.append((7.05, "peer2.0", {"event": "resync", "from_step": 3, "step": 2, "state_hash": "b",
                                         "discarded": 2, "seconds": 0.1}))
    rec.events.sort(key=lambda e: e[0])
    inv, problems = check_all(rec, cleaned=True, loss_ok=True)
    assert all(inv.values()), problems
    assert [e["state_hash"] for _, k, e in rec.of("step") if k == "peer2.0"] == ["c"]
    # a re-sync that discarded fewer steps than it went back is still a lost step
    rec.events = [(t, k, {**e, "discarded": 1} if e["event"] == "resync" else e) for t, k, e in rec.events]
    assert not no_committed_step_lost(rec)[0]
