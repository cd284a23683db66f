"""A trainer left out by a fast swarm asks to be planned a step ahead (``CatchUp.left_out``), waits there, and asks
further ahead when the swarm went past its ask; rounds that keep failing end in exit 3, not exit 5 (issue 14)."""

import asyncio
from types import SimpleNamespace

import pytest

from swarmrun.node.peer import catchup as catchup_mod
from swarmrun.node.peer.catchup import CatchUp
from swarmrun.node.peer.trainer import Trainer
from swarmrun.protocol.errors import RoundsFailed
from swarmrun.protocol.round import ProgressReport, Role, SwarmView


def _report(step: int) -> ProgressReport:
    return ProgressReport(step=step, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="h", time=0.0)


def _catch_up(swarm_step: int, my_step: int) -> CatchUp:
    view = SwarmView(reports={"QmOther": _report(swarm_step), "QmMe": _report(my_step)})
    return CatchUp(dht=None, spec=SimpleNamespace(run_id="r"), config=SimpleNamespace(state_timeout=60.0, report_ttl=8.0),
                   events=None, peer_id="QmMe", state=SimpleNamespace(step=my_step), served=None,
                   reporter=SimpleNamespace(view=view), stop_requested=asyncio.Event(), replay=None, record_bytes=1)


def test_an_ask_lies_ahead_of_the_swarm_and_doubles_per_miss():
    up = _catch_up(swarm_step=40, my_step=38)
    assert up.left_out() == 42 and up.waiting()  # two past the swarm's newest step
    up.state.step = 41  # replayed on its way: still waiting
    assert up.waiting() and up.joining == 42
    up.state.step = 42  # at its step: it trains
    assert not up.waiting() and up.joining is None
    # left out again (within a minute): four ahead, then eight, ...
    up.reporter.view = SwarmView(reports={"QmOther": _report(50)})
    assert up.left_out() == 54
    # caught up past its ask (the swarm did not read it in time): it asks again, further ahead, and waits
    up.state.step = 56
    up.reporter.view = SwarmView(reports={"QmOther": _report(56)})
    assert up.waiting() and up.joining == 56 + 8


def test_a_round_with_the_others_ends_the_asks_in_a_row():
    up = _catch_up(swarm_step=10, my_step=10)
    for ahead in (2, 4, 8):  # left out three times while joining
        assert up.left_out() - 10 == ahead
    up.trained()  # then it trained in the swarm's rounds; later (a partition healed) it is left out once more
    up.reporter.view = SwarmView(reports={"QmOther": _report(70)})
    assert up.left_out() == 72  # two ahead again, not sixteen: a slow swarm takes 16 steps in half a minute


def test_asks_stop_after_max_misses_and_when_the_others_are_gone(monkeypatch):
    up = _catch_up(swarm_step=10, my_step=10)
    for _ in range(catchup_mod.MAX_JOIN_MISSES):
        assert up.left_out() is not None
    assert up.joining - 10 == catchup_mod.MAX_JOIN_AHEAD  # capped
    assert up.left_out() is None and not up.waiting()  # it races for rounds again (and gives up after a while)
    lone = _catch_up(swarm_step=10, my_step=10)
    lone.left_out()
    lone.reporter.view = SwarmView(reports={"QmMe": _report(10)})  # no other trainer is live: nothing to wait for
    assert not lone.waiting()


def test_an_asker_holding_the_newest_step_of_a_stalled_swarm_stops_waiting(monkeypatch):
    """CI's smoke trace: the asker's partner left, the last trainer would not step alone and counted the asker out
    while it waited for a step only the two of them could take; the trainer gave up after 50 rounds in 17 s."""
    now = [1000.0]
    monkeypatch.setattr(catchup_mod.time, "monotonic", lambda: now[0])
    up = _catch_up(swarm_step=28, my_step=28)
    assert up.left_out() == 30 and up.waiting()
    now[0] += 5.0
    assert up.waiting()  # within a report TTL: the swarm may just be between steps
    now[0] += 4.0
    assert not up.waiting() and up.joining is None  # 9 s without a step, and it holds the newest: it trains
    behind = _catch_up(swarm_step=28, my_step=25)
    behind.left_out()
    now[0] += 20.0
    assert behind.waiting()  # behind the swarm's newest step: it catches up first (a stall is not its to end)


def test_rounds_abandoned_in_a_row_end_in_exit_3():
    trainer = SimpleNamespace(spent_at=0.0, ready_at=0.0, _drop_ahead=lambda: None, stats={"rounds_abandoned": 0}, failed_rounds=2,
                              state=SimpleNamespace(step=7),
                              config=SimpleNamespace(max_failed_rounds=2),
                              events=SimpleNamespace(emit=lambda *a, **k: None))
    with pytest.raises(RoundsFailed) as caught:
        Trainer._abandon(trainer, "no round formed: SwarmMovedOn: the swarm committed this step before a group formed")
    assert caught.value.exit_code == 3 and "3 rounds in a row" in str(caught.value)

