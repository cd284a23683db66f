"""Compression in the exact round: bytes each peer sends per step, and the eval loss at equal samples, per codec.

For each seed, one 2-peer swarmrun swarm per codec (``node join --set compression=C``, loopback, CPU), the codecs
interleaved (seed 1: none, fp16, 8bit; seed 2: ...), all with the same task, model, data, seed, batch size and steps:

- **bytes per step**: each peer's ``sent_bytes`` of every committed step (its step event): the encoded size of every
  tensor message its all-reduce sent, counted by ``ExactAllReduceRunner`` on the messages themselves (its parts to
  the other reducer, ``AveragingData.ByteSize()``, and the averaged parts it sent back as a reducer). Framing below
  protobuf (libp2p, yamux, noise) and the round's small messages (matchmaking, DHT, votes) are not in it; the median
  over steps and peers is the figure, ``bytes_ratio_<codec>`` = that of ``none`` / that of the codec.
- **eval loss at equal samples**: the task's held-out loss after the last step, with the samples the run applied
  (its cursor) next to it; ``loss_gap_<codec>`` is the mean over seeds of (codec - none) / none on the same seed,
  ``loss_gap_<codec>_std`` its standard deviation over seeds (the noise: two swarm runs of one seed differ too, as
  blocks and group order depend on timing).
- **same_state_hash**: every step both peers committed has one ``state_hash``.

    /work/venv/bin/python benchmarks/compression.py --json                 # 3 seeds x none/fp16/8bit, 20 steps
    /work/venv/bin/python benchmarks/compression.py --quick --json         # smoke: 1 seed, none/8bit, 3 steps, tiny

With ``--json`` one ``run`` line per run and, last, the ``summary``; otherwise a table. Progress goes to stderr.
Every peer runs in its own session, killed as a group when its run ends; every wait is bounded.
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
import uuid
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _procs import Peer, RunFailed, kill_all, node_command  # noqa: E402

CODECS = ("none", "fp16", "8bit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated; 'none' is always run (the baseline)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--total-steps", type=int, default=20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--target-batch-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--quick", action="store_true", help="1 seed, 3 steps, dim 16, hidden 64, none and 8bit only")
    p.add_argument("--workdir", default=None, help="peer logs and state (default: a temp dir, removed on success)")
    p.add_argument("--node", default=None, help="the node executable (default: this Python's)")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.seeds, opts.total_steps, opts.dim, opts.hidden, opts.codecs = 1, 3, 16, 64, "8bit"
    opts.codecs = ["none"] + [c for c in opts.codecs.split(",") if c and c != "none"]
    return opts


def gradient_bytes(opts) -> int:
    """fp32 bytes of the model's gradient (what ``none`` would send in full)."""
    from swarmrun.node import load_task_class

    task = load_task_class("synthetic")({"dim": opts.dim, "hidden": opts.hidden, "num_examples": 64, "eval_examples": 8}, 1)
    return 4 * sum(p.numel() for p in task.build_model().parameters())


def block_size() -> int:
    from swarmrun.node import load_task_class

    return int(load_task_class("synthetic").hparam_defaults["block_size"])


def run_one(opts, codec: str, seed: int, log_dir: Path) -> dict[str, Any]:
    """One 2-peer swarm: the figures of this codec and seed."""
    deadline = time.monotonic() + opts.run_timeout
    run_id = f"bench-cmp-{uuid.uuid4().hex[:10]}"
    common = ["--json", "--device", "cpu", "--batch-size", str(opts.batch_size), "--min-peers", "2",
              "--matchmaking-time", str(opts.matchmaking_time)]
    sets = [f"compression={codec}", f"dim={opts.dim}", f"hidden={opts.hidden}", f"total_steps={opts.total_steps}",
            f"target_batch_size={opts.target_batch_size}", f"eval_every={opts.total_steps}"]
    cmd_a = [*node_command(opts), "join", run_id, "--task", "synthetic", *[x for s in sets for x in ("--set", s)],
             "--seed", str(seed), "--state-dir", str(log_dir / "state-a"), *common]
    peers: list[Peer] = []
    try:
        peers.append(Peer(f"{codec}-{seed}-a", cmd_a, log_dir))
        listening = peers[0].wait_event(("listening",), deadline)
        cmd_b = [*node_command(opts), "join", run_id, "--peers", *listening["maddrs"][:1],
                 "--state-dir", str(log_dir / "state-b"), *common]
        peers.append(Peer(f"{codec}-{seed}-b", cmd_b, log_dir))
        lefts = [p.wait_event(("left",), deadline) for p in peers]
        return figures(codec, seed, peers, lefts, opts)
    except RunFailed as e:
        raise RunFailed(f"{e}; " + "; ".join(f"{p.name} stderr tail: {p.stderr_tail(600)!r}" for p in peers)) from None
    finally:
        for p in peers:
            p.kill()


