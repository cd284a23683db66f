"""The invariants of DESIGN.md, checked on what the peers printed: pure functions of a :class:`Record`.

The runner records every ``--json`` event with the time it arrived and which incarnation of which peer
printed it, plus each process's life (start, end, how it ended). Everything here is computed from that
record alone, so the checks are unit-testable on hand-written records and can be re-run on a saved
``events.jsonl``.

"Alive" means the process had not exited (a stalled peer is alive: it still holds its state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

STATE_EVENTS = ("step", "bootstrapped", "resync", "resumed", "left")
JOIN_ALLOWANCE = 120.0  # seconds a joiner may take to start and bootstrap before the run's end counts against it


@dataclass
class Life:
    """One process: a peer's incarnation (``key`` = ``name.k``)."""

    key: str
    peer: str
    start: float
    end: Optional[float] = None
    initial: bool = False  # started with the run (not a joiner)
    resumed: bool = False  # started by a resume after a pause
    ended_by: str = ""  # kill, leave, pause, finished, exit, cleanup

    def alive_at(self, t: float) -> bool:
        return self.start <= t and (self.end is None or t < self.end)


@dataclass
class Record:
    """What a simulation observed: ``events`` are (t, key, event dict) in arrival order."""

    events: list = field(default_factory=list)
    lives: dict = field(default_factory=dict)  # key -> Life
    faults: list = field(default_factory=list)  # dicts: t, kind, peer, ...
    total_steps: int = 0
    target_batch_size: int = 0
    sample_budget: bool = False  # the run ends on total_samples or epochs: its last step is the peers' to tell
    end: float = 0.0
    proxies: dict = field(default_factory=dict)  # traces with latency: the delay proxies' counters and audit
    link_bytes: dict = field(default_factory=dict)  # traces with links: bytes each peer's namespace sent, at the end

    def of(self, *kinds: str):
        """The events of these kinds, without those of a history its peer later discarded (``discarded``)."""
        gone = self.discarded()
        return [(t, k, e) for i, (t, k, e) in enumerate(self.events) if e.get("event") in kinds and i not in gone]

    def discarded(self) -> set[int]:
        """Indices of events a peer printed on a history it discarded later: a split's minority re-synced to the
        majority's history and said how many of its steps it gave up (``resync``'s ``discarded``, at most the steps
        since its last majority commit); its ``step`` and ``eval`` events at those steps, printed before the re-sync,
        are not the run's."""
        gone: set[int] = set()
        for j, (_, key, e) in enumerate(self.events):
            lost, top = e.get("discarded") or 0, e.get("from_step")
            if e.get("event") != "resync" or not lost or top is None:
                continue
            gone |= {i for i, (_, k, x) in enumerate(self.events[:j]) if k == key and x.get("event") in ("step", "eval")
                     and isinstance(x.get("step"), int) and top - lost < x["step"] <= top}
        return gone


def _holders(rec: Record) -> dict[tuple[int, str], list[tuple[float, str]]]:
    """(step, state_hash) -> [(first time, key)] of every process that reported holding it."""
    out: dict[tuple[int, str], list[tuple[float, str]]] = {}
    for t, key, e in rec.of(*STATE_EVENTS):
        if e.get("state_hash") is None or e.get("step") is None:
            continue
        lst = out.setdefault((int(e["step"]), e["state_hash"]), [])
        if all(k != key for _, k in lst):
            lst.append((t, key))
    return out


def state_hash_agrees(rec: Record) -> tuple[bool, list[str]]:
    """Invariant 1: every report of step s carries one state_hash. A second hash at s is tolerated only when
    no process that reported the first one was alive any more (the step was lost with all its holders: a
    different invariant, counted there)."""
    holders = _holders(rec)
    by_step: dict[int, list[tuple[float, str, str]]] = {}
    for (step, h), lst in holders.items():
        for t, key in lst:
            by_step.setdefault(step, []).append((t, key, h))
    problems = []
    for step, reports in sorted(by_step.items()):
        reports.sort()
        for i, (t, key, h) in enumerate(reports):
            rivals = [(k2, h2) for t2, k2, h2 in reports[:i] if h2 != h and rec.lives[k2].alive_at(t)]
            if rivals:
                problems.append(f"step {step}: {key} reported {h[:12]} while {rivals[0][0]} (alive) had {rivals[0][1][:12]}")
    return not problems, problems


