"""The pool's invariants and figures, computed from a :class:`PoolRecord` alone (pure functions, unit-tested on
hand-written records; ``python -m simulations report`` re-runs them on a saved ``pool_record.json``).

Three witnesses, on one clock (trace time: wall seconds since every agent registered):
- the registry's event log (``coord_events``): submissions, assignments and their ends with reasons, run states,
  residents as the coordinator heard of them;
- the agents' events (``agent_events``): residents as the agent saw them, its peers started and stopped;
- every peer's own ``--json`` events (``peer_events``, key ``worker/run/k``): steps with state hashes and blocks,
  bootstraps, resumes, snapshots, evaluations. Each run's slice of them is a :class:`checks.Record`, so the run
  invariants of the churn harness apply to every pool run unchanged.
The harness's own actions (``faults``: submissions, residents' flags, the coordinator's kill) and what the
coordinator answered before its kill and after its restart (``restarts``) complete it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .checks import Life, Record, final_cursor, no_committed_step_lost, state_hash_agrees

ACTIVE = ("pending", "running", "paused")
PRIORITY_GRACE = 10.0  # seconds placement may take to act on a change (a pass a second, an agent's heartbeat)


@dataclass
class PoolRecord:
    """What a pool simulation observed (see the module docstring)."""

    trace: str = ""
    workers: list = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # run id -> its spec (priority, min_peers, max_peers, sets)
    db: str = ""
    wall0: float = 0.0
    end: float = 0.0
    cleaned: bool = False
    agent_events: list = field(default_factory=list)  # (t, worker, event)
    coordinator_out: list = field(default_factory=list)  # (t, coordinator.k, event)
    peer_events: list = field(default_factory=list)  # (t, worker/run/k, event)
    coord_events: list = field(default_factory=list)  # the registry's rows, with t
    lives: dict = field(default_factory=dict)  # worker/run/k -> Life
    faults: list = field(default_factory=list)
    restarts: list = field(default_factory=list)

    def lives_end(self, end: float) -> None:
        for life in self.lives.values():
            if life.end is None:
                life.end, life.ended_by = end, life.ended_by or "cleanup"

    def run_record(self, run_id: str, total_steps: int = 0) -> Record:
        """One run's slice as the churn harness's Record (its peers' lives and events)."""
        rec = Record(total_steps=total_steps, end=self.end)
        rec.lives = {k: v for k, v in self.lives.items() if k.split("/")[1] == run_id}
        rec.events = [(t, k, e) for t, k, e in self.peer_events if k in rec.lives]
        return rec

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.coord_events if e["kind"] == kind]


def as_jsonable(rec: PoolRecord) -> dict[str, Any]:
    out = dict(vars(rec))
    out["lives"] = {k: vars(v) for k, v in rec.lives.items()}
    return out


def from_jsonable(data: dict[str, Any]) -> PoolRecord:
    rec = PoolRecord(**{k: v for k, v in data.items() if k != "lives"})
    rec.lives = {k: Life(**v) for k, v in data.get("lives", {}).items()}
    for name in ("agent_events", "coordinator_out", "peer_events"):
        setattr(rec, name, [tuple(x) for x in getattr(rec, name)])
    return rec


# ---- timelines ------------------------------------------------------------------------------------------
def assignment_spans(rec: PoolRecord) -> list[dict]:
    """Every assignment: worker, run, start, end (the record's end if still open), why it began and ended."""
    open_: dict[str, dict] = {}
    out = []
    for e in rec.coord_events:
        if e["kind"] == "assign":
            open_[e["worker_id"]] = dict(worker=e["worker_id"], run=e["run_id"], start=e["t"], end=None,
                                         why=(e.get("detail") or {}).get("reason"))
        elif e["kind"] == "unassign" and e["worker_id"] in open_:
            span = open_.pop(e["worker_id"])
            span.update(end=e["t"], ended=(e.get("detail") or {}).get("reason"))
            out.append(span)
    out += [dict(s, end=rec.end, ended="trace end") for s in open_.values()]
    return sorted(out, key=lambda s: (s["start"], s["worker"]))


