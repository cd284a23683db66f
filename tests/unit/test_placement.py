"""Placement and preemption of the pool, at the pure level: examples of each rule, then properties.

The examples follow the issue's rules one by one, the vision's scenario first. The properties draw
random pools (CPU and CUDA workers, residents present, dead workers, runs of every state and any
assignments, consistent or not) and check, after one plan and at the fixed point that planning with
time advancing reaches: no worker in two runs or lent while its resident is present; max_peers and
min_peers hold (a run below its minimum is paused instead); young assignments go only when they must;
priority is never inverted once the residence time has passed; shares inside a class are max-min
fair (exactly, against a brute force, in a uniform pool); no run starves when capacity is enough for
it; plan is idempotent. Reference checks here are written independently of the module (brute force).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.coordinator.matching import b_matching, matched_counts
from swarmrun.coordinator.placement import (
    Assign, Assignment, Needs, Pause, Policy, PoolRun, Release, Resume, RunState, Worker, apply, plan,
)
from swarmrun.protocol.errors import UsageError

FAST = settings(max_examples=120, deadline=None)
GiB = 1 << 30
RUNNING, PENDING, PAUSED = RunState.RUNNING, RunState.PENDING, RunState.PAUSED


def worker(name: str, *, now: float = 0.0, cuda: int = 0, ram: int = 32, resident: bool = False) -> Worker:
    devices = {"cpu": ram * GiB} | ({"cuda": cuda * GiB} if cuda else {})
    return Worker(worker_id=name, devices=devices, last_seen=now, resident_present=resident)


def run(name: str, *, priority: int = 1, lo: int = 1, hi: int = 8, share: float = 1.0, at: float = 0.0,
        state: RunState = PENDING, device: str = "cpu", memory: int = 0) -> PoolRun:
    return PoolRun(run_id=name, owner="u", priority=priority, min_peers=lo, max_peers=hi, share=share,
                   submitted_at=at, state=state, needs=Needs(device=device, min_memory=memory * GiB))


def holding(assignments) -> dict[str, set[str]]:
    """Run id -> the workers it holds."""
    out: dict[str, set[str]] = {}
    for a in assignments:
        out.setdefault(a.run_id, set()).add(a.worker_id)
    return out


def state_of(runs, run_id: str) -> RunState:
    return next(r.state for r in runs if r.run_id == run_id)


def step(now, runs, workers, assignments, policy=Policy()):
    """One tick of the coordinator: plan, then record the actions."""
    acts = plan(now, runs, workers, assignments, policy)
    runs, assignments = apply(acts, runs, assignments, now)
    return acts, runs, assignments


def seen(workers, now):
    return [replace(w, last_seen=now) for w in workers]


# ----------------------------------------------------------------------------------------------- examples


def test_vision_scenario_big_run_gives_way_to_a_wave_and_comes_back():
    """A big low-priority run holds the pool; high-priority small runs arrive; it shrinks, pauses, resumes."""
    names = [f"w{i}" for i in range(6)]
    workers = [worker(n) for n in names]
    runs = [run("big", priority=0, lo=3, hi=6)]
    acts, runs, asg = step(0.0, runs, workers, [])
    assert acts[0] == Resume(run_id="big", reason="starts on 6 workers (min_peers=3)")
    assert holding(asg) == {"big": set(names)}

    # a wave of three small runs of priority 2: the big one shrinks to its minimum and keeps running
    now = 1000.0
    runs += tuple(run(f"s{i}", priority=2, lo=1, hi=1, at=now) for i in range(3))
    acts, runs, asg = step(now, runs, seen(workers, now), asg)
    assert len(holding(asg)["big"]) == 3 and state_of(runs, "big") is RUNNING
    assert {a.reason for a in acts if isinstance(a, Release)} == {
        f"preempted by run s{i} (priority 2 over 0)" for i in range(3)}
    assert not any(isinstance(a, Pause) for a in acts)

    # a fourth one would push it below its minimum: it is paused (all its workers released), never killed
    now = 2000.0
    runs += (run("s3", priority=2, lo=1, hi=1, at=now),)
    acts, runs, asg = step(now, runs, seen(workers, now), asg)
    assert state_of(runs, "big") is PAUSED and "big" not in holding(asg)
    assert isinstance(acts[0], Pause) and acts[0].run_id == "big"
    assert [a.run_id for a in acts[1:4]] == ["big"] * 3 and all(isinstance(a, Release) for a in acts[1:4])
    idle = set(names) - set().union(*holding(asg).values())
    assert len(idle) == 2

    # a resident returns to s0's machine, 10 s after it was lent: handed back at once; s0 moves to an idle one
    now = 2010.0
    back = next(iter(holding(asg)["s0"]))
    workers = [replace(w, resident_present=w.worker_id == back) for w in workers]
    acts, runs, asg = step(now, runs, seen(workers, now), asg)
    assert Release(worker_id=back, run_id="s0", reason="resident returned") in acts
    assert state_of(runs, "s0") is RUNNING and holding(asg)["s0"] <= idle

    # the wave finishes: the big run resumes on what is free, fewer machines than before (a resident is in)
    now = 3000.0
    runs = tuple(replace(r, state=RunState.FINISHED) if r.run_id != "big" else r for r in runs)
    acts, runs, asg = step(now, runs, seen(workers, now), asg)
    assert Resume(run_id="big", reason="resumes on 5 workers (min_peers=3)") in acts
    assert holding(asg) == {"big": set(names) - {back}}

    # the resident leaves: the big run grows back at once (a free worker needs no residence time)
    now = 3010.0
    workers = [replace(w, resident_present=False) for w in workers]
    acts, runs, asg = step(now, runs, seen(workers, now), asg)
    assert acts == [Assign(worker_id=back, run_id="big", reason="a free worker that fits it")]


def test_strict_priority_between_classes():
    workers = [worker(f"w{i}") for i in range(4)]
    runs = [run("low", priority=0, lo=1, hi=8), run("high", priority=2, lo=1, hi=8, at=5.0)]
    _, runs, asg = step(0.0, runs, workers, [])
    assert holding(asg) == {"high": {"w0", "w1", "w2", "w3"}}
    assert state_of(runs, "low") is PENDING


def test_weighted_max_min_share_inside_a_class():
    workers = [worker(f"w{i}") for i in range(6)]
    runs = [run("a", share=1.0), run("b", share=2.0), run("c", share=1.0, hi=1)]
    _, runs, asg = step(0.0, runs, workers, [])
    assert {r: len(ws) for r, ws in holding(asg).items()} == {"a": 2, "b": 3, "c": 1}

    # max-min is lexicographic: with the lowest share fixed at 1 (run b), the next lowest is raised too
    runs = [run("a", share=0.5, hi=1), run("b", share=2.0, hi=3), run("c", share=1.0, hi=2)]
    _, runs, asg = step(0.0, runs, workers[:5], [])
    assert {r: len(ws) for r, ws in holding(asg).items()} == {"a": 1, "b": 2, "c": 2}


def test_a_run_starts_only_when_it_can_hold_its_minimum():
    workers = [worker(f"w{i}") for i in range(3)]
    runs = [run("r", lo=4)]
    assert plan(0.0, runs, workers, []) == []
    acts, runs, asg = step(0.0, runs, workers + [worker("w3")], [])
    assert acts[0] == Resume(run_id="r", reason="starts on 4 workers (min_peers=4)") and len(asg) == 4


def test_device_and_memory_constraints():
    """A CUDA run only on CUDA workers with enough memory; a CPU run leaves the CUDA workers to it."""
    workers = [worker("cpu0"), worker("cpu1"), worker("small", cuda=16), worker("big0", cuda=80),
               worker("big1", cuda=80)]
    runs = [run("cpu", priority=2, lo=1, hi=3), run("gpu", priority=1, lo=2, hi=4, device="cuda", memory=40)]
    _, runs, asg = step(0.0, runs, workers, [])
    assert holding(asg) == {"cpu": {"cpu0", "cpu1", "small"}, "gpu": {"big0", "big1"}}


def test_max_peers_never_exceeded_even_when_lowered():
    workers = [worker(f"w{i}") for i in range(5)]
    _, runs, asg = step(0.0, [run("r", lo=1, hi=2)], workers, [])
    assert len(asg) == 2
    lowered = [replace(runs[0], max_peers=1)]
    acts = plan(10.0, lowered, seen(workers, 10.0), asg)
    assert [a.reason for a in acts] == ["over max_peers=1"]


def test_preemption_takes_from_the_lowest_priority_most_over_share_run_first():
    workers = [worker(f"w{i}") for i in range(6)]
    asg = [Assignment(worker_id=w, run_id=r, since=0.0)
           for w, r in zip(["w0", "w1", "w2", "w3", "w4", "w5"], ["a", "a", "a", "b", "c", "c"])]
    runs = [run("a", priority=0, state=RUNNING), run("b", priority=0, state=RUNNING),
            run("c", priority=1, hi=2, state=RUNNING), run("h", priority=2, lo=2, hi=2, at=500.0)]
    acts = plan(1000.0, runs, seen(workers, 1000.0), asg)
    assert {(a.worker_id, a.run_id) for a in acts if isinstance(a, Release)} <= {("w0", "a"), ("w1", "a"), ("w2", "a")}
    assert sum(isinstance(a, Release) for a in acts) == 2 and not any(isinstance(a, Pause) for a in acts)


def test_residence_time_protects_young_assignments_from_preemption():
    workers = [worker(f"w{i}") for i in range(2)]
    asg = [Assignment(worker_id=f"w{i}", run_id="low", since=990.0) for i in range(2)]
    runs = [run("low", priority=0, state=RUNNING), run("high", priority=2, lo=1, at=995.0)]
    policy = Policy(min_residence_s=120.0)
    assert plan(1000.0, runs, seen(workers, 1000.0), asg, policy) == []
    acts = plan(1200.0, runs, seen(workers, 1200.0), asg, policy)
    assert Resume(run_id="high", reason="starts on 2 workers (min_peers=1)") in acts


def test_a_returning_resident_or_a_dead_worker_frees_the_machine_at_once():
    workers = [worker("home", now=1000.0, resident=True), worker("gone", now=900.0), worker("ok", now=1000.0)]
    asg = [Assignment(worker_id=w.worker_id, run_id="r", since=999.0) for w in workers]
    runs = [run("r", lo=1, state=RUNNING)]
    acts = plan(1000.0, runs, workers, asg)
    assert acts == [Release(worker_id="home", run_id="r", reason="resident returned"),
                    Release(worker_id="gone", run_id="r", reason="worker lost: not heard from for 100 s")]


def test_a_run_pushed_below_its_minimum_is_paused_not_killed():
    workers = [worker("w0", now=10.0, resident=True), worker("w1", now=10.0)]
    asg = [Assignment(worker_id=w, run_id="r", since=0.0) for w in ("w0", "w1")]
    acts, runs, asg = step(10.0, [run("r", lo=2, state=RUNNING)], workers, asg)
    assert acts[0].run_id == "r" and isinstance(acts[0], Pause)
    assert acts[0].reason.startswith("cannot hold min_peers=2: 1 worker left to it")
    assert state_of(runs, "r") is PAUSED and asg == ()


def test_hysteresis_inside_a_class():
    workers = [worker(f"w{i}") for i in range(5)]
    asg = [Assignment(worker_id=f"w{i}", run_id="a" if i < 4 else "b", since=0.0) for i in range(5)]
    runs = [run("a", state=RUNNING), run("b", state=RUNNING)]
    now = 1000.0
    assert plan(now, runs, seen(workers, now), asg, Policy(hysteresis=3.0)) == []  # a gap of 3 is tolerated
    acts = plan(now, runs, seen(workers, now), asg, Policy(hysteresis=0.5))
    assert [(type(a), a.run_id) for a in acts] == [(Release, "a"), (Assign, "b")]
    assert acts[1].reason == "rebalanced from run a: fair share of priority 1"


@pytest.mark.parametrize("state", [RunState.HELD, RunState.CANCELLED, RunState.FINISHED])
def test_held_cancelled_and_finished_runs_hold_no_worker(state):
    workers = [worker("w0")]
    asg = [Assignment(worker_id="w0", run_id="r", since=0.0)]
    assert plan(0.0, [run("r", state=state)], workers, asg) == [
        Release(worker_id="w0", run_id="r", reason=f"run {state.value}")]


def test_a_paused_run_resumes_on_other_workers():
    workers = [worker("old", resident=True), worker("n0"), worker("n1")]
    acts, runs, asg = step(0.0, [run("r", lo=2, state=PAUSED)], workers, [])
    assert acts[0] == Resume(run_id="r", reason="resumes on 2 workers (min_peers=2)")
    assert holding(asg) == {"r": {"n0", "n1"}}


def test_a_newcomer_of_the_same_class_gets_its_minimum_from_a_run_above_its_own():
    workers = [worker(f"w{i}") for i in range(4)]
    asg = [Assignment(worker_id=f"w{i}", run_id="a", since=0.0) for i in range(4)]
    runs = [run("a", state=RUNNING), run("b", lo=3, at=500.0)]
    _, runs, asg = step(1000.0, runs, seen(workers, 1000.0), asg)
    assert {r: len(ws) for r, ws in holding(asg).items()} == {"a": 1, "b": 3}


def test_apply_refuses_actions_that_do_not_fit_the_state():
    runs = (run("r", state=RUNNING), run("p"))
    asg = (Assignment(worker_id="w0", run_id="r", since=0.0),)
    for bad in ([Assign(worker_id="w0", run_id="p", reason="x")],
                [Release(worker_id="w1", run_id="r", reason="x")],
                [Pause(run_id="p", reason="x")],
                [Resume(run_id="r", reason="x")],
                [Pause(run_id="r", reason="x")]):  # leaves w0 with a paused run
        with pytest.raises(ValueError):
            apply(bad, runs, asg, 1.0)


def test_records_refuse_nonsense():
    with pytest.raises(UsageError):
        run("r", lo=3, hi=2)
    with pytest.raises(UsageError):
        run("r", share=0.0)
    with pytest.raises(UsageError):
        Policy(hysteresis=-1.0)
    with pytest.raises(ValueError):
        plan(0.0, [], [], [Assignment(worker_id="w", run_id="a", since=0.0),
                           Assignment(worker_id="w", run_id="b", since=0.0)])


# --------------------------------------------------------------------------------------------- properties

NOW = 1000.0
TIMEOUT = 30.0


def fits_ref(r: PoolRun, w: Worker) -> bool:
    return r.needs.device in w.devices and w.devices[r.needs.device] >= r.needs.min_memory


def usable_ref(w: Worker, now: float) -> bool:
    return not w.resident_present and now - w.last_seen <= TIMEOUT


@st.composite
def pools(draw, uniform: bool = False, one_class: bool = False, consistent_start: bool = False):
    """(runs, workers, assignments, policy) at NOW: any pool, including inconsistent registries."""
    workers = []
    for i in range(draw(st.integers(1, 7))):
        cuda = 0 if uniform else draw(st.sampled_from([0, 0, 16, 80]))
        ram = 32 if uniform else draw(st.sampled_from([8, 32]))
        dead = False if uniform else draw(st.integers(0, 5)) == 0
        workers.append(worker(f"w{i}", now=NOW - (100.0 if dead else 5.0), cuda=cuda, ram=ram,
                              resident=False if uniform else draw(st.integers(0, 4)) == 0))
    runs = []
    states = [PENDING, RUNNING, PAUSED] if consistent_start else list(RunState)
    for i in range(draw(st.integers(0 if not uniform else 1, 4))):
        lo = draw(st.integers(1, 3))
        device = "cpu" if uniform else draw(st.sampled_from(["cpu", "cpu", "cuda"]))
        runs.append(run(f"r{i}", priority=1 if one_class else draw(st.integers(0, 2)), lo=lo,
                        hi=lo + draw(st.integers(0, 3)), share=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
                        at=float(draw(st.integers(0, 100))), state=draw(st.sampled_from(states)), device=device,
                        memory=0 if uniform else draw(st.sampled_from([0, 0, 16, 40]))))
    asg = []
    for w in workers:
        holder = draw(st.sampled_from([None] + runs)) if runs else None
        if holder is not None and (not consistent_start or holder.state is RUNNING):
            asg.append(Assignment(worker_id=w.worker_id, run_id=holder.run_id,
                                  since=NOW - draw(st.sampled_from([1.0, 50.0, 500.0]))))
    policy = Policy(min_residence_s=draw(st.sampled_from([0.0, 60.0])),
                    hysteresis=0.0 if uniform else draw(st.sampled_from([0.0, 0.5, 1.5])), worker_timeout=TIMEOUT)
    return runs, workers, asg, policy


def check_valid(now, runs, workers, asg):
    """No worker in two runs; lent workers usable and fitting; max_peers; running runs at their minimum."""
    by_w = {w.worker_id: w for w in workers}
    assert len({a.worker_id for a in asg}) == len(asg)
    held = holding(asg)
    for a in asg:
        assert usable_ref(by_w[a.worker_id], now)
    for r in runs:
        mine = held.get(r.run_id, set())
        assert all(fits_ref(r, by_w[w]) for w in mine)
        assert len(mine) <= r.max_peers
        assert (r.min_peers <= len(mine)) if r.state is RUNNING else not mine


def can_hold_minimums(runs, workers) -> bool:
    """Brute force: can every run get ``min_peers`` distinct workers that fit it, all at once?"""
    slots = [r for r in runs for _ in range(r.min_peers)]

    def place(i, used, last):
        if i == len(slots):
            return True
        start = last + 1 if i and slots[i - 1] is slots[i] else 0  # a run's slots take workers in order
        return any(place(i + 1, used | {j}, j) for j in range(start, len(workers))
                   if j not in used and fits_ref(slots[i], workers[j]))

    return len(slots) <= len(workers) and place(0, frozenset(), -1)


def settle(runs, workers, asg, policy, max_ticks: int = 25):
    """Plan and apply with time advancing past the residence time each tick, until plan has nothing to do
    with every assignment older than the residence time: a fixed point, not a wait."""
    now, dt = NOW, policy.min_residence_s + 1.0
    alive = {w.worker_id for w in workers if NOW - w.last_seen <= TIMEOUT}
    for _ in range(max_ticks):
        workers = [replace(w, last_seen=now) if w.worker_id in alive else w for w in workers]
        acts = plan(now, runs, workers, asg, policy)
        if not acts and all(now - a.since >= policy.min_residence_s for a in asg):
            return now, runs, workers, asg  # nothing to do, and not because of a young assignment
        runs, asg = apply(acts, runs, asg, now)
        now += dt
    raise AssertionError(f"no fixed point after {max_ticks} ticks; last actions {acts}")


@FAST
@given(pools())
def test_one_plan_leaves_a_valid_pool_moves_young_workers_only_when_it_must_and_is_idempotent(pool):
    runs, workers, asg, policy = pool
    acts = plan(NOW, runs, workers, asg, policy)
    runs2, asg2 = apply(acts, runs, asg, NOW)
    check_valid(NOW, runs2, workers, asg2)
    assert all(a.reason for a in acts)
    assert plan(NOW, runs2, workers, asg2, policy) == []
    by_r, by_w = {r.run_id: r for r in runs}, {w.worker_id: w for w in workers}
    before = holding(asg)
    for a in asg:
        if NOW - a.since < policy.min_residence_s and a not in asg2:
            r, w = by_r.get(a.run_id), by_w[a.worker_id]
            assert (not usable_ref(w, NOW) or r is None or r.state is not RUNNING or not fits_ref(r, w)
                    or state_of(runs2, r.run_id) is PAUSED or len(before[r.run_id]) > r.max_peers), a
    for p in (a for a in acts if isinstance(a, Pause)):
        assert state_of(runs, p.run_id) is RUNNING  # only a running run pauses, and only to PAUSED


@FAST
@given(pools())
def test_the_fixed_point_respects_priority_and_fair_shares(pool):
    runs, workers, asg, policy = pool
    now, runs, workers, asg = settle(runs, workers, asg, policy)
    check_valid(now, runs, workers, asg)
    ok = [w for w in workers if usable_ref(w, now)]
    owner = {a.worker_id: a.run_id for a in asg}
    prio = {r.run_id: r.priority for r in runs}
    held = holding(asg)
    running = [r for r in runs if r.state is RUNNING]
    for r in runs:
        # a waiting run could not hold its minimum beside the running runs of its class, even taking every
        # worker that is free or held by a lower class: priority is not inverted
        if r.state in (PENDING, PAUSED):
            room = [w for w in ok if prio.get(owner.get(w.worker_id), -1) <= r.priority]
            assert not can_hold_minimums([s for s in running if s.priority == r.priority] + [r], room), r
    for x in running:
        mine = held[x.run_id]
        if len(mine) < x.max_peers:
            # work conserving and strict priority: nothing free or held by a lower class fits it
            assert not any(fits_ref(x, w) and prio.get(owner.get(w.worker_id), -1) < x.priority for w in ok)
            for y in running:
                theirs = held[y.run_id]
                if y is not x and y.priority == x.priority and len(theirs) > y.min_peers and any(
                        fits_ref(x, w) for w in workers if w.worker_id in theirs):
                    assert not fairer_move(len(mine), x.share, len(theirs), y.share, policy.hysteresis), (x, y)


def fairer_move(cx: int, sx: float, cy: int, sy: float, hysteresis: float) -> bool:
    """Whether moving one worker from y to x raises the pair's sorted shares, across a gap over the hysteresis."""
    a, b = Fraction(cx) / Fraction(sx), Fraction(cy) / Fraction(sy)
    raised = sorted([Fraction(cx + 1) / Fraction(sx), Fraction(cy - 1) / Fraction(sy)]) > sorted([a, b])
    return raised and b - a > Fraction(hysteresis)


