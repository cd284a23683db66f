"""`node demo`'s run length: --steps, --epochs or --total-samples (issue 19: a demo could only say steps)."""

import pytest

from swarmrun.node.cli.demo import demo_length
from swarmrun.node.cli.main import build_parser
from swarmrun.protocol.errors import UsageError


def length(*argv):
    return demo_length(build_parser().parse_args(["demo", *argv]))


def test_the_demo_takes_its_length_in_steps_epochs_or_samples():
    assert length() == (["total_steps=60"], "60 steps")
    assert length("--steps", "12") == (["total_steps=12"], "12 steps")
    assert length("--epochs", "1") == (["epochs=1"], "1 epoch")
    assert length("--total-samples", "640") == (["total_samples=640"], "640 samples")
    assert length("--set", "epochs=2") == ([], "epochs=2")  # the user's own --set is the length


@pytest.mark.parametrize("argv", [("--steps", "10", "--epochs", "1"), ("--epochs", "1", "--set", "total_samples=9"),
                                  ("--steps", "2"), ("--epochs", "0"), ("--total-samples", "-1")])
def test_two_lengths_or_a_bad_one_are_usage_errors(argv):
    with pytest.raises(UsageError):
        length(*argv)
