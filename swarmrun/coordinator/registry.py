"""The coordinator's registry: users, runs, workers, assignments and events in one database.

Why a database and not a file of our own: the coordinator must survive a SIGKILL with no run,
assignment or submission lost (invariant 9), and a lab may outgrow a file. SQLAlchemy gives
both: SQLite by default (WAL mode, ``synchronous=FULL``: a committed transaction survives a
crash of the process and of the machine), PostgreSQL through a URL. Every write is one
transaction; the schema is created on open.

The registry records decisions, it does not make them. The placement seam is
``Registry.pool()``: plain rows (dicts) of runs, workers and assignments read in one
transaction, which the coordinator's loop converts into placement's dataclasses; the actions
``plan()`` returns come back through ``assign``, ``unassign`` and ``set_run_state``.

Writes are serialised by one lock: the coordinator is the only writer of its database (one
process), and the lock makes event ids commit in increasing order, so a dashboard that polls
``events(since=last_id)`` never misses an event that committed late with a smaller id.

Event kinds (the dashboard's timelines): ``submit``, ``priority``, ``hold``, ``release`` (a
user's release of a held run), ``cancel``, ``state`` (the loop's pause, resume, start, finish:
``detail.reason`` says which), ``progress`` (a reported step), ``register``, ``assign``,
``unassign`` (an assignment's end; ``detail.reason``: release, preempt, resident_return, ...),
``resident_return`` and ``resident_leave`` (the resident's presence as an agent reports it), ``certify`` (a
certificate issued to an assigned worker's peer id; ``coordinator/owner.py``).

Isolation's records: each run's owner key (made at submission, in the submission's transaction) and its signed
spec in ``run_keys``; each certificate issued, and when its worker was released (the revocation follows), in
``certificates``.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sqlalchemy import create_engine, event, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from swarmrun.coordinator.owner import CLEAR_KEYS
from swarmrun.coordinator.schema import Heartbeat, Progress, Registration, Submission, check_name
from swarmrun.coordinator.tables import (
    add_new_columns, sqlite_pragmas,
    AssignmentRow as _Assignment, Base as _Base, CertificateRow as _Certificate, EventRow as _Event, RunKeyRow as _RunKey,
    RunRow as _Run, UserRow as _User, WorkerRow as _Worker,
)
from swarmrun.protocol.errors import AccessRefused, Conflict, RunNotFound, UsageError, WorkerNotFound

__all__ = [
    "RUN_STATES",
    "ACTIVE_STATES",
    "Conflict",
    "WorkerNotFound",
    "User",
    "PoolRows",
    "Registry",
    "default_url",
    "token_hash",
]

RUN_STATES = ("pending", "running", "paused", "held", "finished", "cancelled")
ACTIVE_STATES = ("pending", "running", "paused")  # states the placement loop may give workers to
_TERMINAL = ("finished", "cancelled")
# A user's action on a run: the states it may start from and the state it leads to.
_USER_ACTIONS = {
    "hold": (("pending", "running", "paused"), "held"),
    "release": (("held",), "pending"),
    "cancel": (("pending", "running", "paused", "held"), "cancelled"),
}


@dataclass(frozen=True)
class User:
    """An authenticated user: a name and whether they may change every run."""

    name: str
    admin: bool


@dataclass(frozen=True)
class PoolRows:
    """The placement seam: runs, workers and assignments as plain dicts, read in one transaction."""

    runs: tuple[dict[str, Any], ...]
    workers: tuple[dict[str, Any], ...]
    assignments: tuple[dict[str, Any], ...]


def default_url(state_dir: str | Path) -> str:
    """The default database: an SQLite file ``coordinator.db`` in the coordinator's state dir."""
    return f"sqlite:///{Path(state_dir).expanduser().resolve() / 'coordinator.db'}"


