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

    from .trace import load_trace

    out = _Out(getattr(args, "json", False))
    try:
        trace = load_trace(args.trace, seed=args.seed)
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


def _run(trace, args, out) -> int:
    from .baseline import run_baseline
    from .checks import check_all, eval_losses, samples_per_step
    from .report import compare_loss, figures, write_report
    from .runner import Simulation

    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"sim-{trace.name}-"))
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    sim = Simulation(trace, logs=logs, emit=out)
    try:
        rec = sim.run()
    finally:
        _dump_events(folder, sim)
    baseline = None
    steps = samples_per_step(rec)
    if not args.no_baseline and steps:
        ordered = [steps.get(s) for s in range(1, max(steps) + 1)]
        if None not in ordered:
            out("sim", message=f"baseline: {len(ordered)} steps in one process")
            baseline = run_baseline(task=trace.task, sets=trace.sets, seed=trace.seed, samples_per_step=ordered,
                                    eval_steps=sorted(eval_losses(rec)))
    loss = compare_loss(rec, baseline, rel_tol=trace.loss_tolerance, abs_tol=trace.loss_abs_tolerance)
    invariants, problems = check_all(rec, cleaned=sim.cleaned, loss_ok=loss.get("ok") if baseline else None)
    summary = figures(rec, trace.name, sim.run_id, loss, time.monotonic() - t0)
    summary.update(invariants=invariants, problems=problems, seed=trace.seed, out=str(folder))
    write_report(folder, summary, rec, loss, baseline)
    ok = all(invariants.values())
    if args.json:
        print(json.dumps(summary, default=str), flush=True)
    else:
        for name, value in invariants.items():
            print(f"{'ok  ' if value else 'FAIL'} {name}" + "".join(f"\n       {p}" for p in problems.get(name, [])[:5]))
        lf = summary["loss"]
        print(f"final step {summary['final_step']}/{summary['total_steps']}, {summary['peers_started']} peers, "
              f"faults {summary['faults']}, loss {lf.get('swarm_loss')} vs baseline {lf.get('baseline_loss')}; "
              f"report in {folder}")
    return 0 if ok else 1


def _dump_events(folder: Path, sim) -> None:
    from .checks import as_jsonable

    with open(folder / "events.jsonl", "w") as f:
        for t, key, e in sim.rec.events:
            f.write(json.dumps(dict(t=round(t, 3), peer=key, **e), default=str) + "\n")
    (folder / "lives.json").write_text(json.dumps(as_jsonable(sim.rec), indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