def resident_spans(rec: PoolRecord) -> list[tuple[str, float, float]]:
    """(worker, from, to): when each resident was at their workstation (the harness set their flag)."""
    out, since = [], {}
    for f in rec.faults:
        if f["kind"] == "resident":
            since.setdefault(f["worker"], f["t"])
        elif f["kind"] == "resident_leaves" and f["worker"] in since:
            out.append((f["worker"], since.pop(f["worker"]), f["t"]))
    return out + [(w, t, rec.end) for w, t in since.items()]


def down_spans(rec: PoolRecord) -> list[tuple[float, float]]:
    """When the coordinator was down (killed .. serving again)."""
    return [(r["killed"], r.get("serving", rec.end)) for r in rec.restarts] + \
        [(f["t"], rec.end) for f in rec.faults if f["kind"] == "coordinator_kill"
         and not any(abs(r["killed"] - f["t"]) < 1.0 for r in rec.restarts)]


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def run_window(rec: PoolRecord) -> tuple[Optional[float], float]:
    """From the first run's start to the last run's end (finished or cancelled), or the record's end."""
    states = [e for e in rec.of("state")]
    starts = [e["t"] for e in states if (e.get("detail") or {}).get("state") == "running"]
    if not starts:
        return None, rec.end
    ends = {e["run_id"]: e["t"] for e in states if (e.get("detail") or {}).get("state") in ("finished", "cancelled")}
    end = max(ends.values()) if set(ends) >= set(rec.runs) else rec.end
    return min(starts), end


def utilisation(rec: PoolRecord) -> dict[str, Any]:
    """Worker-seconds assigned to a run ÷ idle worker-seconds (resident away), from the first run's start to the
    last run's end; ``serving`` counts the seconds a peer process ran instead of the assignment's."""
    t0, t1 = run_window(rec)
    if t0 is None or t1 <= t0:
        return dict(utilisation=None, serving=None, window=None, idle_worker_seconds=0.0)
    present = resident_spans(rec)

    def away(worker: str, a: float, b: float) -> float:
        return _overlap(a, b, t0, t1) - sum(_overlap(a, b, max(p0, t0), min(p1, t1)) for w, p0, p1 in present if w == worker)

    idle = sum(away(w, t0, t1) for w in rec.workers)
    assigned = sum(away(s["worker"], s["start"], s["end"]) for s in assignment_spans(rec))
    serving = sum(away(life.peer, life.start, life.end if life.end is not None else rec.end) for life in rec.lives.values())
    return dict(utilisation=round(assigned / idle, 4) if idle else None, serving=round(serving / idle, 4) if idle else None,
                window=[round(t0, 2), round(t1, 2)], idle_worker_seconds=round(idle, 1),
                assigned_worker_seconds=round(assigned, 1), serving_worker_seconds=round(serving, 1))


def handbacks(rec: PoolRecord) -> list[dict]:
    """Each resident's return: how long until their workstation's peer stopped (0 when none ran)."""
    out = []
    for f in [f for f in rec.faults if f["kind"] == "resident"]:
        worker, t = f["worker"], f["t"]
        running = [life for life in rec.lives.values() if life.peer == worker and life.alive_at(t)]
        stops = [tt for tt, w, e in rec.agent_events if w == worker and tt >= t and e.get("event") == "peer_stopped"
                 and e.get("reason") == "resident returned"]
        row = dict(worker=worker, t=round(t, 2), run=running[0].key.split("/")[1] if running else None)
        if not running:
            row.update(seconds=0.0, note="no peer was running")
        elif stops:
            stopped = next(e for tt, w, e in rec.agent_events if w == worker and tt == stops[0] and e.get("event") == "peer_stopped")
            row.update(seconds=round(stops[0] - t, 2), killed=stopped.get("killed"))
        else:
            end = running[0].end
            row.update(seconds=round((end if end is not None else rec.end) - t, 2), note=f"peer ended by {running[0].ended_by}")
        out.append(row)
    return out


