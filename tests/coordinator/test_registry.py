"""The registry on SQLite and PostgreSQL: what it records, what it refuses, and that it lasts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from swarmrun.coordinator.registry import Registry, User, default_url, token_hash
from swarmrun.protocol.errors import Conflict, WorkerNotFound
from swarmrun.coordinator.schema import Heartbeat, Progress, Registration, Resources, Submission
from swarmrun.protocol.errors import RunNotFound

REPO = Path(__file__).resolve().parents[2]
CUDA = Resources(devices=(("cuda", 80.0),), cpus=16, ram_gib=128.0)


def sub(run_id="big", **kw) -> Submission:
    kw.setdefault("task", "synthetic")
    kw.setdefault("task_args", {"steps": 100})
    return Submission(run_id=run_id, **kw)


def reg(worker_id="w1", resources=CUDA) -> Registration:
    return Registration(worker_id=worker_id, hostname=f"{worker_id}.lab", resources=resources)


def kinds(registry, **kw) -> list[str]:
    return [e["kind"] for e in registry.events(**kw)]


def populate(registry: Registry) -> str:
    """One of everything: a user, runs in several states, workers, an assignment, progress."""
    token = registry.add_user("alice")
    registry.add_user("root", admin=True)
    registry.submit("alice", sub("big", priority=0, min_peers=2, max_peers=6, share=2.0, need_device="cuda",
                                 need_memory_gib=40.0, total_steps=1000))  # fmt: skip
    registry.submit("alice", sub("small", priority=2))
    registry.register_worker(reg("w1"), owner="alice")
    registry.register_worker(reg("w2", Resources(cpus=4)), owner="alice")
    registry.assign("w1", "big")
    registry.set_run_state("big", "running", expect="pending", reason="start")
    registry.report_progress("big", Progress(step=7, loss=2.5, samples_per_second=900.0, peers=1,
                                             snapshot_url="file:///snaps/big", snapshot_step=5))  # fmt: skip
    registry.heartbeat("w2", Heartbeat(resident_present=True))
    registry.user_action("small", "hold", by="alice")
    return token


def test_a_user_is_stored_by_token_hash_never_the_token(registry, db_url):
    token = registry.add_user("alice")
    admin_token = registry.add_user("root", admin=True)
    assert registry.authenticate(token) == User("alice", False)
    assert registry.authenticate(admin_token) == User("root", True)
    assert registry.authenticate(token + "x") is None and registry.authenticate("") is None
    with pytest.raises(Conflict):
        registry.add_user("alice")
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, token_sha256 FROM users ORDER BY name")).all()
    engine.dispose()
    assert rows == [("alice", token_hash(token)), ("root", token_hash(admin_token))]
    assert token not in repr(rows)


def test_submit_records_a_pending_run_and_refuses_a_taken_id(registry, clock):
    registry.add_user("alice")
    row = registry.submit("alice", sub("big", priority=0, min_peers=2, max_peers=6, need_device="cuda"))
    assert row["state"] == "pending" and row["owner"] == "alice" and row["submitted_at"] == clock.now
    assert (row["priority"], row["min_peers"], row["max_peers"], row["need_device"]) == (0, 2, 6, "cuda")
    assert row["task_args"] == {"steps": 100}
    clock.advance()
    registry.submit("alice", sub("small"))
    assert [r["run_id"] for r in registry.runs()] == ["big", "small"]
    with pytest.raises(Conflict):
        registry.submit("alice", sub("big"))
    assert registry.run("big")["workers"] == []
    assert kinds(registry) == ["submit", "submit"]
    with pytest.raises(RunNotFound):
        registry.run("nope")


def test_user_actions_follow_the_run_states(registry):
    registry.add_user("alice")
    registry.submit("alice", sub("r"))
    assert registry.user_action("r", "hold", by="alice")["state"] == "held"
    assert registry.user_action("r", "hold", by="alice")["state"] == "held"  # a retried hold changes nothing
    assert registry.user_action("r", "release", by="alice")["state"] == "pending"
    registry.set_run_state("r", "running", expect="pending", reason="start")
    with pytest.raises(Conflict, match="not .*held|it is running"):
        registry.user_action("r", "release", by="alice")
    assert registry.user_action("r", "cancel", by="alice")["state"] == "cancelled"
    for action in ("hold", "release"):
        with pytest.raises(Conflict):
            registry.user_action("r", action, by="alice")
    with pytest.raises(Conflict):
        registry.set_priority("r", 5, by="alice")
    assert kinds(registry) == ["submit", "hold", "release", "state", "cancel"]


def test_the_loop_cannot_undo_a_users_hold(registry):
    registry.add_user("alice")
    registry.submit("alice", sub("r"))
    registry.user_action("r", "hold", by="alice")  # between the loop's read and its write
    with pytest.raises(Conflict):
        registry.set_run_state("r", "running", expect="pending", reason="start")
    assert registry.run("r")["state"] == "held"


def test_a_worker_is_in_at_most_one_run(registry, db_url):
    registry.add_user("alice")
    for run_id in ("a", "b", "c"):
        registry.submit("alice", sub(run_id))
    registry.register_worker(reg("w1"), owner="alice")
    registry.assign("w1", "a")
    with pytest.raises(Conflict, match="assigned to run 'a'"):
        registry.assign("w1", "b")
    with pytest.raises(WorkerNotFound):
        registry.assign("w9", "a")
    registry.user_action("c", "hold", by="alice")
    assert registry.unassign("w1", reason="preempt") == "a"
    assert registry.unassign("w1") is None  # a repeated release is harmless
    with pytest.raises(Conflict, match="held"):
        registry.assign("w1", "c")
    registry.assign("w1", "b")
    assert registry.run("b")["workers"] == ["w1"] and registry.run("a")["workers"] == []
    assert [e["detail"]["reason"] for e in registry.events() if e["kind"] == "unassign"] == ["preempt"]
    # The database itself refuses a second assignment of a worker, whoever writes it.
    engine = create_engine(db_url)
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("INSERT INTO assignments (worker_id, run_id, since) VALUES ('w1', 'a', 0)"))
    engine.dispose()


def test_heartbeat_records_presence_changes_and_returns_the_assignment(registry, clock):
    registry.add_user("alice")
    registry.submit("alice", sub("r", task_args={"lr": 0.1}))
    first = registry.register_worker(reg("w1"), owner="alice")
    assert first["assignment"] is None and first["worker"]["resident_present"] is False
    registry.assign("w1", "r")
    clock.advance(5)
    beat = registry.heartbeat("w1", Heartbeat(resident_present=False, resources=Resources(cpus=2)))
    assert beat["assignment"] == {"run_id": "r", "since": clock.now - 5, "task": "synthetic",
                                  "task_args": {"lr": 0.1}, "state": "pending"}  # fmt: skip
    assert beat["worker"]["last_seen"] == clock.now and beat["worker"]["resources"]["cpus"] == 2
    registry.heartbeat("w1", Heartbeat(resident_present=True))
    registry.heartbeat("w1", Heartbeat(resident_present=True))  # no change, no event
    registry.heartbeat("w1", Heartbeat(resident_present=False))
    presence = [(e["kind"], e["run_id"]) for e in registry.events() if e["kind"].startswith("resident")]
    assert presence == [("resident_return", "r"), ("resident_leave", "r")]
    with pytest.raises(WorkerNotFound):
        registry.heartbeat("w9", Heartbeat(resident_present=False))
    # An agent restarted on the workstation registers again and learns its run back.
    assert registry.register_worker(reg("w1"), owner="alice")["assignment"]["run_id"] == "r"
    assert [w["worker_id"] for w in registry.workers()] == ["w1"] and registry.workers()[0]["run_id"] == "r"


def test_progress_moves_forward_and_writes_events_only_for_news(registry):
    registry.add_user("alice")
    registry.submit("alice", sub("r"))
    registry.report_progress("r", Progress(step=5, samples_per_second=100.0, peers=2))
    row = registry.report_progress("r", Progress(step=3, peers=3))  # a late report of an older step
    assert (row["step"], row["peers"], row["samples_per_second"]) == (5, 3, 100.0)
    registry.report_progress("r", Progress(step=5))  # a repeat: no event
    registry.report_progress("r", Progress(step=5, loss=1.25))  # an eval loss: an event
    row = registry.report_progress("r", Progress(step=6, snapshot_url="s3://b/r@6", snapshot_step=6))
    row = registry.report_progress("r", Progress(step=6, snapshot_url="s3://b/r@4", snapshot_step=4))
    assert (row["step"], row["loss"], row["snapshot_url"], row["snapshot_step"]) == (6, 1.25, "s3://b/r@6", 6)
    steps = [e["detail"]["step"] for e in registry.events() if e["kind"] == "progress"]
    assert steps == [5, 5, 6]


CURSOR = {"samples_applied": 512, "blocks_applied": 8, "blocks_pending": 24, "blocks_skipped": 0,
          "blocks_duplicated": 1, "data_epoch": 0}


def test_the_newest_eval_loss_and_the_newest_steps_data_accounting_are_kept(registry):
    registry.add_user("alice")
    registry.submit("alice", sub("r"))
    assert (registry.run("r")["eval_loss"], registry.run("r")["accounting"]) == (None, None)
    registry.report_progress("r", Progress(step=10, loss=2.0, cursor=CURSOR))
    registry.report_progress("r", Progress(step=10, eval_step=10, eval_loss=1.75))
    row = registry.report_progress("r", Progress(step=12, eval_step=8, eval_loss=9.0))  # a late eval of an older step
    assert (row["eval_step"], row["eval_loss"], row["loss"]) == (10, 1.75, 2.0)
    row = registry.report_progress("r", Progress(step=11, cursor={**CURSOR, "blocks_applied": 99}))  # an older step's
    assert row["accounting"] == CURSOR
    newer = {**CURSOR, "samples_applied": 768, "blocks_applied": 12, "blocks_pending": 20}
    registry.report_progress("r", Progress(step=12, cursor=newer))
    run = registry.run("r")
    assert run["accounting"] == newer and (run["eval_step"], run["eval_loss"]) == (10, 1.75)
    evals = [(e["detail"]["eval_step"], e["detail"]["eval_loss"]) for e in registry.events() if "eval_loss" in e["detail"]]
    assert evals == [(10, 1.75), (8, 9.0)]  # every evaluation is an event (the plot's points); the run keeps the newest
    assert not any("cursor" in e["detail"] for e in registry.events())  # kept on the run, not in every event
    json.dumps(registry.runs())


def test_an_old_database_gets_the_new_columns_on_open(db_url, clock):
    first = Registry(db_url, clock=clock)
    first.add_user("alice")
    first.submit("alice", sub("r"))
    first.report_progress("r", Progress(step=3, loss=1.0))
    first.close()
    engine = create_engine(db_url)
    with engine.begin() as conn:  # the runs table as a coordinator before eval losses and accounting made it
        for column in ("eval_step", "eval_loss", "accounting"):
            conn.execute(text(f"ALTER TABLE runs DROP COLUMN {column}"))
    engine.dispose()
    second = Registry(db_url, clock=clock)
    assert second.run("r")["step"] == 3 and second.run("r")["accounting"] is None
    row = second.report_progress("r", Progress(step=4, eval_step=4, eval_loss=0.5, cursor=CURSOR))
    assert (row["eval_loss"], row["accounting"]) == (0.5, CURSOR)
    second.close()
    third = Registry(db_url, clock=clock)  # and opened again: nothing more to add
    assert third.run("r")["eval_loss"] == 0.5
    third.close()


def test_events_are_a_cursor_by_id(registry):
    registry.add_user("alice")
    for i in range(5):
        registry.submit("alice", sub(f"r{i}"))
    registry.user_action("r2", "hold", by="alice")
    events = registry.events()
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert [e["run_id"] for e in registry.events(since=ids[2], limit=2)] == ["r3", "r4"]
    assert kinds(registry, run_id="r2") == ["submit", "hold"]
    assert registry.events(since=ids[-1]) == []


def test_pool_gives_plain_rows_for_placement(registry):
    populate(registry)
    pool = registry.pool()
    assert [r["run_id"] for r in pool.runs] == ["big", "small"]
    assert [w["worker_id"] for w in pool.workers] == ["w1", "w2"]
    assert [(a["worker_id"], a["run_id"]) for a in pool.assignments] == [("w1", "big")]
    big = pool.runs[0]
    assert (big["state"], big["share"], big["need_memory_gib"], big["step"]) == ("running", 2.0, 40.0, 7)
    assert pool.workers[0]["resources"] == CUDA.to_json() and pool.workers[1]["resident_present"] is True
    json.dumps([pool.runs, pool.workers, pool.assignments])  # plain rows: JSON all the way down


def test_everything_is_there_after_the_engine_is_disposed_and_reopened(db_url, clock):
    first = Registry(db_url, clock=clock)
    token = populate(first)
    before = (first.pool(), first.events(), first.runs())
    first.close()
    second = Registry(db_url, clock=clock)  # create_all on an existing schema changes nothing
    assert (second.pool(), second.events(), second.runs()) == before
    assert second.authenticate(token) == User("alice", False)
    second.close()


_KILLED_WRITER = """
import json, os, signal, sys
from swarmrun.coordinator.registry import Registry
from swarmrun.coordinator.schema import Registration, Resources, Submission
registry = Registry(sys.argv[1])
token = registry.add_user("alice")
registry.submit("alice", Submission(run_id="r", task="synthetic", task_args={}))
registry.register_worker(Registration(worker_id="w1", hostname="h", resources=Resources()), owner="alice")
registry.assign("w1", "r")
print(json.dumps({"token": token}), flush=True)  # the last write returned: it must be durable
os.kill(os.getpid(), signal.SIGKILL)  # no close, no dispose, no atexit
"""


def test_nothing_committed_is_lost_when_the_writer_is_sigkilled(db_url):
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, db_url], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    token = json.loads(proc.stdout)["token"]
    registry = Registry(db_url)
    assert registry.authenticate(token) == User("alice", False)
    assert registry.run("r")["workers"] == ["w1"]
    assert kinds(registry) == ["submit", "register", "assign"]
    assert len(registry.owner_key("r")) > 1000  # the run's owner key (RSA, DER), made with it, lasts with it
    registry.close()


def test_sqlite_runs_in_wal_mode_with_full_sync(tmp_path):
    registry = Registry(default_url(tmp_path / "state"))
    registry.add_user("alice")
    assert (tmp_path / "state" / "coordinator.db").exists()
    with registry._engine.connect() as conn:  # the pragmas hold on every pooled connection
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    registry.close()


def test_each_run_keeps_its_own_owner_key_through_a_reopen(db_url, clock):
    """Isolation's records last like the rest: the owner key made at submission, the first signed spec."""
    first = Registry(db_url, clock=clock)
    first.add_user("alice")
    first.submit("alice", sub("a"))
    first.submit("alice", sub("b"), owner_key=b"key of b")
    key_a = first.owner_key("a")
    assert key_a != first.owner_key("b") == b"key of b"
    assert first.set_spec("a", b"signed 1") == b"signed 1"
    assert first.set_spec("a", b"signed 2") == b"signed 1"  # a run has one spec: the first signed
    first.close()
    second = Registry(db_url, clock=clock)
    assert second.owner_key("a") == key_a and second.owner_key("b") == b"key of b"
    with pytest.raises(RunNotFound):
        second.owner_key("nope")
    second.close()


