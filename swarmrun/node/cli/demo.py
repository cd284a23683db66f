"""`node demo`: a local swarm on loopback that trains, loses a peer to SIGKILL and takes in a fresh one.

Each peer is a real `node join` process in its own session (process group), with its own state dir;
the demo kills whole process groups, so no hivemind child or p2pd outlives it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from swarmrun.protocol.errors import SwarmrunError, UsageError
from swarmrun.node.cli.common import EXIT_CODES
import argparse


@dataclass
class PeerProcess:
    """One `node join` subprocess and the JSON events it printed."""

    name: str
    proc: subprocess.Popen
    events: list = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def start_peer(name: str, args: list[str], *, workdir: Path, sink: "queue.Queue",
               prefix: Sequence[str] = (), command: str = "join") -> PeerProcess:
    """Start `node COMMAND ARGS --json` (join, or keep) in its own session; its stdout events go to ``sink`` as
    (name, event) and to ``WORKDIR/NAME.events.jsonl``, its stderr to ``WORKDIR/NAME.log``.

    ``prefix`` wraps the command (the churn harness runs peers under ``ip netns exec NS``; that execs, so the
    process group is still the peer's)."""
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "swarmrun.node.cli", command, *args, "--json"],
                            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    peer = PeerProcess(name, proc)

    def pump():
        with open(workdir / f"{name}.events.jsonl", "wb") as record:  # kept for a post-mortem of a failed run
            for line in proc.stdout:
                record.write(line)
                record.flush()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                peer.events.append(event)
                sink.put((name, event))
        sink.put((name, None))

    threading.Thread(target=pump, daemon=True).start()
    return peer


def demo_length(args) -> tuple[list[str], str]:
    """The run's length as ``--set`` pairs (``--steps``, ``--epochs`` or ``--total-samples``, or a budget the user
    gave with ``--set``; 60 steps by default) and how the demo names it.

    Raises:
        UsageError: two lengths, or one that is not positive (``--steps`` below 3).
    """
    flags = {k: v for k, v in (("total_steps", args.steps), ("epochs", args.epochs),
                               ("total_samples", args.total_samples)) if v is not None}
    in_sets = {k for k in ("total_steps", "epochs", "total_samples") for s in args.sets if s.startswith(f"{k}=")}
    if len(flags) + len(in_sets) > 1:
        raise UsageError("give one run length: --steps, --epochs or --total-samples (or one --set of them)")
    if in_sets:
        return [], next(s for s in args.sets if s.split("=")[0] in in_sets)
    key, value = next(iter(flags.items()), ("total_steps", 60))
    if value < (3 if key == "total_steps" else 1):
        raise UsageError("--steps must be at least 3" if key == "total_steps" else
                         f"--{key.replace('_', '-')} must be positive")
    unit = key.replace("total_", "")
    return [f"{key}={value}"], f"{value} {unit[:-1] if value == 1 else unit}"


