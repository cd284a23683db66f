"""Outer mode (``--set outer=diloco``): its hparams in the spec, the inner batch, the pseudo-gradient and the outer
step, and identical bits from identical inputs (without I/O: the swarm test is in tests/integration)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmrun.node.peer.build import initial_state, make_spec
from swarmrun.node.peer.outer import make_outer_optimizer, pseudo_gradient
from swarmrun.node.state.run import RunState
from swarmrun.node.tasks.synthetic import SyntheticTask
from swarmrun.protocol.cursor import RangeSet
from swarmrun.protocol.errors import RemoteProtocolError, UsageError
from swarmrun.protocol.plan import inner_batch
from swarmrun.protocol.spec import OUTER_DEFAULTS, Spec, amend

pytestmark = pytest.mark.timeout(60)

OUTER = {"outer": "diloco", "inner_steps": "4"}


def spec_from(sets):
    return make_spec(run_id="r", task_cls=SyntheticTask, sets=sets, seed=1, owner_key=b"k")[0]


# ---- the spec -------------------------------------------------------------------------------------------------
def test_default_mode_adds_no_hparam_so_old_specs_keep_their_hash():
    plain, explicit = spec_from({}), spec_from({"outer": "none"})
    assert not set(OUTER_DEFAULTS) & set(plain.hparams)
    assert explicit.hparams == plain.hparams  # outer=none given is the spec it always was
    assert dataclasses.replace(explicit, created_at=plain.created_at).spec_hash() == plain.spec_hash()
    assert plain.outer == "none" and plain.inner_steps == 1


def test_outer_mode_holds_every_outer_hparam_with_the_papers_defaults():
    spec = spec_from(OUTER)
    assert spec.outer == "diloco" and spec.inner_steps == 4
    assert {k: spec.hparams[k] for k in ("outer_lr", "outer_momentum", "outer_nesterov")} == {
        "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
    tuned = spec_from({**OUTER, "outer_lr": "0.5", "outer_momentum": "0.8", "outer_nesterov": "false"})
    assert (tuned.hparams["outer_lr"], tuned.hparams["outer_momentum"], tuned.hparams["outer_nesterov"]) == (
        0.5, 0.8, False)
    assert tuned.spec_hash() != spec.spec_hash()


@pytest.mark.parametrize("sets, match", [
    ({"outer": "diloco"}, "inner_steps"),
    ({"inner_steps": "4"}, "needs --set outer=diloco"),
    ({"outer": "none", "outer_lr": "0.5"}, "needs --set outer=diloco"),
    ({"outer": "streaming", "inner_steps": "4"}, "outer.*must be one of none, diloco"),
    ({**OUTER, "inner_steps": "0"}, "inner_steps"),
    ({**OUTER, "outer_lr": "0"}, "outer_lr"),
    ({**OUTER, "outer_momentum": "1.0"}, "outer_momentum"),
    ({**OUTER, "outer_momentum": "0"}, "outer_nesterov"),  # Nesterov needs momentum
    ({**OUTER, "inner_steps": "two"}, "inner_steps"),
])
def test_bad_outer_hparams_are_refused_clearly(sets, match):
    with pytest.raises(UsageError, match=match):
        spec_from(sets)


def test_a_received_spec_is_checked_alike_and_outer_is_fixed_for_the_run():
    spec = spec_from(OUTER)
    for bad in ({"inner_steps": -1}, {"outer_nesterov": 1}, {"outer": "none"}):
        d = spec.to_dict()
        d["hparams"] = {**d["hparams"], **bad}
        with pytest.raises(RemoteProtocolError):
            Spec.from_dict(d)
    d = spec.to_dict()
    d["hparams"] = {k: v for k, v in d["hparams"].items() if k != "outer_lr"}
    with pytest.raises(RemoteProtocolError, match="outer_lr"):
        Spec.from_dict(d)
    assert amend(spec, outer_lr=0.5, inner_steps=8).inner_steps == 8
    with pytest.raises(UsageError, match="outer is fixed"):
        amend(spec, hparams={k: v for k, v in spec.hparams.items() if k not in OUTER_DEFAULTS})
    with pytest.raises(UsageError, match="outer is fixed"):
        amend(spec_from({}), **{k: v for k, v in spec.hparams.items() if k in OUTER_DEFAULTS})


# ---- the pure parts -------------------------------------------------------------------------------------------
def test_inner_batch_makes_inner_steps_of_a_part():
    assert inner_batch(64, 4) == 16
    assert inner_batch(30, 4) == 8  # rounded up: 4 steps cover the part
    assert inner_batch(3, 8) == 1 and inner_batch(0, 4) == 1  # never an empty step


def test_pseudo_gradient_is_start_minus_local_in_fp32():
    start = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]], dtype=torch.bfloat16)]
    local = [torch.tensor([0.5, 2.5]), torch.tensor([[1.0]], dtype=torch.bfloat16)]
    out = pseudo_gradient(start, local)
    assert torch.equal(out[0], torch.tensor([0.5, -0.5])) and torch.equal(out[1], torch.tensor([[2.0]]))
    assert all(t.dtype == torch.float32 for t in out)


def test_outer_step_is_nesterov_sgd_with_the_papers_defaults():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    opt = make_outer_optimizer(model, spec_from(OUTER).hparams)
    lr, mu = 0.7, 0.9
    w, buf = torch.tensor([[1.0, -1.0]]), None
    for g in (torch.tensor([[0.1, 0.2]]), torch.tensor([[-0.3, 0.05]])):
        model.weight.grad = g.clone()
        opt.step()
        buf = g.clone() if buf is None else mu * buf + g
        w = w - lr * (g + mu * buf)
        assert torch.allclose(model.weight.detach(), w, atol=1e-7)


# ---- identical inputs, identical bits ---------------------------------------------------------------------------
def outer_round(spec, task, blocks_by_peer, *, steps=2):
    """Peers of one state: each takes inner steps on its blocks; their pseudo-gradients are averaged by samples and
    every peer applies the outer step. Returns the states."""
    states = [initial_state(spec, task, "cpu") for _ in blocks_by_peer]
    for _ in range(steps):
        updates, weights = [], []
        for state, blocks in zip(states, blocks_by_peer):
            inner = state.inner
            inner.restart(state.model, base="s", lr=state.scheduler.get_last_lr())
            n = 0
            for b in blocks:
                x, y = task.batch_for_blocks([b], spec.block_size)
                (task.loss(inner.model, (x, y)) * len(x)).backward()
                inner.step(len(x), clip=1.0)
                n += len(x)
            updates.append(inner.pseudo_gradient(state.model))
            weights.append(n)
        averaged = [sum(w * u[i] for w, u in zip(weights, updates)) / sum(weights) for i in range(len(updates[0]))]
        applied = RangeSet.from_items([b for blocks in blocks_by_peer for b in blocks])
        for state in states:
            for p, g in zip(state.model.parameters(), averaged):
                p.grad = g.clone()
            state.optimizer.step()
            state.scheduler.step()
            state.step += 1
            state.cursor = state.cursor.apply(applied)
        blocks_by_peer = [[b + 8 for b in blocks] for blocks in blocks_by_peer]  # the next step's blocks
    return states


def test_identical_inputs_give_every_peer_the_same_state_hash_and_the_outer_state_travels():
    spec = spec_from({**OUTER, "total_steps": "10"})
    task = SyntheticTask({}, 1)
    a, b = outer_round(spec, task, [[0, 1], [2, 3]])
    c, = outer_round(spec, task, [[0, 1], [2, 3]])[:1]
    assert a.step == 2 and a.state_hash() == b.state_hash() == c.state_hash()
    tensors, _ = a.capture()
    names = [n for n, _ in tensors]
    assert any(n.endswith("/momentum_buffer") for n in names)  # the outer optimizer's state is the run's
    assert not any("exp_avg" in n for n in names)  # the inner optimizer's is the peer's own
    # the state transfers (a joiner's apply), its outer momentum included, and hashes alike
    joiner = initial_state(spec, task, "cpu")
    joiner.apply_frozen(a.freeze())
    assert joiner.state_hash() == a.state_hash() and joiner.step == 2
    assert joiner.inner.optimizer.state == {}  # a joiner's inner optimizer starts fresh
    # the scheduled inner learning rate follows the committed step: restarting the joiner's inner model sets it
    joiner.inner.restart(joiner.model, base="s", lr=joiner.scheduler.get_last_lr())
    assert [g["lr"] for g in joiner.inner.optimizer.param_groups] == [g["lr"] for g in a.inner.optimizer.param_groups]
    assert all(torch.equal(x, y) for x, y in zip(joiner.inner.model.parameters(), joiner.model.parameters()))


def test_the_default_mode_state_is_laid_out_as_before():
    spec = spec_from({})
    state = initial_state(spec, SyntheticTask({}, 1), "cpu")
    assert isinstance(state, RunState) and state.inner is None
    assert isinstance(state.optimizer, torch.optim.AdamW) and state.scheduler.optimizer is state.optimizer


def test_the_local_work_of_each_mode():
    """``work.make_work``: accumulated gradients by default; outer mode's inner steps, whose update is the
    pseudo-gradient, go stale when the committed state changes, and restart from it."""
    from types import SimpleNamespace

    from swarmrun.node.peer.work import Accumulate, InnerSteps, make_work

    task, config = SyntheticTask({}, 1), SimpleNamespace(batch_size=8, mixed_precision=False)
    spec = spec_from({**OUTER, "total_steps": "10"})
    state = initial_state(spec, task, "cpu")
    work = make_work(spec=spec, task=task, state=state, device=torch.device("cpu"), config=config)
    assert isinstance(work, InnerSteps) and not work.clips_commit and work.batch(64) == 16
    assert work.stale("h0")
    work.reset("h0")
    assert not work.stale("h0") and work.stale("h1")
    loss, n = work.compute([0, 1, 2])  # 24 samples: one inner step, in batches of 8
    assert n == 24 and work.fields() == {"inner_steps": 1}
    update, divisor = work.update(n)
    assert divisor == 1 and any(bool(u.abs().sum() > 0) for u in update)
    assert all(p.grad is None for p in state.model.parameters())  # the run state's model holds no inner work
    work.reset("h1")
    assert all(float(u.abs().sum()) == 0 for u in work.update(0)[0]) and work.fields() == {"inner_steps": 0}

    plain_spec = spec_from({})
    plain = make_work(spec=plain_spec, task=task, state=initial_state(plain_spec, task, "cpu"),
                      device=torch.device("cpu"), config=config)
    assert type(plain) is Accumulate and plain.clips_commit and not plain.stale("anything")
    plain.compute([0])
    grads, samples = plain.update(8)
    assert samples == 8 and all(g is not None for g in grads)


# ---- overlap (outer_overlap) ----------------------------------------------------------------------------------
def test_outer_overlap_is_an_optional_bool_of_outer_mode_only():
    assert not spec_from(OUTER).outer_overlap and "outer_overlap" not in spec_from(OUTER).hparams  # old specs' hash
    assert spec_from({**OUTER, "outer_overlap": "true"}).outer_overlap
    with pytest.raises(UsageError, match="outer_overlap.*needs outer=diloco"):
        spec_from({"outer_overlap": "true"})
    with pytest.raises(RemoteProtocolError, match="outer_overlap"):  # a received spec is checked alike
        Spec.from_dict({**spec_from(OUTER).to_dict(), "hparams": {**spec_from(OUTER).hparams, "outer_overlap": 1}})


def test_work_computed_during_the_round_moves_onto_the_committed_state_and_nothing_else_does():
    """``InnerSteps.hold`` / ``carry``: the inner steps taken after the round took its pseudo-gradient go on from the
    committed parameters (committed + what they moved); without any, the inner model is the committed one exactly;
    after ``release`` (the round was abandoned) they are dropped and the round's own steps kept."""
    from types import SimpleNamespace

    from swarmrun.node.peer.work import make_work

    task, config = SyntheticTask({}, 1), SimpleNamespace(batch_size=8, mixed_precision=False)
    spec = spec_from({**OUTER, "total_steps": "10", "outer_overlap": "true"})
    state = initial_state(spec, task, "cpu")
    work = make_work(spec=spec, task=task, state=state, device=torch.device("cpu"), config=config)
    work.reset("h0")
    work.compute([0, 1])
    work.hold()  # the round takes its pseudo-gradient here
    sent = [p.detach().clone() for p in state.inner.model.parameters()]
    work.compute([2, 3])  # ahead, during the round
    moved = [p.detach() - s for p, s in zip(state.inner.model.parameters(), sent)]
    assert any(float(m.abs().sum()) > 0 for m in moved) and work.fields() == {"inner_steps": 1}  # the round's step
    with torch.no_grad():  # the commit: some outer step of the run state's model
        for p in state.model.parameters():
            p.add_(0.25)
    work.carry("h1")
    assert not work.stale("h1") and work.fields() == {"inner_steps": 1}  # the step taken ahead counts for the next
    for p, c, m in zip(state.inner.model.parameters(), state.model.parameters(), moved):
        assert torch.allclose(p, c + m, atol=1e-6)
    update, _ = work.update(0)  # the next pseudo-gradient holds the work taken ahead
    assert all(torch.allclose(u, -m, atol=1e-6) for u, m in zip(update, moved))

    work.hold()  # a round, nothing computed during it, a commit: the inner model is the committed one, bit for bit
    with torch.no_grad():
        for p in state.model.parameters():
            p.mul_(0.5).add_(0.1)
    work.carry("h2")
    assert all(torch.equal(p, c) for p, c in zip(state.inner.model.parameters(), state.model.parameters()))

    work.compute([4])
    work.hold()  # abandoned: release puts the inner model back where the round took it, its one step kept
    before = [p.detach().clone() for p in state.inner.model.parameters()]
    work.compute([5])
    assert not all(torch.equal(p, b) for p, b in zip(state.inner.model.parameters(), before))
    work.release()
    assert not work.stale("h2") and work.fields() == {"inner_steps": 1}
    assert all(torch.equal(p, b) for p, b in zip(state.inner.model.parameters(), before))
    work.carry("h3")  # no hold: a plain restart from the committed state
    assert all(torch.equal(p, c) for p, c in zip(state.inner.model.parameters(), state.model.parameters()))


