"""Scaling: do 2 swarmrun peers train faster than one local process? Against hivemind.Optimizer alike.

Every process runs pinned to one CPU core with one torch thread (``sched_setaffinity`` before exec, and
``OMP_NUM_THREADS=1``, inherited by a peer's p2pd and hivemind processes): peer ``i`` of a run on core
``cores[i]``, the local process on ``cores[0]``. Systems, interleaved per repeat (each a fresh swarm):

- ``local``: ``_local_run.py``, one process, a plain loop with the same task, batch, optimizer and schedule;
- ``local_pair``: two such loops at once, one per core: what this machine gives two independent processes. Its
  ratio to ``local`` (``ceiling_2``) is the most two peers could reach here (cores that share a physical core,
  a cache or memory bandwidth give less than 2);
- ``swarmrun_1`` / ``swarmrun_2``: 1 / 2 ``node join`` peers (``--min-peers`` 1 / 2);
- ``hivemind_1`` / ``hivemind_2``: 1 / 2 ``hivemind.Optimizer`` peers (``_hivemind_peer.py``), same matchmaking
  time and timeouts.

The default task is ``char-lm`` at its defaults (470k parameters, 64-byte windows) with a ``target_batch_size``
sized so that one target batch computes in about ``--step-seconds`` (1.0) on one core of the machine at hand: a
short local loop pinned like the others measures samples/s first (``calibrate_target``; the summary's
``calibration`` says what it measured), rounded to whole local batches of both peers. ``--target-batch-size``
fixes it instead. ``eval_every=0``: no run evaluates.

The figure of a run is read from its ``step`` events (each step at the time the first peer reported it), the
first step excluded (start-up is not counted): ``samples_per_s`` = the samples of the steps after the first (swarmrun and local report them; for
hivemind, the samples the peers fed to ``opt.step`` in that epoch) / the time from the first step to the last;
``samples_per_s_at_target`` counts ``target_batch_size`` per step instead. The summary (last stdout line with
``--json``) holds ``speedup_2`` (swarmrun_2 / local, medians), ``speedup_2_hivemind``, ``round_overhead_2`` (mean
of ``round_overhead_s`` / the step's wall time over swarmrun_2's steps; null when the peers do not report the
field), ``step_size_p95_error`` (95th percentile of ``|samples - target| / target`` over swarmrun_2's steps).

    python benchmarks/scaling.py --json                 # char-lm, a ~1 s target, batch 32, 20 steps, 1 repeat

Every wait is bounded (``--run-timeout``, ``--startup-timeout``); every process group is killed when its run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository: simulations.stepstats

from _procs import (RunFailed, figure, hivemind_peers, kill_all, local_process, local_processes,  # noqa: E402
                    swarmrun_peers)
from simulations.stepstats import abandoned_by_reason, round_overhead, step_size_stats, step_sizes  # noqa: E402

DEFAULT_SEED = 20261202
SYSTEMS = ("local", "local_pair", "swarmrun_1", "swarmrun_2", "hivemind_1", "hivemind_2")


# ---- figures (pure) -----------------------------------------------------------------------------------------
def throughput(steps: list[dict], sizes: Mapping[int, int], target: int) -> dict[str, Any]:
    """The run's figures over the window of ``steps`` (its ``step`` events, one per step): ``sizes`` gives each
    step's samples; a step without a size counts ``target`` (``samples_counted`` says how many did)."""
    base = figure(steps, target)
    window = range(base["first_step"] + 1, base["last_step"] + 1)
    samples = sum(sizes.get(s, target) for s in window)
    return dict(samples_per_s=samples / base["window_s"], samples_per_s_at_target=base["samples_per_s"],
                step_s=base["window_s"] / base["steps_in_window"], steps_in_window=base["steps_in_window"],
                window_s=round(base["window_s"], 3), first_step=base["first_step"], last_step=base["last_step"],
                samples_counted=sum(s in sizes for s in window))


def swarm_steps(peers_steps: list[list[dict]]) -> list[dict]:
    """Each step once, as the first peer that reached it reported it: the swarm's step times (a peer whose last
    round waits out a timeout after the others left does not stretch the window)."""
    first: dict[int, dict] = {}
    for steps in peers_steps:
        for e in steps:
            s = int(e["step"])
            if s not in first or float(e["time"]) < float(first[s]["time"]):
                first[s] = e
    return [first[s] for s in sorted(first)]


