"""Placement and preemption of the pool: which run gets which worker, as one pure function.

``plan(now, runs, workers, assignments, policy)`` returns the actions (``Assign``, ``Release``,
``Pause``, ``Resume``) that take the pool from the registry's present state to the one these rules
want; the coordinator only carries them out, in order, and records them with ``apply``. The clock is
injected (``now``) so that every rule is tested without I/O or waiting. The rules:

- strict priority between classes (runs of one ``priority``): a class takes every worker it can use,
  up to its runs' ``max_peers``, before a lower class gets any;
- inside a class, a max-min fair share of workers weighted by each run's ``share``;
- a run starts, or resumes, only when it can hold its ``min_peers`` at once; device and memory
  constraints hold (a run that needs CUDA only goes to CUDA workers), and a run that does not need a
  scarce device prefers the workers without one;
- preemption takes workers from the lowest-priority, most-over-share runs first; a run pushed below
  its ``min_peers`` is paused (to a snapshot: the coordinator's keeper holds its state), never killed;
- no thrashing: an assignment younger than ``Policy.min_residence_s`` is not taken for preemption or
  rebalancing, and a lent worker moves between two runs of a class only when the move makes their
  shares fairer and the gap between them exceeds ``Policy.hysteresis``. A returning resident or a dead
  worker frees its machine at once, whatever its age.

Decisions where the issue is silent are written where they are made (``_admission_order``,
``_preference``, ``_fairer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Optional, Sequence

from .matching import b_matching, matched_counts
from .pool import (
    ACTIVE, Action, Assign, Assignment, Needs, Pause, Policy, PoolRun, Release, Resume, RunState, Worker, apply, fits,
    usable,
)

__all__ = [
    "Action", "Assign", "Assignment", "Needs", "Pause", "Policy", "PoolRun", "Release", "Resume", "RunState", "Worker",
    "apply", "fits", "plan", "usable",
]


def plan(now: float, runs: Sequence[PoolRun], workers: Sequence[Worker], assignments: Sequence[Assignment],
         policy: Policy = Policy()) -> list[Action]:
    """The actions that take the pool to the placement the rules want at ``now``.

    One pass can free workers that an earlier class could have used (a lower run paused below its
    minimum releases its young workers too), so passes repeat at the same instant until one has
    nothing to do; the result is their net effect. Planning again after applying it, at the same
    ``now``, returns no action.

    Returns:
        Pauses (each followed by its releases), the other releases, then resumes (each followed by its
        assignments) and the other assignments; every action with a human reason.

    Raises:
        ValueError: two assignments of one worker (the registry keeps a worker in at most one run).
    """
    if len({a.worker_id for a in assignments}) != len(assignments):
        raise ValueError("a worker is assigned twice")
    cur_runs, cur_asg = tuple(runs), tuple(assignments)
    reasons: dict[tuple, str] = {}
    # a pass that acts pauses a run or lends workers that later passes may not take back (younger than
    # the residence time): few passes; the bound only stops a zero residence time or a bug from looping
    for _ in range(2 * (len(runs) + len(workers)) + 2):
        acts = _plan_once(now, cur_runs, workers, cur_asg, policy)
        if not acts:
            break
        reasons.update((_key(a), a.reason) for a in acts)
        cur_runs, cur_asg = apply(acts, cur_runs, cur_asg, now)
    return _net(runs, assignments, cur_runs, cur_asg, reasons)


def _key(act: Action) -> tuple:
    return (type(act).__name__, getattr(act, "worker_id", None), act.run_id)


def _net(runs0: Sequence[PoolRun], asg0: Sequence[Assignment], runs1: Sequence[PoolRun],
         asg1: Sequence[Assignment], reasons: Mapping[tuple, str]) -> list[Action]:
    """The actions from the first state to the last, in the order the coordinator carries them out."""
    before = {a.worker_id: a.run_id for a in asg0}
    after = {a.worker_id: a.run_id for a in asg1}
    gone = [Release(worker_id=w, run_id=r, reason=reasons[("Release", w, r)])
            for w, r in before.items() if after.get(w) != r]
    new = [Assign(worker_id=w, run_id=r, reason=reasons[("Assign", w, r)])
           for w, r in after.items() if before.get(w) != r]
    out: list[Action] = []
    for r0, r1 in zip(runs0, runs1):
        if r0.state is RunState.RUNNING and r1.state is RunState.PAUSED:
            out.append(Pause(run_id=r0.run_id, reason=reasons[("Pause", None, r0.run_id)]))
            out += [a for a in gone if a.run_id == r0.run_id]
    out += [a for a in gone if a not in out]
    for r0, r1 in zip(runs0, runs1):
        if r0.state is not RunState.RUNNING and r1.state is RunState.RUNNING:
            out.append(Resume(run_id=r0.run_id, reason=reasons[("Resume", None, r0.run_id)]))
            out += [a for a in new if a.run_id == r0.run_id]
    return out + [a for a in new if a not in out]


@dataclass(eq=False)
class _Pass:
    """One planning pass's working state: who holds each usable worker, as the pass moves them.

    It records why each assignment ends and begins and which runs pause or resume, so that the
    pass's result reads as actions with reasons.
    """

    now: float
    policy: Policy
    runs: dict[str, PoolRun]
    workers: dict[str, Worker]  # the usable ones
    hold: dict[str, str] = field(default_factory=dict)  # usable worker id -> run id
    since: dict[str, float] = field(default_factory=dict)  # assignments as the pass found them
    members: dict[str, set[str]] = field(default_factory=dict)
    released: dict[tuple[str, str], str] = field(default_factory=dict)
    assigned: dict[tuple[str, str], str] = field(default_factory=dict)
    paused: dict[str, str] = field(default_factory=dict)
    resumed: list[PoolRun] = field(default_factory=list)

    def count(self, run_id: str) -> int:
        return len(self.members.get(run_id, ()))

    def ratio(self, run: PoolRun) -> float:
        """Workers held per unit of share: what max-min fairness equalises inside a class."""
        return self.count(run.run_id) / run.share

    def locked(self, worker_id: str) -> bool:
        """Lent for less than the residence time: not taken, except by its run's pause.

        ``since`` holds only the assignments this pass started with: a worker placed during the pass
        has not been lent yet, and the pass may still place it elsewhere.
        """
        since = self.since.get(worker_id)
        return since is not None and self.now - since < self.policy.min_residence_s

    def move(self, worker_id: str, run_id: Optional[str], why_release: str, why_assign: str) -> None:
        old = self.hold.pop(worker_id, None)
        self.since.pop(worker_id, None)
        if old is not None:
            self.members[old].discard(worker_id)
            self.released[(worker_id, old)] = why_release
        if run_id is not None:
            self.hold[worker_id] = run_id
            self.members.setdefault(run_id, set()).add(worker_id)
            self.assigned[(worker_id, run_id)] = why_assign

    def take(self, worker_id: str, run: PoolRun) -> None:
        """Give ``run`` a worker that is free or held by another run (one the rules let it take)."""
        holder = self.hold.get(worker_id)
        if holder is None:
            self.move(worker_id, run.run_id, "", "a free worker that fits it")
        elif self.runs[holder].priority < run.priority:
            self.move(worker_id, run.run_id,
                      f"preempted by run {run.run_id} (priority {run.priority} over {self.runs[holder].priority})",
                      f"preempted from run {holder} (priority {self.runs[holder].priority} under {run.priority})")
        else:
            self.move(worker_id, run.run_id, f"rebalanced to run {run.run_id}: fair share of priority {run.priority}",
                      f"rebalanced from run {holder}: fair share of priority {run.priority}")

    def pause(self, run: PoolRun, why: str) -> None:
        for worker_id in sorted(self.members.get(run.run_id, ())):
            self.move(worker_id, None, f"run paused: {why}", "")
        self.paused[run.run_id] = why


def _plan_once(now: float, runs: Sequence[PoolRun], workers: Sequence[Worker], assignments: Sequence[Assignment],
               policy: Policy) -> list[Action]:
    """One pass: release what must go at once, then place class by class, highest priority first."""
    p = _start(now, runs, workers, assignments, policy)
    active = [r for r in runs if r.state in ACTIVE]
    for priority in sorted({r.priority for r in active}, reverse=True):
        admitted = _admit(p, [r for r in active if r.priority == priority])
        _floors(p, admitted)
        _cap(p, admitted)
        _extras(p, admitted)
        _rebalance(p, admitted)
        p.resumed += [r for r in admitted if r.state is not RunState.RUNNING]
    return _pass_actions(p, runs, assignments)


def _start(now: float, runs: Sequence[PoolRun], workers: Sequence[Worker], assignments: Sequence[Assignment],
           policy: Policy) -> _Pass:
    """The pass's first state: every assignment that must end at once, whatever its age, already ended."""
    by_id = {r.run_id: r for r in runs}
    known = {w.worker_id: w for w in workers}
    p = _Pass(now=now, policy=policy, runs=by_id,
              workers={w.worker_id: w for w in workers if usable(w, now, policy)})
    for a in assignments:
        why = _forced(by_id.get(a.run_id), known.get(a.worker_id), now, policy)
        if why:
            p.released[(a.worker_id, a.run_id)] = why
        else:
            p.hold[a.worker_id] = a.run_id
            p.since[a.worker_id] = a.since
            p.members.setdefault(a.run_id, set()).add(a.worker_id)
    return p


