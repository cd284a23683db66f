"""The snapshot writer as a commit hook, without a swarm: which commits it writes, the auto policy's report."""

from types import SimpleNamespace

import pytest
import torch

from swarmrun.node.peer.build import initial_state, make_spec
from swarmrun.node.peer.snapshots import SnapshotOptions, SnapshotWriter
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.spec import SignedSpec


class Recorder:
    json_mode = True

    def __init__(self):
        self.events = []

    def emit(self, event, **fields):
        self.events.append(dict(event=event, **fields))


def fake_trainer(peer_id="QmB", others=(), stores=True):
    spec, task = make_spec(run_id="w", task_cls=SyntheticTask, sets={}, seed=3, owner_key=b"k")
    state = initial_state(spec, task, "cpu")
    view = SimpleNamespace(trainers={p: SimpleNamespace(finished=False, snapshots=stores or p == peer_id)
                                     for p in (*others, peer_id)})
    return SimpleNamespace(peer_id=peer_id, view=view, state=state, dht=None), SignedSpec(spec=spec, signature=b"s")


async def commit_steps(writer, trainer, steps):
    for step in steps:
        trainer.state.step = step
        with torch.no_grad():
            next(trainer.state.model.parameters()).add_(0.5)
        writer.on_commit(trainer.state.freeze(chunk_size=4096))
        await writer.flush()  # one write at a time: let each finish, as a step's time would


@pytest.mark.parametrize("others, stores, expected", [((), True, [1, 3, 5]), (("QmA",), True, []),
                                                      (("QmA",), False, [1, 3, 5])])
async def test_elected_writer_writes_every_n_steps(tmp_path, others, stores, expected):
    """QmA < QmB: QmA is the elected writer when it has a store; without one, QmB is (it has)."""
    trainer, signed = fake_trainer(others=others, stores=stores)
    events = Recorder()
    writer = SnapshotWriter(trainer, options=SnapshotOptions(store=str(tmp_path / "s"), every="2", keep=10),
                            signed=signed, history=(b"h",), events=events)
    await commit_steps(writer, trainer, range(1, 6))
    assert writer.store.steps() == expected
    assert [e["step"] for e in events.events if e["event"] == "snapshot"] == expected
    if expected:
        assert writer.store.read_record(5).history == (b"h",) and writer.store.read_record(5).writer == "QmB"


@pytest.mark.parametrize("every, fields", [("1", {"every_steps": 1}), ("30s", {"every_s": 30.0})])
async def test_a_fixed_policy_reports_its_cadence_and_one_write_at_a_time(tmp_path, every, fields):
    """--snapshot-every 1 writes only some steps when the swarm steps faster than a write: the writer says so once,
    in its snapshot_policy event (issue 19); a peer that is not the elected writer says nothing."""
    for others, expected in (((), [dict(event="snapshot_policy", **fields, one_write_at_a_time=True)]),
                             (("QmA",), [])):
        trainer, signed = fake_trainer(others=others)
        events = Recorder()
        writer = SnapshotWriter(trainer, options=SnapshotOptions(store=str(tmp_path / every / str(len(others))),
                                                                 every=every, keep=10),
                                signed=signed, history=(b"h",), events=events)
        await commit_steps(writer, trainer, range(1, 4))
        assert [e for e in events.events if e["event"] == "snapshot_policy"] == expected


async def test_auto_policy_reports_interval_and_expected_replay(tmp_path):
    trainer, signed = fake_trainer()
    events = Recorder()
    writer = SnapshotWriter(trainer, options=SnapshotOptions(store=str(tmp_path / "s"), every="auto", keep=2),
                            signed=signed, history=(b"h",), events=events)
    await commit_steps(writer, trainer, range(1, 4))
    assert writer.store.steps() == [1]  # the first measures the cost; Young/Daly then says minutes, not ms
    policy = [e for e in events.events if e["event"] == "snapshot_policy"]
    assert policy and policy[0]["interval_s"] > 1 and policy[0]["expected_replay_s"] >= policy[0]["interval_s"] / 2
    assert policy[0]["cost_s"] == pytest.approx(writer.cost_s)
    # a trainer that vanishes without finishing counts as a failure: a shorter interval
    trainer.view.trainers["QmC"] = SimpleNamespace(finished=False, snapshots=False)
    writer.on_commit(trainer.state.freeze())
    del trainer.view.trainers["QmC"]
    trainer.state.step = 9
    writer.on_commit(trainer.state.freeze())
    await writer.flush()
    assert writer.failures.failures == 1
    policy = [e for e in events.events if e["event"] == "snapshot_policy"]
    assert policy[-1]["failures"] == 1 and policy[-1]["interval_s"] < 0.8 * policy[0]["interval_s"]