def token_hash(token: str) -> str:
    """The sha256 hex digest under which a token is stored (a stolen database holds no token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _row(obj: _Base, exclude: tuple[str, ...] = ("id",)) -> dict[str, Any]:
    return {c.key: getattr(obj, c.key) for c in obj.__table__.columns if c.key not in exclude}


class Registry:
    """The coordinator's durable state, over a SQLAlchemy URL.

    Args:
        url: a SQLAlchemy URL (``sqlite:///PATH``, ``postgresql+psycopg://...``); see ``default_url``.
        clock: the time source of every timestamp (injected so tests control it).
        seal: seals the owner keys it stores (``owner.KeySeal``, the coordinator's). Without one (``user add``,
            tools) keys are stored in the clear and a sealed key cannot be read.
    """

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time, seal=None) -> None:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        self._engine = create_engine(url, pool_pre_ping=True)
        if parsed.get_backend_name() == "sqlite":
            event.listen(self._engine, "connect", sqlite_pragmas)
        self._clock = clock
        self._seal = seal or CLEAR_KEYS
        self._lock = threading.Lock()
        _Base.metadata.create_all(self._engine)
        add_new_columns(self._engine)
        if seal is not None:  # keys an older coordinator stored in the clear are sealed now, in place
            with self._write() as s:
                for key in s.scalars(select(_RunKey)):
                    key.owner_key = seal.seal_clear(key.owner_key)

    def close(self) -> None:
        """Close every pooled connection (the data is already committed)."""
        self._engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """One write transaction: committed on exit, rolled back on any exception."""
        with self._lock, Session(self._engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with Session(self._engine) as session, session.begin():
            yield session

    def _event(self, session: Session, kind: str, *, run_id=None, worker_id=None, **detail) -> None:
        session.add(_Event(time=self._clock(), kind=kind, run_id=run_id, worker_id=worker_id, detail=detail))

    # Users

    def add_user(self, name: str, *, admin: bool = False) -> str:
        """Create a user and return their new API token (shown once; only its hash is kept).

        Raises:
            UsageError: the name is not a valid name. Conflict: the name is taken.
        """
        check_name(name, "user name")
        token = secrets.token_urlsafe(32)
        with self._write() as s:
            if s.scalar(select(_User).where(_User.name == name)) is not None:
                raise Conflict(f"user {name!r} exists")
            s.add(_User(name=name, token_sha256=token_hash(token), admin=admin, created_at=self._clock()))
        return token

    def authenticate(self, token: str) -> User | None:
        """The user whose token this is, or None."""
        with self._read() as s:
            user = s.scalar(select(_User).where(_User.token_sha256 == token_hash(token)))
            return None if user is None else User(user.name, user.admin)

    # Runs

    def submit(self, owner: str, sub: Submission, *, owner_key: bytes | None = None) -> dict[str, Any]:
        """Record a new pending run of ``owner`` with its owner key (``owner_key``: DER bytes, made here when None);
        returns its row. Raises Conflict if the id is taken."""
        if owner_key is None:
            from swarmrun.coordinator.owner import new_owner_key

            owner_key = new_owner_key()
        now = self._clock()
        try:
            with self._write() as s:
                if s.scalar(select(_Run.id).where(_Run.run_id == sub.run_id)) is not None:
                    raise Conflict(f"run {sub.run_id!r} exists")
                run = _Run(
                    run_id=sub.run_id, owner=owner, task=sub.task, task_args=sub.task_args,
                    priority=sub.priority, min_peers=sub.min_peers, max_peers=sub.max_peers,
                    share=sub.share, need_device=sub.need_device, need_memory_gib=sub.need_memory_gib,
                    total_steps=sub.total_steps, state="pending", submitted_at=now, updated_at=now,
                )  # fmt: skip
                s.add(run)
                s.flush()  # the run's row before its key's (the foreign key)
                s.add(_RunKey(run_id=sub.run_id, owner_key=self._seal.seal(owner_key)))
                self._event(s, "submit", run_id=sub.run_id, owner=owner, priority=sub.priority,
                            min_peers=sub.min_peers, max_peers=sub.max_peers)  # fmt: skip
                s.flush()
                return _row(run)
        except IntegrityError as e:  # another writer of the same database got there first
            raise Conflict(f"run {sub.run_id!r} exists") from e

    def runs(self, *, states: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """Every run (optionally only those in ``states``), oldest submission first."""
        with self._read() as s:
            query = select(_Run).order_by(_Run.submitted_at, _Run.id)
            if states is not None:
                query = query.where(_Run.state.in_(states))
            return [_row(r) for r in s.scalars(query)]

    def run(self, run_id: str) -> dict[str, Any]:
        """One run's row with ``workers``: the ids of the workers assigned to it. Raises RunNotFound."""
        with self._read() as s:
            run = self._get_run(s, run_id)
            row = _row(run)
            row["workers"] = list(
                s.scalars(select(_Assignment.worker_id).where(_Assignment.run_id == run_id).order_by(_Assignment.worker_id))
            )
            return row

    @staticmethod
    def _get_run(session: Session, run_id: str) -> _Run:
        run = session.scalar(select(_Run).where(_Run.run_id == run_id))
        if run is None:
            raise RunNotFound(f"no run {run_id!r} in this pool")
        return run

    def reporters(self, run_id: str) -> set[str]:
        """Users who may report a run's progress: its owner and the owners of its workers' agents.

        Raises RunNotFound.
        """
        with self._read() as s:
            owner = self._get_run(s, run_id).owner
            query = select(_Worker.owner).join(_Assignment, _Assignment.worker_id == _Worker.worker_id)
            return {owner, *s.scalars(query.where(_Assignment.run_id == run_id))}

    def user_action(self, run_id: str, action: str, *, by: str) -> dict[str, Any]:
        """Apply a user's ``hold``, ``release`` or ``cancel`` to a run; returns its row.

        Repeating an action whose state the run is already in changes nothing (a retried
        command succeeds). Releasing workers of a held or cancelled run is the placement
        loop's job: it sees the new state on its next pass.

        Raises:
            RunNotFound; Conflict: the run's state does not allow the action.
        """
        sources, target = _USER_ACTIONS[action]
        with self._write() as s:
            run = self._get_run(s, run_id)
            if run.state != target:
                if run.state not in sources:
                    raise Conflict(f"cannot {action} run {run_id!r}: it is {run.state}")
                self._event(s, action, run_id=run_id, by=by, previous=run.state)
                run.state, run.updated_at = target, self._clock()
            return _row(run)

    def set_priority(self, run_id: str, priority: int, *, by: str) -> dict[str, Any]:
        """Change a run's priority; returns its row. Raises RunNotFound, Conflict (run ended)."""
        with self._write() as s:
            run = self._get_run(s, run_id)
            if run.state in _TERMINAL:
                raise Conflict(f"run {run_id!r} is {run.state}")
            if run.priority != priority:
                self._event(s, "priority", run_id=run_id, by=by, previous=run.priority, priority=priority)
                run.priority, run.updated_at = priority, self._clock()
            return _row(run)

    def set_run_state(self, run_id: str, state: str, *, expect: str, reason: str, **detail) -> dict[str, Any]:
        """The placement loop's state change (start, pause, resume, finish), compare-and-set.

        ``expect`` is the state the loop planned from: if a user held or cancelled the run
        meanwhile, the change is refused (Conflict) rather than undoing the user's action.
        """
        if state not in RUN_STATES:
            raise UsageError(f"unknown run state {state!r}")
        with self._write() as s:
            run = self._get_run(s, run_id)
            if run.state != expect:
                raise Conflict(f"run {run_id!r} is {run.state}, not {expect}")
            self._event(s, "state", run_id=run_id, reason=reason, previous=run.state, state=state, **detail)
            run.state, run.updated_at = state, self._clock()
            return _row(run)

    def report_progress(self, run_id: str, progress: Progress) -> dict[str, Any]:
        """Record a progress report from a run's peers; returns the run's row.

        Reports come from several peers and may arrive out of order, so the run's step only
        moves forward. An event is written when the step advances or the report carries an
        evaluation loss or a snapshot, so repeated reports of one step do not grow the table.
        """
        with self._write() as s:
            run = self._get_run(s, run_id)
            advanced = run.step is None or progress.step > run.step
            if advanced:
                run.step = progress.step
            for key in ("loss", "samples_per_second", "peers"):
                value = getattr(progress, key)
                if value is not None:
                    setattr(run, key, value)
            newer_snapshot = progress.snapshot_step is not None and (
                run.snapshot_step is None or progress.snapshot_step >= run.snapshot_step
            )
            if newer_snapshot:
                run.snapshot_url, run.snapshot_step = progress.snapshot_url, progress.snapshot_step
            if progress.eval_loss is not None and (run.eval_step is None or progress.eval_step >= run.eval_step):
                run.eval_step, run.eval_loss = progress.eval_step, progress.eval_loss
            if progress.cursor is not None and progress.step >= (run.step or 0):  # an older step's cursor is not kept
                run.accounting = dict(progress.cursor)
            run.progress_at = run.updated_at = self._clock()
            if advanced or progress.loss is not None or newer_snapshot or progress.eval_loss is not None:
                # the cursor's summary is kept on the run, not in every event (the events table grows with each step)
                detail = {k: v for k, v in vars(progress).items() if v is not None and k != "cursor"}
                self._event(s, "progress", run_id=run_id, **detail)
            return _row(run)

    # Workers and assignments

    def register_worker(self, reg: Registration, *, owner: str) -> dict[str, Any]:
        """Record a worker (new, or an agent restarted on it); returns ``{"worker", "assignment"}``
        like ``heartbeat`` (an agent restarted while its peer trains learns its run back).

        Who may register which worker id is the API's check (``worker_owner``), not the registry's.
        """
        now = self._clock()
        with self._write() as s:
            worker = s.scalar(select(_Worker).where(_Worker.worker_id == reg.worker_id))
            if worker is None:
                worker = _Worker(worker_id=reg.worker_id, owner=owner, registered_at=now, resident_present=False)
                s.add(worker)
            worker.hostname, worker.resources, worker.last_seen = reg.hostname, reg.resources.to_json(), now
            self._event(s, "register", worker_id=reg.worker_id, hostname=reg.hostname)
            s.flush()
            return {"worker": _row(worker), "assignment": self._assignment_of(s, reg.worker_id)}

    def worker_owner(self, worker_id: str) -> str | None:
        """The user who registered the worker, or None if it is not registered."""
        with self._read() as s:
            return s.scalar(select(_Worker.owner).where(_Worker.worker_id == worker_id))

    def heartbeat(self, worker_id: str, beat: Heartbeat) -> dict[str, Any]:
        """Record an agent's heartbeat; returns ``{"worker": row, "assignment": ...}``.

        The assignment (None, or its run id, since, and the run's task, arguments and state)
        is how an agent learns what to run. Raises WorkerNotFound.
        """
        with self._write() as s:
            worker = self._get_worker(s, worker_id)
            assignment = self._assignment_of(s, worker_id)
            if beat.resident_present != worker.resident_present:
                kind = "resident_return" if beat.resident_present else "resident_leave"
                self._event(s, kind, run_id=assignment and assignment["run_id"], worker_id=worker_id)
            worker.resident_present, worker.last_seen = beat.resident_present, self._clock()
            if beat.resources is not None:
                worker.resources = beat.resources.to_json()
            return {"worker": _row(worker), "assignment": assignment}

    @staticmethod
    def _get_worker(session: Session, worker_id: str) -> _Worker:
        worker = session.scalar(select(_Worker).where(_Worker.worker_id == worker_id))
        if worker is None:
            raise WorkerNotFound(f"no worker {worker_id!r} registered")
        return worker

    @staticmethod
    def _assignment_of(session: Session, worker_id: str) -> dict[str, Any] | None:
        pair = session.execute(
            select(_Assignment, _Run).join(_Run, _Run.run_id == _Assignment.run_id).where(_Assignment.worker_id == worker_id)
        ).first()
        if pair is None:
            return None
        assignment, run = pair
        return {"run_id": run.run_id, "since": assignment.since, "task": run.task, "task_args": run.task_args, "state": run.state}

    def workers(self) -> list[dict[str, Any]]:
        """Every worker's row with ``run_id``: the run it is assigned to, or None."""
        with self._read() as s:
            assigned = {w: r for w, r in s.execute(select(_Assignment.worker_id, _Assignment.run_id))}
            return [
                {**_row(w), "run_id": assigned.get(w.worker_id)}
                for w in s.scalars(select(_Worker).order_by(_Worker.worker_id))
            ]

    def assign(self, worker_id: str, run_id: str, *, reason: str = "place") -> dict[str, Any]:
        """Give a worker to a run (a placement action); returns the assignment.

        Raises:
            WorkerNotFound; RunNotFound; Conflict: the worker is in a run already (invariant 9),
            or the run is not in a state that takes workers (pending, running, paused).
        """
        try:
            with self._write() as s:
                self._get_worker(s, worker_id)
                run = self._get_run(s, run_id)
                if run.state not in ACTIVE_STATES:
                    raise Conflict(f"run {run_id!r} is {run.state}: it takes no workers")
                held = s.scalar(select(_Assignment.run_id).where(_Assignment.worker_id == worker_id))
                if held is not None:
                    raise Conflict(f"worker {worker_id!r} is assigned to run {held!r}")
                assignment = _Assignment(worker_id=worker_id, run_id=run_id, since=self._clock())
                s.add(assignment)
                self._event(s, "assign", run_id=run_id, worker_id=worker_id, reason=reason)
                s.flush()
                return _row(assignment, exclude=())
        except IntegrityError as e:  # the primary key refused a second assignment
            raise Conflict(f"worker {worker_id!r} is assigned already") from e

    def unassign(self, worker_id: str, *, reason: str = "release") -> str | None:
        """End a worker's assignment (release, preempt, resident_return, ...); returns the run it
        left, or None when it had none (a repeated release is harmless)."""
        with self._write() as s:
            assignment = s.get(_Assignment, worker_id)
            if assignment is None:
                return None
            s.delete(assignment)
            s.execute(update(_Certificate)
                      .where(_Certificate.run_id == assignment.run_id, _Certificate.worker_id == worker_id,
                             _Certificate.released_at.is_(None))
                      .values(released_at=self._clock()))
            self._event(s, "unassign", run_id=assignment.run_id, worker_id=worker_id, reason=reason)
            return assignment.run_id

    # Isolation: owner keys, specs, certificates

    def owner_key(self, run_id: str) -> bytes:
        """The run's owner key (private, DER). Raises RunNotFound."""
        with self._read() as s:
            key = s.scalar(select(_RunKey.owner_key).where(_RunKey.run_id == run_id))
            if key is None:
                raise RunNotFound(f"no run {run_id!r} in this pool")
            return self._seal.open(key)

    def certify(self, run_id: str, worker_id: str, peer_id: str) -> dict[str, Any]:
        """Record a certificate for ``peer_id``, the peer ``worker_id`` starts in ``run_id``; returns the run's
        ``owner_key`` and ``signed_spec`` (None before its first start) to issue it with.

        Raises:
            RunNotFound; AccessRefused: the worker is not assigned to the run, or the peer id is another worker's;
            Conflict: the peer id was released from the run (its certificate is revoked for good).
        """
        with self._write() as s:
            key = s.get(_RunKey, run_id)
            if key is None:  # a run submitted to a coordinator older than its keys: it gets one now
                self._get_run(s, run_id)
                from swarmrun.coordinator.owner import new_owner_key

                key = _RunKey(run_id=run_id, owner_key=self._seal.seal(new_owner_key()))
                s.add(key)
            held = s.scalar(select(_Assignment.run_id).where(_Assignment.worker_id == worker_id))
            if held != run_id:
                raise AccessRefused(f"worker {worker_id!r} is not assigned to run {run_id!r}: no certificate")
            cert = s.get(_Certificate, (run_id, peer_id))
            if cert is not None and cert.worker_id != worker_id:
                raise AccessRefused(f"peer {peer_id} is another worker's")
            if cert is not None and cert.released_at is not None:
                raise Conflict(f"peer {peer_id} was released from run {run_id!r}: each assignment starts a new peer id")
            if cert is None:
                s.add(_Certificate(run_id=run_id, peer_id=peer_id, worker_id=worker_id, issued_at=self._clock()))
                self._event(s, "certify", run_id=run_id, worker_id=worker_id, peer_id=peer_id)
            return {"owner_key": self._seal.open(key.owner_key),
                    "signed_spec": key.signed_spec and bytes(key.signed_spec)}

    def set_spec(self, run_id: str, signed_spec: bytes) -> bytes:
        """Keep a run's signed spec unless it has one; returns the one kept (the first: a run has one spec)."""
        with self._write() as s:
            key = s.get(_RunKey, run_id)
            if key is None:
                raise RunNotFound(f"no run {run_id!r} in this pool")
            if key.signed_spec is None:
                key.signed_spec = signed_spec
            return bytes(key.signed_spec)

    def released_certificates(self) -> list[dict[str, Any]]:
        """Every certificate whose worker was released (``run_id``, ``peer_id``, ``released_at``): what the runs'
        revocation lists are made of (``owner.due_revocations``)."""
        with self._read() as s:
            query = select(_Certificate).where(_Certificate.released_at.is_not(None)).order_by(_Certificate.run_id)
            return [_row(c, exclude=()) for c in s.scalars(query)]

    def pool(self) -> PoolRows:
        """Runs, workers and assignments in one consistent read: what placement plans from."""
        with self._read() as s:
            return PoolRows(
                runs=tuple(_row(r) for r in s.scalars(select(_Run).order_by(_Run.id))),
                workers=tuple(_row(w) for w in s.scalars(select(_Worker).order_by(_Worker.id))),
                assignments=tuple(_row(a, exclude=()) for a in s.scalars(select(_Assignment).order_by(_Assignment.worker_id))),
            )

    # Events

    def events(self, *, since: int = 0, limit: int = 500, run_id: str | None = None) -> list[dict[str, Any]]:
        """Events with an id above ``since`` (a cursor: pass the last id you saw), oldest first."""
        with self._read() as s:
            query = select(_Event).where(_Event.id > since).order_by(_Event.id).limit(limit)
            if run_id is not None:
                query = query.where(_Event.run_id == run_id)
            return [_row(e, exclude=()) for e in s.scalars(query)]