def leximin_best(runs, n_workers):
    """Brute force: the best sorted vector of workers per unit share over every allocation in bounds."""
    best = None
    for counts in product(*(range(r.min_peers, r.max_peers + 1) for r in runs)):
        if sum(counts) <= n_workers:
            key = sorted(Fraction(c) / Fraction(r.share) for c, r in zip(counts, runs))
            best = key if best is None or key > best else best
    return best


@FAST
@given(pools(uniform=True, one_class=True, consistent_start=True))
def test_shares_converge_to_the_max_min_fair_allocation(pool):
    runs, workers, asg, policy = pool
    active = [r for r in runs if r.state in (PENDING, RUNNING, PAUSED)]
    if sum(r.min_peers for r in active) > len(workers):
        return  # not every run can start: the fixed-point test covers that case
    now, runs, workers, asg = settle(runs, workers, asg, policy)
    held = holding(asg)
    got = sorted(Fraction(len(held.get(r.run_id, ()))) / Fraction(r.share) for r in active)
    assert got == leximin_best(active, len(workers))


@settings(max_examples=60, deadline=None)
@given(pools(consistent_start=True), st.data())
def test_no_run_starves_when_capacity_is_enough_for_it(pool, data):
    """Running runs finish one at a time; every run the pool can hold on its own runs at some point."""
    runs, workers, asg, policy = pool
    while True:
        now, runs, workers, asg = settle(runs, workers, asg, policy)
        running = [r.run_id for r in runs if r.state is RUNNING]
        if not running:
            break
        done = data.draw(st.sampled_from(running))
        runs = tuple(replace(r, state=RunState.FINISHED) if r.run_id == done else r for r in runs)
    ok = [w for w in workers if usable_ref(w, now)]
    for r in runs:
        if r.state in (PENDING, PAUSED):
            assert sum(fits_ref(r, w) for w in ok) < r.min_peers, r


