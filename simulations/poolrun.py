"""The pool runner: a real ``node coordinator`` and ``node agent`` processes driven through a pool trace.

The runner starts the coordinator (SQLite in its state dir, or ``--db``), one agent per workstation with the
``file`` resident source, and then only acts as the lab's users and residents would: it submits runs, sets and
clears residents' flags, and SIGKILLs and restarts the coordinator. Placement, preemption, pauses, resumes and
every peer are the pool's own. Every process's ``--json`` events are pumped into one queue; the main loop is one
bounded ``while`` over it. ``finally`` stops the agents (SIGTERM: they stop their peers as on a shutdown), then
SIGKILLs every process group started (the coordinator's, the agents', each peer's from ``peer_started`` and,
once the coordinator is gone, each keeper's from ``keeper_started``), waits for them, reads the peers' event
files and the registry's event log, and deletes the state dirs.
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
from pathlib import Path
from typing import Any, Callable, Optional

from swarmrun.node import PeerProcess
from swarmrun.protocol.errors import SwarmrunError

from .checks import Life
from .poolchecks import PoolRecord
from .pooltrace import PoolEvent, PoolTrace
from .groups import kill_groups, wait_groups_gone

Emit = Callable[..., None]
ROOT = Path(__file__).resolve().parents[1]  # the tree the pool's processes import (agents start peers elsewhere)
START_TIMEOUT = 90.0  # the coordinator's `serving`, every agent's `registered`
FINISH_GRACE = 60.0  # after the trace's duration: the agents' peers stop
RUNS_POLL = 2.0  # seconds between two reads of the runs' states


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PoolSimulation:
    """One run of one pool trace. ``run()`` returns the :class:`PoolRecord`; ``cleaned`` says whether every
    process group started was gone at the end."""

    def __init__(self, trace: PoolTrace, *, logs: Path, emit: Emit, db: Optional[str] = None):
        self.trace, self.logs, self.emit = trace, logs, emit
        self.root = Path(tempfile.mkdtemp(prefix="swarmrun-pool-"))
        self.coord_dir = self.root / "coordinator"
        self.db = db or f"sqlite:///{self.coord_dir / 'coordinator.db'}"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "SWARMRUN_COORDINATOR": self.url}
        self.sink: queue.Queue = queue.Queue()
        self.procs: dict[str, PeerProcess] = {}  # coordinator.k, agent ids
        self.peer_pids: dict[int, str] = {}  # pid of a peer's group -> its key worker/run/k
        self.closed: set[str] = set()  # keys of the processes whose output ended
        self.keeper_pids: set[int] = set()  # the coordinators' keepers (each its own session: not in their group)
        self.rec = PoolRecord(trace=trace.name, workers=trace.worker_ids,
                              runs={r.run_id: dict(vars(r), sets=dict(r.sets)) for r in trace.runs.values()},
                              db=self.db.split("://")[0])
        self.t0 = time.monotonic()
        self.wall0 = time.time()  # moved to trace time 0 once every agent registered
        self.client = None
        self.coordinator: Optional[str] = None  # key of the live coordinator process
        self.down_since: Optional[float] = None
        self.restart: Optional[dict] = None  # the restart in progress: its row of rec.restarts
        self.fronts: dict[str, int] = {}  # run id -> newest committed step an agent reported
        self.states: dict[str, str] = {}  # run id -> state, as the coordinator last said
        self.timers: list[tuple[float, str, Callable[[], None]]] = []
        self.cleaned = False
        self.sockets_before = set(Path("/tmp").glob("hivemind-*.sock"))

    # ---- clock ------------------------------------------------------------------------------------------
    def now(self) -> float:
        """Trace time: seconds since every agent registered (negative before)."""
        return time.time() - self.wall0

    def _t(self, event: dict) -> float:
        return float(event["time"]) - self.wall0 if isinstance(event.get("time"), (int, float)) else self.now()

    # ---- processes ----------------------------------------------------------------------------------
    def _start(self, key: str, args: list[str]) -> PeerProcess:
        """``node ARGS --json`` in its own session; its events go to the queue and to ``logs/KEY.events.jsonl``."""
        log = open(self.logs / f"{key}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "swarmrun.node.cli", *args, "--json"], stdout=subprocess.PIPE,
                                stderr=log, start_new_session=True, env=self.env, cwd=ROOT)
        log.close()
        handle = PeerProcess(key, proc)

        def pump() -> None:
            with open(self.logs / f"{key}.events.jsonl", "wb") as record:
                for line in proc.stdout:
                    record.write(line)
                    record.flush()
                    try:
                        self.sink.put((key, json.loads(line)))
                    except ValueError:
                        continue
            self.sink.put((key, None))

        threading.Thread(target=pump, daemon=True).start()
        self.procs[key] = handle
        return handle

    def _start_coordinator(self) -> None:
        k = sum(1 for key in self.procs if key.startswith("coordinator."))
        self.coordinator = f"coordinator.{k}"
        self._start(self.coordinator, ["coordinator", "--state-dir", str(self.coord_dir), "--db", self.db,
                                       "--http", self.url.split("//")[1], "--min-residence", str(self.trace.min_residence)])

    def _start_agent(self, worker: str) -> None:
        self._start(worker, ["agent", "--worker-id", worker, "--state-dir", str(self.root / worker),
                             "--resident", "file", "--device", "cpu", "--stop-timeout", str(self.trace.stop_timeout),
                             *(f"--peer-arg={arg}" for arg in ("--matchmaking-time", str(self.trace.matchmaking_time),
                                                               *self.trace.peer_args))])

    def _setup(self) -> None:
        """User, coordinator, agents; trace time 0 once every agent registered."""
        from swarmrun.coordinator.client import Client

        self.coord_dir.mkdir(parents=True)
        added = subprocess.run([sys.executable, "-m", "swarmrun.node.cli", "coordinator", "user", "add", "sim",
                                "--state-dir", str(self.coord_dir), "--db", self.db], env=self.env, cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        if added.returncode != 0:
            raise SwarmrunError(f"`node coordinator user add` failed: {added.stderr[-2000:]}")
        token = added.stdout.strip()
        self.env["SWARMRUN_TOKEN"] = token
        self.client = Client(self.url, token)
        self._start_coordinator()
        self._wait_for(lambda k, e: k == self.coordinator and e.get("event") == "serving", "the coordinator serving")
        for worker in self.trace.worker_ids:
            self._start_agent(worker)
        waiting = set(self.trace.worker_ids)
        self._wait_for(lambda k, e: e.get("event") == "registered" and not waiting.discard(k) and not waiting,
                       "every agent registered")
        self.wall0 = time.time()
        self.rec.wall0 = self.wall0
        self.emit("sim", message=f"pool of {len(self.trace.worker_ids)} workers up at {self.url}; trace time starts")

    def _wait_for(self, match: Callable[[str, dict], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                key, event = self.sink.get(timeout=0.5)
            except queue.Empty:
                continue
            self._on_event(key, event)
            if event is not None and match(key, event):
                return
            if event is None:
                raise SwarmrunError(f"{key} exited while waiting for {what} (see {self.logs / (key + '.log')})")
        raise SwarmrunError(f"no {what} within {START_TIMEOUT:.0f}s (see {self.logs})")

    # ---- events of the pool's processes -----------------------------------------------------------------
    def _on_event(self, key: str, event: Optional[dict]) -> None:
        if event is None:
            self.closed.add(key)
            return
        t = self._t(event)
        if key.startswith("coordinator."):
            self.rec.coordinator_out.append((t, key, event))
            if event.get("event") == "serving" and self.restart is not None:
                self._restarted(t)
            elif event.get("event") == "keeper_started":
                self.keeper_pids.add(int(event["pid"]))
            return
        self.rec.agent_events.append((t, key, event))
        kind = event.get("event")
        if kind == "peer_started":
            k = sum(1 for life in self.rec.lives.values() if life.peer == key and life.key.split("/")[1] == event["run_id"])
            life = Life(key=f"{key}/{event['run_id']}/{k}", peer=key, start=t,
                        resumed="--resume-from" in (event.get("args") or []),
                        initial=bool({"--task", "--spec"} & set(event.get("args") or ())))  # a new run
            self.rec.lives[life.key] = life
            self.peer_pids[int(event["pid"])] = life.key
        elif kind in ("peer_stopped", "peer_exited"):
            live = [lf for lf in self.rec.lives.values() if lf.peer == key and lf.end is None]
            for life in live:
                life.end = t
                life.ended_by = f"stopped: {event.get('reason')}" if kind == "peer_stopped" else \
                    ("finished" if event.get("left") == "finished" else "exit")
        elif kind == "peer_step" and event.get("step") is not None:
            self.fronts[event["run_id"]] = max(self.fronts.get(event["run_id"], 0), int(event["step"]))

    # ---- trace events -------------------------------------------------------------------------------
    def fire(self, ev: PoolEvent) -> None:
        """Apply one trace event now."""
        row = dict(t=round(self.now(), 3), **{("at" if k == "time" else k): v for k, v in ev.to_dict().items()})
        if ev.kind == "submit":
            spec = self.trace.runs[ev.run]
            body = dict(run_id=spec.run_id, task=self.trace.task, task_args={k: str(v) for k, v in spec.sets.items()},
                        priority=spec.priority, min_peers=spec.min_peers, max_peers=spec.max_peers)
            if "total_steps" in spec.sets:
                body["total_steps"] = int(spec.sets["total_steps"])
            try:
                self.client.post("runs", body)
            except SwarmrunError as e:  # the coordinator is down: submit again once it is back
                row["note"] = f"retried: {e}"
                self.timers.append((self.now() + 2.0, f"submit {ev.run}", lambda: self.fire(ev)))
                self.emit("fault", **row)
                return
            self.states.setdefault(ev.run, "pending")
        elif ev.kind == "resident":
            self._resident(ev.worker, True)
            if ev.duration:
                self.timers.append((self.now() + ev.duration, f"resident of {ev.worker} leaves",
                                    lambda: self._resident(ev.worker, False)))
        else:
            self._kill_coordinator(ev.down)
        self.rec.faults.append(row)
        self.emit("fault", **row)

    def _resident(self, worker: str, present: bool) -> None:
        """What ``node agent busy|idle --state-dir`` does: the agent's ``file`` source reads the flag."""
        from swarmrun.coordinator.residents import flag_path

        flag = flag_path(self.root / worker)
        flag.touch() if present else flag.unlink(missing_ok=True)
        if not present:
            row = dict(t=round(self.now(), 3), kind="resident_leaves", worker=worker)
            self.rec.faults.append(row)
            self.emit("fault", **row)

    def _kill_coordinator(self, down: float) -> None:
        """SIGKILL the coordinator after reading what it says it holds; restart it ``down`` seconds later."""
        try:
            before = dict(runs=self.client.get("runs")["runs"], workers=self.client.get("workers")["workers"])
        except SwarmrunError as e:
            self.emit("sim", message=f"coordinator_kill: could not read the pool first ({e}); killing anyway")
            before = None
        self.procs[self.coordinator].kill_group(signal.SIGKILL)
        self.procs[self.coordinator].proc.wait(timeout=10)
        self.down_since = self.now()
        self.restart = dict(killed=round(self.down_since, 3), before=before)
        self.timers.append((self.now() + down, "coordinator restart", self._start_coordinator))

    def _restarted(self, t: float) -> None:
        row, self.restart = self.restart, None
        row["serving"] = round(t, 3)
        try:
            row["after"] = dict(runs=self.client.get("runs")["runs"], workers=self.client.get("workers")["workers"])
        except SwarmrunError as e:
            row["after"], row["error"] = None, str(e)
        self.rec.restarts.append(row)
        self.down_since = None
        self.emit("sim", message=f"coordinator restarted after {t - row['killed']:.1f}s down")

    # ---- the loop -------------------------------------------------------------------------------------
    def run(self) -> PoolRecord:
        """Run the trace to its end. Raises SwarmrunError when the pool cannot even start."""
        try:
            self._setup()
            self._loop()
        finally:
            self.rec.end = self.now()
            self._cleanup()
        return self.rec

    def _loop(self) -> None:
        pending = list(self.trace.events)
        next_poll = 0.0
        while self.now() < self.trace.duration:
            self._drain()
            for when, what, fn in [x for x in self.timers if x[0] <= self.now()]:
                self.timers.remove((when, what, fn))
                fn()
            for ev in [e for e in pending if self._due(e)]:
                pending.remove(ev)
                self.fire(ev)
            if self.now() >= next_poll and self.down_since is None:
                next_poll = self.now() + RUNS_POLL
                try:
                    self.states = {r["run_id"]: r["state"] for r in self.client.get("runs")["runs"]}
                except SwarmrunError:
                    continue
                if not pending and not self.timers and set(self.states) == set(self.trace.runs) and \
                        all(s in ("finished", "cancelled") for s in self.states.values()):
                    self.emit("sim", message="every run finished; stopping")
                    return
        self.emit("sim", message=f"the trace's duration ({self.trace.duration:g}s) is over; stopping")

    def _drain(self) -> None:
        try:
            key, event = self.sink.get(timeout=0.2)
            self._on_event(key, event)
            while True:
                key, event = self.sink.get_nowait()
                self._on_event(key, event)
        except queue.Empty:
            pass

    def _drain_until_closed(self, keys: list[str], deadline: float) -> None:
        """Handle events until each process of ``keys`` closed its output (its pump's last item), or ``deadline``."""
        while not self.closed >= set(keys) and time.monotonic() < deadline:
            try:
                self._on_event(*self.sink.get(timeout=0.2))
            except queue.Empty:
                continue

    def _due(self, ev: PoolEvent) -> bool:
        if ev.time is not None:
            return self.now() >= ev.time
        run, step = ev.after
        return self.fronts.get(run, -1) >= step

    # ---- clean-up ---------------------------------------------------------------------------------------
    def _cleanup(self) -> None:
        """The agents stop their peers (SIGTERM), then every group started is SIGKILLed and waited for; the peers'
        event files and the registry's log are read; the state dirs go. Ctrl-C and SIGTERM wait for it."""
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread
                pass
        try:
            self._stop_all()
            self._collect()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _stop_all(self) -> None:
        agents = [p for key, p in self.procs.items() if not key.startswith("coordinator.")]
        for p in agents:
            p.kill_group(signal.SIGTERM)  # the agent's group only: it stops its peers' groups itself
        deadline = time.monotonic() + self.trace.stop_timeout + 10
        for p in agents:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._drain()
        groups = [p.proc.pid for p in self.procs.values()] + list(self.peer_pids)
        kill_groups(groups)
        for p in self.procs.values():
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # a keeper is its own session: the coordinator's death only SIGTERMs it (a leave of up to LEAVE_GRACE).
        # The coordinators are dead now, so no keeper starts after their last `keeper_started`, read here
        self._drain_until_closed([key for key in self.procs if key.startswith("coordinator.")], time.monotonic() + 10)
        kill_groups(self.keeper_pids)
        groups += sorted(self.keeper_pids)
        self.cleaned = wait_groups_gone(groups, time.monotonic() + 15)
        self.rec.cleaned = self.cleaned
        _remove_stale_sockets(self.sockets_before)

    def _collect(self) -> None:
        """The peers' own events (``peer-PID.jsonl`` in each agent's run dirs) and the registry's event log."""
        for pid, key in self.peer_pids.items():
            worker, run_id, _ = key.split("/")
            path = self.root / worker / "runs" / run_id / f"peer-{pid}.jsonl"
            dest = self.logs / worker / run_id
            dest.mkdir(parents=True, exist_ok=True)
            for src in (path, path.parent / "peer.log"):
                if src.exists():
                    shutil.copy(src, dest / src.name)
            for line in path.read_bytes().splitlines() if path.exists() else []:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                self.rec.peer_events.append((self._t(event), key, event))
        self.rec.peer_events.sort(key=lambda x: x[0])
        for src in sorted((self.coord_dir / "keepers").glob("*/keeper.*")):  # the coordinator's keepers, per run
            dest = self.logs / "keepers" / src.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / src.name)
        try:
            self.rec.coord_events = _registry_events(self.db, self.wall0)
        except Exception as e:  # a database the run never created: the checks say what is missing
            self.emit("sim", message=f"could not read the registry's events: {e}")
        self.rec.lives_end(self.rec.end)


def _registry_events(db: str, wall0: float) -> list[dict[str, Any]]:
    from swarmrun.coordinator.registry import Registry

    registry = Registry(db)
    out, since = [], 0
    try:
        while True:
            batch = registry.events(since=since, limit=500)
            if not batch:
                return out
            out += [dict(e, t=round(e["time"] - wall0, 3)) for e in batch]
            since = batch[-1]["id"]
    finally:
        registry.close()


def _remove_stale_sockets(before: set) -> None:
    """hivemind's p2pd sockets (``/tmp/hivemind-*.sock``) that appeared during the run and that no process has
    open any more (not in ``/proc/net/unix``): a SIGKILLed p2pd leaves its socket file behind."""
    try:
        bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:] if len(line.split()) > 7}
    except OSError:
        return
    for path in set(Path("/tmp").glob("hivemind-*.sock")) - before:
        if str(path) not in bound:
            path.unlink(missing_ok=True)
