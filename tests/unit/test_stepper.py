"""The step thread (``node.peer.stepper``): every optimizer step of a peer on one thread of its own, warmed up."""

import asyncio
import threading

import torch

from swarmrun.node.peer.stepper import StepThread, _probe, warm_up


def test_warm_up_finds_two_runs_that_agree():
    assert warm_up() == 0  # in a bare process the first run already agrees with the next
    assert torch.equal(_probe(), _probe()) and torch.isfinite(_probe()).all()


def test_steps_run_in_order_on_one_thread_that_does_nothing_else():
    stepper = StepThread()
    seen = []

    async def main():
        for i in range(3):
            await stepper.run(lambda k: seen.append((k, threading.current_thread().name)), i)
        return await stepper.run(sum, [1, 2, 3])

    try:
        assert asyncio.run(main()) == 6
    finally:
        stepper.close()
    assert [k for k, _ in seen] == [0, 1, 2]
    names = {name for _, name in seen}
    assert len(names) == 1 and names.pop().startswith("swarmrun-step")


def test_the_trainer_applies_and_replays_steps_on_its_step_thread():
    """Commits (``_apply_step``, solo or not) and replayed step records go through ``Trainer.stepper``."""
    import inspect

    from swarmrun.node.peer import catchup, trainer

    source = inspect.getsource(trainer.Trainer)
    assert "asyncio.to_thread(self._apply_step" not in source and source.count("self.stepper.run(self._apply_step") == 2
    assert "self.stepper.run(self._optimizer_step" in source
    assert "to_thread(self.replay" not in inspect.getsource(catchup.CatchUp)