def test_b_matching_reroutes_a_greedy_first_choice():
    """r0 prefers w0, the only worker r1 can use: r0 must move to w1."""
    assert b_matching({"r0": 1, "r1": 1}, {"r0": ["w0", "w1"], "r1": ["w0"]}) == {"w0": "r1", "w1": "r0"}


@FAST
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 7), st.data())
def test_b_matching_meets_every_demand_exactly_when_some_matching_does(demands, n_workers, data):
    """The admission oracle against the brute force: workers 'fit' a run when drawn into its candidates."""
    names = [f"w{i}" for i in range(n_workers)]
    cands = {f"r{i}": data.draw(st.lists(st.sampled_from(names), unique=True)) for i in range(len(demands))}
    match = b_matching({f"r{i}": d for i, d in enumerate(demands)}, cands)
    got = matched_counts(match)
    assert all(w in cands[r] for w, r in match.items()) and all(got.get(f"r{i}", 0) <= d for i, d in enumerate(demands))
    fake_runs = [run(f"r{i}", lo=d, hi=d, device=f"d{i}") for i, d in enumerate(demands)]
    fake_workers = [Worker(worker_id=n, devices={f"d{i}": 0 for i in range(len(demands)) if n in cands[f"r{i}"]},
                           last_seen=0.0) for n in names]
    assert all(got.get(f"r{i}", 0) == d for i, d in enumerate(demands)) == can_hold_minimums(fake_runs, fake_workers)