def first_step_times(rec: PoolRecord) -> dict[str, float]:
    """Each run's first committed step (the first ``step`` event of any of its peers)."""
    out: dict[str, float] = {}
    for t, key, e in rec.peer_events:
        if e.get("event") == "step":
            out.setdefault(key.split("/")[1], t)
    return out


def preemptions(rec: PoolRecord) -> list[dict]:
    """One row per run that preempted others: from its submission to its first committed step, and whom it took
    workers from (placement's reasons: ``preempted from run X``)."""
    submitted = {e["run_id"]: e["t"] for e in rec.of("submit")}
    first = first_step_times(rec)
    rows: dict[str, dict] = {}
    for e in rec.of("assign"):
        why = (e.get("detail") or {}).get("reason") or ""
        if why.startswith("preempted from run "):
            victim = why[len("preempted from run "):].split(" ")[0]
            row = rows.setdefault(e["run_id"], dict(run=e["run_id"], submitted=submitted.get(e["run_id"]), workers=[],
                                                    from_runs=[]))
            row["workers"].append(e["worker_id"])
            row["from_runs"] = sorted(set(row["from_runs"]) | {victim})
    for run, row in rows.items():
        t_first = first.get(run)
        row["first_step"] = round(t_first, 2) if t_first is not None else None
        row["seconds"] = round(t_first - row["submitted"], 2) if t_first is not None and row["submitted"] is not None else None
    return sorted(rows.values(), key=lambda r: r["submitted"] or 0.0)


def pauses_and_resumes(rec: PoolRecord) -> list[dict]:
    """Placement's state changes of each run (start, pause, resume, finish) with their reasons."""
    return [dict(t=round(e["t"], 2), run=e["run_id"], state=(e.get("detail") or {}).get("state"),
                 reason=(e.get("detail") or {}).get("reason")) for e in rec.of("state")]


# ---- invariants -----------------------------------------------------------------------------------------
def committed_steps_lost(rec: PoolRecord) -> tuple[int, list[str]]:
    """Steps a run had committed that its later history started below: a peer resumed or bootstrapped at step s
    while the run had committed step S > s and no other live peer of it held S (so S - s steps were lost)."""
    lost, problems = 0, []
    for run_id in rec.runs:
        r = rec.run_record(run_id)
        known, held = 0, {}
        for t, key, e in r.events:
            kind, step = e.get("event"), e.get("step")
            if step is None:
                continue
            if kind in ("resumed", "bootstrapped") and step < known:
                others = [k for k, s in held.items() if k != key and s >= known and r.lives[k].alive_at(t)]
                if not others:
                    lost += known - step
                    problems.append(f"run {run_id}: {key} {kind} at step {step} after step {known} was committed "
                                    f"({known - step} lost)")
                    known = step
            if kind == "step":
                known = max(known, int(step))
            held[key] = max(held.get(key, 0), int(step))
    return lost, problems


def one_run_per_worker(rec: PoolRecord) -> tuple[bool, list[str]]:
    """Invariant 9: no worker is assigned to two runs at once, nor runs two peers at once."""
    problems = []
    for spans, what in ((assignment_spans(rec), "assignment"),
                        ([dict(worker=lf.peer, run=lf.key, start=lf.start, end=lf.end if lf.end is not None else rec.end)
                          for lf in rec.lives.values()], "peer")):
        by_worker: dict[str, list[dict]] = {}
        for s in spans:
            by_worker.setdefault(s["worker"], []).append(s)
        for worker, rows in by_worker.items():
            rows.sort(key=lambda s: s["start"])
            for a, b in zip(rows, rows[1:]):
                if b["start"] < a["end"] - 1e-6:
                    problems.append(f"{worker}: {what} of {a['run']} until {a['end']:.1f} overlaps {b['run']} from {b['start']:.1f}")
    return not problems, problems