def test_pause_record_is_honoured_only_from_the_owner_and_when_current(tmp_path):
    from dataclasses import replace

    from hivemind.utils.timed_storage import get_dht_time

    from swarmrun.node.peer.snapshots import SnapshotSide
    from swarmrun.node.net.swarm import ensure_identity, public_key_bytes
    from swarmrun.protocol.snapshot import PauseRecord

    owner, intruder = ensure_identity(tmp_path / "owner")[1], ensure_identity(tmp_path / "intruder")[1]
    spec, task = make_spec(run_id="w", task_cls=SyntheticTask, sets={}, seed=3, owner_key=public_key_bytes(owner))
    state = initial_state(spec, task, "cpu")
    state.step = 4
    trainer = SimpleNamespace(spec=spec, state=state, commit_hooks=[], config=SimpleNamespace(report_interval=0.5))
    side = SnapshotSide(trainer=trainer, signed=SignedSpec(spec=spec, signature=b""), history=(), events=Recorder())
    side.started_step, side.started_time = state.step, get_dht_time()  # what start() records

    def signed(key, **kw):
        r = PauseRecord(**{**dict(run_id="w", spec_hash=spec.spec_hash(), at_step=5, time=get_dht_time() + 1), **kw})
        return replace(r, signature=bytes(key.sign(r.unsigned_bytes())))

    assert side._honoured(signed(owner))
    assert not side._honoured(signed(intruder))
    assert not side._honoured(replace(signed(owner), at_step=6))  # the signature covers the step
    assert not side._honoured(signed(owner, spec_hash="0" * 64))
    assert not side._honoured(signed(owner, run_id="v"))
    # the pause a resumed run was paused by (older, at or before the state it holds) is history
    assert not side._honoured(signed(owner, at_step=4, time=get_dht_time() - 60))
    assert side._honoured(signed(owner, at_step=5, time=get_dht_time() - 60))


@pytest.mark.parametrize("other_has_store, writes", [(False, True), (True, True)])
async def test_a_peer_with_a_store_writes_as_it_leaves(tmp_path, other_has_store, writes):
    """A (store) leaves while B trains on: A writes its state even when B has a store too (B may be leaving in the
    same second, seeing A still there: a pool handing back both workstations of a run lost 11 steps that way)."""
    from swarmrun.node.peer.snapshots import SnapshotSide

    trainer, signed = fake_trainer(peer_id="QmA", others=("QmB",), stores=other_has_store)
    trainer.state.step = 7
    trainer.frozen = trainer.state.freeze(chunk_size=4096)
    trainer.view.trainers["QmB"].left = False
    trainer.spec, trainer.gate = signed.spec, None
    trainer.dht = SimpleNamespace(is_alive=lambda: False)  # no DHT to read: the last view stands
    events = Recorder()
    writer = SnapshotWriter(trainer, options=SnapshotOptions(store=str(tmp_path / "s"), every="1000"), signed=signed,
                            history=(b"h",), events=events)
    side = SnapshotSide(trainer=trainer, signed=signed, history=(b"h",), events=events, writer=writer)
    await side.close("stopped")
    assert writer.store.steps() == ([7] if writes else [])


def test_the_longest_published_history_that_verifies_is_taken(tmp_path):
    """Each peer republishes the run's amendment history under its signed subkey (issue 14); a reader takes the
    longest one that verifies against the spec, skips one that does not, and fails only when none does."""
    import dataclasses

    from hivemind.utils.timed_storage import get_dht_time

    from swarmrun.node.net.swarm import ensure_identity, public_key_bytes
    from swarmrun.node.peer.snapshots import choose_history
    from swarmrun.protocol.errors import IncompatibleState
    from swarmrun.protocol.snapshot import Amendment
    from swarmrun.protocol.spec import amend

    owner, intruder = ensure_identity(tmp_path / "owner")[1], ensure_identity(tmp_path / "intruder")[1]
    spec0, _ = make_spec(run_id="h", task_cls=SyntheticTask, sets={}, seed=3, owner_key=public_key_bytes(owner))
    spec1 = amend(spec0, lr=0.5)
    spec2 = amend(spec1, lr=0.25)

    def link(key, a, b, step):
        x = Amendment(step=step, from_spec=a.spec_hash(), to_spec=b.spec_hash(), changes={"lr": b.hparams["lr"]},
                      time=get_dht_time())
        return dataclasses.replace(x, signature=bytes(key.sign(x.unsigned_bytes()))).encode()

    good = (link(owner, spec0, spec1, 2), link(owner, spec1, spec2, 5))
    forged = (link(intruder, spec0, spec1, 2), link(intruder, spec1, spec2, 5), link(intruder, spec2, spec2, 9))
    assert choose_history([good[:1], forged, good], spec2) == good  # the stranger's longer one does not verify
    assert choose_history([], spec2) == ()
    with pytest.raises(IncompatibleState):
        choose_history([forged, good[:1]], spec2)  # good[:1] ends at spec1, not at the run's spec


