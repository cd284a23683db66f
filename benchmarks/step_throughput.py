"""Step throughput: samples/s of a 2-peer swarmrun swarm vs plain ``hivemind.Optimizer`` vs one local process.

All three train the same task, model, optimizer, data order, per-peer batch size, target batch size and number of
steps; the two swarms use the same matchmaking time and timeouts (swarmrun's ``TrainerConfig`` defaults).
Runs are interleaved (swarmrun, hivemind, local, swarmrun, ...), ``--repeats`` of each; the figure of a run is

    samples/s = target_batch_size * (steps committed after the first) / (time of last step - time of first step)

read from the first peer's step events, so start-up and the first step are excluded. Every peer runs in its own
session and its whole process group is killed at the end of its run, whatever happens; every wait is bounded.

    /work/venv/bin/python benchmarks/step_throughput.py [--repeats 3] [--total-steps 20] [--json]

With ``--json`` the last stdout line is the summary (medians, ``ratio_vs_hivemind``, ``ratio_vs_local``, every
run's figure); otherwise a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _procs import RunFailed, figure, hivemind_peers, kill_all, local_process, swarmrun_peers  # noqa: E402

DEFAULT_SEED = 20261202  # swarmrun.node.DEFAULT_SEED; passed explicitly to every run anyway
SYSTEMS = ("swarmrun", "hivemind", "local")


def all_sets(opts) -> list[str]:
    return [*opts.sets, f"total_steps={opts.total_steps}", f"target_batch_size={opts.target_batch_size}"]


def run_swarmrun(opts, log_dir: Path) -> dict[str, Any]:
    (a, b), left = swarmrun_peers(opts, log_dir, 2, sets=all_sets(opts))
    out = figure(a.of("step"), opts.target_batch_size)
    out.update(reason=left.get("reason"), rounds_abandoned=len(a.of("round_abandoned")), resyncs=left.get("resyncs"),
               peer_b_steps=len(b.of("step")), commands=[" ".join(a.cmd), " ".join(b.cmd)])
    if left.get("step") != opts.total_steps:
        out["warning"] = f"peer a left at step {left.get('step')} ({left.get('reason')})"
    return out


def run_hivemind(opts, log_dir: Path) -> dict[str, Any]:
    # the second peer starts half-way through the block order (swarmrun's peers start at crc32(peer_id) % n)
    (a, b), left = hivemind_peers(opts, log_dir, 2, sets=all_sets(opts), starts=[0, opts.start_b])
    steps = a.of("step")
    out = figure(steps, opts.target_batch_size)
    out.update(jumped=sum(int(e.get("jumped", 0)) for e in steps), peer_b_steps=len(b.of("step")))
    if left.get("step") != opts.total_steps:
        out["warning"] = f"peer a left at epoch {left.get('step')}"
    return out


def run_local(opts, log_dir: Path) -> dict[str, Any]:
    return figure(local_process(opts, log_dir, sets=all_sets(opts)).of("step"), opts.target_batch_size)


RUNNERS = {"swarmrun": run_swarmrun, "hivemind": run_hivemind, "local": run_local}


# ---- driver -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="synthetic", help="installed swarmrun task (default synthetic)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra task argument or hyperparameter, as `node join --set` (repeatable)")
    p.add_argument("--total-steps", type=int, default=20)
    p.add_argument("--target-batch-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="per-peer local batch")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--repeats", type=int, default=3, help="runs of each system, interleaved (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of swarmrun,hivemind,local")
    p.add_argument("--run-timeout", type=float, default=180.0, help="seconds before a run is killed (default 180)")
    p.add_argument("--startup-timeout", type=float, default=90.0, help="seconds for a peer to start listening")
    p.add_argument("--start-b", type=int, default=None,
                   help="hivemind peer b's start position in the block order (default: half the blocks)")
    p.add_argument("--node", default=None, help="the `node` executable (default: next to this Python)")
    p.add_argument("--workdir", default=None, help="where peer logs and state dirs go (default: a temp dir)")
    p.add_argument("--verbose-peers", action="store_true", help="hivemind baseline peers log their status to stderr")
    p.add_argument("--keep", action="store_true", help="keep the temp workdir")
    p.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")
    opts = p.parse_args(argv)
    opts.systems = [s.strip() for s in opts.systems.split(",") if s.strip()]
    bad = [s for s in opts.systems if s not in SYSTEMS]
    if bad or opts.repeats < 1 or opts.total_steps < 2:
        p.error(f"bad --systems {bad}" if bad else "--repeats must be >= 1 and --total-steps >= 2")
    return opts


def _default_start_b(opts) -> int:
    from _common import count_blocks  # noqa: E402 (imports torch and the task; only once)

    return count_blocks(opts.task, dict(s.split("=", 1) for s in all_sets(opts)), opts.seed) // 2


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.start_b is None:
        opts.start_b = _default_start_b(opts)
    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        for rep in range(opts.repeats):
            for system in opts.systems:
                log_dir = workdir / f"{rep:02d}-{system}"
                log_dir.mkdir(parents=True, exist_ok=True)
                t0 = time.monotonic()
                record: dict[str, Any] = dict(system=system, repeat=rep)
                try:
                    record.update(RUNNERS[system](opts, log_dir))
                except RunFailed as e:
                    record.update(samples_per_s=None, error=str(e))
                    if e.partial:
                        record["partial"] = e.partial
                record["wall_s"] = round(time.monotonic() - t0, 2)
                runs.append(record)
                sps = record.get("samples_per_s")
                say(f"[{rep + 1}/{opts.repeats}] {system:8s} " + (f"{sps:10.1f} samples/s  "
                    f"({record['steps_in_window']} steps in {record['window_s']:.3f}s, wall {record['wall_s']}s)"
                    if sps is not None else f"FAILED: {record['error'][:300]}" + (
                        f" (before failing: {record['partial']['samples_per_s']:.1f} samples/s over steps "
                        f"{record['partial']['first_step']}..{record['partial']['last_step']})"
                        if record.get("partial") else "")))
                if opts.json:
                    print(json.dumps(dict(event="run", **record)), flush=True)
    except KeyboardInterrupt:
        say("interrupted: killing peers")
        kill_all()
        return 130
    finally:
        kill_all()
        if not opts.workdir and not opts.keep and all(r.get("error") is None for r in runs):
            shutil.rmtree(workdir, ignore_errors=True)
        elif runs:
            say(f"peer logs kept in {workdir}")

    summary = make_summary(opts, runs)
    if opts.json:
        print(json.dumps(summary), flush=True)
    else:
        print_table(summary)
    return 0 if all(summary["medians"].get(s) is not None for s in opts.systems) else 1


def make_summary(opts, runs: list[dict[str, Any]]) -> dict:
    """The ``summary`` line: each system's figures and median, the ratios of the medians, the failed runs."""
    figures = {s: [r["samples_per_s"] for r in runs if r["system"] == s and r.get("samples_per_s") is not None]
               for s in opts.systems}
    medians = {s: (statistics.median(v) if v else None) for s, v in figures.items()}

    def ratio(a: str, b: str) -> Optional[float]:
        x, y = medians.get(a), medians.get(b)
        return x / y if x is not None and y else None

    return dict(
        event="summary", task=opts.task,
        settings=dict(total_steps=opts.total_steps, target_batch_size=opts.target_batch_size,
                      batch_size=opts.batch_size, matchmaking_time=opts.matchmaking_time, seed=opts.seed,
                      repeats=opts.repeats, sets=opts.sets, peers=2),
        medians=medians, figures=figures, ratio_vs_hivemind=ratio("swarmrun", "hivemind"),
        ratio_vs_local=ratio("swarmrun", "local"),
        failed=[dict(system=r["system"], repeat=r["repeat"], error=r["error"], partial=r.get("partial"))
                for r in runs if r.get("error")],
        runs=runs,
    )


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    st = summary["settings"]
    table = Table(title=f"step throughput: task {summary['task']}, 2 peers, {st['total_steps']} steps, target batch "
                        f"{st['target_batch_size']}, batch {st['batch_size']}, matchmaking {st['matchmaking_time']}s")
    table.add_column("system")
    table.add_column("median samples/s", justify="right")
    table.add_column("runs (samples/s)", justify="right")
    table.add_column("swarmrun / this", justify="right")
    sr = summary["medians"].get("swarmrun")
    for system, med in summary["medians"].items():
        runs = ", ".join(f"{x:.1f}" for x in summary["figures"][system]) or "-"
        rel = f"{sr / med:.3f}" if sr is not None and med else "-"
        table.add_row(system, "-" if med is None else f"{med:.1f}", runs, rel)
    console = Console()
    console.print(table)
    for f in summary["failed"]:
        console.print(f"failed {f['system']} #{f['repeat']}: {f['error'][:500]}", markup=False, highlight=False)
    if summary["ratio_vs_hivemind"] is not None or summary["ratio_vs_local"] is not None:
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        console.print(f"ratio_vs_hivemind {fmt(summary['ratio_vs_hivemind'])}  "
                      f"ratio_vs_local {fmt(summary['ratio_vs_local'])}", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
