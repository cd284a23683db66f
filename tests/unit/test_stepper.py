"""The step thread (``node.peer.stepper``): every optimizer step of a peer on one thread of its own, warmed up."""

import asyncio
import threading

import torch

from swarmrun.node.peer import stepper as stepper_mod
from swarmrun.node.peer.stepper import StepThread, _probe, warm_up


def test_warm_up_runs_until_two_runs_agree(monkeypatch):
    a, b = torch.zeros(3), torch.ones(3)
    runs = iter([a, b, a, a, b])
    monkeypatch.setattr(stepper_mod, "_probe", lambda: next(runs))
    assert warm_up() == 2  # a≠b, b≠a, then a = a
    monkeypatch.setattr(stepper_mod, "_probe", lambda: torch.rand(3))
    assert warm_up(runs=4) == 4  # never agreed: bounded
    assert torch.equal(_probe(), _probe()) and torch.isfinite(_probe()).all()  # the real probe is deterministic


def test_the_warm_up_runs_on_the_step_thread_before_its_first_step_and_only_once(monkeypatch):
    calls = []
    monkeypatch.setattr(stepper_mod, "warm_up", lambda: calls.append(("warm", threading.current_thread().name)) or 1)
    stepper = StepThread()

    async def main():
        for i in range(2):
            await stepper.run(lambda k: calls.append((k, threading.current_thread().name)), i)

    try:
        asyncio.run(main())
    finally:
        stepper.close()
    assert [c for c, _ in calls] == ["warm", 0, 1] and len({name for _, name in calls}) == 1


def test_a_failed_warm_up_does_not_stop_the_steps(monkeypatch):
    monkeypatch.setattr(stepper_mod, "warm_up", lambda: 1 / 0)
    stepper = StepThread()
    try:
        assert asyncio.run(stepper.run(sum, [1, 2])) == 3
    finally:
        stepper.close()


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