def no_committed_step_lost(rec: Record) -> tuple[bool, list[str]]:
    """Invariant 3, first half: a process's step never goes back, and a step committed while its holder lives is
    never committed again with other content; a resumed run starts at the step it paused at or later."""
    problems, last = [], {}
    for t, key, e in rec.of(*STATE_EVENTS):
        step = e.get("step")
        if step is None:
            continue
        if key in last and step < last[key]:
            problems.append(f"{key} went back from step {last[key]} to {step} ({e['event']})")
        last[key] = max(step, last.get(key, step))
    paused = [f.get("step") for f in rec.faults if f["kind"] == "pause" and f.get("step") is not None]
    for t, key, e in rec.of("resumed"):
        before = [s for s in paused]
        if before and e["step"] < max(before):
            problems.append(f"{key} resumed at step {e['step']} but the run paused at step {max(before)}")
    ok, forks = state_hash_agrees(rec)
    return not problems and ok, problems + forks


def frontier(rec: Record, t: float) -> tuple[int, list[str]]:
    """The newest step held by a process alive at ``t`` (from its reports before ``t``), and who holds it."""
    steps: dict[str, int] = {}
    for te, key, e in rec.of(*STATE_EVENTS):
        if te > t:
            continue
        if e.get("step") is not None:
            steps[key] = max(steps.get(key, 0), int(e["step"]))
    alive = {k: s for k, s in steps.items() if rec.lives[k].alive_at(t)}
    if not alive:
        return 0, []
    top = max(alive.values())
    return top, [k for k, s in alive.items() if s == top]


def run_end(rec: Record) -> Optional[tuple[float, int]]:
    """(time, step) of the first commit of the run's last step, or None while the run has not finished.

    Under ``total_steps`` the last step is ``total_steps``. Under a sample budget (``total_samples``, ``epochs``)
    only the peers know which step reached it (the ``step`` events' ``total_steps`` is a plan, give or take a
    step): it is the newest step a peer left with reason ``finished`` at."""
    if rec.sample_budget:
        done = [int(e["step"]) for _, _, e in rec.of("left")
                if e.get("reason") == "finished" and e.get("step") is not None]
        if not done:
            return None
        last = max(done)
        times = [t for t, _, e in rec.of(*STATE_EVENTS) if e.get("step") is not None and int(e["step"]) >= last]
        return min(times), last
    if not rec.total_steps:
        return None
    times = [(t, int(e["step"])) for t, _, e in rec.of("step") if int(e.get("step") or 0) >= rec.total_steps]
    return min(times) if times else None


def joiners_reach_current_step(rec: Record) -> tuple[bool, list[str], list[dict]]:
    """Invariant 3, second half: a joiner bootstraps to at least the step the swarm held when it started (unless
    every holder of that step died before it finished downloading), and one alive when the run ended ends at
    the run's final step (one that leaves behind, or that the runner has to stop because it stayed behind after
    the run finished, fails it). A joiner that exits on an error without bootstrapping while that step was served,
    or is still not bootstrapped ``JOIN_ALLOWANCE`` seconds later, fails it; one the trace killed does not.
    Returns (ok, problems, one row per joiner for the report)."""
    final = max([int(e["step"]) for _, _, e in rec.of(*STATE_EVENTS) if e.get("step") is not None], default=0)
    problems, rows = [], []
    left = {k: t for t, k, _ in rec.of("left")}  # a peer that printed `left` serves no more
    end = run_end(rec)
    finished_at = end[0] if end is not None else None  # the first commit of the run's last step
    for life in rec.lives.values():
        if life.initial or life.resumed:
            continue
        mine = [(t, e) for t, k, e in rec.events if k == life.key]
        boot = next(((t, e) for t, e in mine if e.get("event") == "bootstrapped"), None)
        start_step, holders = frontier(rec, life.start)
        row = dict(peer=life.key, started=round(life.start, 2), swarm_step_at_start=start_step,
                   bootstrapped_step=boot[1]["step"] if boot else None,
                   bootstrap_seconds=boot[1].get("seconds") if boot else None, ended_by=life.ended_by)
        last = max([int(e["step"]) for _, e in mine if e.get("event") in STATE_EVENTS and e.get("step") is not None],
                   default=None)
        row["last_step"] = last
        rows.append(row)
        if boot is None:
            end = (life.end if life.end is not None else rec.end) - 1e-6
            providers = [k for k in holders if rec.lives[k].alive_at(end) and left.get(k, end + 1) > end] \
                if start_step > 0 else []
            if life.ended_by == "exit" and providers:  # it gave up (an error) while the state it needed was served
                problems.append(f"{life.key} exited without bootstrapping while {providers[0]} held step {start_step}")
            elif life.ended_by == "finished" and start_step < final:
                problems.append(f"{life.key} joined at swarm step {start_step} and never bootstrapped")
            elif life.ended_by == "cleanup" and providers and end - life.start > JOIN_ALLOWANCE:
                problems.append(f"{life.key} did not bootstrap in {end - life.start:.0f}s while {providers[0]} "
                                f"held step {start_step}")
            continue
        t_boot, b = boot
        survivors = [k for k in holders if rec.lives[k].alive_at(t_boot)]
        if b["step"] < start_step and survivors:
            problems.append(f"{life.key} bootstrapped step {b['step']} < {start_step}, held by live {survivors[0]}")
        if life.ended_by == "finished" and last is not None and last < final:
            problems.append(f"{life.key} was still in the run at its end but stopped at step {last} < {final}")
        elif life.ended_by == "cleanup" and finished_at is not None and life.start < finished_at \
                and last is not None and last < final:
            # the run finished while it was behind, and it neither caught up nor left: stopped by the runner
            problems.append(f"{life.key} was still running when the run finished but stayed at step {last} < {final} "
                            f"until the runner stopped it")
    return not problems, problems, rows


