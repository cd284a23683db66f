"""The baseline process: on the run's data order, or replaying the blocks each of the swarm's steps applied."""

import pytest

from simulations.baseline import _blocks, run_baseline
from swarmrun.protocol.cursor import num_blocks

SETS = {"num_examples": 512, "target_batch_size": 64, "total_steps": 6, "block_size": 8}


def test_replaying_the_data_orders_own_blocks_gives_the_same_bits_and_other_blocks_do_not():
    order = _blocks(5, num_blocks(512, 8))
    steps = [[[b, b + 1] for b in (next(order) for _ in range(8))] for _ in range(6)]
    kwargs = dict(task="synthetic", sets=SETS, seed=5, samples_per_step=[64] * 6, eval_steps=[3, 6])
    plain = run_baseline(**kwargs)
    replayed = run_baseline(**kwargs, blocks_per_step=steps)
    assert replayed["eval"] == plain["eval"] and replayed["samples"] == plain["samples"]
    other = run_baseline(**kwargs, blocks_per_step=[[[8 * k, 8 * k + 8]] for k in range(6)])
    assert other["eval"][6] != plain["eval"][6]


def test_blocks_that_are_not_the_steps_samples_are_refused():
    kwargs = dict(task="synthetic", sets=SETS, seed=5, samples_per_step=[64] * 2, eval_steps=[2])
    with pytest.raises(ValueError, match="holds? 56 samples"):
        run_baseline(**kwargs, blocks_per_step=[[[0, 8]], [[8, 15]]])
    with pytest.raises(ValueError, match="blocks for 1 steps"):
        run_baseline(**kwargs, blocks_per_step=[[[0, 8]]])
