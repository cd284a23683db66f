"""The registry's tables (SQLAlchemy's declarative mapping): users, runs, workers, assignments, run keys,
certificates and events. ``registry.Registry`` is their only reader and writer; see there for what each holds."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, LargeBinary, String, Text, inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "UserRow", "RunRow", "WorkerRow", "AssignmentRow", "RunKeyRow", "CertificateRow", "EventRow",
           "add_new_columns", "sqlite_pragmas"]


class Base(DeclarativeBase):
    pass


# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit sequence.
_Id = BigInteger().with_variant(Integer, "sqlite")


class UserRow(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # never the token itself
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)


class RunRow(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(64), ForeignKey("users.name"))
    task: Mapped[str] = mapped_column(String(128))
    task_args: Mapped[dict] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer)
    min_peers: Mapped[int] = mapped_column(Integer)
    max_peers: Mapped[int] = mapped_column(Integer)
    share: Mapped[float] = mapped_column(Float)
    need_device: Mapped[str | None] = mapped_column(String(32))
    need_memory_gib: Mapped[float | None] = mapped_column(Float)
    total_steps: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    submitted_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    snapshot_url: Mapped[str | None] = mapped_column(Text)
    snapshot_step: Mapped[int | None] = mapped_column(BigInteger)
    step: Mapped[int | None] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    samples_per_second: Mapped[float | None] = mapped_column(Float)
    peers: Mapped[int | None] = mapped_column(Integer)
    progress_at: Mapped[float | None] = mapped_column(Float)
    eval_step: Mapped[int | None] = mapped_column(BigInteger)  # the newest held-out evaluation: its step and loss
    eval_loss: Mapped[float | None] = mapped_column(Float)
    accounting: Mapped[dict | None] = mapped_column(JSON)  # the data cursor's summary at the newest reported step


class WorkerRow(Base):
    __tablename__ = "workers"
    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(64), ForeignKey("users.name"))  # who registered it
    hostname: Mapped[str] = mapped_column(String(255))
    resources: Mapped[dict] = mapped_column(JSON)
    resident_present: Mapped[bool] = mapped_column(Boolean, default=False)
    registered_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


class AssignmentRow(Base):
    __tablename__ = "assignments"
    # The primary key is the worker: the database itself keeps a worker in at most one run.
    worker_id: Mapped[str] = mapped_column(String(64), ForeignKey("workers.worker_id"), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id"), index=True)
    since: Mapped[float] = mapped_column(Float)


class RunKeyRow(Base):
    __tablename__ = "run_keys"
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id"), primary_key=True)
    owner_key: Mapped[bytes] = mapped_column(LargeBinary)  # the run owner's private key (DER), sealed (owner.KeySeal)
    signed_spec: Mapped[bytes | None] = mapped_column(LargeBinary)  # the first spec signed for the run


class CertificateRow(Base):
    __tablename__ = "certificates"
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.run_id"), primary_key=True)
    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(64), ForeignKey("workers.worker_id"))
    issued_at: Mapped[float] = mapped_column(Float)
    released_at: Mapped[float | None] = mapped_column(Float)  # its worker's release: revoked revoke_after later


class EventRow(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    time: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    run_id: Mapped[str | None] = mapped_column(String(64))
    worker_id: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict] = mapped_column(JSON)
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)


def add_new_columns(engine) -> None:
    """Columns of ``runs`` added since a database was created (nullable ones only): ``create_all`` makes missing
    tables, not missing columns, and a coordinator upgraded in place opens its old database."""
    have = {c["name"] for c in inspect(engine).get_columns(RunRow.__tablename__)}
    missing = [c for c in RunRow.__table__.columns if c.key not in have]
    if not missing:
        return
    with engine.begin() as conn:
        for column in missing:
            assert column.nullable, f"a new column must be nullable: {column.key}"
            kind = column.type.compile(dialect=engine.dialect)
            conn.exec_driver_sql(f'ALTER TABLE {RunRow.__tablename__} ADD COLUMN "{column.key}" {kind}')


def sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the API read while the loop writes; FULL syncs each commit (durable on power
    # loss too); foreign keys are off by default in SQLite.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
