"""The process side of the training benchmarks (``step_throughput.py``, ``scaling.py``): a child process in its own
session whose JSON lines are collected, every wait bounded, every process group killed at the end; and the runs
of the three systems built on it (``swarmrun`` peers, ``hivemind.Optimizer`` peers, one local process), for any
number of peers, each optionally pinned to one core with one torch thread.

A run's options (``opts``) carry: ``task``, ``seed``, ``batch_size``, ``target_batch_size``,
``matchmaking_time``, ``run_timeout``, ``startup_timeout``, ``node``, ``verbose_peers``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
#: one torch (OpenMP/MKL) thread in a pinned peer; read by torch when it starts, inherited by the peer's children
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class RunFailed(Exception):
    def __init__(self, message: str, partial: Optional[dict] = None):
        super().__init__(message)
        self.partial = partial


class Peer:
    """A child process in its own session; stdout JSON lines collected by a thread, stderr to a log file.

    With ``core``, the process (and every process it starts: p2pd, hivemind's DHT and averager) runs on that CPU
    core only (``sched_setaffinity`` before exec) with one torch thread (``OMP_NUM_THREADS=1``)."""

    live: list["Peer"] = []

    def __init__(self, name: str, cmd: list[str], log_dir: Path, *, stdin_pipe: bool = False,
                 core: Optional[int] = None):
        self.name, self.cmd, self.core = name, cmd, core
        self.stderr_path = log_dir / f"{name}.stderr"
        self.stdout_path = log_dir / f"{name}.stdout"
        self._stderr = open(self.stderr_path, "wb")
        env = None if core is None else {**os.environ, **ONE_THREAD_ENV}
        pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                     start_new_session=True, text=True, bufsize=1, env=env, preexec_fn=pin)
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group
        self.cores = self.affinity()  # as set before exec: what the benchmark reports as the peer's cores
        Peer.live.append(self)
        self.events: list[dict] = []
        self.queue: "queue.Queue[Optional[dict]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.stdout_path, "w") as raw:
            for line in self.proc.stdout:
                raw.write(line)
                raw.flush()
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    ev.setdefault("_received", time.time())
                    self.events.append(ev)
                    self.queue.put(ev)
        self.queue.put(None)  # EOF

    def wait_event(self, names: tuple[str, ...], deadline: float) -> dict:
        """The next event named one of ``names``; RunFailed on EOF, an error event or the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunFailed(f"{self.name}: timed out waiting for {'/'.join(names)}")
            try:
                ev = self.queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if ev is None:
                raise RunFailed(f"{self.name}: exited (rc={self.proc.poll()}) before {'/'.join(names)}")
            if ev.get("event") in names:
                return ev
            if ev.get("event") == "error":
                raise RunFailed(f"{self.name}: error event {ev}")

    def affinity(self) -> Optional[list[int]]:
        """The cores the process may run on now (None once it is gone)."""
        try:
            return sorted(os.sched_getaffinity(self.proc.pid))
        except OSError:
            return None

    def send(self, text: str) -> None:
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def wait_exit(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=2)
        self._stderr.close()
        if self in Peer.live:
            Peer.live.remove(self)

    def stderr_tail(self, n: int = 1500) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == name]


def kill_all() -> None:
    for peer in list(Peer.live):
        peer.kill()


# ---- figures ------------------------------------------------------------------------------------------------
def figure(steps: list[dict], target_batch_size: int) -> dict:
    """samples/s over the window from the first committed step to the last, counting ``target_batch_size`` per step."""
    steps = sorted(steps, key=lambda e: float(e["time"]))
    if len(steps) < 2:
        raise RunFailed(f"only {len(steps)} step(s) committed: no window to measure")
    first, last = steps[0], steps[-1]
    committed = int(last["step"]) - int(first["step"])
    window = float(last["time"]) - float(first["time"])
    if committed <= 0 or window <= 0:
        raise RunFailed(f"empty window: steps {first['step']}..{last['step']} in {window:.6f}s")
    return dict(samples_per_s=target_batch_size * committed / window, steps_in_window=committed,
                window_s=window, first_step=int(first["step"]), last_step=int(last["step"]))


def partial_figure(peer: Optional[Peer], target_batch_size: int) -> Optional[dict]:
    """The figure over the steps a failed run did commit (reported apart, never in the medians)."""
    if peer is None:
        return None
    try:
        return figure(peer.of("step"), target_batch_size)
    except RunFailed:
        return None


def _failed(e: RunFailed, peers: list[Peer], target_batch_size: int) -> RunFailed:
    return RunFailed(f"{e}; " + "; ".join(f"{p.name} stderr tail: {p.stderr_tail(600)!r}" for p in peers),
                     partial_figure(peers[0] if peers else None, target_batch_size))


# ---- one run of each system ---------------------------------------------------------------------------------
def node_command(opts) -> list[str]:
    if opts.node:
        return [opts.node]
    exe = Path(sys.executable).parent / "node"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "swarmrun.node.cli"]


