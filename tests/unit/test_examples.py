"""The examples' promises that need no peers: the swarm port of the word language model is a small diff."""

import difflib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def changed_lines(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """Lines ``b`` adds to ``a`` and lines it removes (difflib's unified diff, no context)."""
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), lineterm="", n=0)
    body = [line for line in diff if not line.startswith(("+++", "---", "@@"))]
    return [line[1:] for line in body if line.startswith("+")], [line[1:] for line in body if line.startswith("-")]


def test_the_word_lm_swarm_port_writes_at_most_10_lines():
    added, removed = changed_lines(EXAMPLES / "word_lm_plain.py", EXAMPLES / "word_lm_swarm.py")
    # what a user writes to move the script: the import, make_task and train instead of the loop, two flags
    assert len(added) <= 10, "\n".join(added)
    # what the port removes is the hand-written loop (seeding, optimizer, schedule, batches, clip, step, evaluation)
    assert len(removed) <= 13, "\n".join(removed)
    assert any("swarmrun.make_task" in line for line in added) and any("swarmrun.train" in line for line in added)
