"""``python -m simulations run TRACE [--json] [--out DIR]`` and ``python -m simulations expand TRACE``.

Exit codes: 0 every invariant held; 1 an invariant failed (or an unexpected error); 2 a bad trace or flag.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


ORDER_NOISE_RUNS = 2  # baselines on other data orders: the loss comparison's noise floor, reported beside it


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulations", description="The churn harness: real peers, real faults.",
                                epilog="exit codes: 0 all invariants held, 1 an invariant failed, 2 bad trace or flag")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    r = sub.add_parser("run", help="run a trace with real `node join` peers; check invariants; write a report")
    r.add_argument("trace", metavar="TRACE", help="a trace file (JSON; see simulations/traces/)")
    r.add_argument("--out", default=None, help="report folder: summary.json, plots, events.jsonl, peer logs "
                                               "(default: a new temp dir, printed)")
    r.add_argument("--seed", type=int, default=None, help="override the trace's seed")
    r.add_argument("--no-baseline", action="store_true", help="skip the single-process baseline")
    r.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")
    r.add_argument("--db", default=None, help="pool traces: the coordinator's SQLAlchemy URL (default: SQLite in its "
                                              "state dir)")
    rp = sub.add_parser("report", help="recompute summary.json and the plots from a run's folder (events.jsonl)")
    rp.add_argument("dir", metavar="DIR", help="the --out folder of an earlier run")
    rp.add_argument("--trace", required=True, help="the trace that run used")
    rp.add_argument("--seed", type=int, default=None)
    rp.add_argument("--no-baseline", action="store_true")
    rp.add_argument("--json", action="store_true")
    e = sub.add_parser("expand", help="print a trace's events, generators expanded (JSON lines)")
    e.add_argument("trace", metavar="TRACE")
    e.add_argument("--seed", type=int, default=None)
    return p


class _Out:
    def __init__(self, json_mode: bool):
        self.json_mode = json_mode

    def __call__(self, event: str, **fields) -> None:
        if self.json_mode:
            print(json.dumps(dict(event=event, time=round(time.time(), 3), **fields), default=str), flush=True)
        else:
            msg = fields.pop("message", None)
            rest = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
            print(f"[{event}] {msg or ''} {rest}".rstrip(), file=sys.stderr, flush=True)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from swarmrun.protocol.errors import SwarmrunError

    from .pooltrace import is_pool_trace
    from .trace import load_trace

    out = _Out(getattr(args, "json", False))
    try:
        if is_pool_trace(args.trace):
            return _pool(args, out)
        trace = load_trace(args.trace, seed=args.seed)
        if args.command == "report":
            return _report(args, trace, out)
        if args.command == "expand":
            for ev in trace.expanded():
                print(json.dumps(ev.to_dict()))
            return 0
        signal.signal(signal.SIGTERM, _sigterm)  # so `finally` cleans up on SIGTERM as on Ctrl-C
        return _run(trace, args, out)
    except SwarmrunError as e:
        out("error", code=e.exit_code, message=str(e))
        return e.exit_code
    except KeyboardInterrupt:
        out("error", code=1, message="interrupted; peers and namespaces cleaned up")
        return 1


def _pool(args, out) -> int:
    """A pool trace (``"kind": "pool"``): a coordinator and agents (:mod:`simulations.poolrun`). SIGTERM and Ctrl-C
    as for the other traces; ``report DIR`` recomputes from the saved ``pool_record.json``."""
    from .poolreport import finish_pool, load_record, save_record
    from .pooltrace import load_pool_trace

    trace = load_pool_trace(args.trace)
    if args.command == "expand":
        for ev in trace.events:
            print(json.dumps(ev.to_dict()))
        return 0
    if args.command == "report":
        rec = load_record(Path(args.dir))
        if rec is None:
            from swarmrun.protocol.errors import UsageError

            raise UsageError(f"{args.dir} holds no pool_record.json")
        return finish_pool(Path(args.dir), trace, rec, args=args, interrupted=False, wall_s=rec.end)
    from .poolrun import PoolSimulation

    signal.signal(signal.SIGTERM, _sigterm)
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"sim-{trace.name}-"))
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sim = PoolSimulation(trace, logs=logs, emit=out, db=getattr(args, "db", None))
    interrupted = False
    try:
        rec = sim.run()
    except KeyboardInterrupt:
        interrupted, rec = True, sim.rec
        out("sim", message="interrupted; every process cleaned up; writing the report of what ran")
    finally:
        save_record(folder, sim.rec)
    return finish_pool(folder, trace, rec, args=args, interrupted=interrupted, wall_s=time.monotonic() - t0)


def _run(trace, args, out) -> int:
    from .runner import Simulation

    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"sim-{trace.name}-"))
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sim = Simulation(trace, logs=logs, emit=out)
    interrupted = False
    try:
        rec = sim.run()  # its own `finally` has cleaned up processes and namespaces when it returns or raises
    except KeyboardInterrupt:
        interrupted, rec = True, sim.rec
        out("sim", message="interrupted; peers and namespaces cleaned up; writing the report of what ran")
    finally:
        _dump_events(folder, sim)
    return _finish(folder, trace, rec, cleaned=sim.cleaned, run_id=sim.run_id, args=args, out=out,
                   interrupted=interrupted, wall_s=time.monotonic() - t0)


def _report(args, trace, out) -> int:
    """Recompute the checks, figures and plots of a finished (or interrupted) run from its saved record."""
    from .checks import Life, Record

    folder = Path(args.dir)
    try:
        saved = json.loads((folder / "lives.json").read_text())
        lines = (folder / "events.jsonl").read_text().splitlines()
        rec = Record(total_steps=int(saved.get("total_steps") or trace.sets.get("total_steps") or 0),
                     target_batch_size=int(saved.get("target_batch_size") or trace.sets.get("target_batch_size") or 0),
                     sample_budget=bool(saved.get("sample_budget")))
        rec.lives = {k: Life(**v) for k, v in saved["lives"].items()}
        rec.faults = saved["faults"]
        rec.proxies = saved.get("proxies") or {}
        rec.link_bytes = saved.get("link_bytes") or {}
        for line in lines:
            e = json.loads(line)
            rec.events.append((e.pop("t"), e.pop("peer"), e))
    except (OSError, ValueError, KeyError, TypeError) as e:
        from swarmrun.protocol.errors import UsageError

        raise UsageError(f"{folder} does not hold a run's record (lives.json, events.jsonl): {e}") from None
    rec.end = float(saved.get("end") or max((t for t, _, _ in rec.events), default=0.0))
    run_id = saved.get("run_id") or next((e.get("run_id") for _, _, e in rec.events if e.get("run_id")), "")
    cleaned = saved.get("cleaned")
    if cleaned is None:  # an older record: whether anything of that run is still running now
        cleaned = bool(run_id) and not any(run_id in c for c in _cmdlines())
    return _finish(folder, trace, rec, cleaned=cleaned, run_id=run_id, args=args, out=out,
                   interrupted=bool(saved.get("interrupted")), wall_s=rec.end)


def _finish(folder: Path, trace, rec, *, cleaned: bool, run_id: str, args, out, interrupted: bool, wall_s: float) -> int:
    from .checks import blocks_per_step, check_all, eval_losses, samples_per_step
    from .report import compare_loss, figures, human_lines, write_report

    baseline = None
    steps = samples_per_step(rec)
    if trace.sets.get("outer") not in (None, "none") and not args.no_baseline:
        # the baseline takes one optimizer step per committed step on its samples: the synchronous algorithm. An
        # outer step is H inner steps on each trainer's own blocks, then an average: no one process repeats it
        out("sim", message="no baseline: the run is in outer mode (its loss is compared by benchmarks/links.py)")
    elif not args.no_baseline and steps and not interrupted:
        ordered = [steps.get(s) for s in range(1, max(steps) + 1)]
        if None not in ordered:
            from swarmrun.protocol.errors import ProtocolError

            from .baseline import run_baseline  # torch and the task: only when there is a baseline to run

            blocks = blocks_per_step(rec)
            replay = [blocks.get(s) for s in range(1, len(ordered) + 1)]
            replay = None if None in replay else replay  # a record of peers that did not report their blocks
            same = dict(task=trace.task, sets=trace.sets, seed=trace.seed, samples_per_step=ordered,
                        eval_steps=sorted(eval_losses(rec)))
            out("sim", message=f"baseline: {len(ordered)} steps in one process, on "
                               + ("the blocks each step of the swarm applied" if replay else "the run's data order"))
            try:
                baseline = run_baseline(**same, blocks_per_step=replay)
            except (ValueError, ProtocolError) as e:
                if replay is None:
                    raise
                out("sim", message=f"baseline: the swarm's blocks cannot be replayed ({e}); on the data order instead")
                replay = None
                baseline = run_baseline(**same)
            baseline["data"] = "swarm_blocks" if replay else "data_order"
            baseline["other_orders"] = [run_baseline(**same, order_shift=k)["eval"]
                                        for k in range(1, ORDER_NOISE_RUNS + 1)]
    loss = compare_loss(rec, baseline, rel_tol=trace.loss_tolerance, abs_tol=trace.loss_abs_tolerance)
    invariants, problems = check_all(rec, cleaned=cleaned, loss_ok=loss.get("ok") if baseline else None)
    summary = figures(rec, trace.name, run_id, loss, wall_s)
    summary.update(invariants=invariants, problems=problems, seed=trace.seed, out=str(folder), interrupted=interrupted)
    write_report(folder, summary, rec, loss, baseline)
    ok = all(invariants.values()) and not interrupted
    if args.json:
        print(json.dumps(summary, default=str), flush=True)
    else:
        for name, value in invariants.items():
            print(f"{'ok  ' if value else 'FAIL'} {name}" + "".join(f"\n       {p}" for p in problems.get(name, [])[:5]))
        lf = summary["loss"]
        of = f"/{summary['total_steps']}" if summary["total_steps"] else " (sample budget)"
        print(f"final step {summary['final_step']}{of}, {summary['peers_started']} peers, "
              f"faults {summary['faults']}, loss {lf.get('swarm_loss')} vs baseline {lf.get('baseline_loss')}"
              f"{' (interrupted)' if interrupted else ''}; report in {folder}")
        for line in human_lines(summary):
            print(line)
    return 0 if ok else 1


def _dump_events(folder: Path, sim) -> None:
    from .checks import as_jsonable

    with open(folder / "events.jsonl", "w") as f:
        for t, key, e in sim.rec.events:
            f.write(json.dumps(dict(t=round(t, 3), peer=key, **e), default=str) + "\n")
    saved = dict(as_jsonable(sim.rec), run_id=sim.run_id, cleaned=sim.cleaned)
    (folder / "lives.json").write_text(json.dumps(saved, indent=1, default=str))


def _cmdlines() -> list[str]:
    rows = []
    for pid in Path("/proc").iterdir():
        if pid.name.isdigit():
            try:
                rows.append((pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return rows


if __name__ == "__main__":
    sys.exit(main())