def _forced(run: Optional[PoolRun], worker: Optional[Worker], now: float, policy: Policy) -> Optional[str]:
    """Why an assignment ends now regardless of the residence time, or None."""
    if worker is None:
        return "worker unknown to the pool"
    if worker.resident_present:
        return "resident returned"
    if now - worker.last_seen > policy.worker_timeout:
        return f"worker lost: not heard from for {now - worker.last_seen:.0f} s"
    if run is None:
        return "run unknown to the pool"
    if run.state is not RunState.RUNNING:
        return f"run {run.state.value}"
    if not fits(run, worker):
        return "worker no longer fits the run's needs"
    return None


def _admission_order(cls: Sequence[PoolRun]) -> list[PoolRun]:
    """The order in which a class's runs claim their minimums.

    Running runs first (pausing one costs a snapshot and a restart), then the others first come,
    first served. A run that cannot start does not block a smaller one behind it (backfilling): the
    pool stays used, and the bigger run starts as soon as running runs of its class or above leave
    it room.
    """
    return sorted(cls, key=lambda r: (r.state is not RunState.RUNNING, r.submitted_at, r.run_id))


def _admit(p: _Pass, cls: Sequence[PoolRun]) -> list[PoolRun]:
    """The runs of a class that can hold their ``min_peers`` at once; the running others are paused.

    Exact under device constraints: each candidate is admitted only if a matching gives it and every
    run admitted before it their minimums together.
    """
    admitted: list[PoolRun] = []
    for run in _admission_order(cls):
        trial = admitted + [run]
        got = matched_counts(_match_minimums(p, trial))
        if all(got.get(r.run_id, 0) >= r.min_peers for r in trial):
            admitted.append(run)
        elif run.state is RunState.RUNNING:
            p.pause(run, f"cannot hold min_peers={run.min_peers}: {_workers(got.get(run.run_id, 0))} left to it "
                         "beside higher-priority runs and the runs ahead of it in its class")
    return admitted


