"""The pool trace's report: ``summary.json`` (the issue's figures and ``invariants``), ``gantt.png`` (which
workstation served which run over time) and ``pool_steps.png`` (each run's step over time), in ``--out``.

Each run's final eval loss is compared with a baseline that replays, in one process, the very blocks each of the
run's steps applied (as for the other traces: :mod:`simulations.baseline`). matplotlib is imported lazily, Agg.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .checks import blocks_per_step, eval_losses, samples_per_step
from .poolchecks import (
    PoolRecord, assignment_spans, committed_steps_lost, down_spans, first_step_times, handbacks, one_run_per_worker,
    pauses_and_resumes, peers_left_gracefully, preemptions, priorities_respected, resident_spans, restarts_lost_nothing,
    run_invariants, utilisation,
)
from .pooltrace import PoolTrace
from .report import compare_loss

PLOTS = ("gantt.png", "pool_steps.png")


def total_steps(trace: PoolTrace, run_id: str) -> int:
    from swarmrun.node import load_task_class

    sets = trace.runs[run_id].sets
    return int(sets.get("total_steps") or load_task_class(trace.task).hparam_defaults["total_steps"])


def run_loss(trace: PoolTrace, rec: PoolRecord, run_id: str, *, baseline: bool) -> dict:
    """The run's final eval loss against its replayed baseline (``ok`` None when there is nothing to compare)."""
    r = rec.run_record(run_id, total_steps(trace, run_id))
    steps = samples_per_step(r)
    ordered = [steps.get(s) for s in range(1, max(steps) + 1)] if steps else []
    if not baseline or not ordered or None in ordered:
        return dict(ok=None, reason="no baseline" if not baseline else "a committed step has no report")
    from swarmrun.node import DEFAULT_SEED

    from .baseline import run_baseline  # torch and the task: only when there is a baseline to run

    blocks = blocks_per_step(r)
    replay = [blocks.get(s) for s in range(1, len(ordered) + 1)]
    replay = None if None in replay else replay
    base = run_baseline(task=trace.task, sets=trace.runs[run_id].sets, seed=DEFAULT_SEED, samples_per_step=ordered,
                        eval_steps=sorted(eval_losses(r)), blocks_per_step=replay)
    base["data"] = "swarm_blocks" if replay else "data_order"
    loss = compare_loss(r, base, rel_tol=trace.loss_tolerance, abs_tol=trace.loss_abs_tolerance)
    return {k: v for k, v in loss.items() if k not in ("swarm_eval", "baseline_eval")}


def evaluate(trace: PoolTrace, rec: PoolRecord, *, baseline: bool = True) -> tuple[dict, dict, dict]:
    """(figures, invariants, problems) of a pool record."""
    util = utilisation(rec)
    backs = handbacks(rec)
    lost, lost_why = committed_steps_lost(rec)
    restarts_ok, restarts_why, restart_rows = restarts_lost_nothing(rec)
    pre = preemptions(rec)
    inv: dict[str, bool] = {}
    why: dict[str, list[str]] = {}
    inv["committed_steps_lost_zero"], why["committed_steps_lost_zero"] = lost == 0, lost_why
    inv["one_run_per_worker"], why["one_run_per_worker"] = one_run_per_worker(rec)
    inv["handback_within_bound"] = all(b["seconds"] <= trace.handback_bound for b in backs)
    why["handback_within_bound"] = [f"{b['worker']} at {b['t']}: {b['seconds']} s" for b in backs
                                    if b["seconds"] > trace.handback_bound]
    inv["priorities_respected"], why["priorities_respected"] = priorities_respected(rec, min_residence=trace.min_residence)
    inv["peers_left_gracefully"], why["peers_left_gracefully"] = peers_left_gracefully(rec)
    inv["utilisation_at_least_target"] = util["utilisation"] is not None and util["utilisation"] >= trace.utilisation_target
    why["utilisation_at_least_target"] = [] if inv["utilisation_at_least_target"] else [f"utilisation {util['utilisation']}"]
    inv["preemptions_reach_first_step"] = all(p["seconds"] is not None for p in pre)
    why["preemptions_reach_first_step"] = [f"{p['run']} never committed a step" for p in pre if p["seconds"] is None]
    if rec.restarts or any(f["kind"] == "coordinator_kill" for f in rec.faults):
        inv["coordinator_restart_lost_nothing"], why["coordinator_restart_lost_nothing"] = restarts_ok, restarts_why
    final = {}
    for row in pauses_and_resumes(rec):
        final[row["run"]] = row["state"]
    inv["runs_finished_in_registry"] = all(final.get(r) == "finished" for r in trace.runs)
    why["runs_finished_in_registry"] = [f"{r}: {final.get(r)}" for r in trace.runs if final.get(r) != "finished"]
    inv["processes_cleaned_up"] = bool(rec.cleaned)
    why["processes_cleaned_up"] = [] if rec.cleaned else ["a process group outlived the run"]
    runs, firsts = {}, first_step_times(rec)
    for run_id, spec in trace.runs.items():
        total = total_steps(trace, run_id)
        run_inv, run_why = run_invariants(rec, run_id, total)
        loss = run_loss(trace, rec, run_id, baseline=baseline)
        if loss.get("ok") is not None or baseline:
            run_inv["final_loss_within_tolerance"] = bool(loss.get("ok"))
        for name, value in run_inv.items():
            inv[f"{run_id}.{name}"] = value
            why[f"{run_id}.{name}"] = run_why.get(name, [])
        steps = [int(e["step"]) for _, k, e in rec.run_record(run_id).events if e.get("event") == "step"]
        runs[run_id] = dict(priority=spec.priority, min_peers=spec.min_peers, max_peers=spec.max_peers,
                            total_steps=total, final_step=max(steps, default=0),
                            first_step=round(firsts[run_id], 2) if run_id in firsts else None,
                            peers_started=len(rec.run_record(run_id).lives), loss=loss)
    figures = dict(
        trace=trace.name, db=rec.db, workers=len(rec.workers), utilisation=util["utilisation"],
        utilisation_detail=util, committed_steps_lost=lost,
        handback_seconds_max=max((b["seconds"] for b in backs), default=None), handbacks=backs,
        preemption_seconds=[p["seconds"] for p in pre], preemptions=pre,
        pauses_and_resumes=pauses_and_resumes(rec), coordinator_restarts=restart_rows, runs=runs,
        assignments=len(assignment_spans(rec)),
    )
    return figures, inv, {k: v for k, v in why.items() if v}


