"""`node agent`: one per workstation. It registers the machine, heartbeats once a second with its resident's
presence and its peer's address, and starts and stops one peer (a `node join` child) as its assignment says.

Each peer is a child process in its own session (process group), with its own state dir
``STATE_DIR/runs/RUN_ID`` (its stderr in ``peer.log`` there, its ``--json`` events in ``peer-PID.jsonl``); it writes snapshots to ``STORE/RUN_ID`` (the pool's store, from the coordinator), so
the last peer of a run that leaves writes its newest state there. A peer is stopped with SIGTERM (to its main process)
and SIGKILL to its whole group after ``stop_timeout``: the resident gets the machine back within ``stop_timeout`` plus one tick.

Every pool run is invite-only (``owner.py``): before each start the agent asks the coordinator for a certificate
for the peer's id (its identity in the run's state dir, new for each assignment: a released peer id is revoked for
good) and passes it with ``--invite``; the leader of a new run builds the run's spec (the task is installed here)
with the run's owner key, has the coordinator sign it and starts with ``--spec``. Every peer gets the coordinator's
peer in its ``--peers`` (``bootstrap``): the pool's runs share its DHT, where it publishes their revocations.

The agent decides locally what it can: when the resident returns it stops its peer at once, without waiting for
the coordinator; when the coordinator is unreachable it keeps its peer training.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from swarmrun.coordinator.client import Client
from swarmrun.coordinator.residents import Resident
from swarmrun.coordinator.schema import CURSOR_KEYS
from swarmrun.protocol.errors import AccessRefused, SwarmrunError, UsageError

__all__ = ["AgentConfig", "Agent", "local_resources"]

logger = logging.getLogger("swarmrun.agent")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """One agent: who it is, where it keeps its peers, how its peers listen."""

    worker_id: str
    state_dir: Path
    heartbeat_interval: float = 1.0
    stop_timeout: float = 20.0  # SIGTERM, then SIGKILL of the peer's group after this many seconds
    restart_backoff: float = 5.0  # a peer that exited on its own is started again after this long
    snapshot_wait: float = 60.0  # how long a leader waits for a snapshot of the run's reported step before older
    device: str = "auto"
    peer_args: tuple[str, ...] = ()  # passed to every `node join` (--listen, --announce, --matchmaking-time ...)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def local_resources() -> dict[str, Any]:
    """CPU count, RAM and CUDA devices (through torch.cuda when torch imports; none otherwise)."""
    import psutil

    devices = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                devices.append({"kind": "cuda", "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 2)})
    except Exception:  # no torch, no driver: a CPU workstation
        pass
    return {"devices": devices, "cpus": os.cpu_count() or 1, "ram_gib": round(psutil.virtual_memory().total / 2**30, 2)}


@dataclass(eq=False)
class _Peer:
    run_id: str
    proc: asyncio.subprocess.Process
    started: float
    maddr: Optional[str] = None
    left: Optional[dict] = None
    reader: Optional[asyncio.Task] = None
    stopping: bool = field(default=False)
    pending: Optional[dict] = None  # the newest step, evaluation and snapshot not yet reported (one body)
    reported_at: float = 0.0
    sending: Optional[asyncio.Task] = None  # the report in flight (the reader never waits for one)
    # the run's state is here: a peer that creates or resumes the run from the start, a joiner once it bootstrapped
    # or stepped. Only such a peer is reported to the coordinator: a joiner still looking for the state does not
    # hold the run (its peers may all have left), and leading others to it restarted the run from step 0
    holds_state: bool = False


class Agent:
    """The agent's loop (``run``) and its peer's life (``start_peer``, ``stop_peer``)."""

    def __init__(self, config: AgentConfig, client: Client, resident: Resident, events) -> None:
        self.config, self.client, self.resident, self.events = config, client, resident, events
        self.peer: Optional[_Peer] = None
        self.store: Optional[str] = None
        self.bootstrap: list[str] = []  # the coordinator's peer
        self.finished: set[str] = set()
        self.unreported: dict[str, dict[str, Any]] = {}  # run id -> the newest report the coordinator did not take
        self.waiting: dict[str, float] = {}  # run id -> when this agent began waiting for its newest snapshot
        self.told: set[str] = set()  # runs whose wait was announced (once, not every heartbeat)
        self.last_exit = 0.0
        self.present = False
        self.stop = asyncio.Event()

    async def run(self) -> None:
        resources = await asyncio.to_thread(local_resources)
        body = {"worker_id": self.config.worker_id, "hostname": socket.gethostname(), "resources": resources}
        answer = await asyncio.to_thread(self.client.post, "workers/register", body)
        self.events.emit("registered", worker_id=self.config.worker_id, resources=resources)
        await self._act(answer)
        try:
            while not self.stop.is_set():
                await self.tick()
                try:
                    await asyncio.wait_for(self.stop.wait(), timeout=self.config.heartbeat_interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.stop_peer("agent stopping")
            for run_id, report in list(self.unreported.items()):  # the peer's last word (its leave's snapshot)
                del self.unreported[run_id]
                await self._report(run_id, report)

    async def tick(self) -> None:
        present = self.resident.present()
        if present != self.present:
            self.present = present
            self.events.emit("resident", present=present)
        if present and self.peer is not None:
            await self.stop_peer("resident returned")  # at once: the coordinator hears of it on this heartbeat
        body: dict[str, Any] = {"resident_present": present}
        if self.peer is not None and self.peer.holds_state and not self.peer.stopping:
            body["peer"] = {"run_id": self.peer.run_id, "maddr": self.peer.maddr}  # maddr None until it listens
        if self.peer is not None:
            await self._flush(self.peer, now=True)
        for run_id, report in list(self.unreported.items()):  # sent again once the coordinator is back
            del self.unreported[run_id]
            await self._report(run_id, report)
        try:
            answer = await asyncio.to_thread(self.client.post, f"workers/{self.config.worker_id}/heartbeat", body)
        except SwarmrunError as e:  # the coordinator is down or restarting: the peer trains on
            logger.warning(f"heartbeat failed: {e}")
            return
        await self._act(answer)

    async def _act(self, answer: dict[str, Any]) -> None:
        """Carry out the assignment the coordinator answered with."""
        self.store = answer.get("store") or self.store
        self.bootstrap = answer.get("bootstrap") or self.bootstrap
        assignment = answer.get("assignment")
        peer = self.peer
        if peer is not None and peer.proc.returncode is not None:
            await self._reap(peer)
            peer = None
        wanted = assignment["run_id"] if assignment and assignment["state"] == "running" and not self.present else None
        if peer is not None and peer.run_id != wanted:
            await self.stop_peer("released" if wanted is None else f"assigned to run {wanted}")
            peer = None
        if peer is None and wanted is not None and wanted not in self.finished:
            if time.monotonic() - self.last_exit >= self.config.restart_backoff:
                await self._maybe_start(assignment)

    async def _maybe_start(self, assignment: dict[str, Any]) -> None:
        run_id = assignment["run_id"]
        args = [run_id]
        creating = False
        if assignment.get("peers"):
            args += ["--peers", *assignment["peers"][:4], *self.bootstrap]
        elif assignment.get("leader") == self.config.worker_id:
            step = assignment.get("step") or 0
            resume, snapshot_step = self._snapshot(run_id)
            args += ["--peers", *self.bootstrap] if self.bootstrap else []
            if resume is None and step == 0:
                creating = True
            elif resume is None or (snapshot_step < step and not self._waited(run_id)):
                # a run with steps and no live peer: its last peer may still be writing its leave snapshot. Never
                # restart it from its seed; resume from an older snapshot only after ``snapshot_wait``.
                if run_id not in self.told:
                    self.told.add(run_id)
                    self.events.emit("waiting", run_id=run_id, step=step, snapshot_step=snapshot_step,
                                     message="waiting for the run's newest snapshot")
                return
            else:
                if snapshot_step < step:
                    self.events.emit("resumed_behind", run_id=run_id, step=step, snapshot_step=snapshot_step)
                args += ["--resume-from", resume]
        else:
            return  # the leader creates or resumes the run; this worker joins once a peer listens
        try:
            args += await self._admission(assignment, creating)
        except SwarmrunError as e:  # the coordinator is down, or released this worker meanwhile: a later tick
            logger.warning(f"no certificate for run {run_id}: {e}")
            self.last_exit = time.monotonic()
            return
        await self.start_peer(run_id, args, holds_state=not assignment.get("peers"))

    async def _admission(self, assignment: dict[str, Any], creating: bool) -> list[str]:
        """``--invite FILE`` (a certificate for this assignment's peer id) and, for a new run, ``--spec FILE`` (its
        spec signed by the coordinator), written to the run's state dir.

        Raises:
            SwarmrunError: the coordinator refused or did not answer.
        """
        from swarmrun.node import ensure_identity, peer_id_of, public_key_bytes

        run_id = assignment["run_id"]
        state_dir = self.config.state_dir / "runs" / run_id
        state_dir.mkdir(parents=True, exist_ok=True)
        since = state_dir / "assigned"
        if not since.exists() or since.read_text() != repr(assignment["since"]):
            (state_dir / "identity.key").unlink(missing_ok=True)  # a new assignment, a new peer id
            since.write_text(repr(assignment["since"]))
        _, key = await asyncio.to_thread(ensure_identity, state_dir)
        body = {"worker_id": self.config.worker_id, "peer_id": peer_id_of(public_key_bytes(key))}
        answer = await asyncio.to_thread(self.client.post, f"runs/{run_id}/certificate", body)
        (state_dir / "invite").write_text(answer["certificate"] + "\n")
        args = ["--invite", str(state_dir / "invite")]
        if creating:
            signed = answer.get("spec")
            if signed is None:
                unsigned = await asyncio.to_thread(_unsigned_spec, assignment, base64.b64decode(answer["owner_key"]))
                body = {"worker_id": self.config.worker_id, "spec": base64.b64encode(unsigned).decode()}
                signed = (await asyncio.to_thread(self.client.post, f"runs/{run_id}/spec", body))["spec"]
            (state_dir / "spec").write_bytes(base64.b64decode(signed))
            args += ["--spec", str(state_dir / "spec")]
        return args

    def _store_of(self, run_id: str) -> Optional[str]:
        return None if not self.store else f"{self.store.rstrip('/')}/{run_id}"

    def _snapshot(self, run_id: str) -> tuple[Optional[str], int]:
        """The run's store and its newest complete snapshot's step, or (None, -1) when it holds none."""
        from swarmrun.node import SnapshotStore

        where = self._store_of(run_id)
        if where is None:
            return None, -1
        try:
            return where, SnapshotStore(where).newest_step()
        except (SwarmrunError, OSError):
            return None, -1

    def _waited(self, run_id: str) -> bool:
        """Whether this agent has waited ``snapshot_wait`` for a run's newest snapshot (the clock starts now)."""
        since = self.waiting.setdefault(run_id, time.monotonic())
        return time.monotonic() - since >= self.config.snapshot_wait

    async def start_peer(self, run_id: str, args: list[str], *, holds_state: bool = False) -> None:
        state_dir = self.config.state_dir / "runs" / run_id
        state_dir.mkdir(parents=True, exist_ok=True)
        store = self._store_of(run_id)
        cmd = [sys.executable, "-m", "swarmrun.node.cli", "join", *args, "--state-dir", str(state_dir),
               "--device", self.config.device, *(["--snapshot-to", store] if store else []), *self.config.peer_args,
               "--json"]
        log = open(state_dir / "peer.log", "ab")
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log,
                                                    start_new_session=True, cwd=state_dir, limit=2**22)
        log.close()
        self.waiting.pop(run_id, None)
        self.told.discard(run_id)
        self.peer = _Peer(run_id=run_id, proc=proc, started=time.monotonic(), holds_state=holds_state)
        self.peer.reader = asyncio.create_task(self._read(self.peer))
        self.events.emit("peer_started", run_id=run_id, pid=proc.pid, args=args)

    async def _read(self, peer: _Peer) -> None:
        """The peer's --json events: its address, its steps and snapshots (reported to the coordinator)."""
        assert peer.proc.stdout is not None
        record = open(self.config.state_dir / "runs" / peer.run_id / f"peer-{peer.proc.pid}.jsonl", "ab")
        try:
            async for line in peer.proc.stdout:
                record.write(line)  # every event as printed, for a post-mortem and the churn harness's checks
                record.flush()
                await self._on_peer_line(peer, line)
        finally:
            record.close()

    async def _on_peer_line(self, peer: _Peer, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        kind = event.get("event")
        if kind in ("bootstrapped", "step", "resync"):
            peer.holds_state = True
        if kind == "listening" and event.get("maddrs"):
            peer.maddr = event["maddrs"][0]
            self.events.emit("peer_listening", run_id=peer.run_id, maddr=peer.maddr)
        elif kind == "step":
            fields = {k: event.get(k) for k in ("step", "loss", "samples_per_second", "peers")}
            # the run's samples so far (its cursor's count): the dashboard plots loss against samples
            cursor = event.get("cursor")
            fields["samples"] = cursor.get("samples_applied") if isinstance(cursor, dict) else None
            self.events.emit("peer_step", run_id=peer.run_id, **fields)
            body = {k: v for k, v in fields.items() if v is not None}
            if isinstance(cursor, dict):  # the run's data accounting, shown on its page
                body["cursor"] = {k: cursor[k] for k in CURSOR_KEYS if isinstance(cursor.get(k), int)}
            self._send_soon(peer, body)
        elif kind == "eval" and isinstance(event.get("step"), int) and _finite(event.get("loss")):
            # a held-out evaluation (every ``eval_every`` steps): sent at once with its own step, unless a report is
            # in flight (then with the next one: only the newest evaluation is kept)
            self.events.emit("peer_eval", run_id=peer.run_id, step=event["step"], loss=event["loss"])
            self._send_soon(peer, {"step": event["step"], "eval": {"step": event["step"], "loss": event["loss"]}},
                            now=True)
        elif kind == "snapshot" and event.get("where"):
            self.events.emit("peer_snapshot", run_id=peer.run_id, step=event.get("step"), where=event["where"])
            self._send_soon(peer, {"step": event["step"], "snapshot": {"url": event["where"], "step": event["step"]}},
                            now=True)
        elif kind == "left":
            peer.left = event
        elif kind == "error":
            self.events.emit("peer_error", run_id=peer.run_id, message=event.get("message"))

    def _send_soon(self, peer: _Peer, body: dict[str, Any], *, now: bool = False) -> None:
        """Merge ``body`` into the peer's pending report and send it in the background when due. The peer's events
        are read one line at a time: a reader that waited for each report (a coordinator slow under load, or one
        that does not answer for the client's timeout) would fill the peer's stdout pipe, and the peer, blocked on
        its next line, would stop training. A fast run evaluates many times a second: each of those was a report."""
        peer.pending = _merged(peer.pending or {}, body)
        due = now or time.monotonic() - peer.reported_at >= self.config.heartbeat_interval
        if due and (peer.sending is None or peer.sending.done()):
            peer.sending = asyncio.ensure_future(self._flush(peer, now=True))

    async def _flush(self, peer: _Peer, *, now: bool = False) -> None:
        """Report the newest step, at most once per ``heartbeat_interval`` (a small run steps many times a second;
        every report is a database commit)."""
        if peer.pending is not None and (now or time.monotonic() - peer.reported_at >= self.config.heartbeat_interval):
            body, peer.pending, peer.reported_at = peer.pending, None, time.monotonic()
            await self._report(peer.run_id, body)

    async def _report(self, run_id: str, body: dict[str, Any]) -> None:
        """Report progress; a report the coordinator could not take (down, restarting) is kept, merged with any
        newer one, and sent again on the next tick: a run that finishes while the coordinator is down would
        otherwise never be reported finished, and would hold its workers for good."""
        try:
            await asyncio.to_thread(self.client.post, f"runs/{run_id}/progress", body)
        except (AccessRefused, UsageError) as e:  # released meanwhile (403), or refused: the peer's steps stand
            logger.info(f"progress report of run {run_id} not taken: {e}")
        except Exception as e:  # down, or an answer cut short (http.client.IncompleteRead is no OSError)
            logger.info(f"progress report of run {run_id} not taken, kept to send again: {type(e).__name__}: {e}")
            self.unreported[run_id] = _merged(self.unreported.get(run_id, {}), body)

    async def _forget_peer(self, peer: _Peer) -> None:
        """A peer that exited: the report in flight ends (bounded), what was not sent yet goes on the next tick."""
        if peer.sending is not None:
            await asyncio.wait([peer.sending], timeout=getattr(self.client, "timeout", 10.0))
        if peer.pending:
            self.unreported[peer.run_id] = _merged(self.unreported.get(peer.run_id, {}), peer.pending)
            peer.pending = None

    async def stop_peer(self, reason: str) -> None:
        """SIGTERM to the peer, SIGKILL to its process group after ``stop_timeout``; waits for it."""
        peer = self.peer
        if peer is None:
            return
        peer.stopping = True
        began = time.monotonic()
        killed = False
        if peer.proc.returncode is None:
            # the peer alone: it leaves gracefully and shuts its hivemind processes and p2pd down itself (a p2pd
            # ended by the group's signal would take the last report and the leave's DHT reads with it)
            try:
                peer.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(peer.proc.wait(), timeout=self.config.stop_timeout)
            except asyncio.TimeoutError:
                killed = True
        _signal_group(peer.proc.pid, signal.SIGKILL)  # whatever of the group is left (p2pd, hivemind's children)
        await peer.proc.wait()
        if peer.reader is not None:
            await asyncio.wait([peer.reader], timeout=5)
        self.events.emit("peer_stopped", run_id=peer.run_id, reason=reason, seconds=round(time.monotonic() - began, 2),
                         killed=killed, exit_code=peer.proc.returncode, left=(peer.left or {}).get("reason"))
        await self._forget_peer(peer)
        self.peer = None
        self.last_exit = 0.0  # a stop we asked for is no failure: no backoff

    async def _reap(self, peer: _Peer) -> None:
        """A peer that exited on its own: finished (not started again) or failed (started again after a backoff)."""
        _signal_group(peer.proc.pid, signal.SIGKILL)
        if peer.reader is not None:
            await asyncio.wait([peer.reader], timeout=5)
        reason = (peer.left or {}).get("reason")
        if reason == "finished":
            self.finished.add(peer.run_id)
        self.events.emit("peer_exited", run_id=peer.run_id, exit_code=peer.proc.returncode, left=reason)
        await self._forget_peer(peer)
        self.peer = None
        self.last_exit = time.monotonic()


def _merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two progress reports of one run as one: the newer step's fields win, and of two evaluations or two snapshots
    the one of the later step (the registry keeps only the newest of each anyway)."""
    newer = (new.get("step") or 0) >= (old.get("step") or 0)
    out = {**old, **new} if newer else {**new, **old}
    for key in ("eval", "snapshot"):
        mine = [b[key] for b in (new, old) if isinstance(b.get(key), dict)]  # of one step, the newer report's
        if mine:
            out[key] = max(mine, key=lambda v: v.get("step") or 0)
    return out


def _unsigned_spec(assignment: dict[str, Any], owner_key: bytes) -> bytes:
    """A new pool run's spec, unsigned: its task and arguments as submitted, the coordinator's owner key, invite-only.

    Raises:
        UsageError: the task is not installed here, or an argument it refuses.
    """
    from swarmrun.node import DEFAULT_SEED, load_task_class, make_spec
    from swarmrun.protocol.errors import TaskError

    try:
        task_cls = load_task_class(assignment["task"])
    except TaskError as e:
        raise UsageError(str(e)) from None
    sets = {key: str(value) for key, value in (assignment.get("task_args") or {}).items()}
    spec, _ = make_spec(run_id=assignment["run_id"], task_cls=task_cls, sets=sets, seed=DEFAULT_SEED,
                        owner_key=owner_key, access="invite")
    return spec.unsigned_bytes()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
