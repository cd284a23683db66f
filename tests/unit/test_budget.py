"""The run's length: a step budget (``total_steps``) or a sample budget (``total_samples``, ``epochs``).

The decision is ``protocol.spec.budget_reached`` on the data cursor's ``samples_applied()``; these tests drive it
with runs simulated on the cursor alone (steps of whole blocks, as the round decides them).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet, block_examples, block_order
from swarmrun.protocol.errors import UsageError
from swarmrun.protocol.round import step_target
from swarmrun.protocol.snapshot import amend_changes
from swarmrun.protocol.spec import (Spec, amend, budget_reached, choose_budget, planned_steps, steps_left)

FAST = settings(max_examples=150, deadline=None)
KEY = b"owner-key"
BASE = {"lr": 0.001, "target_batch_size": 64, "block_size": 16}


def spec_of(num_examples=1000, **budget) -> Spec:
    return Spec(run_id="run-1", task="toy", task_version="1.0", task_args={"width": 8, "act": "relu"},
                hparams={**BASE, **budget}, seed=7, data_fingerprint="sha256:abc", num_examples=num_examples,
                owner_key=KEY)


def test_a_step_budget_spec_keeps_its_bytes_and_hash():
    # the hash this spec had before sample budgets existed (computed on the tree before them)
    old = spec_of(total_steps=100)
    assert old.spec_hash() == "b0084cf5667257470d7687d8cb50d9849d32fdc613a87828a4d43dd2a2f82176"
    assert set(unpack(old.unsigned_bytes())["hparams"]) == {*BASE, "total_steps"}
    assert old.total_samples is None and old.total_steps == 100
    new = spec_of(total_samples=5000)
    assert new.spec_hash() != old.spec_hash() and new.total_samples == 5000
    assert Spec.from_dict(unpack(pack(new.to_dict()))) == new


@pytest.mark.parametrize("budget", [{}, {"total_steps": 10, "epochs": 1}, {"total_samples": 10, "epochs": 1},
                                    {"epochs": 0}, {"total_samples": -5}, {"epochs": 1.5}, {"total_steps": True}])
def test_exactly_one_positive_int_budget(budget):
    with pytest.raises(UsageError):
        spec_of(**budget)


def test_epochs_are_whole_passes_and_plan_their_steps():
    spec = spec_of(num_examples=1000, epochs=3)
    assert spec.total_samples == 3000
    assert spec.total_steps == 3 * 16  # 1000 = 15 steps of 64 and one of 40, per epoch
    assert spec_of(total_samples=1000 + 64).total_steps == 16 + 1


def test_choose_budget():
    defaults = {"lr": 1.0, "total_steps": 100}
    assert choose_budget(defaults, set()) == defaults
    assert choose_budget(defaults, {"epochs"}) == {"lr": 1.0, "epochs": 0}  # the value comes from the set
    assert choose_budget({**defaults, "epochs": 2}, set()) == {"lr": 1.0, "epochs": 2}  # a task's own budget
    assert choose_budget({**defaults, "epochs": 2}, {"total_steps"}) == {"lr": 1.0, "total_steps": 100}
    with pytest.raises(UsageError, match="one run length"):
        choose_budget(defaults, {"total_steps", "total_samples"})
    with pytest.raises(UsageError, match="two run lengths"):
        choose_budget({**defaults, "epochs": 2, "total_samples": 9}, set())


def test_amend_replaces_the_budget():
    spec = spec_of(total_steps=100)
    assert amend(spec, total_samples=640).hparams.get("total_steps") is None
    assert amend(amend(spec, epochs=2), total_steps=7).total_steps == 7
    assert amend(spec, lr=0.5).total_steps == 100
    assert amend_changes({"total_samples": "640", "epochs": "2"}, spec.hparams) == {"total_samples": 640, "epochs": 2}


# ---- the cursor's sample count ------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 200), st.integers(1, 40), st.lists(st.sets(st.integers(0, 60), max_size=12), max_size=25))
def test_samples_applied_counts_the_distinct_applied_examples(num_examples, block_size, applies):
    cursor = DataCursor.new(seed=3, num_examples=num_examples, block_size=block_size)
    expected = 0
    seen: set = set()
    for blocks in applies:
        blocks = {b % cursor.num_blocks for b in blocks}
        epoch = cursor.data_epoch
        cursor = cursor.apply(RangeSet.from_items(blocks))
        seen |= blocks
        if cursor.data_epoch != epoch:  # the epoch closed: all its examples counted, a new one starts
            expected += num_examples
            seen = set()
        now = sum(len(block_examples(b, block_size, num_examples)) for b in seen)
        assert cursor.samples_applied() == expected + now
        assert cursor.summary()["samples_applied"] == cursor.samples_applied()


# ---- a run simulated on the cursor --------------------------------------------------------------------------
def exact(spec: Spec) -> bool:
    """Steps hold exactly ``target_batch_size`` samples (an epoch's last one what is left): whole blocks add up to
    the target, and no block is short. Otherwise a step may take up to a block more."""
    return spec.target_batch_size % spec.block_size == 0 and spec.num_examples % spec.block_size == 0


def simulate(spec: Spec) -> list[int]:
    """Steps as the swarm takes them (whole blocks in the data order until ``step_target`` is reached), until
    ``budget_reached``; the samples applied after each step."""
    cursor = DataCursor.new(seed=spec.seed, num_examples=spec.num_examples, block_size=spec.block_size)
    step, after = 0, []
    while not spec.finished(step, cursor):
        left_before = spec.steps_left(step, cursor)
        target, taken, samples = step_target(cursor, spec.target_batch_size), [], 0
        for b in block_order(cursor.seed, cursor.data_epoch, cursor.num_blocks):
            if samples >= target:
                break
            if b not in cursor.applied:
                taken.append(b)
                samples += len(block_examples(b, spec.block_size, spec.num_examples))
        cursor, step = cursor.apply(taken), step + 1
        after.append(cursor.samples_applied())
        if exact(spec):  # the plan counts down one by one
            assert spec.steps_left(step, cursor) == left_before - 1
        assert len(after) < 10_000
    return after


@FAST
@given(num_examples=st.integers(1, 200), block=st.sampled_from([1, 2, 4, 8]), blocks_per_step=st.integers(1, 6),
       total=st.integers(1, 500))
def test_a_sample_budget_ends_with_the_step_that_reaches_it(num_examples, block, blocks_per_step, total):
    spec = Spec(run_id="r", task="toy", task_version="1", task_args={}, seed=5, data_fingerprint="",
                num_examples=num_examples, owner_key=KEY,
                hparams={"target_batch_size": block * blocks_per_step, "block_size": block, "total_samples": total})
    after = simulate(spec)
    assert after[-1] >= total  # reached ...
    assert len(after) == 1 or after[-2] < total  # ... by the last step, not before it
    assert after[-1] - total < spec.target_batch_size + block  # not trimmed: less than a step (and a block) more
    if exact(spec):
        assert len(after) == planned_steps(total, num_examples=num_examples, target_batch_size=spec.target_batch_size)
    assert budget_reached(spec, step=0, samples=after[-1]) and steps_left(spec, step=0, samples=after[-1]) == 0


@FAST
@given(num_examples=st.integers(1, 300), block=st.integers(1, 9), target=st.integers(1, 70), epochs=st.integers(1, 3))
def test_epochs_end_exactly_on_the_budget(num_examples, block, target, epochs):
    spec = Spec(run_id="r", task="toy", task_version="1", task_args={}, seed=5, data_fingerprint="",
                num_examples=num_examples, owner_key=KEY,
                hparams={"target_batch_size": target, "block_size": block, "epochs": epochs})
    after = simulate(spec)
    assert after[-1] == epochs * num_examples  # a data epoch's last step holds only what is left of it


def test_a_step_budget_ignores_samples():
    spec = spec_of(total_steps=3)
    assert not budget_reached(spec, step=2, samples=10**9) and budget_reached(spec, step=3, samples=0)
    assert steps_left(spec, step=1, samples=0) == 2