def write_pool_report(out: Path, summary: dict, rec: PoolRecord) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    written = _plots(out, rec)
    summary["plots"] = written
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return written


def _colors(runs: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {r: cmap(i % 10) for i, r in enumerate(runs)}


def _plots(out: Path, rec: PoolRecord) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = _colors(list(rec.runs))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(rec.workers)))
    rows = {w: i for i, w in enumerate(rec.workers)}
    for s in assignment_spans(rec):  # the assignment: a light band; the peer that served it: solid inside
        ax.broken_barh([(s["start"], s["end"] - s["start"])], (rows[s["worker"]] - 0.4, 0.8),
                       facecolors=colors.get(s["run"], "gray"), alpha=0.3)
    for life in rec.lives.values():
        run = life.key.split("/")[1]
        end = life.end if life.end is not None else rec.end
        ax.broken_barh([(life.start, end - life.start)], (rows[life.peer] - 0.25, 0.5), facecolors=colors.get(run, "gray"))
    for w, a, b in resident_spans(rec):
        ax.broken_barh([(a, b - a)], (rows[w] - 0.45, 0.9), facecolors="none", edgecolors="black", hatch="//")
    for a, b in down_spans(rec):
        ax.axvspan(a, b, color="red", alpha=0.12)
    for e in rec.of("submit"):
        ax.axvline(e["t"], color=colors.get(e["run_id"], "gray"), linestyle="--", linewidth=1)
        ax.text(e["t"], len(rec.workers) - 0.4, f" submit {e['run_id']}", fontsize=8, rotation=90, va="top")
    for p in pauses_and_resumes(rec):
        if p["state"] == "paused":
            ax.axvline(p["t"], color=colors.get(p["run"], "gray"), linestyle=":", linewidth=1.5)
    ax.set_yticks(range(len(rec.workers)), rec.workers)
    ax.set_xlabel("trace time (s)")
    ax.set_title("which workstation served which run (band: assigned; solid: its peer ran; hatched: resident "
                 "present; red: coordinator down; dotted: pause)", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=r) for r, c in colors.items()], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gantt.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(10, 4))
    for run in rec.runs:
        pts = sorted((t, int(e["step"])) for t, k, e in rec.peer_events if e.get("event") == "step" and k.split("/")[1] == run)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=2, color=colors[run], label=run)
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("committed step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pool_steps.png", dpi=100)
    plt.close(fig)
    return list(PLOTS)


def finish_pool(folder: Path, trace: PoolTrace, rec: PoolRecord, *, args, interrupted: bool, wall_s: float) -> int:
    """Checks, figures, plots and the summary of a pool run; prints them; returns the exit code."""
    figures, invariants, problems = evaluate(trace, rec, baseline=not args.no_baseline and not interrupted)
    summary = dict(figures, invariants=invariants, problems=problems, wall_s=round(wall_s, 1), out=str(folder),
                   interrupted=interrupted)
    write_pool_report(folder, summary, rec)
    ok = all(invariants.values()) and not interrupted
    if args.json:
        print(json.dumps(summary, default=str), flush=True)
    else:
        for name, value in invariants.items():
            print(f"{'ok  ' if value else 'FAIL'} {name}" + "".join(f"\n       {p}" for p in problems.get(name, [])[:5]))
        print(f"utilisation {summary['utilisation']}, committed steps lost {summary['committed_steps_lost']}, "
              f"handback max {summary['handback_seconds_max']} s, preemptions {summary['preemption_seconds']} s, "
              f"{len(summary['coordinator_restarts'])} coordinator restart(s); report in {folder}")
    return 0 if ok else 1


def save_record(folder: Path, rec: PoolRecord) -> None:
    from .poolchecks import as_jsonable

    (folder / "pool_record.json").write_text(json.dumps(as_jsonable(rec), default=str))


def load_record(folder: Path) -> Optional[PoolRecord]:
    from .poolchecks import from_jsonable

    path = folder / "pool_record.json"
    return from_jsonable(json.loads(path.read_text())) if path.exists() else None