def hivemind_sizes(peers_steps: list[list[dict]]) -> dict[int, int]:
    """Samples of each hivemind epoch: what all peers fed to ``opt.step`` before they reached it."""
    out: dict[int, int] = {}
    for steps in peers_steps:
        for e in steps:
            if e.get("samples_fed") is not None:
                out[int(e["step"])] = out.get(int(e["step"]), 0) + int(e["samples_fed"])
    return out


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def swarm_figures(runs: list[dict], target: int) -> dict[str, Any]:
    """Round overhead and step size over every step of the given swarmrun runs (their ``_steps`` rows)."""
    rows = [r for run in runs for r in run.get("_steps", [])]
    overhead = round_overhead((peer, t, e) for peer, t, e in rows)
    sizes = [s for run in runs for s in run.get("_sizes", {}).values()]
    return dict(round_overhead=overhead, step_size=step_size_stats(sizes, target))


def summarize(runs: list[dict], opts) -> dict[str, Any]:
    """The summary line: medians per system, the speedups, the swarm figures of swarmrun_1 and swarmrun_2."""
    by = {s: [r for r in runs if r["system"] == s and r.get("samples_per_s") is not None] for s in opts.systems}
    med = {s: statistics.median(r["samples_per_s"] for r in v) if v else None for s, v in by.items()}
    med_t = {s: statistics.median(r["samples_per_s_at_target"] for r in v) if v else None for s, v in by.items()}
    two, one = swarm_figures(by.get("swarmrun_2", []), opts.target_batch_size), \
        swarm_figures(by.get("swarmrun_1", []), opts.target_batch_size)
    local = by.get("local") or []
    out = dict(
        event="summary", task=opts.task,
        settings=dict(sets=opts.sets, target_batch_size=opts.target_batch_size, batch_size=opts.batch_size,
                      total_steps=opts.total_steps, matchmaking_time=opts.matchmaking_time, seed=opts.seed,
                      repeats=opts.repeats, cores=opts.cores, torch_threads=1),
        calibration=getattr(opts, "calibration", None),
        local_step_s=statistics.median(r["step_s"] for r in local) if local else None,
        speedup_2=ratio(med.get("swarmrun_2"), med.get("local")),
        speedup_2_hivemind=ratio(med.get("hivemind_2"), med.get("local")),
        speedup_1=ratio(med.get("swarmrun_1"), med.get("local")),
        speedup_1_hivemind=ratio(med.get("hivemind_1"), med.get("local")),
        ceiling_2=ratio(med.get("local_pair"), med.get("local")),
        speedup_2_of_ceiling=ratio(med.get("swarmrun_2"), med.get("local_pair")),
        speedup_2_at_target=ratio(med_t.get("swarmrun_2"), med_t.get("local")),
        speedup_2_hivemind_at_target=ratio(med_t.get("hivemind_2"), med_t.get("local")),
        round_overhead_2=two["round_overhead"]["share"], round_overhead_2_steps=two["round_overhead"]["steps"],
        step_size_p95_error=two["step_size"]["p95_error"], step_size_2=two["step_size"],
        step_size_p95_error_1=one["step_size"]["p95_error"], round_overhead_1=one["round_overhead"]["share"],
        rounds_abandoned_2=abandoned_by_reason(x for r in by.get("swarmrun_2", []) for x in r.get("_abandoned", [])),
        medians_samples_per_s=med, medians_samples_per_s_at_target=med_t,
        failed=[dict(system=r["system"], repeat=r["repeat"], error=r["error"]) for r in runs if r.get("error")],
        runs=[{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    )
    if by.get("swarmrun_2") and not two["round_overhead"]["reported"]:
        out["round_overhead_2_note"] = "the swarmrun peers' step events carry no round_overhead_s"
    return out


# ---- one run of each system ---------------------------------------------------------------------------------
def all_sets(opts) -> list[str]:
    return [*opts.sets, f"total_steps={opts.total_steps}", f"target_batch_size={opts.target_batch_size}"]


def run_swarmrun(opts, log_dir: Path, n: int) -> dict[str, Any]:
    peers, left = swarmrun_peers(opts, log_dir, n, sets=all_sets(opts), cores=opts.cores[:n])
    sizes = step_sizes(e for p in peers for e in p.of("step"))
    out = throughput(swarm_steps([p.of("step") for p in peers]), sizes, opts.target_batch_size)
    out.update(cores=[p.cores for p in peers], resyncs=left.get("resyncs"),
               rounds_abandoned=sum(len(p.of("round_abandoned")) for p in peers),
               peer_steps=[len(p.of("step")) for p in peers],
               _steps=[(p.name, float(e["time"]), e) for p in peers for e in p.of("step")], _sizes=sizes,
               _abandoned=[e.get("reason") for p in peers for e in p.of("round_abandoned")])
    fig = swarm_figures([out], opts.target_batch_size)
    out.update(round_overhead=fig["round_overhead"]["share"], step_size=fig["step_size"])
    if left.get("step") != opts.total_steps:
        out["warning"] = f"peer a left at step {left.get('step')} ({left.get('reason')})"
    return out


def run_hivemind(opts, log_dir: Path, n: int) -> dict[str, Any]:
    starts = [i * opts.num_blocks // n for i in range(n)]  # apart in the block order, as swarmrun's peers start
    peers, left = hivemind_peers(opts, log_dir, n, sets=all_sets(opts), starts=starts, cores=opts.cores[:n])
    steps = [p.of("step") for p in peers]
    out = throughput(swarm_steps(steps), hivemind_sizes(steps), opts.target_batch_size)
    out.update(cores=[p.cores for p in peers], jumped=sum(int(e.get("jumped", 0)) for e in steps[0]),
               peer_steps=[len(p.of("step")) for p in peers])
    if left.get("step") != opts.total_steps:
        out["warning"] = f"peer a left at epoch {left.get('step')}"
    return out


def run_local(opts, log_dir: Path) -> dict[str, Any]:
    peer = local_process(opts, log_dir, sets=all_sets(opts), core=opts.cores[0])
    out = throughput(peer.of("step"), step_sizes(peer.of("step")), opts.target_batch_size)
    out.update(cores=[peer.cores])
    return out


def run_local_pair(opts, log_dir: Path) -> dict[str, Any]:
    if len(opts.cores) < 2:
        raise RunFailed("local_pair needs two cores (--cores)")
    peers = local_processes(opts, log_dir, sets=all_sets(opts), cores=opts.cores[:2])
    each = [throughput(p.of("step"), step_sizes(p.of("step")), opts.target_batch_size) for p in peers]
    return dict(samples_per_s=sum(f["samples_per_s"] for f in each),
                samples_per_s_at_target=sum(f["samples_per_s_at_target"] for f in each),
                step_s=statistics.mean(f["step_s"] for f in each), steps_in_window=min(f["steps_in_window"] for f in each),
                last_step=min(f["last_step"] for f in each), cores=[p.cores for p in peers],
                each_samples_per_s=[round(f["samples_per_s"], 2) for f in each])


def run_system(system: str, opts, log_dir: Path) -> dict[str, Any]:
    if system == "local":
        return run_local(opts, log_dir)
    if system == "local_pair":
        return run_local_pair(opts, log_dir)
    kind, n = system.split("_")
    return (run_swarmrun if kind == "swarmrun" else run_hivemind)(opts, log_dir, int(n))


# ---- driver -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="char-lm", help="installed swarmrun task (default char-lm)")
    p.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE",
                   help="task argument or hyperparameter, as `node join --set` (repeatable; default eval_every=0)")
    p.add_argument("--total-steps", type=int, default=20)
    p.add_argument("--target-batch-size", type=int, default=None,
                   help="samples per step (default: what one core computes in --step-seconds, measured first)")
    p.add_argument("--step-seconds", type=float, default=1.0,
                   help="the compute of one target batch on one core, when --target-batch-size is not given")
    p.add_argument("--batch-size", type=int, default=32, help="per-peer local batch")
    p.add_argument("--matchmaking-time", type=float, default=2.0, help="both swarms (default 2.0, node join's)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--repeats", type=int, default=1, help="runs of each system, interleaved (default 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--cores", default=None, help="comma-separated cores for peers 0, 1 (default: the first two "
                                                 "this process may use)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed (default 300)")
    p.add_argument("--startup-timeout", type=float, default=90.0, help="seconds for a peer to start listening")
    p.add_argument("--node", default=None, help="the `node` executable (default: next to this Python)")
    p.add_argument("--workdir", default=None, help="where peer logs and state dirs go (default: a temp dir)")
    p.add_argument("--verbose-peers", action="store_true", help="hivemind baseline peers log their status to stderr")
    p.add_argument("--keep", action="store_true", help="keep the temp workdir")
    p.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")
    opts = p.parse_args(argv)
    opts.sets = ["eval_every=0"] if opts.sets is None else opts.sets
    opts.systems = [s.strip() for s in opts.systems.split(",") if s.strip()]
    allowed = sorted(os.sched_getaffinity(0))
    opts.cores = [int(c) for c in opts.cores.split(",")] if opts.cores else allowed[:2]
    bad = [s for s in opts.systems if s not in SYSTEMS]
    if bad or opts.repeats < 1 or opts.total_steps < 2 or not opts.cores:
        p.error(f"bad --systems {bad}" if bad else "--repeats must be >= 1, --total-steps >= 2, --cores not empty")
    if (opts.target_batch_size is not None and opts.target_batch_size < 1) or not opts.step_seconds > 0:
        p.error("--target-batch-size and --step-seconds must be positive")
    return opts


CALIBRATION_STEPS = 12  # local steps of CALIBRATION_BATCHES batches: ~6 s of compute at 500 samples/s
CALIBRATION_BATCHES = 8  # per step: a step's own overhead (clip, optimizer) weighs as in a ~1 s step, not 8 times more


def calibrate_target(opts, workdir: Path) -> int:
    """The target batch one core computes in ``--step-seconds``: a short ``local`` run (same task, batch, pinning;
    steps of ``CALIBRATION_BATCHES`` batches) measures samples/s; rounded to whole local batches of two peers (at
    least one each). Sets ``opts.calibration``.

    Raises:
        RunFailed: the calibration run failed.
    """
    quantum = 2 * opts.batch_size
    probe = argparse.Namespace(**{**vars(opts), "target_batch_size": CALIBRATION_BATCHES * opts.batch_size,
                                  "total_steps": CALIBRATION_STEPS})
    log_dir = workdir / "calibration"
    log_dir.mkdir(parents=True, exist_ok=True)
    rate = run_local(probe, log_dir)["samples_per_s"]
    target = max(quantum, int(round(rate * opts.step_seconds / quantum)) * quantum)
    opts.calibration = dict(samples_per_s=round(rate, 1), step_seconds=opts.step_seconds, target_batch_size=target)
    return target


def run_all(opts, workdir: Path, say) -> list[dict]:
    runs: list[dict[str, Any]] = []
    for rep in range(opts.repeats):
        for system in opts.systems:
            log_dir = workdir / f"{rep:02d}-{system}"
            log_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            record: dict[str, Any] = dict(system=system, repeat=rep)
            try:
                record.update(run_system(system, opts, log_dir))
            except RunFailed as e:
                record.update(samples_per_s=None, error=str(e))
            record["wall_s"] = round(time.monotonic() - t0, 2)
            runs.append(record)
            sps = record.get("samples_per_s")
            say(f"[{rep + 1}/{opts.repeats}] {system:10s} " + (
                f"{sps:8.1f} samples/s ({record['samples_per_s_at_target']:.1f} at target), "
                f"{record['step_s']:.3f} s/step over {record['steps_in_window']} steps, wall {record['wall_s']}s"
                if sps is not None else f"FAILED: {record['error'][:300]}"))
            if opts.json:
                print(json.dumps(dict(event="run", **{k: v for k, v in record.items() if not k.startswith("_")}),
                                 default=str), flush=True)
    return runs


def main(argv=None) -> int:
    opts = parse_args(argv)
    from _common import count_blocks  # imports torch and the task: once, after the arguments are checked

    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-scaling-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    if opts.target_batch_size is None:
        try:
            opts.target_batch_size = calibrate_target(opts, workdir)
        except RunFailed as e:
            say(f"calibration failed: {e}")
            kill_all()
            return 1
        except KeyboardInterrupt:
            say("interrupted: killing the calibration run")
            kill_all()
            return 130
        say(f"target_batch_size {opts.target_batch_size}: one core computed {opts.calibration['samples_per_s']} "
            f"samples/s, {opts.step_seconds:g} s a step")
    opts.num_blocks = count_blocks(opts.task, dict(s.split("=", 1) for s in all_sets(opts)), opts.seed)

    runs: list[dict] = []
    done = False
    try:
        runs, done = run_all(opts, workdir, say), True
    except KeyboardInterrupt:
        say("interrupted: killing peers")
        return 130
    finally:
        kill_all()
        if done and not opts.workdir and not opts.keep and all(r.get("error") is None for r in runs):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"peer logs kept in {workdir}")
    summary = summarize(runs, opts)
    if summary.get("round_overhead_2_note"):
        say(f"round_overhead_2 is null: {summary['round_overhead_2_note']}")
    if opts.json:
        print(json.dumps(summary, default=str), flush=True)
    else:
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2, default=str))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