def peers_left_gracefully(rec: PoolRecord) -> tuple[bool, list[str]]:
    """A run is paused (or shrunk, or handed back) to a snapshot, never killed: every peer an agent stopped left
    on SIGTERM within its bound (``killed`` false)."""
    problems = [f"{w}: peer of {e.get('run_id')} SIGKILLed after its stop timeout ({e.get('reason')})"
                for t, w, e in rec.agent_events if e.get("event") == "peer_stopped" and e.get("killed")
                and e.get("reason") != "agent stopping"]
    return not problems, problems


def priorities_respected(rec: PoolRecord, *, min_residence: float, grace: float = PRIORITY_GRACE) -> tuple[bool, list[str]]:
    """No lower-priority run holds a worker, past its residence time and a placement grace, while a higher run
    that could use it (active, under its ``max_peers``, able to reach its ``min_peers`` with the workers not held
    by runs of its priority or above) waits. Checked every second of the registry's replayed history."""
    spans, present = assignment_spans(rec), resident_spans(rec)
    prio = {r: int(spec.get("priority", 1)) for r, spec in rec.runs.items()}
    states, changed = _state_history(rec)
    problems: list[str] = []
    t, seen = 0.0, set()
    while t < rec.end:
        holding = {s["worker"]: s for s in spans if s["start"] <= t < s["end"]}
        here = [w for w in rec.workers if not any(pw == w and p0 <= t < p1 for pw, p0, p1 in present)]
        st = {r: _state_at(states[r], t) for r in rec.runs}
        for hi in [r for r in rec.runs if st[r] in ACTIVE]:
            mine = sum(1 for s in holding.values() if s["run"] == hi)
            spec = rec.runs[hi]
            free = [w for w in here if w not in holding or prio[holding[w]["run"]] < prio[hi]]
            if mine >= spec["max_peers"] or len(free) < spec["min_peers"]:
                continue
            for w, s in holding.items():
                lo = s["run"]
                since = max(s["start"] + min_residence, changed[hi](t), _last_up(rec, t))
                if prio[lo] < prio[hi] and w in here and t - since > grace and (w, lo, hi) not in seen:
                    seen.add((w, lo, hi))
                    problems.append(f"t={t:.0f}: {w} held by {lo} (priority {prio[lo]}) while {hi} (priority "
                                    f"{prio[hi]}, {st[hi]}, {mine} of max {spec['max_peers']}) could use it")
        t += 1.0
    return not problems, problems


def _state_history(rec: PoolRecord):
    """Each run's (t, state) changes from the registry's log, and for each run a function of t: when it last
    changed state (a higher run's wait counts from there)."""
    hist: dict[str, list[tuple[float, str]]] = {r: [] for r in rec.runs}
    for e in rec.coord_events:
        d, r = e.get("detail") or {}, e.get("run_id")
        if r not in hist:
            continue
        if e["kind"] == "submit":
            hist[r].append((e["t"], "pending"))
        elif e["kind"] == "state":
            hist[r].append((e["t"], d.get("state")))
        elif e["kind"] in ("hold", "release", "cancel"):
            hist[r].append((e["t"], {"hold": "held", "release": "pending", "cancel": "cancelled"}[e["kind"]]))

    def changed(run: str):
        return lambda t: max([tt for tt, _ in hist[run] if tt <= t], default=0.0)

    return hist, {r: changed(r) for r in rec.runs}


def _state_at(history: list[tuple[float, str]], t: float) -> Optional[str]:
    state = None
    for tt, s in history:
        if tt > t:
            break
        state = s
    return state


def _last_up(rec: PoolRecord, t: float) -> float:
    """When the coordinator last came back before ``t`` (0 if it never went down): a dead coordinator places nothing."""
    return max([b for a, b in down_spans(rec) if a <= t], default=0.0)