def final_cursor(rec: Record) -> Optional[dict]:
    """The data cursor summary of the newest state (from ``left``, else the last ``step`` report)."""
    best: Optional[tuple[int, int, dict]] = None
    for i, (t, key, e) in enumerate(rec.of("step", "left", "resumed")):
        cur = e.get("cursor")
        if isinstance(cur, dict) and e.get("step") is not None:
            cand = (int(e["step"]), 1 if e["event"] == "left" else 0, cur)
            if best is None or cand[:2] >= best[:2]:
                best = cand
    return best[2] if best else None


def samples_per_step(rec: Record) -> dict[int, int]:
    """Samples committed in each step (the first report of that step; every participant reports the same)."""
    out: dict[int, int] = {}
    for _, _, e in rec.of("step"):
        if e.get("samples") is not None and e.get("step") is not None:
            out.setdefault(int(e["step"]), int(e["samples"]))
    return out


def blocks_per_step(rec: Record) -> dict[int, list[list[int]]]:
    """The block ids each step applied (``[start, end)`` ranges), where its reports agree: a step that two
    histories committed (every holder of the first died) is left out, and with it the replay of the swarm's
    blocks (the baseline then walks the data order)."""
    seen: dict[int, list[list[int]]] = {}
    split: set[int] = set()
    for _, _, e in rec.of("step"):
        if isinstance(e.get("blocks"), list) and e.get("step") is not None:
            step = int(e["step"])
            if seen.setdefault(step, e["blocks"]) != e["blocks"]:
                split.add(step)
    return {s: b for s, b in seen.items() if s not in split}


def eval_losses(rec: Record) -> dict[int, float]:
    """Evaluation loss at each evaluated step (the first report: every peer holds the same weights)."""
    out: dict[int, float] = {}
    for _, _, e in rec.of("eval"):
        if e.get("loss") is not None:
            out.setdefault(int(e["step"]), float(e["loss"]))
    return out


def work_lost(rec: Record) -> list[dict]:
    """Samples computed but never applied, per fault and per re-sync, as far as the events tell.

    A peer's accumulated samples are lost when it is killed, leaves, stalls long enough to be re-synced, or
    re-syncs (the accumulator is dropped). Events do not carry the accumulator, so this estimates it as the
    peer's share of the swarm's rate (``samples_per_second / peers`` of its last report) times the time since
    its last commit or bootstrap, capped at its share of a step (``target_batch_size / peers``): peers stop
    computing once the swarm holds a step's samples. A report's ``samples_accumulated`` field,
    when a peer prints one, is used as is.
    """
    rows = []
    ends = [(life.end, life.key, life.ended_by) for life in rec.lives.values()
            if life.end is not None and life.ended_by in ("kill", "leave")]
    resyncs = [(t, key, "resync") for t, key, e in rec.of("resync")]
    for t_fault, key, why in sorted(ends + resyncs):
        last_commit, rate, accumulated, peers = rec.lives[key].start, 0.0, None, 1
        for t, k, e in rec.events:
            if t > t_fault:
                continue
            if k != key:
                continue
            if e.get("event") in ("step", "bootstrapped", "resync", "resumed") and t < t_fault:
                last_commit, accumulated = t, None
            if e.get("event") in ("step", "progress") and e.get("samples_per_second") is not None:
                peers = max(1, int(e.get("peers") or 1))
                rate = float(e["samples_per_second"]) / peers
                if e.get("samples_accumulated") is not None:
                    accumulated = int(e["samples_accumulated"])
        if accumulated is not None:
            lost, method = accumulated, "reported"
        else:
            lost = min(rec.target_batch_size / peers, rate * max(0.0, t_fault - last_commit))
            method = "estimated"
        rows.append(dict(t=round(t_fault, 2), peer=key, kind=why, samples_lost=int(round(lost)), method=method))
    return rows


