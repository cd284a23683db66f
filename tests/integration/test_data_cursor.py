"""The data cursor on real peers on loopback: every block of a data epoch applied exactly once while peers of
different batch sizes train, one is SIGKILLed in the middle of an all-reduce (a reducer failure: that round is
abandoned) and a fresh one joins; the accounting is read from the peers' events and from `node status`."""

import json
import threading

import pytest

from tests.swarm_helpers import Swarm, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s

NUM_EXAMPLES, BLOCK_SIZE = 128, 8  # 16 blocks; a step needs 40 samples (5 blocks): data epoch 0 closes by step 4
NUM_BLOCKS = NUM_EXAMPLES // BLOCK_SIZE
TOTAL_STEPS = 4


def test_full_data_epoch_under_churn_applies_every_block_once(tmp_path):
    with Swarm(tmp_path, "cursor") as swarm:
        common = ("--matchmaking-time", "1.0")
        # p0 (batch 8) steps only with a second trainer, so every round until the kill has the victim in it
        swarm.create("p0", "--task", "synthetic", "--set", f"num_examples={NUM_EXAMPLES}", "--set",
                     f"block_size={BLOCK_SIZE}", "--set", "target_batch_size=40", "--set", f"total_steps={TOTAL_STEPS}",
                     "--set", "eval_every=0", "--min-peers", "2", "--batch-size", "8", *common)
        # batch 5: less than a block, it takes whole blocks anyway. It is SIGKILLed in the middle of the
        # all-reduce of step 2 (mid data epoch, holding leases on blocks), so that round must be abandoned
        swarm.join("victim", "--batch-size", "5", *common, env={"SWARMRUN_FAULTS": "kill@allreduce:step=2"})
        assert swarm.wait_exit("victim", timeout=120) != 0, swarm.log("victim")
        # while p0 waits for a second trainer: a fresh peer (batch 24) joins, and `node status` reads the run
        status: dict = {}
        reader = threading.Thread(target=lambda: status.update(
            result=run_cli("status", "cursor", "--peers", swarm.maddr, "--json", timeout=90)))
        reader.start()
        swarm.join("p1", "--batch-size", "24", *common)
        reader.join(timeout=100)
        for name in ("p0", "p1"):
            assert swarm.wait_exit(name, timeout=120) == 0, swarm.log(name)

        lefts = {n: swarm.events(n, "left")[0] for n in ("p0", "p1")}
        assert {e["reason"] for e in lefts.values()} == {"finished"}
        assert {e["step"] for e in lefts.values()} == {TOTAL_STEPS}
        assert len({e["state_hash"] for e in lefts.values()}) == 1
        assert swarm.events("victim", "left") == []  # it died, it did not leave
        assert max(e["step"] for e in swarm.events("victim", "step")) == 2
        assert lefts["p0"]["cursor"] == lefts["p1"]["cursor"]
        cursor = lefts["p0"]["cursor"]
        assert cursor["data_epoch"] == 1, cursor  # data epoch 0 closed: every one of its blocks was applied
        assert cursor["blocks_skipped"] == 0 and cursor["blocks_duplicated"] == 0, cursor
        assert cursor["blocks_applied"] == NUM_BLOCKS + (NUM_BLOCKS - cursor["blocks_pending"])

        # the round of step 2 was abandoned (p0 missed the part the victim reduced, or its vote) and applied
        # none of its blocks: each committed step advances the cursor by exactly the blocks of the samples it
        # committed, and the committed steps make up all that was applied
        abandoned = [e for e in swarm.events("p0", "round_abandoned") if e["step"] == 2]
        assert any("incomplete" in e["reason"] or "did not vote" in e["reason"] for e in abandoned), \
            swarm.events("p0", "round_abandoned")
        steps = {e["step"]: e for e in swarm.events("p0", "step")}
        assert sorted(steps) == list(range(1, TOTAL_STEPS + 1))
        applied_before = 0
        for step in range(1, TOTAL_STEPS + 1):
            e = steps[step]
            assert e["cursor"]["blocks_duplicated"] == 0 and e["cursor"]["blocks_skipped"] == 0
            assert (e["cursor"]["blocks_applied"] - applied_before) * BLOCK_SIZE == e["samples"], (step, e)
            applied_before = e["cursor"]["blocks_applied"]
        assert applied_before == cursor["blocks_applied"]
        # the step that closed data epoch 0 applied its last blocks and none of epoch 1's
        closing = [e["cursor"] for e in steps.values() if e["cursor"]["blocks_applied"] == NUM_BLOCKS]
        assert closing == [dict(closing[0], data_epoch=1, blocks_pending=NUM_BLOCKS)], closing

        # `node status --json` reported the run's accounting, from p0's cursor at step 2
        result = status["result"]
        assert result.returncode == 0, result.stderr[-2000:]
        report = json.loads(result.stdout.splitlines()[-1])
        assert report["event"] == "status" and report["step"] >= 2
        at = steps[report["step"]]["cursor"]
        assert {k: report[k] for k in at} == at, (report, at)