def test_owner_keys_are_sealed_in_the_database_under_the_coordinators_state_dir(db_url, clock, tmp_path):
    """The database alone admits no one: what it stores is sealed under a secret in the coordinator's state dir.
    A key an older coordinator stored in the clear is sealed when a coordinator opens the database."""
    from swarmrun.coordinator.owner import SEAL_FILE, KeySeal
    from swarmrun.protocol.errors import SwarmrunError

    old = Registry(db_url, clock=clock)  # a coordinator from before sealing: the key in the clear
    old.add_user("alice")
    old.submit("alice", sub("a"), owner_key=b"0\x82 key of a")
    old.close()
    seal = KeySeal.at(tmp_path / "state")
    assert (tmp_path / "state" / SEAL_FILE).stat().st_mode & 0o777 == 0o600
    first = Registry(db_url, clock=clock, seal=seal)
    first.submit("alice", sub("b"), owner_key=b"0\x82 key of b")
    assert first.owner_key("a") == b"0\x82 key of a" and first.owner_key("b") == b"0\x82 key of b"
    first.close()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        stored = dict(conn.execute(text("SELECT run_id, owner_key FROM run_keys")).all())
    engine.dispose()
    assert set(stored) == {"a", "b"} and all(KeySeal.is_sealed(bytes(v)) for v in stored.values())
    assert not any(b"key of" in bytes(v) for v in stored.values())
    again = Registry(db_url, clock=clock, seal=KeySeal.at(tmp_path / "state"))  # a restart: the same secret
    assert again.owner_key("b") == b"0\x82 key of b"
    again.close()
    for registry, message in ((Registry(db_url, clock=clock, seal=KeySeal.at(tmp_path / "elsewhere")), "another secret"),
                              (Registry(db_url, clock=clock), "sealed")):
        with pytest.raises(SwarmrunError, match=message):
            registry.owner_key("a")
        registry.close()


