"""A run's length and its schedule from the user's side: ``--set``/flags, ``make_task``, and a schedule stepped on
the run's evaluation (``OnEvaluation``)."""

from __future__ import annotations

import pytest
import torch

import swarmrun
from swarmrun.node.api import OnEvaluation
from swarmrun.node.cli.main import build_parser
from swarmrun.node.peer.build import initial_state, make_spec
from swarmrun.node.state.run import _plain
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.errors import UsageError


def spec_from(sets, cls=SyntheticTask):
    return make_spec(run_id="r", task_cls=cls, sets=sets, seed=1, owner_key=b"k")[0]


def test_sets_choose_the_length():
    assert set(spec_from({}).hparams) == set(SyntheticTask.hparam_defaults)  # no new key: the same spec hash
    by_epochs = spec_from({"epochs": "2"})
    assert "total_steps" not in by_epochs.hparams and by_epochs.total_samples == 2 * by_epochs.num_examples
    assert spec_from({"total_samples": "100"}).total_samples == 100
    for bad in ({"epochs": "1", "total_steps": "5"}, {"epochs": "0"}, {"total_samples": "1.5"}):
        with pytest.raises(UsageError):
            spec_from(bad)


def test_join_flags_are_the_sets():
    args = build_parser().parse_args(["join", "r", "--task", "synthetic", "--epochs", "1", "--total-samples", "9"])
    assert (args.epochs, args.total_samples) == (1, 9)


def regression(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_make_task_takes_a_sample_budget_and_plans_its_schedule():
    cls = swarmrun.make_task("budget-t", model=lambda: torch.nn.Linear(4, 1), dataset=regression(), loss=mse,
                             hparams={"epochs": 3, "target_batch_size": 16})
    assert "total_steps" not in cls.hparam_defaults
    spec = spec_from({}, cls)
    assert spec.total_samples == 3 * 64 and spec.total_steps == 12
    state = initial_state(spec, cls({}, 1), "cpu")  # the cosine schedule's horizon: the planned steps
    lrs = []
    for _ in range(12):
        state.optimizer.step()
        state.scheduler.step()
        lrs.append(state.optimizer.param_groups[0]["lr"])
    assert lrs[-1] == pytest.approx(0.1 * 1e-3)  # decayed to 10% at the planned end
    with pytest.raises(UsageError):
        swarmrun.make_task("budget-u", model=lambda: torch.nn.Linear(4, 1), dataset=regression(), loss=mse,
                           hparams={"epochs": 3, "total_steps": 5})


def plateau_task(held_out):
    return swarmrun.make_task(
        "plateau-t", model=lambda: torch.nn.Linear(4, 1), dataset=regression(), loss=mse,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.25, patience=0, threshold=0),
        evaluate=lambda m: mse(m, held_out).item(), hparams={"eval_every": 2, "total_steps": 10})


def test_a_plateau_schedule_is_stepped_on_the_evaluation_and_travels_with_the_state():
    held_out = next(iter(torch.utils.data.DataLoader(regression(8), batch_size=8)))
    cls = plateau_task(held_out)
    task = cls({}, 0)
    model = task.build_model()
    opt = task.build_optimizer(model, cls.hparam_defaults)
    sched = task.build_scheduler(opt, cls.hparam_defaults)
    assert isinstance(sched, OnEvaluation)
    lrs, calls = [], []
    for step in range(1, 9):
        opt.zero_grad()
        # a gradient that makes things worse from step 3 on: the evaluation stops improving
        (mse(model, held_out) * (1 if step < 3 else -1)).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if step % 2 == 0:
            calls.append(task.evaluate(model, torch.device("cpu")))  # the `eval` event reuses the schedule's
            assert calls[-1] == sched.cached() == pytest.approx(mse(model, held_out).item())
        else:
            assert sched.cached() is None
    assert lrs[:3] == pytest.approx([0.1] * 3) and lrs[3] == pytest.approx(0.025) and lrs[-1] < lrs[3]
    # the schedule's state is msgpack content of the run's state: a joiner continues it
    content = unpack(pack(_plain(sched.state_dict())))
    other = cls({}, 0)
    m2 = other.build_model()
    sched2 = other.build_scheduler(other.build_optimizer(m2, cls.hparam_defaults), cls.hparam_defaults)
    merged = sched2.state_dict()
    merged.update(content)  # as RunState.apply_frozen loads it
    sched2.load_state_dict(merged)
    assert sched2.state_dict() == sched.state_dict()


def test_a_plateau_schedule_needs_an_evaluation():
    cls = swarmrun.make_task("plateau-u", model=lambda: torch.nn.Linear(4, 1), dataset=regression(), loss=mse,
                             scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    task = cls({}, 0)
    with pytest.raises(ValueError, match="evaluate"):
        task.build_scheduler(task.build_optimizer(task.build_model(), cls.hparam_defaults), cls.hparam_defaults)
