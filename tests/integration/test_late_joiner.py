"""A late joiner of a swarm whose steps are shorter than the way its reports take through the DHT.

The CI saw it twice in one run (the liar bootstrap test, the stranger's records test): the joiner re-synced to the
swarm's step, but the others had planned that step before they read its report, formed their group without it and
committed; it re-synced again, one step behind again, until 50 abandoned rounds ended it (exit 5). Here its reports
are delayed on purpose (``delay@report``), so the race is lost by construction, not by chance.
"""

import pytest

from tests.swarm_helpers import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAST = ("--set", "total_steps=100000", "--set", "hidden=32", "--matchmaking-time", "1.0")


def test_a_joiner_left_out_by_a_fast_swarm_asks_for_a_step_ahead_and_trains_in_it(tmp_path):
    with Swarm(tmp_path, "fast") as swarm:
        swarm.create("p0", "--task", "synthetic", *FAST, "--min-peers", "2")
        swarm.join("p1", "--matchmaking-time", "1.0")
        first = swarm.wait_for("p0", "step", timeout=120)["step"]
        swarm.wait_for("p0", "step", timeout=120, step=first + 5)
        # its reports reach the DHT a second late: several of the others' steps
        swarm.join("late", "--matchmaking-time", "1.0", env={"SWARMRUN_FAULTS": "delay@report:ms=1000"})
        swarm.wait_for("late", "bootstrapped", timeout=120)
        step = swarm.wait_for("late", "step", timeout=120)  # a round with the others, not exit 5
        assert step["group"] >= 2, step
        # then all three train together. The first may leave a partner out (CI, and 1 in 4 runs here: a round of the
        # pair lost a part in hivemind's all-reduce as the joiner's matchmaking met them, and the joiner and one of
        # them committed the next round as 2 of the 3 live trainers, a majority): a round of three follows
        swarm.wait_for("late", "step", timeout=60, group=3)
        # how it got in: each round the others committed before it found them ended in an ask for a step ahead
        moved_on = [e for e in swarm.events("late", "round_abandoned") if "SwarmMovedOn" in e["reason"]]
        assert all(e.get("asks_for", 0) > e["step"] for e in moved_on), moved_on
        assert len(moved_on) < 10, moved_on  # not the 50 that ended it
        # and the others planned it in the step it asked for: their step holds three parts
        asked = [e["asks_for"] for e in moved_on]
        assert not asked or step["step"] >= min(asked), (step, asked)