def _paused(swarm_step: dict, step: int):
    """A SnapshotSide paused at ``step`` over a trainer double at ``step``, behind while ``swarm_step["newest"]`` is
    past its step."""
    import asyncio

    from swarmrun.node.peer.snapshots import SnapshotSide
    from swarmrun.protocol.snapshot import PauseRecord

    state = SimpleNamespace(step=step)
    trainer = SimpleNamespace(state=state, spec=SimpleNamespace(run_id="w"), holding=0.0, stop_requested=asyncio.Event(),
                              config=SimpleNamespace(report_interval=0.01, matchmaking_time=0.0),
                              reporter=SimpleNamespace(interval=lambda: 0.01),
                              catchup=SimpleNamespace(behind=lambda: state.step < swarm_step["newest"]))
    side = SnapshotSide(trainer=trainer, signed=None, history=(), events=None)
    side.pause = PauseRecord(run_id="w", spec_hash="0" * 64, at_step=step, time=0.0)
    return side, trainer, state


async def test_a_peer_behind_at_the_pause_step_catches_up_before_it_stops(monkeypatch):
    """A round in flight when the pause came committed one more step without a peer that was behind (CI saw it leave
    a step short of the others): at the pause step it steps no further (``holding``), catches up, then stops. A peer
    that cannot catch up stops after PAUSE_CATCH_UP anyway."""
    import asyncio

    from swarmrun.node.peer import snapshots

    swarm_step = {"newest": 81}
    side, trainer, state = _paused(swarm_step, 80)
    monkeypatch.setattr(snapshots, "PAUSE_SETTLE", 0.05)
    watch = asyncio.ensure_future(side._watch_pause())
    await asyncio.sleep(0.1)
    assert trainer.holding and not trainer.stop_requested.is_set()  # held at 80: no step of its own, only catch-up
    state.step = 81  # the trainer's loop re-synced to the step the others stopped at
    await asyncio.wait_for(watch, 1.0)
    assert trainer.stop_requested.is_set() and state.step == 81

    monkeypatch.setattr(snapshots, "PAUSE_CATCH_UP", 0.05)
    swarm_step["newest"], trainer.holding = 90, 0.0
    trainer.stop_requested.clear()
    await asyncio.wait_for(side._watch_pause(), 1.0)  # no provider answers: it stops where it is, bounded
    assert trainer.stop_requested.is_set() and state.step == 81


async def test_a_peer_that_commits_the_pause_step_holds_before_it_stops(monkeypatch):
    """A commit at the pause step holds the peer (no further round) rather than stopping it: its view is a report
    old, and the others may still commit the round they had in flight when the pause came (CI: a peer left at 76,
    two at 77, and `node pause` reported 76). Not behind, it still holds until the settle time is over; behind, it
    catches up first."""
    import asyncio

    from swarmrun.node.peer import snapshots

    swarm_step = {"newest": 80}
    side, trainer, state = _paused(swarm_step, 80)
    side._on_commit(SimpleNamespace(step=80))
    assert trainer.holding and not trainer.stop_requested.is_set()
    monkeypatch.setattr(snapshots, "PAUSE_SETTLE", 5.0)  # (capped at PAUSE_CATCH_UP / 2: 10 s)
    watch = asyncio.ensure_future(side._watch_pause())
    await asyncio.sleep(0.1)
    assert not watch.done() and not trainer.stop_requested.is_set()  # not behind, but within the settle time
    swarm_step["newest"] = 81  # the others' round in flight committed 81: read within the settle time
    monkeypatch.setattr(snapshots, "PAUSE_SETTLE", 0.0)
    await asyncio.sleep(0.1)
    assert not watch.done() and not trainer.stop_requested.is_set()  # behind: it catches up rather than stopping
    state.step = 81
    await asyncio.wait_for(watch, 5.0)
    assert trainer.stop_requested.is_set()