def figures(codec: str, seed: int, peers: list[Peer], lefts: list[dict], opts) -> dict[str, Any]:
    steps = [[e for e in p.events if e.get("event") == "step"] for p in peers]
    sent = [int(e["sent_bytes"]) for per_peer in steps for e in per_peer if e.get("group", 1) > 1]
    if not sent:
        raise RunFailed("no committed round of two peers")
    by_step: dict[int, set] = {}
    for per_peer in steps:
        for e in per_peer:
            by_step.setdefault(int(e["step"]), set()).add(e["state_hash"])
    evals = [e for e in peers[0].events if e.get("event") == "eval" and e.get("step") == opts.total_steps]
    if not evals or lefts[0].get("step") != opts.total_steps:
        raise RunFailed(f"peer a left at step {lefts[0].get('step')} ({lefts[0].get('reason')}) without a final eval")
    cursor = lefts[0]["cursor"]
    return dict(codec=codec, seed=seed, eval_loss=float(evals[-1]["loss"]),
                samples=int(cursor["blocks_applied"]) * block_size(), blocks_duplicated=cursor["blocks_duplicated"],
                bytes_per_step=statistics.median(sent), sent_bytes_min=min(sent), sent_bytes_max=max(sent),
                rounds=len(sent), same_state_hash=all(len(h) == 1 for h in by_step.values()),
                final_state_hash=lefts[0]["state_hash"])


def summarize(runs: list[dict], failed: list[dict], opts) -> dict[str, Any]:
    out: dict[str, Any] = dict(event="summary", gradient_bytes=gradient_bytes(opts), bytes_per_step={}, eval_loss={},
                               samples={}, loss_gaps={})
    by = {(r["codec"], r["seed"]): r for r in runs}
    base_bytes = statistics.median([r["bytes_per_step"] for r in runs if r["codec"] == "none"] or [0]) or None
    for codec in opts.codecs:
        mine = [r for r in runs if r["codec"] == codec]
        median_bytes = statistics.median([r["bytes_per_step"] for r in mine]) if mine else None
        out["bytes_per_step"][codec] = median_bytes
        out[f"bytes_ratio_{codec}"] = base_bytes / median_bytes if base_bytes and median_bytes else None
        out["eval_loss"][codec] = [r["eval_loss"] for r in mine]
        out["samples"][codec] = [r["samples"] for r in mine]
        gaps = [(by[(codec, s)]["eval_loss"] - by[("none", s)]["eval_loss"]) / by[("none", s)]["eval_loss"]
                for s in range(1, opts.seeds + 1) if (codec, s) in by and ("none", s) in by]
        out["loss_gaps"][codec] = gaps
        out[f"loss_gap_{codec}"] = statistics.mean(gaps) if gaps else None
        out[f"loss_gap_{codec}_std"] = statistics.stdev(gaps) if len(gaps) > 1 else None
    none_losses = out["eval_loss"]["none"]
    out["loss_none_std"] = statistics.stdev(none_losses) if len(none_losses) > 1 else None
    out["equal_samples"] = all(len(set(r["samples"] for r in runs if r["seed"] == s)) <= 1
                               for s in range(1, opts.seeds + 1))
    out["same_state_hash"] = bool(runs) and all(r["same_state_hash"] for r in runs)
    out.update(settings=dict(codecs=opts.codecs, seeds=opts.seeds, total_steps=opts.total_steps, dim=opts.dim,
                             hidden=opts.hidden, target_batch_size=opts.target_batch_size,
                             batch_size=opts.batch_size, quick=opts.quick),
               runs=runs, failed=failed)
    return out


def main(argv=None) -> int:
    opts = parse_args(argv)
    workdir = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-compression-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def on_signal(signum, frame):
        kill_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    runs, failed = [], []
    try:
        for seed in range(1, opts.seeds + 1):
            for codec in opts.codecs:
                log_dir = workdir / f"{codec}-{seed}"
                log_dir.mkdir(exist_ok=True)
                print(f"seed {seed} {codec} ...", file=sys.stderr, flush=True)
                try:
                    run = run_one(opts, codec, seed, log_dir)
                except RunFailed as e:
                    failed.append(dict(codec=codec, seed=seed, error=str(e)[:3000]))
                    print(f"  failed: {str(e)[:300]}", file=sys.stderr, flush=True)
                    continue
                runs.append(run)
                if opts.json:
                    print(json.dumps(dict(event="run", **run)), flush=True)
    finally:
        kill_all()
    summary = summarize(runs, failed, opts)
    if opts.json:
        print(json.dumps(summary), flush=True)
    else:
        print_table(summary)
    if not failed and not opts.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not failed and summary["same_state_hash"] else 1


def print_table(summary: dict) -> None:
    print(f"gradient: {summary['gradient_bytes']} bytes in fp32")
    print(f"{'codec':8} {'bytes/step/peer':>16} {'ratio':>7} {'eval loss per seed':>30} {'gap vs none':>18}")
    for codec, median_bytes in summary["bytes_per_step"].items():
        ratio: Optional[float] = summary.get(f"bytes_ratio_{codec}")
        gap, std = summary.get(f"loss_gap_{codec}"), summary.get(f"loss_gap_{codec}_std")
        losses = " ".join(f"{x:.5f}" for x in summary["eval_loss"][codec])
        gap_text = "-" if gap is None else f"{gap:+.2%}" + ("" if std is None else f" ± {std:.2%}")
        print(f"{codec:8} {median_bytes or 0:>16.0f} {ratio or 0:>7.2f} {losses:>30} {gap_text:>18}")
    print(f"same state_hash on every step: {summary['same_state_hash']}; equal samples: {summary['equal_samples']}; "
          f"failed runs: {len(summary['failed'])}")


if __name__ == "__main__":
    sys.exit(main())
