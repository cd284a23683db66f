"""Real peers on loopback: the owner pauses a 2-peer run (snapshot, every peer leaves), it resumes elsewhere (one
peer restarts it, another joins); a resumed single peer is bit-identical to a run that never paused."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarmrun.node.state.store import SnapshotStore
from tests.swarm_helpers import Swarm, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s


def test_owner_pauses_two_peers_and_the_run_resumes_elsewhere(tmp_path):
    store = tmp_path / "store"
    common = ("--matchmaking-time", "1.0", "--snapshot-to", str(store), "--snapshot-every", "1000")
    with Swarm(tmp_path, "paused-run") as swarm:
        swarm.create("p0", "--task", "synthetic", "--set", "total_steps=400", "--min-peers", "2", *common)
        with ThreadPoolExecutor(1) as pool:  # another key asks to pause while p1 joins: refused (exit 4)
            refused = pool.submit(run_cli, "pause", "paused-run", "--peers", swarm.maddr, "--state-dir",
                                  str(tmp_path / "intruder"), "--json", timeout=90)
            swarm.join("p1", *common)
            swarm.wait_for("p1", "step", timeout=120)
            refused = refused.result()
        assert refused.returncode == 4, refused.stdout + refused.stderr[-2000:]
        assert "owner" in json.loads(refused.stdout.splitlines()[-1])["message"]
        paused = run_cli("pause", "paused-run", "--peers", swarm.maddr, "--state-dir", str(tmp_path / "p0"),
                         "--timeout", "100", "--json", timeout=150)
        assert paused.returncode == 0, paused.stdout + paused.stderr[-2000:]
        event = json.loads(paused.stdout.splitlines()[-1])
        assert event["event"] == "paused" and event["where"] == f"{store}@{event['step']}"
        for name in ("p0", "p1"):
            assert swarm.wait_exit(name, timeout=60) == 0, swarm.log(name)
        lefts = [swarm.events(n, "left")[0] for n in ("p0", "p1")]
        assert {e["reason"] for e in lefts} == {"stopped"}
        assert {(e["step"], e["state_hash"]) for e in lefts} == {(event["step"], event["state_hash"])}
        snap = SnapshotStore(str(store)).load()  # the newest complete snapshot, every chunk verified
        assert snap.frozen.step == event["step"] and snap.frozen.manifest.state_hash() == event["state_hash"]

        # the first peer restarts the run from the store, another joins it: 2 peers again, elsewhere
        swarm.create("r", "--resume-from", str(store), "--min-peers", "2", "--max-steps", str(event["step"] + 2),
                     "--matchmaking-time", "1.0")
        resumed = swarm.wait_for("r", "resumed", timeout=60)
        assert (resumed["step"], resumed["state_hash"]) == (event["step"], event["state_hash"])
        assert resumed["cursor"] == lefts[0]["cursor"]
        swarm.join("r2", "--max-steps", str(event["step"] + 2), "--matchmaking-time", "1.0")
        for name in ("r", "r2"):
            assert swarm.wait_exit(name, timeout=120) == 0, swarm.log(name)
        ends = [swarm.events(n, "left")[0] for n in ("r", "r2")]
        assert {(e["step"], e["state_hash"]) for e in ends} == {(event["step"] + 2, ends[0]["state_hash"])}
        assert ends[0]["cursor"]["blocks_duplicated"] == 0
        assert ends[0]["cursor"]["blocks_applied"] > lefts[0]["cursor"]["blocks_applied"]
        assert swarm.events("r2", "bootstrapped")[0]["step"] >= event["step"]


def test_resumed_single_peer_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    """Same device, same peer identity (its block walk derives from the peer id): the same bits at step 6."""
    store = tmp_path / "store"
    with Swarm(tmp_path, "solo") as swarm:
        swarm.create("a", "--task", "synthetic", "--set", "total_steps=20", "--max-steps", "6", "--snapshot-to",
                     str(store), "--snapshot-every", "1", "--snapshot-keep", "20")
        assert swarm.wait_exit("a", timeout=90) == 0, swarm.log("a")
        uninterrupted = swarm.events("a", "left")[0]
        steps = SnapshotStore(str(store)).steps()
        assert 6 in steps  # by the policy, or by the last peer of the run on its way out
        resume_at = max(s for s in steps if s < 6)  # a step whose commit found no write in flight
        assert resume_at >= 1 and uninterrupted["step"] == 6
        swarm.create("a", "--resume-from", f"{store}@{resume_at}", "--max-steps", "6")
        assert swarm.wait_for("a", "resumed", timeout=60)["step"] == resume_at
        assert swarm.wait_exit("a", timeout=90) == 0, swarm.log("a")
        resumed = swarm.events("a", "left")[0]
        assert resumed["step"] == 6 and resumed["steps_committed"] == 6 - resume_at
        assert resumed["state_hash"] == uninterrupted["state_hash"]
        assert resumed["cursor"] == uninterrupted["cursor"]