def run_demo(args, events) -> int:
    if args.peers < 2:
        raise UsageError("--peers must be at least 2 (one of them is killed mid-way)")
    length, length_text = demo_length(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="swarmrun-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"demo-{os.getpid()}"
    sets = [*length, *args.sets]
    steps = int(length[0].split("=")[1]) if length and length[0].startswith("total_steps=") else None
    if args.task == "char-lm" and steps and not any(s.startswith("eval_every=") for s in args.sets):
        sets.append(f"eval_every={max(1, steps // 6)}")
    peers: list[PeerProcess] = []
    sink: queue.Queue = queue.Queue()
    summary = dict(run_id=run_id, task=args.task, peers=args.peers, peers_killed=0, peers_joined=0)

    def on_sigterm(signum, frame):  # a SIGTERM ends the demo like Ctrl-C: its peers are stopped in the finally
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        common = ["--device", "cpu", "--matchmaking-time", "1.0"]
        creator = start_peer("peer0", [run_id, "--task", args.task, *sum((["--set", s] for s in sets), []),
                                       "--state-dir", str(workdir / "peer0"), "--min-peers", str(args.peers), *common],
                             workdir=workdir, sink=sink)
        peers.append(creator)
        maddr = _wait_listening(creator, sink, timeout=120)
        events.emit("demo", message=f"peer0 created run {run_id} ({args.task}, {length_text}); {args.peers - 1} more joining",
                    maddr=maddr)
        for i in range(1, args.peers):
            peers.append(start_peer(f"peer{i}", [run_id, "--peers", maddr, "--state-dir", str(workdir / f"peer{i}"), *common],
                                    workdir=workdir, sink=sink))
        result = _drive(args, events, peers, sink, maddr, workdir, common, summary, run_id)
        summary.update(result)
        events.emit("summary", **summary)
        return 0 if summary.get("ok") else 1
    finally:
        for peer in peers:
            peer.kill_group(signal.SIGKILL)
        for peer in peers:
            try:
                peer.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _wait_listening(peer: PeerProcess, sink: queue.Queue, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            name, event = sink.get(timeout=1)
        except queue.Empty:
            continue
        if event is None and name == peer.name:
            raise SwarmrunError(f"{peer.name} exited before listening (exit code {peer.proc.wait()})")
        if event and event.get("event") == "error":
            raise SwarmrunError(f"{name}: {event.get('message')}")
        if name == peer.name and event and event.get("event") == "listening":
            return event["maddrs"][0]
    raise SwarmrunError(f"{peer.name} did not start listening within {timeout:.0f}s")


def _drive(args, events, peers, sink, maddr, workdir, common, summary, run_id) -> dict:
    kill_at = None  # a third of the run: of total_steps, or of the planned steps of a sample budget (step events)
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    final_step = 0
    done = set()
    killed = False
    deadline = time.monotonic() + 600  # and 20 s a step once the first step event tells the run's (planned) steps
    while time.monotonic() < deadline and len(done) < len(peers):
        try:
            name, event = sink.get(timeout=1)
        except queue.Empty:
            continue
        if event is None:
            done.add(name)
            continue
        kind = event.get("event")
        if kind in ("eval", "step") and name == _reporter(peers, done):
            if kind == "eval":
                first_loss = event["loss"] if first_loss is None else first_loss
                last_loss = event["loss"]
            else:
                final_step = max(final_step, event["step"])
                if first_loss is None and event.get("loss") is not None:
                    first_loss = event["loss"]
                events.emit("progress", **{k: event.get(k) for k in ("step", "total_steps", "loss", "samples_per_second", "peers", "eta_s")})
        if kind == "error":
            events.emit("demo", message=f"{name} reported an error: {event.get('message')}")
        if kind == "step" and kill_at is None:
            kill_at = max(1, int(event.get("total_steps") or 3) // 3)
            deadline = max(deadline, time.monotonic() + 20 * int(event.get("total_steps") or 0))
        if kind == "step" and not killed and event["step"] >= kill_at:
            victim = peers[-1]
            victim.kill_group(signal.SIGKILL)
            killed = True
            summary["peers_killed"] += 1
            events.emit("demo", message=f"killed {victim.name} with SIGKILL at step {event['step']}")
            fresh = f"peer{len(peers)}"
            peers.append(start_peer(fresh, [run_id, "--peers", maddr, "--state-dir", str(workdir / fresh), *common],
                                    workdir=workdir, sink=sink))
            summary["peers_joined"] += 1
            events.emit("demo", message=f"started {fresh}, which joins the run")
    lefts = {p.name: next((e for e in p.events if e.get("event") == "left"), None) for p in peers}
    finishers = {n: e for n, e in lefts.items() if e and e.get("reason") == "finished"}
    hashes = {e["state_hash"] for e in finishers.values()}
    cursor = next(iter(finishers.values()))["cursor"] if finishers else {}
    # the run's data accounting, read from the final state's cursor (DESIGN invariant 2: none skipped or repeated)
    accounting = {k: cursor.get(k) for k in ("blocks_applied", "blocks_pending", "blocks_skipped", "blocks_duplicated")}
    exactly_once = accounting["blocks_skipped"] == 0 and accounting["blocks_duplicated"] == 0
    joined = peers[-1].name
    return dict(final_step=max([final_step, *(e["step"] for e in finishers.values())]), first_loss=first_loss,
                last_loss=last_loss, peers_finished=len(finishers), same_state_hash=len(hashes) == 1,
                joined_peer_finished=joined in finishers, exit_codes={p.name: p.proc.poll() for p in peers},
                cursor=cursor, **accounting,
                ok=bool(finishers) and len(hashes) == 1 and joined in finishers and exactly_once)


def _reporter(peers, done) -> str:
    """The peer whose steps the demo shows: the first one still running (peer0, normally)."""
    for p in peers:
        if p.name not in done and p.alive:
            return p.name
    return peers[0].name


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="a local swarm on loopback: trains, kills a peer, a fresh one joins",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    d.add_argument("--steps", type=int, default=None, help="total steps of the run (default 60)")
    d.add_argument("--epochs", type=int, default=None, metavar="N",
                   help="the run's length in whole passes over the task's dataset instead of --steps")
    d.add_argument("--total-samples", type=int, default=None, metavar="N",
                   help="the run's length in samples instead of --steps")
    d.add_argument("--task", default="char-lm", help="task of the run (default char-lm)")
    d.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--workdir", default=None, help="where peers keep state dirs and logs (default: a temp dir)")
    d.add_argument("--json", action="store_true", help="JSON lines; the last one is the summary")