def _set_args(sets: Sequence[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def _core(cores: Optional[Sequence[int]], i: int) -> Optional[int]:
    return None if cores is None else cores[i % len(cores)]


def swarmrun_peers(opts, log_dir: Path, n: int, *, sets: Sequence[str], cores: Optional[Sequence[int]] = None,
                   settle: float = 10.0) -> tuple[list[Peer], dict]:
    """``n`` ``node join`` peers (``--min-peers n``; the first creates the run, the others join through it) until
    the first leaves. Returns the peers (killed, their events kept) and the first one's ``left`` event."""
    deadline = time.monotonic() + opts.run_timeout
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    common = ["--json", "--device", "cpu", "--batch-size", str(opts.batch_size), "--min-peers", str(n),
              "--matchmaking-time", str(opts.matchmaking_time)]
    peers: list[Peer] = []
    try:
        cmd = [*node_command(opts), "join", run_id, "--task", opts.task, *_set_args(sets), "--seed", str(opts.seed),
               "--state-dir", str(log_dir / "state-a"), *common]
        peers.append(Peer("swarmrun-a", cmd, log_dir, core=_core(cores, 0)))
        listening = peers[0].wait_event(("listening",), min(deadline, time.monotonic() + opts.startup_timeout))
        for i in range(1, n):
            tag = chr(ord("a") + i)
            cmd = [*node_command(opts), "join", run_id, "--peers", *listening["maddrs"][:1],
                   "--state-dir", str(log_dir / f"state-{tag}"), *common]
            peers.append(Peer(f"swarmrun-{tag}", cmd, log_dir, core=_core(cores, i)))
        left = peers[0].wait_event(("left",), deadline)
        for p in peers[1:]:
            p.wait_exit(min(settle, deadline - time.monotonic()))
        return peers, left
    except RunFailed as e:
        raise _failed(e, peers, opts.target_batch_size) from None
    finally:
        for p in peers:
            p.kill()


def hivemind_peers(opts, log_dir: Path, n: int, *, sets: Sequence[str], starts: Sequence[int],
                   cores: Optional[Sequence[int]] = None) -> tuple[list[Peer], dict]:
    """``n`` ``_hivemind_peer.py`` peers (peer ``i`` starts at position ``starts[i]`` of the block order); each
    waits until hivemind's tracker sees all ``n``, then all start together. Returns the peers (killed) and the
    first one's ``left`` event."""
    deadline = time.monotonic() + opts.run_timeout
    run_id = f"bench-hm-{uuid.uuid4().hex[:10]}"
    base = [sys.executable, str(HERE / "_hivemind_peer.py"), "--run-id", run_id, "--task", opts.task,
            *_set_args(sets), "--seed", str(opts.seed), "--batch-size", str(opts.batch_size),
            "--matchmaking-time", str(opts.matchmaking_time), "--wait-go", "--min-peers", str(n),
            *(["--verbose"] if opts.verbose_peers else [])]
    peers: list[Peer] = []
    try:
        startup = min(deadline, time.monotonic() + opts.startup_timeout)
        peers.append(Peer("hivemind-a", [*base, "--start", str(starts[0])], log_dir, stdin_pipe=True,
                          core=_core(cores, 0)))
        listening = peers[0].wait_event(("listening",), startup)
        for i in range(1, n):
            cmd = [*base, "--start", str(starts[i]), "--peers", *listening["maddrs"][:1]]
            peers.append(Peer(f"hivemind-{chr(ord('a') + i)}", cmd, log_dir, stdin_pipe=True, core=_core(cores, i)))
        for p in peers:
            p.wait_event(("synced",), startup)
        for p in peers:
            p.send("go\n")
        return peers, peers[0].wait_event(("left",), deadline)
    except RunFailed as e:
        raise _failed(e, peers, opts.target_batch_size) from None
    finally:
        for p in peers:
            p.kill()


def local_process(opts, log_dir: Path, *, sets: Sequence[str], core: Optional[int] = None) -> Peer:
    """``_local_run.py``: one process, a plain PyTorch loop. Returns it (killed, its events kept)."""
    return local_processes(opts, log_dir, sets=sets, cores=[core])[0]


def local_processes(opts, log_dir: Path, *, sets: Sequence[str], cores: Sequence[Optional[int]]) -> list[Peer]:
    """One ``_local_run.py`` per entry of ``cores``, all at once (each on its core). Returns them (killed, their
    events kept) once every one has left."""
    deadline = time.monotonic() + opts.run_timeout
    cmd = [sys.executable, str(HERE / "_local_run.py"), "--task", opts.task, *_set_args(sets),
           "--seed", str(opts.seed), "--batch-size", str(opts.batch_size)]
    peers = [Peer("local" if len(cores) == 1 else f"local-{i}", cmd, log_dir, core=core) for i, core in enumerate(cores)]
    try:
        for peer in peers:
            try:
                peer.wait_event(("left",), deadline)
            except RunFailed as e:
                raise RunFailed(f"{e}; stderr tail: {peer.stderr_tail(600)!r}") from None
        return peers
    finally:
        for peer in peers:
            peer.kill()