def _workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


def _match_minimums(p: _Pass, runs: Sequence[PoolRun]) -> dict[str, str]:
    return b_matching({r.run_id: r.min_peers for r in runs}, {r.run_id: _candidates(p, r, True) for r in runs})


def _candidates(p: _Pass, run: PoolRun, same_class: bool) -> list[str]:
    """The usable workers ``run`` may take, best first (see ``_preference``)."""
    ranked = []
    for w in p.workers.values():
        if fits(run, w):
            key = _preference(p, run, w.worker_id, same_class)
            if key is not None:
                ranked.append((key, _capability(w), w.worker_id))
    ranked.sort()
    return [worker_id for _, _, worker_id in ranked]


def _preference(p: _Pass, run: PoolRun, worker_id: str, same_class: bool) -> Optional[tuple]:
    """How much ``run`` would rather take this worker (lower first), or None if it may not take it.

    Its own workers first (stability), then free ones, then preemption: lowest priority first; among
    equals, a run already below its minimum (it pauses anyway, so taking costs nothing more), then
    one above its minimum, last one exactly at it (taking pauses it); then the most over its share.
    Workers of the same class only through ``same_class`` (minimums and rebalancing).
    """
    holder = p.hold.get(worker_id)
    if holder == run.run_id:
        return (0, 0, 0, 0.0)
    if holder is None:
        return (1, 0, 0, 0.0)
    other = p.runs[holder]
    if p.locked(worker_id) or other.priority > run.priority or (other.priority == run.priority and not same_class):
        return None
    have = p.count(holder)
    standing = 0 if have < other.min_peers else 1 if have > other.min_peers else 2
    return (2 if other.priority < run.priority else 3, other.priority, standing, -p.ratio(other))


def _capability(w: Worker) -> tuple[int, int]:
    """Least capable first, so that a run which does not need a scarce device leaves it to one that does."""
    return (len(w.devices), sum(w.devices.values()))