def restarts_lost_nothing(rec: PoolRecord) -> tuple[bool, list[str], list[dict]]:
    """Each coordinator restart on the same database: every run it answered before the kill is there after with
    the same submission and no earlier step or snapshot, every assignment is kept (or ended later by placement,
    in the log), and no agent stopped a peer while it was down (except for its resident)."""
    problems, rows = [], []
    fields = ("owner", "task", "priority", "min_peers", "max_peers", "total_steps", "submitted_at")
    for r in rec.restarts:
        before, after = r.get("before"), r.get("after")
        row = dict(killed=r["killed"], serving=r.get("serving"), down_seconds=round(r.get("serving", rec.end) - r["killed"], 2))
        if not before or not after:
            problems.append(f"restart at {r['killed']:.0f}: the pool was not read {'before' if not before else 'after'}")
            rows.append(row)
            continue
        runs_after = {x["run_id"]: x for x in after["runs"]}
        lost = [x["run_id"] for x in before["runs"] if x["run_id"] not in runs_after]
        changed = [x["run_id"] for x in before["runs"] if x["run_id"] in runs_after and (
            any(x[f] != runs_after[x["run_id"]][f] for f in fields)
            or (runs_after[x["run_id"]]["step"] or 0) < (x["step"] or 0)
            or (runs_after[x["run_id"]]["snapshot_step"] or -1) < (x["snapshot_step"] or -1))]
        held_after = {w["worker_id"]: w["run_id"] for w in after["workers"]}
        ended_later = {(e["worker_id"], e["run_id"]) for e in rec.of("unassign") if e["t"] >= r.get("serving", rec.end) - 1}
        lost_asg = [f"{w['worker_id']}->{w['run_id']}" for w in before["workers"] if w["run_id"] is not None
                    and held_after.get(w["worker_id"]) != w["run_id"] and (w["worker_id"], w["run_id"]) not in ended_later]
        stopped = [f"{w}: {e.get('run_id')} ({e.get('reason')})" for t, w, e in rec.agent_events
                   if e.get("event") == "peer_stopped" and r["killed"] <= t <= r.get("serving", rec.end)
                   and e.get("reason") != "resident returned"]
        row.update(runs_before=len(before["runs"]), runs_after=len(after["runs"]), lost_runs=lost, changed_runs=changed,
                   assignments_before=sum(1 for w in before["workers"] if w["run_id"]), lost_assignments=lost_asg,
                   peers_stopped_while_down=stopped)
        problems += [f"restart at {r['killed']:.0f}: {what}: {x}" for what, xs in
                     (("run lost", lost), ("run changed", changed), ("assignment lost", lost_asg),
                      ("peer stopped while down", stopped)) for x in xs]
        rows.append(row)
    return not problems, problems, rows


def run_invariants(rec: PoolRecord, run_id: str, total_steps: int) -> tuple[dict, dict]:
    """The churn harness's run invariants on one pool run: hashes agree, no committed step lost, no block skipped
    or applied twice, the run reached its last step."""
    r = rec.run_record(run_id, total_steps)
    inv, why = {}, {}
    inv["state_hash_agrees"], why["state_hash_agrees"] = state_hash_agrees(r)
    inv["no_committed_step_lost"], why["no_committed_step_lost"] = no_committed_step_lost(r)
    cursor = final_cursor(r)
    for name, key in (("blocks_skipped_zero", "blocks_skipped"), ("blocks_duplicated_zero", "blocks_duplicated")):
        inv[name] = bool(cursor) and cursor.get(key, 1) == 0
        why[name] = [] if inv[name] else [f"final cursor: {cursor}"]
    final = max([int(e["step"]) for _, _, e in r.events if e.get("event") in ("step", "left", "resumed", "bootstrapped")
                 and e.get("step") is not None], default=0)
    inv["run_finished"] = final >= total_steps > 0
    why["run_finished"] = [] if inv["run_finished"] else [f"final step {final} of {total_steps}"]
    return inv, {k: v for k, v in why.items() if v}
