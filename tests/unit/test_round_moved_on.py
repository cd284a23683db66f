"""A round still looking for a group gives up as soon as the swarm commits its step without it; a round whose group
formed (all-reduce running) is never left half-way by that rule."""

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage

from swarmrun.node.peer.rounds import RoundRunner, SwarmMovedOn


class Control:
    """Stands in for hivemind's StepControl: an awaitable that resolves when told, a stage, and cancel()."""

    def __init__(self, stage):
        self.stage, self.cancelled = stage, False
        self.future = asyncio.get_running_loop().create_future()

    def __await__(self):
        return self.future.__await__()

    def cancel(self) -> bool:
        self.cancelled = True
        return self.future.cancel()


def _runner(moved_on) -> RoundRunner:
    return RoundRunner(averager=None, dht=None, spec=None, gate=None, config=SimpleNamespace(averaging_timeout=30.0),
                       subkey=b"", live=lambda: 2, moved_on=moved_on, stop_requested=asyncio.Event())


async def test_matchmaking_gives_up_once_the_swarm_moved_past_the_step():
    ahead = asyncio.Event()
    control = Control(AveragingStage.LOOKING_FOR_GROUP)
    runner = _runner(ahead.is_set)
    asyncio.get_running_loop().call_later(0.3, ahead.set)
    with pytest.raises(SwarmMovedOn):
        await asyncio.wait_for(runner._outcome(control), 5)
    assert control.cancelled


async def test_a_running_allreduce_is_awaited_even_when_the_swarm_looks_ahead():
    control = Control(AveragingStage.RUNNING_ALLREDUCE)
    runner = _runner(lambda: True)
    asyncio.get_running_loop().call_later(0.6, control.future.set_result, "outcome")
    assert await asyncio.wait_for(runner._outcome(control), 5) == "outcome"
    assert not control.cancelled


async def test_a_round_that_forms_is_not_cancelled_while_the_swarm_is_level():
    control = Control(AveragingStage.LOOKING_FOR_GROUP)
    runner = _runner(lambda: False)
    asyncio.get_running_loop().call_later(0.4, control.future.set_result, "outcome")
    assert await asyncio.wait_for(runner._outcome(control), 5) == "outcome"
    assert not control.cancelled


async def test_blocks_claimed_in_the_last_round_stay_out_of_reach_only_while_their_holder_lives_at_that_state():
    from swarmrun.protocol.cursor import DataCursor, RangeSet

    runner = _runner(lambda: False)
    cursor = DataCursor.new(seed=1, num_examples=800, block_size=8)
    held = {"big": RangeSet.from_items([1, 2, 3]), "gone": RangeSet.from_items([9])}
    runner._held_elsewhere = (3, cursor.applied, held)
    assert runner.held_elsewhere(cursor, 3, {"big": 0, "gone": 0}) == RangeSet.from_items([1, 2, 3, 9])
    assert runner.held_elsewhere(cursor, 3, {"big": 0}) == RangeSet.from_items([1, 2, 3])  # one gone holds none
    assert runner.held_elsewhere(cursor, 4, {"big": 0}) == RangeSet()  # another step
    assert runner.held_elsewhere(cursor.apply([5]), 3, {"big": 0}) == RangeSet()  # another state at that step number