def test_a_certificate_goes_only_to_an_assigned_worker_and_its_release_revokes_it(registry, clock):
    from swarmrun.protocol.errors import AccessRefused

    registry.add_user("alice")
    registry.submit("alice", sub("r"), owner_key=b"k")
    registry.submit("alice", sub("other"), owner_key=b"k2")
    for w in ("w1", "w2"):
        registry.register_worker(reg(w), owner="alice")
    registry.assign("w1", "r")
    with pytest.raises(AccessRefused):
        registry.certify("r", "w2", "PeerOfW2xxxxxxxxxxxxxxx")  # not assigned to the run
    registry.assign("w2", "other")
    with pytest.raises(AccessRefused):
        registry.certify("r", "w2", "PeerOfW2xxxxxxxxxxxxxxx")  # assigned to another run
    owned = registry.certify("r", "w1", "PeerOfW1xxxxxxxxxxxxxxx")
    assert owned == {"owner_key": b"k", "signed_spec": None}
    assert registry.certify("r", "w1", "PeerOfW1xxxxxxxxxxxxxxx") == owned  # a restarted peer: the same id again
    registry.unassign("w2")
    registry.assign("w2", "r")
    with pytest.raises(AccessRefused):
        registry.certify("r", "w2", "PeerOfW1xxxxxxxxxxxxxxx")  # another worker's peer id
    assert registry.released_certificates() == []
    clock.advance(5)
    registry.unassign("w1", reason="preempt")
    released = registry.released_certificates()
    assert [(c["run_id"], c["peer_id"], c["worker_id"], c["released_at"]) for c in released] == [
        ("r", "PeerOfW1xxxxxxxxxxxxxxx", "w1", clock.now)]
    registry.assign("w1", "r")
    with pytest.raises(Conflict):
        registry.certify("r", "w1", "PeerOfW1xxxxxxxxxxxxxxx")  # released for good: a new assignment, a new id
    registry.certify("r", "w1", "PeerOfW1yyyyyyyyyyyyyyy")
    assert kinds(registry).count("certify") == 2  # one per peer id certified


def test_a_run_submitted_before_owner_keys_gets_one_when_first_certified(registry):
    """A coordinator upgraded on its old database: a run with no key row gets one at its first certificate."""
    from sqlalchemy import delete

    from swarmrun.coordinator.tables import RunKeyRow

    registry.add_user("alice")
    registry.submit("alice", sub("r"), owner_key=b"k")
    registry.register_worker(reg("w1"), owner="alice")
    registry.assign("w1", "r")
    with registry._write() as s:
        s.execute(delete(RunKeyRow))
    owned = registry.certify("r", "w1", "QmPeerOfW1xxxxxxxxxxxxxxxx")
    assert owned["owner_key"] == registry.owner_key("r") != b"k"
    with pytest.raises(RunNotFound):
        registry.certify("nope", "w1", "QmPeerOfW1xxxxxxxxxxxxxxxx")