def _floors(p: _Pass, admitted: Sequence[PoolRun]) -> None:
    """Give every admitted run its minimum, by the matching that admitted them."""
    for worker_id, run_id in _match_minimums(p, admitted).items():
        if p.hold.get(worker_id) != run_id:
            p.take(worker_id, p.runs[run_id])


def _cap(p: _Pass, admitted: Sequence[PoolRun]) -> None:
    """Release what a run holds over its ``max_peers`` (lowered since), youngest assignments last."""
    for run in admitted:
        mine = sorted(p.members.get(run.run_id, ()),
                      key=lambda w: (p.locked(w), tuple(-x for x in _capability(p.workers[w])), w))
        for worker_id in mine[:max(0, len(mine) - run.max_peers)]:
            p.move(worker_id, None, f"over max_peers={run.max_peers}", "")


def _extras(p: _Pass, admitted: Sequence[PoolRun]) -> None:
    """Water-filling: one worker at a time to the admitted run furthest below its weighted share.

    Only free workers and lower classes' (strict priority); the class's own balance is ``_rebalance``'s.
    """
    while True:
        for run in sorted(admitted, key=lambda r: (p.ratio(r), r.submitted_at, r.run_id)):
            if p.count(run.run_id) < run.max_peers:
                cands = [w for w in _candidates(p, run, False) if p.hold.get(w) != run.run_id]
                if cands:
                    p.take(cands[0], run)
                    break
        else:
            return


def _rebalance(p: _Pass, admitted: Sequence[PoolRun]) -> None:
    """Move workers inside a class until its weighted shares are max-min fair, within the hysteresis."""
    while (move := _rebalance_move(p, admitted)) is not None:
        p.take(*move)


def _rebalance_move(p: _Pass, admitted: Sequence[PoolRun]) -> Optional[tuple[str, PoolRun]]:
    """A worker to move to the most under-share run that a move makes fairer (``_fairer``), or None.

    A giver never goes below its minimum, and young assignments stay. A worker placed earlier in this
    pass has not been lent yet: it moves first, and the hysteresis does not hold it back, since
    moving it costs nothing.
    """
    by_need = sorted(admitted, key=lambda r: (p.ratio(r), r.submitted_at, r.run_id))
    for x in by_need:
        if p.count(x.run_id) >= x.max_peers:
            continue
        for y in reversed(by_need):
            if y is x or p.count(y.run_id) <= y.min_peers or not _fairer(p, x, y, 0.0):
                continue
            movable = [w for w in p.members[y.run_id] if not p.locked(w) and fits(x, p.workers[w])
                       and (w not in p.since or _fairer(p, x, y, p.policy.hysteresis))]
            if movable:
                return min(movable, key=lambda w: (w in p.since, _capability(p.workers[w]), w)), x
    return None


def _fairer(p: _Pass, x: PoolRun, y: PoolRun, hysteresis: float) -> bool:
    """Whether one worker from ``y`` to ``x`` is worth it: fairer, and their gap is over ``hysteresis``.

    Fairer is max-min (leximin) on workers per unit share: the pair's sorted values rise, so every
    move raises the class's sorted vector and rebalancing ends. The hysteresis keeps a small gap, one
    the next arrival may reverse, from costing a peer that leaves one swarm for another. Exact
    rationals, so that ties between weighted shares cannot flip back and forth on rounding.
    """
    cx, cy, sx, sy = p.count(x.run_id), p.count(y.run_id), Fraction(x.share), Fraction(y.share)
    before, after = sorted([cx / sx, cy / sy]), sorted([(cx + 1) / sx, (cy - 1) / sy])
    return after > before and cy / sy - cx / sx > Fraction(hysteresis)


def _pass_actions(p: _Pass, runs: Sequence[PoolRun], assignments: Sequence[Assignment]) -> list[Action]:
    before = {a.worker_id: a.run_id for a in assignments}
    out: list[Action] = [Pause(run_id=r.run_id, reason=p.paused[r.run_id]) for r in runs if r.run_id in p.paused]
    out += [Release(worker_id=w, run_id=r, reason=p.released[(w, r)]) for w, r in before.items() if p.hold.get(w) != r]
    for run in p.resumed:
        verb, n = "starts" if run.state is RunState.PENDING else "resumes", p.count(run.run_id)
        out.append(Resume(run_id=run.run_id, reason=f"{verb} on {_workers(n)} (min_peers={run.min_peers})"))
    out += [Assign(worker_id=w, run_id=r, reason=p.assigned[(w, r)]) for w, r in p.hold.items() if before.get(w) != r]
    return out
