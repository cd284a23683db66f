"""The averager's admission decision, without processes: spec and step, access, suspects, the norm range."""

import collections

from swarmrun.node.peer.averaging import NORM_HISTORY, RoundAverager
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.round import RoundMeta

SPEC = "ab" * 32


def _averager(step=4):
    avg = RoundAverager.__new__(RoundAverager)  # the decision only: no DHT, no averager process
    avg.spec_hash, avg.gate, avg._suspects, avg._round_step = SPEC, None, {}, step
    avg._recent_norms = collections.deque(maxlen=NORM_HISTORY)
    return avg


def _meta(norm=1.0, step=4, spec=SPEC):
    return RoundMeta(spec_hash=spec, step=step, samples=8, blocks=RangeSet.from_items([0]), data_epoch=0,
                     grad_norm=norm)


def test_admission_spec_step_suspects_and_norm_range():
    avg = _averager()
    assert avg._admission("QmA", _meta()) is None
    assert "spec" in avg._admission("QmA", _meta(spec="cd" * 32))
    assert "step" in avg._admission("QmA", _meta(step=3))
    avg._suspects["QmB"] = 9
    assert "declared norm" in avg._admission("QmB", _meta())
    avg._round_step = 10  # the suspicion lapses
    assert avg._admission("QmB", _meta(step=10)) is None
    # with a history of norms around 1, a declared norm 100 times larger is refused; 5 times is fine
    avg._recent_norms.extend([1.0, 0.9, 1.1] * 10)
    assert "far above" in avg._admission("QmC", _meta(norm=100.0, step=10))
    assert avg._admission("QmC", _meta(norm=5.0, step=10)) is None


def test_a_reducer_takes_only_parts_in_the_runs_codec_and_shape():
    """A sender's part must be in the spec's codec (its wire compression type and dtype) and of its part's shape;
    the declared norm bounds the decoded part with the codec's rounding as slack."""
    import torch
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from swarmrun.node.peer import codecs
    from swarmrun.node.peer.averaging import ExactAllReduceRunner

    codecs.install_codecs()
    part = torch.randn(5000)
    runner = ExactAllReduceRunner.__new__(ExactAllReduceRunner)  # the check only: no P2P, no group
    runner.compression, runner.part_infos = codecs.make_codec("8bit"), (CompressionInfo.from_tensor(part),)
    runner.parts_for_local_averaging, runner.declared_norms = (part,), (float(part.norm()),)
    message = runner.compression.compress(part, runner.part_infos[0])
    decoded = deserialize_torch_tensor(message)
    assert runner._plausible(0, 0, (message.compression, message.dtype), decoded)
    assert not runner._plausible(0, 0, (runtime_pb2.NONE, "float32"), part)  # fp32 in an 8-bit run
    assert not runner._plausible(0, 0, (message.compression, message.dtype), decoded[:10])
    assert not runner._plausible(0, 1, (message.compression, message.dtype), decoded)  # no such part
    assert not runner._plausible(0, 0, (message.compression, message.dtype), None)  # did not decode
    runner.compression = codecs.make_codec("bf16")  # rounding may grow the norm a little: within the slack
    message = runner.compression.compress(part, runner.part_infos[0])
    assert runner._plausible(0, 0, (message.compression, message.dtype), deserialize_torch_tensor(message))
    assert not runner._plausible(0, 0, (message.compression, message.dtype), 2 * part)


def test_a_matchmaking_lock_held_at_every_round_start_for_a_minute_is_replaced(monkeypatch):
    """hivemind's matchmaking can keep a lock for good (an abandoned join handler or search): the peer is then never
    joined. A lock held at every round start for MATCHMAKING_WEDGED_S gets a fresh Matchmaking; one released in
    between, or held for less, does not."""
    import asyncio
    import types

    from swarmrun.node.peer import averaging

    made = []
    monkeypatch.setattr(averaging, "Matchmaking", lambda *args, **kwargs: made.append((args, kwargs)) or "fresh")
    lock = asyncio.Lock()
    asyncio.run(lock.acquire())
    wedged = types.SimpleNamespace(lock_request_join_group=lock, lock_looking_for_group=asyncio.Lock(),
                                   current_followers={}, current_leader=None,
                                   assembled_group=types.SimpleNamespace(done=lambda: False), step_control=None)
    avg = _averager()
    avg._matchmaking, avg._matchmaking_held_since, avg._matchmaking_held = wedged, None, set()
    avg._p2p, avg.schema_hash, avg.dht, avg.client_mode = "p2p", b"schema", "dht", False
    avg.matchmaking_kwargs = dict(prefix="run", min_matchmaking_time=1.0)
    wait = averaging.MATCHMAKING_WEDGED_S
    for now in (100.0, 100.0 + wait / 2, 100.0 + wait - 1):
        avg._watch_matchmaking(now)
        assert avg._matchmaking is wedged and not made
    lock.release()  # released in between (the other lock held instead): the count starts again
    asyncio.run(wedged.lock_looking_for_group.acquire())
    avg._watch_matchmaking(100.0 + wait + 1)
    assert avg._matchmaking is wedged and not made
    wedged.lock_looking_for_group.release()
    asyncio.run(lock.acquire())
    avg._watch_matchmaking(200.0)
    avg._watch_matchmaking(200.0 + wait - 1)
    assert avg._matchmaking is wedged and not made
    avg._watch_matchmaking(200.0 + wait)
    assert avg._matchmaking == "fresh"
    assert made == [(("p2p", b"schema", "dht"), dict(client_mode=False, prefix="run", min_matchmaking_time=1.0))]
    # a search still running for a step that is over (cancelled: the swarm moved on) is replaced at the next round's
    # start at once: it led groups with the old step's metadata under the new step's key
    running = types.SimpleNamespace(lock_request_join_group=asyncio.Lock(), lock_looking_for_group=asyncio.Lock(),
                                    step_control=types.SimpleNamespace(done=lambda: False))
    avg._matchmaking, avg._matchmaking_held_since = running, None
    avg._watch_matchmaking(300.0)
    assert avg._matchmaking is running and len(made) == 1  # this round's own search (not over) is left alone
    over = types.SimpleNamespace(lock_request_join_group=asyncio.Lock(), lock_looking_for_group=asyncio.Lock(),
                                 step_control=types.SimpleNamespace(done=lambda: True))
    avg._matchmaking = over
    avg._watch_matchmaking(300.0)
    assert avg._matchmaking == "fresh" and len(made) == 2
