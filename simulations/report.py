"""The report: ``summary.json`` (figures and ``invariants``) and PNG plots, directly in ``--out``.

matplotlib is imported here only, lazily, with the Agg backend (no display; STYLE.md 11).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .checks import Record, eval_losses, final_cursor, joiners_reach_current_step, samples_per_step, work_lost
from .stepstats import abandoned_by_reason, distinct_abandoned, round_overhead, step_size_stats
from .trace import KINDS

PLOTS = ("loss_vs_samples.png", "peers_over_time.png", "step_rate.png", "bootstrap_times.png")
FAULT_COLORS = {"kill": "red", "leave": "orange", "join": "green", "stall": "purple", "slow": "brown",
                "loss": "gray", "partition": "black", "pause": "blue", "resume_run": "cyan",
                "latency": "olive"}


def compare_loss(rec: Record, baseline: Optional[dict], *, rel_tol: float, abs_tol: float) -> dict:
    """Final eval loss of the swarm against the baseline's at the same step (equal samples by construction)."""
    swarm = eval_losses(rec)
    out: dict[str, Any] = dict(swarm_eval=swarm, baseline_eval=(baseline or {}).get("eval", {}))
    common = sorted(set(swarm) & set(out["baseline_eval"]))
    if not common:
        out.update(ok=None, reason="no evaluated step in common")
        return out
    step = common[-1]
    s, b = swarm[step], out["baseline_eval"][step]
    rel = abs(s - b) / abs(b) if b else float("inf")
    out.update(step=step, samples=(baseline or {}).get("samples", {}).get(step), swarm_loss=s, baseline_loss=b,
               baseline_data=(baseline or {}).get("data"),
               relative_difference=rel, ok=abs(s - b) <= rel_tol * abs(b) + abs_tol, rel_tol=rel_tol, abs_tol=abs_tol)
    others = [o[step] for o in (baseline or {}).get("other_orders", []) if step in o]
    if others and b:
        # not a check: how far one process on the run's data order shifted lands, same samples per step (what
        # data order alone does; the baseline itself takes the swarm's own blocks when the record has them)
        out["data_order_noise"] = dict(losses=others, relative_differences=[abs(o - b) / abs(b) for o in others],
                                       max=max(abs(o - b) / abs(b) for o in others))
    return out


def figures(rec: Record, trace_name: str, run_id: str, loss: dict, wall_s: float) -> dict:
    """Every figure of the summary, computed from the record."""
    steps = samples_per_step(rec)
    final = max([int(e["step"]) for _, _, e in rec.of("step", "left", "bootstrapped", "resync", "resumed")
                 if e.get("step") is not None], default=0)
    step_times = sorted(t for t, _, e in rec.of("step"))
    first_step = step_times[0] if step_times else None
    kinds: dict[str, int] = {}
    for f in rec.faults:
        if "note" not in f and f["kind"] in KINDS:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    _, _, joiners = joiners_reach_current_step(rec)
    boots = [e.get("seconds") for _, _, e in rec.of("bootstrapped") if e.get("seconds") is not None]
    resync_s = [e.get("seconds") for _, _, e in rec.of("resync") if e.get("seconds") is not None]
    lost = work_lost(rec)
    span = (step_times[-1] - first_step) if len(step_times) > 1 else 0.0
    return dict(
        trace=trace_name, run_id=run_id, wall_s=round(wall_s, 1), final_step=final, total_steps=rec.total_steps or None,
        sample_budget=rec.sample_budget,
        samples_applied=sum(steps.values()), target_batch_size=rec.target_batch_size,
        samples_per_step_mean=round(sum(steps.values()) / len(steps), 1) if steps else None, steps_per_minute=round(60 * (len(set(steps)) - 1) / span, 2) if span else None,
        peers_started=len(rec.lives), faults=kinds, faults_skipped=sum(1 for f in rec.faults if "note" in f),
        rounds_abandoned=len(rec.of("round_abandoned")), resyncs=len(rec.of("resync")), **step_figures(rec),
        bootstrap_seconds=dict(count=len(boots), mean=_mean(boots), max=max(boots, default=None)),
        resync_seconds=dict(count=len(resync_s), mean=_mean(resync_s), max=max(resync_s, default=None)),
        cursor=final_cursor(rec), work_lost=dict(samples=sum(r["samples_lost"] for r in lost), per_fault=lost),
        joiners=joiners,
        loss={k: v for k, v in loss.items() if k not in ("swarm_eval", "baseline_eval")},
        **({"latency": rec.proxies} if rec.proxies else {}),
    )