def latency_applied(rec: Record) -> tuple[bool, list[str]]:
    """Traces with latency: no connection reached a peer's real port without its delay proxy (the runner's
    scans of the TCP tables), and the proxies carried the swarm's connections (each answered, and together
    forwarded bytes both ways)."""
    px = rec.proxies
    problems = [f"a connection bypassed the proxy: {d}" for d in px.get("direct_connections", [])]
    stats = px.get("per_peer") or {}
    silent = sorted(n for n, st in stats.items() if st is None)
    if silent:
        problems.append(f"the proxies of {', '.join(silent)} did not answer at the end")
    if not px.get("scans"):
        problems.append("no scan for direct connections ran")
    carried = [st for st in stats.values() if st]
    if not any(st.get("connections") for st in carried) or not sum(st.get("bytes_in", 0) for st in carried) \
            or not sum(st.get("bytes_out", 0) for st in carried):
        problems.append("the proxies carried no traffic")
    return not problems, problems


def pauses_carried_out(rec: Record) -> tuple[bool, list[str]]:
    """Every pause the trace planned paused the run (``node pause`` returned a snapshot): a trace whose run finished
    before its pause could be read (the pause trace's 36 steps, once steps took 0.1 s) passed every other invariant
    without ever pausing."""
    kinds = [f["kind"] for f in rec.faults]
    problems = [f"the pause at t={f['t']:.1f}s failed: {f.get('message')}" for f in rec.faults
                if f["kind"] == "pause_failed"]
    if not problems and kinds.count("paused") < kinds.count("pause"):
        problems.append(f"{kinds.count('paused')} of {kinds.count('pause')} pauses paused the run")
    return not problems, problems


def check_all(rec: Record, *, cleaned: bool, loss_ok: Optional[bool]) -> tuple[dict, dict]:
    """Every invariant (name -> bool) and the problems found (name -> list of lines)."""
    inv, why = {}, {}
    inv["state_hash_agrees"], why["state_hash_agrees"] = state_hash_agrees(rec)
    inv["no_committed_step_lost"], why["no_committed_step_lost"] = no_committed_step_lost(rec)
    ok, problems, _ = joiners_reach_current_step(rec)
    inv["joiners_reach_current_step"], why["joiners_reach_current_step"] = ok, problems
    cursor = final_cursor(rec)
    inv["blocks_skipped_zero"] = bool(cursor) and cursor.get("blocks_skipped", 1) == 0
    inv["blocks_duplicated_zero"] = bool(cursor) and cursor.get("blocks_duplicated", 1) == 0
    why["blocks_skipped_zero"] = [] if inv["blocks_skipped_zero"] else [f"final cursor: {cursor}"]
    why["blocks_duplicated_zero"] = [] if inv["blocks_duplicated_zero"] else [f"final cursor: {cursor}"]
    final = max([int(e["step"]) for _, _, e in rec.of(*STATE_EVENTS) if e.get("step") is not None], default=0)
    end = run_end(rec)
    inv["run_finished"] = end is not None and final >= end[1] if rec.sample_budget else final >= rec.total_steps > 0
    why["run_finished"] = [] if inv["run_finished"] else [
        f"final step {final}; no peer left 'finished' (sample budget)" if rec.sample_budget
        else f"final step {final} of {rec.total_steps}"]
    inv["processes_cleaned_up"] = cleaned
    why["processes_cleaned_up"] = [] if cleaned else ["a peer process outlived the run"]
    if rec.proxies:
        inv["latency_applied"], why["latency_applied"] = latency_applied(rec)
    if any(f["kind"] == "pause" for f in rec.faults):
        inv["pauses_carried_out"], why["pauses_carried_out"] = pauses_carried_out(rec)
    if loss_ok is not None:
        inv["final_loss_within_tolerance"] = loss_ok
    return inv, {k: v for k, v in why.items() if v}


def as_jsonable(rec: Record) -> dict[str, Any]:
    return dict(lives={k: vars(v) for k, v in rec.lives.items()}, faults=rec.faults, total_steps=rec.total_steps,
                target_batch_size=rec.target_batch_size, sample_budget=rec.sample_budget, end=rec.end, proxies=rec.proxies,
                link_bytes=rec.link_bytes)
