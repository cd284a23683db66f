"""The runner: real `node join` peers driven through a trace, every event recorded, everything cleaned up.

Peers are started with :func:`swarmrun.node.start_peer` (each in its own session, its ``--json`` events
pumped into one queue). The main loop is one bounded ``while`` over that queue: it records each event, fires
the trace's events when their time or step comes, and ends when the run finished (and its peers left), when
no peer is left and none is due to join, or at the trace's ``duration``. ``finally`` SIGCONTs and SIGKILLs
every process group it started and deletes every namespace, whatever ended the loop (Ctrl-C and SIGTERM
included: ``__main__`` turns SIGTERM into KeyboardInterrupt).
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from swarmrun.node import PeerProcess, start_peer
from swarmrun.protocol.errors import SwarmrunError, UsageError

from .checks import Life, Record
from .groups import kill_groups, wait_groups_gone
from .links import Links
from .trace import Event, Trace, default_hparam, sample_budget_of

Emit = Callable[..., None]
LISTEN_TIMEOUT = 120.0  # the creator's first `listening`
FINISH_GRACE = 60.0  # after the run finished, how long the other peers get to leave on their own


def pause_supported() -> bool:
    """Whether this installation has `node pause` and `node join --resume-from` (issue 5)."""
    from swarmrun.node import build_parser

    helps = build_parser().format_help()
    return " pause" in helps and "--resume-from" in _join_help()


def _join_help() -> str:
    from swarmrun.node import build_parser

    parser = build_parser()
    for action in parser._actions:
        if getattr(action, "choices", None) and "join" in action.choices:
            return action.choices["join"].format_help()
    return ""


class Simulation:
    """One run of one trace. ``run()`` returns the :class:`Record`; ``cleaned`` says whether every process
    group it started was gone at the end."""

    def __init__(self, trace: Trace, *, logs: Path, emit: Emit):
        self.trace, self.emit = trace, emit
        self.events = trace.expanded()
        if any(e.kind == "pause" for e in self.events) and not pause_supported():
            raise UsageError("this trace pauses the run, but this swarmrun has no `node pause`/`--resume-from`")
        self.logs = logs
        self.state_root = Path(tempfile.mkdtemp(prefix="swarmrun-sim-"))
        self.store = self.state_root / "snapshots"
        self.run_id = f"sim-{trace.name}-{os.getpid()}"[:64]
        self.sink: queue.Queue = queue.Queue()
        self.procs: dict[str, PeerProcess] = {}  # key (name.k) -> process
        self.current: dict[str, str] = {}  # peer name -> key of its latest incarnation
        self.maddrs: dict[str, str] = {}
        self.rec = Record()
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.t_start: Optional[float] = None  # when the creator listened: time 0 of the trace
        self.timers: list = []  # heap of (t, seq, what, callable)
        self._seq = 0
        self.links = Links(trace, logs=logs, emit=emit, now=self.now)
        self.stalled: set[str] = set()
        self.pause_proc: Optional[subprocess.Popen] = None
        self.pause_event: Optional[Event] = None
        self.holding = False  # from a pause until the resumed run listens: trace events wait
        self.finished_at: Optional[float] = None
        self.first_hash: dict = {}  # step -> (state_hash, key) of its first commit seen
        self.cleaned = False
        self.fired = 0
        self.largest_round = 0  # the most peers in a round that committed a step so far (events' ``group``)

    # ---- clock ------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def _t(self, event: dict) -> float:
        """An event's own wall time on the runner's clock (arrival time when it has none)."""
        if isinstance(event.get("time"), (int, float)):
            return min(self.now(), float(event["time"]) - self.wall0)
        return self.now()

    def _later(self, delay: float, what: str, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (self.now() + delay, self._seq, what, fn))

    # ---- peers ------------------------------------------------------------------------------------
    def alive(self) -> dict[str, PeerProcess]:
        """Live peers by name (their latest incarnation, process not exited)."""
        return {n: self.procs[k] for n, k in self.current.items() if self.procs[k].alive and self.rec.lives[k].end is None}

    def spawn(self, name: str, *, initial: bool = False, resume: bool = False) -> None:
        if name in self.alive():
            self.fault("join", name, note="skipped: already running")
            return
        index = list(self.current).index(name) if name in self.current else len(self.current)
        k = sum(1 for key in self.procs if key.split(".")[0] == name)
        key = f"{name}.{k}"
        tr = self.trace
        args = [self.run_id]
        if initial and name == "peer0" and not resume:
            args += ["--task", tr.task, "--seed", str(tr.seed)]
            for kv, v in tr.sets.items():
                args += ["--set", f"{kv}={v}"]
        elif resume:
            args += ["--resume-from", str(self.store)]
        else:
            peers = self._known_maddrs()
            if not peers:
                self.fault("join", name, note="skipped: no live peer address to join")
                return
            args += ["--peers", *peers]
        args += ["--state-dir", str(self.state_root / name), "--device", "cpu", "--batch-size", str(tr.batch_size),
                 "--matchmaking-time", str(tr.matchmaking_time), "--min-peers", str(tr.min_peers)]
        if tr.alone_after is not None:
            args += ["--alone-after", f"{tr.alone_after:g}"]
        prefix, listen = self.links.attach(name, index)
        args += listen
        if any(e.kind == "pause" for e in self.events):
            args += ["--snapshot-to", str(self.store)]
        self.current[name] = key
        self.procs[key] = start_peer(key, args, workdir=self.logs, sink=self.sink, prefix=prefix)
        self.rec.lives[key] = Life(key=key, peer=name, start=self.now(), initial=initial, resumed=resume)
        if not initial:
            self.fault("join", name)
        self.emit("sim", message=f"started {key}" + (" (resume)" if resume else ""), t=round(self.now(), 2))

    def _known_maddrs(self) -> list[str]:
        live = self.alive()
        names = sorted((n for n in live if self.current[n] in self.maddrs), key=lambda n: (n != "peer0", n))
        return [self.maddrs[self.current[n]] for n in names[:3]]

    def _end(self, name: str, why: str) -> None:
        life = self.rec.lives[self.current[name]]
        if life.end is None:
            life.end, life.ended_by = self.now(), why

    # ---- faults -----------------------------------------------------------------------------------
    def fault(self, kind: str, peer: Any, **fields) -> None:
        row = dict(t=round(self.now(), 3), kind=kind, peer=peer, **fields)
        self.rec.faults.append(row)
        self.emit("fault", **row)

    def fire(self, ev: Event, index: int) -> None:
        """Apply one trace event now."""
        if ev.kind == "join":
            self.spawn(ev.peer or self._fresh_name())
            return
        if ev.kind == "pause":
            self._pause(ev)
            return
        if ev.kind == "partition":
            side = set(ev.peers)
            self.links.partition(side)
            self.fault("partition", sorted(side), duration=ev.duration)
            if ev.duration:
                self._later(ev.duration, "heal", lambda: (self.links.partition(set()), self.fault("partition_end", sorted(side))))
            return
        name = self._target(ev, index)
        if name is None:
            self.fault(ev.kind, ev.peer, note="skipped: peer not running")
            return
        proc = self.procs[self.current[name]]
        if ev.kind == "kill":
            proc.kill_group(signal.SIGCONT)
            proc.kill_group(signal.SIGKILL)
            self.stalled.discard(name)
            self._end(name, "kill")
            self.fault("kill", name)
        elif ev.kind == "leave":
            self.rec.lives[self.current[name]].ended_by = "leave"
            _signal(proc, signal.SIGTERM)
            self.fault("leave", name)
            key = self.current[name]
            self._later(self.trace.leave_timeout, f"kill {key} (leave timed out)",
                        lambda: self.procs[key].kill_group(signal.SIGKILL))
        elif ev.kind == "stall":
            proc.kill_group(signal.SIGSTOP)
            self.stalled.add(name)
            self.fault("stall", name, duration=ev.duration)
            self._later(ev.duration, f"resume {name}", lambda: self._cont(name, proc))
        elif ev.kind == "slow":
            self.links.set_rate(name, ev.rate)
            self.fault("slow", name, rate=ev.rate, duration=ev.duration)
            if ev.duration:
                self._later(ev.duration, f"unslow {name}", lambda: self._link(name, rate=self.trace.link_rate))
        elif ev.kind == "latency":
            self.links.set_delay(name, ev.ms)
            self.fault("latency", name, ms=ev.ms, duration=ev.duration)
            if ev.duration:
                base = self.trace.latency_ms or 0.0
                self._later(ev.duration, f"latency {name} back",
                            lambda: (self.links.set_delay(name, None), self.fault("latency_end", name, ms=base)))
        elif ev.kind == "loss":
            self.links.set_loss(name, ev.percent)
            self.fault("loss", name, percent=ev.percent, duration=ev.duration)
            if ev.duration:
                self._later(ev.duration, f"no loss {name}", lambda: self._link(name, loss=0.0))

    def _cont(self, name: str, proc: PeerProcess) -> None:
        proc.kill_group(signal.SIGCONT)
        self.stalled.discard(name)
        self.fault("stall_end", name)

    def _link(self, name: str, *, rate: Any = "keep", loss: Optional[float] = None) -> None:
        if self.links.restore(name, rate=rate, loss=loss):
            self.fault("link_end", name)

    def _target(self, ev: Event, index: int) -> Optional[str]:
        live = sorted(self.alive())
        if ev.peer == "random":
            pool = [n for n in live if n != "peer0"]
            return random.Random(f"{self.trace.seed}:fire:{index}").choice(pool) if pool else None
        return ev.peer if ev.peer in live else None

    def _fresh_name(self) -> str:
        i = len(self.current)
        while f"peer{i}" in self.current:
            i += 1
        return f"peer{i}"

    # ---- pause and resume ------------------------------------------------------------------------------
    def _pause(self, ev: Event) -> None:
        peers = self._known_maddrs()
        if not peers:
            self.fault("pause", None, note="skipped: no live peer")
            return
        cmd = [sys.executable, "-m", "swarmrun.node.cli", "pause", self.run_id, "--peers", *peers,
               "--state-dir", str(self.state_root / "peer0"), "--to", str(self.store), "--json"]
        log = open(self.logs / "pause.log", "ab")  # the client runs in the root namespace: the bridge reaches every peer
        self.pause_proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        self.pause_event = ev
        self.holding = True
        self.fault("pause", None, resume_after=ev.duration, resume_peers=ev.peers)

    def _poll_pause(self) -> None:
        p = self.pause_proc
        if p is None:
            return
        t_pause = self.rec.faults[_last_index(self.rec.faults, "pause")]["t"]
        seen = [e for t, _, e in self.rec.of("snapshot") if e.get("reason") == "pause" and t >= t_pause - 1]
        if p.poll() is None:
            # `node pause` waits for the peers' notes in the DHT; when the last peer has left there is no DHT to
            # read them from. The peers' own events say it as well: a pause snapshot written, every peer gone.
            if not (seen and not self.alive()):
                return
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)
            paused = dict(step=seen[-1].get("step"), where=seen[-1].get("where"),
                          note="`node pause` did not return after every peer left; taken from the peers' events")
        else:
            out = p.stdout.read().decode(errors="replace").strip().splitlines() if p.stdout else []
            paused = next((json.loads(line) for line in reversed(out) if line.startswith("{")), {})
            if p.returncode != 0:
                self.pause_proc = None
                self.holding = False
                self.fault("pause_failed", None, code=p.returncode, message=paused.get("message"))
                return
        self.pause_proc = None
        ev = self.pause_event
        self.rec.faults[_last_index(self.rec.faults, "pause")]["step"] = paused.get("step")
        self.fault("paused", None, **{k: paused.get(k) for k in ("step", "where", "note") if paused.get(k) is not None})
        for life in self.rec.lives.values():
            if life.end is None or life.end >= t_pause:
                life.ended_by = "pause"

        def resume() -> None:
            for n in list(self.alive()):  # anyone who did not leave is stopped: the run is resumed elsewhere
                self.procs[self.current[n]].kill_group(signal.SIGKILL)
                self._end(n, "pause")
            self.fault("resume_run", None, peers=int(ev.peers))
            self.spawn("peer0", initial=True, resume=True)
            self._later(1.0, "joins after resume", lambda: join_when_listening(int(ev.peers) - 1))

        def join_when_listening(count: int) -> None:
            if count <= 0:
                return
            if self.current["peer0"] in self.maddrs:
                for _ in range(count):
                    self.spawn(self._fresh_name())
            elif self.alive().get("peer0") is not None:  # bounded by the main loop's end
                self._later(1.0, "joins after resume", lambda: join_when_listening(count))

        self._later(ev.duration, "resume", resume)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> Record:
        """Run the trace to its end. Raises SwarmrunError when the run cannot even start."""
        tr = self.trace
        self.rec.sample_budget = sample_budget_of(tr.task, tr.sets)
        if not self.rec.sample_budget:  # a sample budget's last step is the peers' to tell (checks.run_end)
            self.rec.total_steps = int(tr.sets.get("total_steps", 0)) or default_hparam(tr.task, "total_steps")
        self.rec.target_batch_size = int(tr.sets.get("target_batch_size", 0)) or default_hparam(tr.task, "target_batch_size")
        try:
            self.links.open()
            self.spawn("peer0", initial=True)
            self._loop()
        finally:
            self.rec.end = self.now()
            self._cleanup()
        return self.rec

    def _loop(self) -> None:
        tr = self.trace
        pending = list(enumerate(self.events))
        hard_end = LISTEN_TIMEOUT + tr.duration + FINISH_GRACE
        started_rest = False
        while self.now() < hard_end:
            try:
                key, event = self.sink.get(timeout=0.2)
                self._on_event(key, event)
                while True:  # drain what is there before acting on time
                    key, event = self.sink.get_nowait()
                    self._on_event(key, event)
            except queue.Empty:
                pass
            if self.t_start is None:
                if self.now() > LISTEN_TIMEOUT:
                    raise SwarmrunError(f"peer0 did not listen within {LISTEN_TIMEOUT:.0f}s (see {self.logs})")
                if not self.procs["peer0.0"].alive and self.sink.empty():
                    raise SwarmrunError(f"peer0 exited before listening (exit code {self.procs['peer0.0'].proc.poll()}; "
                                        f"see {self.logs / 'peer0.0.log'})")
                continue
            if not started_rest:
                started_rest = True
                for i in range(1, tr.peers):
                    self.spawn(f"peer{i}", initial=True)
            t_run = self.now() - self.t_start
            while self.timers and self.timers[0][0] <= self.now():
                _, _, what, fn = heapq.heappop(self.timers)
                fn()
            self._poll_pause()
            self.links.audit_now()
            front = max((e.get("step", 0) for _, _, e in self.rec.of("step", "bootstrapped", "resumed")), default=0)
            while pending and self.finished_at is None and not self.holding:
                i, ev = pending[0]
                if not is_due(ev, front=front, t_run=t_run, largest_round=self.largest_round):
                    break
                pending.pop(0)
                self.fired += 1
                self.fire(ev, i)
            if self.finished_at is not None:
                if not self.alive() or self.now() - self.finished_at > FINISH_GRACE:
                    return
            elif t_run > tr.duration:
                self.emit("sim", message=f"the trace's duration ({tr.duration:g}s) is over; stopping")
                return
            elif not self.alive() and self.pause_proc is None and not self.timers and \
                    not any(ev.kind == "join" for _, ev in pending):
                self.emit("sim", message="no peer is left and none is due to join; stopping")
                return

    def _on_event(self, key: str, event: Optional[dict]) -> None:
        life = self.rec.lives.get(key)
        if event is None:  # the process's stdout closed: it exited
            if life is not None and life.end is None:
                life.end = self.now()
                life.ended_by = life.ended_by or "exit"
            return
        t = self._t(event)
        self.rec.events.append((t, key, event))
        kind = event.get("event")
        if kind == "listening" and event.get("maddrs"):
            self.maddrs[key] = event["maddrs"][0]
            if self.t_start is None and key.startswith("peer0."):
                self.t_start = self.now()
                self.emit("sim", message=f"run {self.run_id} created; trace time starts", t=round(self.now(), 2))
            if self.holding and life is not None and life.resumed:
                self.holding = False
        elif kind == "step":
            self._check_live(t, key, event)
            if isinstance(event.get("group"), int):
                self.largest_round = max(self.largest_round, event["group"])
            if self.rec.total_steps and event.get("step", 0) >= self.rec.total_steps and self.finished_at is None:
                self.finished_at = self.now()
            if key.startswith(self._reporter()):
                self.emit("progress", step=event.get("step"), loss=event.get("loss"), peers=event.get("peers"),
                          t=round(t, 2))
        elif kind == "left":
            if event.get("reason") == "finished" and life is not None:
                life.ended_by = life.ended_by if life.ended_by in ("leave", "pause") else "finished"
                self.finished_at = self.finished_at or self.now()
        elif kind == "error":
            self.emit("sim", message=f"{key}: error {event.get('code')}: {event.get('message')}")

    def _check_live(self, t: float, key: str, event: dict) -> None:
        """Invariants 1 and 2 while it runs: a commit whose state_hash differs from a live holder's of that step,
        or whose cursor counts a skipped or duplicated block, is reported at once (the full checks run on the
        record at the end)."""
        step, h = event.get("step"), event.get("state_hash")
        first = self.first_hash.setdefault(step, (h, key))
        if first[0] != h and self.rec.lives[first[1]].alive_at(t):
            self.emit("violation", invariant="state_hash_agrees", step=step, peer=key, state_hash=h,
                      other_peer=first[1], other_state_hash=first[0])
        cursor = event.get("cursor") or {}
        for name in ("blocks_skipped", "blocks_duplicated"):
            if cursor.get(name):
                self.emit("violation", invariant=f"{name}_zero", step=step, peer=key, **{name: cursor[name]})

    def _reporter(self) -> str:
        live = sorted(self.alive())
        return self.current[live[0]] if live else "-"

    # ---- clean-up ---------------------------------------------------------------------------------
    def _cleanup(self) -> None:
        """SIGCONT then SIGKILL every process group started; wait for them; delete namespaces and temp dirs.
        A second Ctrl-C or SIGTERM does not cut this short (they are ignored until it is done)."""
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread: nothing to protect from
                pass
        try:
            self._cleanup_now()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _cleanup_now(self) -> None:
        groups = [p.proc.pid for p in self.procs.values()]
        if self.pause_proc is not None:
            groups.append(self.pause_proc.pid)
        self.rec.proxies = self.links.report() or self.rec.proxies
        groups += self.links.stop_proxies()  # they exit by themselves; the SIGKILL below is for one that does not
        for key, p in self.procs.items():
            life = self.rec.lives[key]
            if life.end is None:
                life.end, life.ended_by = self.now(), life.ended_by or "cleanup"
        kill_groups(groups)
        for p in self.procs.values():
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.links.wait_proxies()
        if self.pause_proc is not None:
            try:
                self.pause_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.cleaned = wait_groups_gone(groups, time.monotonic() + 15)
        self.rec.link_bytes = self.links.sent_bytes()
        self.links.close()
        shutil.rmtree(self.state_root, ignore_errors=True)


def is_due(ev: Event, *, front: int, t_run: float, largest_round: int) -> bool:
    """Whether a trace event fires now: its step reached (the newest committed step, ``front``) or its time
    passed, and, with ``group``, a round of at least that many peers committed a step."""
    due = (ev.step is not None and front >= ev.step) or (ev.time is not None and t_run >= ev.time)
    return due and (ev.group is None or largest_round >= ev.group)


def _signal(proc: PeerProcess, sig: int) -> None:
    try:
        proc.proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _last_index(rows: list, kind: str) -> int:
    for i in range(len(rows) - 1, -1, -1):
        if rows[i]["kind"] == kind:
            return i
    return -1
