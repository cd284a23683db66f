"""Snapshot decisions (pure functions) and the signed records: amendment, pause, snapshot record."""

import hashlib
import math
from dataclasses import replace

import pytest

from swarmrun.protocol.errors import IncompatibleState, RemoteProtocolError, UsageError
from swarmrun.protocol.manifest import build_manifest
from swarmrun.protocol.snapshot import (
    Amendment,
    FailureWatch,
    PauseNote,
    PauseRecord,
    SnapshotPolicy,
    SnapshotRecord,
    amend_changes,
    decide_pause_turn,
    decide_snapshot,
    elect_writer,
    estimate_mtbf,
    parse_every,
    retained,
    writer_candidates,
    young_daly_interval,
)


def fake_sign(data: bytes) -> bytes:
    return b"sig:" + hashlib.sha256(data).digest()


def fake_verify(key: bytes, data: bytes, signature: bytes) -> bool:
    return key == b"owner" and signature == fake_sign(data)


def test_parse_every():
    assert parse_every("5") == (5, None, False)
    assert parse_every("2m") == (None, 120.0, False)
    assert parse_every("30s") == (None, 30.0, False)
    assert parse_every("auto") == (None, None, True)
    for bad in ("0", "-1", "1.5", "5h", "x"):
        with pytest.raises(UsageError):
            parse_every(bad)


def test_young_daly_and_mtbf():
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert estimate_mtbf(failures=0, observed_s=0, prior_s=3600) == 3600
    assert estimate_mtbf(failures=3, observed_s=400, prior_s=400) == 200  # more failures: shorter MTBF


def decide(now, **kw):
    base = dict(step=10, last_step=5, last_time=100.0, policy=SnapshotPolicy(), cost_s=1.0, failures=0,
                observed_s=60.0, elected=True)
    return decide_snapshot(now, **{**base, **kw})


def test_decide_snapshot_policies():
    assert not decide(200.0, elected=False).write
    assert decide(100.0, last_step=None, last_time=None).write  # the first one measures the cost
    assert not decide(200.0, last_step=10).write
    assert decide(100.0, policy=SnapshotPolicy(every_steps=5)).write
    assert not decide(100.0, policy=SnapshotPolicy(every_steps=6)).write
    assert not decide(159.0, policy=SnapshotPolicy(every_seconds=60)).write
    assert decide(160.0, policy=SnapshotPolicy(every_seconds=60)).write
    auto = SnapshotPolicy(auto=True, prior_mtbf_s=3600)
    d = decide(100.0 + 80.0, policy=auto, observed_s=0)  # interval sqrt(2 * 1 * 3600) = 84.9 s
    assert not d.write and d.interval_s == pytest.approx(84.85, abs=0.01) and d.replay_s == pytest.approx(43.4, abs=0.1)
    assert decide(100.0 + 86.0, policy=auto, observed_s=0).write
    # failures observed: a shorter interval, less replayed work
    assert decide(100.0 + 40.0, policy=auto, failures=8, observed_s=0).write


def test_election_and_retention():
    assert elect_writer({"QmB", "QmC"}) == "QmB"
    assert elect_writer(set()) is None
    assert retained([3, 1, 2, 5], 2) == ([5, 3], [2, 1])


def test_only_a_peer_with_a_store_is_elected_unless_the_pause_names_one():
    """README's walkthrough: A has --snapshot-to, B (the lowest peer id) has not. B must never be elected."""
    stores = {"QmA": True, "QmB": False}
    assert writer_candidates(stores, "QmB", i_write=False) == ["QmA"]
    assert elect_writer(writer_candidates(stores, "QmA", i_write=True)) == "QmA"
    assert writer_candidates(stores, "QmB", i_write=False, pause_store="/s") == ["QmA", "QmB"]
    assert writer_candidates({}, "QmC", i_write=True) == ["QmC"]  # its own report not seen yet
    assert writer_candidates({"QmB": False}, "QmB", i_write=False) == []


def _turn(me, notes=(), *, waited=0.0, candidates=("QmA", "QmC"), trainers=("QmA", "QmB", "QmC"), step=67):
    return decide_pause_turn(now=100.0 + waited, since=100.0, me=me, candidates=list(candidates), trainers=trainers,
                             notes=dict(notes), step=step, takeover_s=30.0)


def test_a_paused_peer_leaves_only_once_a_snapshot_of_its_step_exists():
    assert _turn("QmA").action == "write"  # the elected writer writes at once
    assert _turn("QmC").action == "wait" and _turn("QmB").action == "wait"
    written = {"QmA": PauseNote(step=67, left=True, where="store@67")}
    assert _turn("QmB", written).action == "leave" and _turn("QmC", written).action == "leave"
    older = {"QmA": PauseNote(step=66, left=True, where="store@66")}  # a snapshot of an older step is not enough
    assert _turn("QmB", older).action == "wait"