def step_figures(rec: Record) -> dict:
    """The step-size distribution, the round overhead and the abandoned rounds by reason class (``stepstats``)."""
    sizes = step_size_stats(samples_per_step(rec).values(), rec.target_batch_size)
    overhead = round_overhead((key, e.get("time", t), e) for t, key, e in rec.of("step"))
    return dict(
        step_size={k: v for k, v in sizes.items() if k != "p95_error"},
        step_size_p95_error=_round(sizes["p95_error"], 4),
        round_overhead=dict(share=_round(overhead["share"], 4), steps=overhead["steps"],
                            reported=overhead["reported"]),
        rounds_abandoned_by_reason=abandoned_by_reason(e.get("reason") for _, _, e in rec.of("round_abandoned")),
        rounds_abandoned_distinct=distinct_abandoned(e for _, _, e in rec.of("round_abandoned")),
    )


def human_lines(summary: dict) -> list[str]:
    """The step figures of ``summary`` as lines for the human report."""
    size, overhead = summary.get("step_size") or {}, summary.get("round_overhead") or {}
    lines = []
    if size.get("steps"):
        lines.append(f"samples per step (target {size.get('target')}): min {size['min']}, p50 {size['p50']:g}, "
                     f"p95 {size['p95']:g}, max {size['max']} over {size['steps']} steps; "
                     f"p95 |samples - target| / target {summary.get('step_size_p95_error')}")
    share = overhead.get("share")
    lines.append("round overhead: " + (f"{share:.3f} of a step's wall time (mean over {overhead['steps']} steps)"
                                       if share is not None else "unknown (the peers report no round_overhead_s)"))
    lines.append(f"rounds abandoned: {summary.get('rounds_abandoned', 0)} reports"
                 + _classes(summary.get("rounds_abandoned_by_reason") or {}))
    distinct = dict(summary.get("rounds_abandoned_distinct") or {})
    if distinct:
        lines.append(f"rounds abandoned, each counted once: {distinct.pop('total', 0)}" + _classes(distinct))
    return lines


def _classes(counts: dict) -> str:
    """`` (class: n, ...)`` for the human report, or nothing."""
    return " (" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ")" if counts else ""


def write_report(out: Path, summary: dict, rec: Record, loss: dict, baseline: Optional[dict]) -> list[str]:
    """Write summary.json and the plots into ``out``; returns the plot file names written."""
    out.mkdir(parents=True, exist_ok=True)
    written = _plots(out, rec, loss, baseline)
    summary["plots"] = written
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return written


