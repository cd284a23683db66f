"""A trainer alone takes the whole step: CI's pool run had its two trainers' last round agree on a plan, then one
left (its agent's resident came back); once its report expired, the plan still held it (a member of the round
that committed the step is planned whatever the view says), so the other's part stayed 24 of 64, it never reached
the target it needs to commit alone, and it abandoned 51 rounds ("no other trainer is live") and exited 3."""

from types import SimpleNamespace

from swarmrun.node.peer.trainer import Trainer
from swarmrun.protocol.plan import StepPlan
from swarmrun.protocol.round import ProgressReport, Role, SwarmView


def trainer(alone: bool) -> Trainer:
    t = object.__new__(Trainer)
    t.peer_id, t.samples, t.floor, t.spent_at = "me", 24, 0, 0.0
    t.state = SimpleNamespace(step=1787)
    mine = ProgressReport(step=1787, samples=24, samples_per_second=1.0, role=Role.TRAINER, state_hash="h", time=0.0)
    t.reporter = SimpleNamespace(view=SwarmView(reports={"me": mine}))
    t._plan = lambda: StepPlan(target=64, quotas={"gone": 40, "me": 24})  # the last round's plan, "gone" left
    t._target = lambda: 64
    t._alone = lambda: alone
    return t


def test_a_trainer_alone_takes_the_whole_step():
    assert trainer(alone=False)._my_quota() == 24  # the plan's part while another trainer may bring the rest
    assert trainer(alone=True)._my_quota() == 64