def test_the_next_writer_takes_over_after_a_failure_or_a_silence():
    failed = {"QmA": PauseNote(step=67, left=True, error="disk full")}
    assert _turn("QmC", failed).action == "write"  # at once
    assert _turn("QmB", failed).action == "wait"  # QmC is still ahead of it
    assert _turn("QmC", waited=29.0).action == "wait" and _turn("QmC", waited=30.0).action == "write"
    # a peer without a store comes after every candidate, and writes to its state dir
    assert _turn("QmB", waited=59.0).action == "wait" and _turn("QmB", waited=60.0).action == "write"
    both = {**failed, "QmC": PauseNote(step=67, left=True, error="denied")}
    assert _turn("QmB", both).action == "write"
    # a writer that says it is writing is waited for past the takeover time; one of an older pause counts for nothing
    writing = {"QmA": PauseNote(step=67, left=False)}
    assert _turn("QmC", writing, waited=300.0).action == "wait"
    assert _turn("QmC", {"QmA": PauseNote(step=66, left=False)}, waited=30.0).action == "write"
    assert _turn("QmC", {"QmA": PauseNote(step=66, left=True, error="old")}).action == "wait"
    # every peer failed: nobody waits for ever
    everyone = {p: PauseNote(step=67, left=False, error="full") for p in ("QmA", "QmB", "QmC")}
    assert _turn("QmB", everyone).action == "give_up"
    # no candidate at all (a race with the CLI's check): the peers without a store go in peer-id order
    assert _turn("QmA", candidates=()).action == "write" and _turn("QmB", candidates=()).action == "wait"


def test_failure_watch_counts_vanished_unfinished_trainers():
    class R:
        def __init__(self, finished=False):
            self.finished = finished

    w = FailureWatch(started=0.0)
    w.update(1.0, {"a": R(), "b": R(), "me": R()}, "me")
    w.update(2.0, {"a": R(), "me": R()}, "me")
    w.update(3.0, {"a": R(finished=True), "me": R()}, "me")
    w.update(4.0, {"me": R()}, "me")  # a finished: not a failure
    assert w.failures == 1 and w.observed_s(4.0) == 4.0


def test_amend_changes_only_allowed_keys():
    hp = {"lr": 0.01, "target_batch_size": 64, "total_steps": 50, "block_size": 8}
    assert amend_changes({"lr": "0.5", "total_steps": "80"}, hp) == {"lr": 0.5, "total_steps": 80}
    for bad in ({"block_size": "4"}, {"task": "x"}, {"lr": "fast"}, {"total_steps": "0"}):
        with pytest.raises(UsageError):
            amend_changes(bad, hp)


def test_signed_records_roundtrip_and_verify():
    a = Amendment(step=3, from_spec="a" * 64, to_spec="b" * 64, changes={"lr": 0.1}, time=1.0)
    a = replace(a, signature=fake_sign(a.unsigned_bytes()))
    back = Amendment.decode(a.encode())
    assert back == a
    back.verify(b"owner", fake_verify)
    with pytest.raises(IncompatibleState):
        replace(back, changes={"lr": 9.0}).verify(b"owner", fake_verify)
    p = PauseRecord(run_id="r", spec_hash="c" * 64, at_step=7, store="/x", time=2.0)
    p = replace(p, signature=fake_sign(p.unsigned_bytes()))
    assert PauseRecord.decode(p.encode()) == p and p.verify(b"owner", fake_verify)
    assert not p.verify(b"intruder", fake_verify)
    n = PauseNote(step=7, where="/x@7", state_hash="d" * 64)
    assert PauseNote.decode(n.encode()) == n
    with pytest.raises(RemoteProtocolError):
        Amendment.decode(b"\x81\xa1x\x01")


def test_snapshot_record_roundtrip_and_truncation():
    m = build_manifest(spec_hash="e" * 64, step=4, tensors=[("model/w", "float32", (2,), b"\0" * 8)],
                       content={"x": 1}, chunk_size=4)
    r = SnapshotRecord(manifest=m, signed_spec=b"spec", history=(b"h",), writer="me", written_at=5.0)
    assert SnapshotRecord.decode(r.encode()) == r
    with pytest.raises(RemoteProtocolError):
        SnapshotRecord.decode(r.encode()[:-3])


def test_pause_notes_count_only_from_the_run_s_trainers():
    from swarmrun.protocol.snapshot import PauseNote, trainer_notes

    mine = PauseNote(step=5, left=True, where="/real/store@5")
    forged = PauseNote(step=9, left=True, where="STORE@999")
    notes = {"a": mine, "stranger": forged, "b": PauseNote(step=3, left=True)}
    assert trainer_notes(notes, trainers={"a", "b"}, step=5) == {"a": mine}
    assert trainer_notes(notes, trainers=["a", "b"]) == {"a": mine, "b": notes["b"]}
    assert trainer_notes(notes, trainers=()) == {}