def _plots(out: Path, rec: Record, loss: dict, baseline: Optional[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return [_save(_plot_loss(plt, rec, loss, baseline), out, "loss_vs_samples.png"),
            _save(_plot_peers(plt, rec), out, "peers_over_time.png"),
            _save(_plot_step_rate(plt, rec), out, "step_rate.png"),
            _save(_plot_bootstrap(plt, rec), out, "bootstrap_times.png")]


def _plot_loss(plt, rec: Record, loss: dict, baseline: Optional[dict]):
    steps = samples_per_step(rec)
    cum, total = {}, 0
    for s in sorted(steps):
        total += steps[s]
        cum[s] = total
    fig, ax = plt.subplots(figsize=(7, 4))
    sw = loss.get("swarm_eval", {})
    xs = [cum.get(s) for s in sorted(sw)]
    ax.plot([x for x in xs if x is not None], [sw[s] for s in sorted(sw) if cum.get(s) is not None], "o-", label="swarm (eval)")
    if baseline:
        be = baseline.get("eval", {})
        ax.plot([baseline["samples"][s] for s in sorted(be)], [be[s] for s in sorted(be)], "s--",
                label="baseline, the swarm's blocks" if baseline.get("data") == "swarm_blocks" else "baseline (eval)")
        for k, other in enumerate(baseline.get("other_orders", [])):
            ax.plot([baseline["samples"][s] for s in sorted(other)], [other[s] for s in sorted(other)], ":", color="gray",
                    lw=1, label="baseline, other data orders" if k == 0 else None)
    ax.set_xlabel("samples applied")
    ax.set_ylabel("eval loss")
    ax.set_yscale("log")
    ax.set_title("loss vs samples")
    ax.legend()
    return fig


def _plot_peers(plt, rec: Record):
    fig, ax = plt.subplots(figsize=(7, 4))
    times = sorted({0.0, rec.end, *(life.start for life in rec.lives.values()),
                    *(life.end for life in rec.lives.values() if life.end is not None)})
    ax.step(times, [sum(1 for life in rec.lives.values() if life.alive_at(t)) for t in times], where="post", label="live peers")
    for f in rec.faults:
        if "note" in f:
            continue
        ax.axvline(f["t"], color=FAULT_COLORS.get(f["kind"], "gray"), alpha=0.6, lw=1)
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in FAULT_COLORS.items()
               if any(f["kind"] == k and "note" not in f for f in rec.faults)]
    ax.legend(handles=[ax.get_lines()[0], *handles], fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("peers")
    ax.set_title("peers over time (faults marked)")
    return fig


def _plot_step_rate(plt, rec: Record):
    fig, ax = plt.subplots(figsize=(7, 4))
    first = {}
    for t, _, e in rec.of("step"):
        first.setdefault(int(e["step"]), t)
    ts = sorted(first.values())
    ax.plot(ts, range(1, len(ts) + 1), "-", label="steps committed")
    window = 20.0  # seconds: the rolling rate
    grid = [ts[0] + window + i for i in range(int(ts[-1] - ts[0] - window) + 1)] if ts else []
    rate = [60.0 * sum(1 for u in ts if t - window < u <= t) / window for t in grid]
    ax2 = ax.twinx()
    ax2.plot(grid, rate, ":", color="tab:green", label=f"steps/min (last {window:g}s)")
    ax2.set_ylabel("steps per minute")
    for f in rec.faults:
        if f["kind"] in ("kill", "leave", "stall", "partition", "pause", "slow", "loss") and "note" not in f:
            ax.axvline(f["t"], color=FAULT_COLORS.get(f["kind"], "gray"), alpha=0.5, lw=1)
    ax.legend(handles=[*ax.get_lines()[:1], *ax2.get_lines()], fontsize=7, loc="upper left")
    ax.set_xlabel("seconds")
    ax.set_ylabel("steps committed")
    ax.set_title("step rate")
    return fig


def _plot_bootstrap(plt, rec: Record):
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [(k, e.get("seconds")) for _, k, e in rec.of("bootstrapped") if e.get("seconds") is not None]
    rows += [(f"{k} (resync)", e.get("seconds")) for _, k, e in rec.of("resync") if e.get("seconds") is not None]
    if rows:
        ax.barh([r[0] for r in rows], [r[1] for r in rows])
    else:
        ax.text(0.5, 0.5, "no bootstrap or re-sync in this run", ha="center", transform=ax.transAxes)
    ax.set_xlabel("seconds")
    ax.set_title("bootstrap and re-sync times")
    return fig


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def _round(x: Optional[float], digits: int) -> Optional[float]:
    return None if x is None else round(x, digits)


def _mean(xs: list) -> Optional[float]:
    return round(sum(xs) / len(xs), 3) if xs else None