def test_work_ahead_is_carried_only_if_the_commit_left_its_blocks_and_epoch_and_dropped_whole_otherwise():
    """``Ahead.carries`` (after a commit) and ``Trainer._drop_ahead`` (an abandoned round, a failure computing ahead):
    the round's claims and samples come back, the ahead ones go, and the inner model goes back (``release``)."""
    from types import SimpleNamespace

    from swarmrun.node.peer.trainer import Trainer
    from swarmrun.node.peer.work import Ahead
    from swarmrun.protocol.round import Claims

    mine = Claims()
    mine.add([1, 2])
    ahead = Ahead(part=16, data_epoch=0, before=(16, mine.copy()))
    ahead.add([7, 8], 16)
    assert ahead.carries(RangeSet.from_items([1, 2, 3]), 0)  # the round's blocks applied, not the ones ahead
    assert not ahead.carries(RangeSet.from_items([1, 8]), 0)  # one of its blocks was applied in another's part
    assert not ahead.carries(RangeSet.from_items([1, 2]), 1)  # the commit closed the data epoch
    mine.add([7, 8])  # the trainer's claims hold both until the round ends
    released = []
    trainer = SimpleNamespace(ahead=ahead, samples=32, claims=mine, work=SimpleNamespace(release=lambda: released.append(1)))
    Trainer._drop_ahead(trainer)
    assert trainer.ahead is None and trainer.samples == 16 and list(trainer.claims.blocks) == [1, 2] and released
    Trainer._drop_ahead(trainer)  # nothing ahead: nothing to drop
    assert trainer.samples == 16 and released == [1]
