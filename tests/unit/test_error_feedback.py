"""The peer's side of error feedback (``node/peer/feedback.py``) and the ``error_feedback`` hyperparameter: the
residual of a committed round goes into the next step's round only; the spec refuses it without a lossy codec."""

import pytest
import torch

from swarmrun.node.peer.feedback import ErrorFeedback
from swarmrun.protocol.errors import UsageError
from swarmrun.protocol.spec import Spec


def loaded(values):
    return [torch.tensor(values, dtype=torch.float32)]


def test_a_committed_rounds_residual_goes_into_the_next_steps_round_only():
    fb = ErrorFeedback(loaded([0.0, 0.0]))
    buffers = loaded([3.0, 4.0])
    assert fb.add_to(buffers, step=7, samples=64) == pytest.approx(5.0)  # nothing carried yet: the gradient's norm
    assert torch.equal(buffers[0], torch.tensor([3.0, 4.0]))

    fb.residuals[0].copy_(torch.tensor([0.5, -1.0]))  # what the averager process wrote during the round at step 7
    fb.committed(7, samples=64)
    fb.residuals[0].zero_()  # the next round's start: the carry is a copy, not the shared buffers
    buffers = loaded([1.0, 1.0])
    assert fb.add_to(buffers, step=8, samples=64) == pytest.approx(float(torch.tensor([1.5, 0.0]).norm()))
    assert torch.equal(buffers[0], torch.tensor([1.5, 0.0]))

    # an abandoned round at step 8 sends its contribution again with the same carry
    buffers = loaded([1.0, 1.0])
    fb.add_to(buffers, step=8, samples=64)
    assert torch.equal(buffers[0], torch.tensor([1.5, 0.0]))

    # a round at step 8 that commits with this peer's claim refused (weight 0): its carry goes on to step 9
    fb.residuals[0].copy_(torch.tensor([9.0, 9.0]))  # what that round's encoding lost, of a contribution not applied
    fb.committed(8, samples=64, delivered=False)
    buffers = loaded([1.0, 1.0])
    fb.add_to(buffers, step=9, samples=64)
    assert torch.equal(buffers[0], torch.tensor([1.5, 0.0]))
    fb.committed(9, samples=64)  # delivered: the residual of step 9's round replaces it
    buffers = loaded([0.0, 0.0])
    fb.add_to(buffers, step=10, samples=64)
    assert torch.equal(buffers[0], torch.tensor([9.0, 9.0]))

    # a round at another step (after a re-sync, a commit alone, a replay) gets none
    for step in (11, 3):
        buffers = loaded([1.0, 1.0])
        fb.add_to(buffers, step=step, samples=64)
        assert torch.equal(buffers[0], torch.tensor([1.0, 1.0])), step


def test_the_carry_is_scaled_to_the_samples_of_the_contribution_it_rides_on():
    """A round weighs a contribution by its samples: a residual lost by a part of 64 samples weighs 64/total; carried
    on a part of 256 it must be a quarter as large to deliver the same (and 4 times on a part of 16)."""
    fb = ErrorFeedback(loaded([0.0, 0.0]))
    fb.residuals[0].copy_(torch.tensor([4.0, -8.0]))
    fb.committed(2, samples=64)
    buffers = loaded([0.0, 0.0])
    fb.add_to(buffers, step=3, samples=256)
    assert torch.equal(buffers[0], torch.tensor([1.0, -2.0]))
    buffers = loaded([0.0, 0.0])
    fb.add_to(buffers, step=3, samples=16)
    assert torch.equal(buffers[0], torch.tensor([16.0, -32.0]))
    buffers = loaded([1.0, 1.0])
    fb.add_to(buffers, step=3, samples=0)  # a member that brings nothing carries nothing yet
    assert torch.equal(buffers[0], torch.tensor([1.0, 1.0]))


def spec(**hparams):
    return Spec(run_id="r", task="t", task_version="1", task_args={}, seed=0, data_fingerprint="", num_examples=64,
                owner_key=b"", hparams=dict(target_batch_size=8, block_size=2, total_steps=3, **hparams))


def test_the_spec_takes_error_feedback_only_as_a_bool_and_only_with_a_lossy_codec():
    assert not spec().error_feedback and not spec(compression="8bit").error_feedback
    assert spec(compression="8bit", error_feedback=True).error_feedback
    assert spec(compression="none", error_feedback=False).hparams["error_feedback"] is False
    with pytest.raises(UsageError, match="lossy compression"):
        spec(error_feedback=True)
    with pytest.raises(UsageError, match="true or false"):
        spec(compression="fp16", error_feedback=1)


def test_make_spec_reads_error_feedback_from_a_set_and_leaves_it_out_otherwise():
    from swarmrun.node.peer.build import make_spec
    from swarmrun.node.tasks.base import load_task_class

    task_cls = load_task_class("synthetic")
    with_it, _ = make_spec(run_id="r", task_cls=task_cls, sets={"compression": "8bit", "error_feedback": "true"},
                           seed=0, owner_key=b"")
    assert with_it.hparams["error_feedback"] is True and with_it.error_feedback
    without, _ = make_spec(run_id="r", task_cls=task_cls, sets={"compression": "8bit"}, seed=0, owner_key=b"")
    assert "error_feedback" not in without.hparams  # a run that does not set it has the spec it had before
    off, _ = make_spec(run_id="r", task_cls=task_cls, sets={"compression": "8bit", "error_feedback": "false"}, seed=0,
                       owner_key=b"")
    assert "error_feedback" not in off.hparams  # nor one that sets it to its default
    with pytest.raises(UsageError, match="error_feedback"):
        make_spec(run_id="r", task_cls=task_cls, sets={"compression": "8bit", "error_feedback": "maybe"}, seed=0,
                  owner_key=b"")
