"""README's walkthrough as a new user ran it: A creates the run with --snapshot-to, B joins without one, and B
has the lower peer id (forced here: the test swaps the two identities if they came out the other way). Electing
B as the writer once lost 66 committed steps on `node pause`; a pause, and the last peers leaving, must never lose
a committed step."""

import json
import shutil
import signal

import pytest
from hivemind.p2p import PeerID

from swarmrun.node.state.store import SnapshotStore
from swarmrun.node.net.swarm import IDENTITY_FILE, ensure_identity
from tests.swarm_helpers import Swarm, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # real peers: more than the default 60 s


def peer_id(state_dir) -> str:
    return PeerID.from_identity((state_dir / IDENTITY_FILE).read_bytes()).to_base58()


def identities_with_b_lowest(tmp_path):
    """State dirs a (the creator, with a store) and b (no store) whose identities make b the lowest peer id."""
    a, b = tmp_path / "a", tmp_path / "b"
    ensure_identity(a), ensure_identity(b)
    if peer_id(a) < peer_id(b):
        swap = tmp_path / "swap"
        shutil.move(a / IDENTITY_FILE, swap)
        shutil.move(b / IDENTITY_FILE, a / IDENTITY_FILE)
        shutil.move(swap, b / IDENTITY_FILE)
    assert peer_id(b) < peer_id(a)


@pytest.mark.timeout(240)
def test_pause_writes_to_the_peer_with_a_store_and_loses_no_step(tmp_path):
    identities_with_b_lowest(tmp_path)
    store = tmp_path / "store"
    with Swarm(tmp_path, "walk") as swarm:
        swarm.create("a", "--task", "synthetic", "--set", "total_steps=2000", "--min-peers", "2",
                     "--matchmaking-time", "1.0", "--snapshot-to", str(store), "--snapshot-every", "1000")
        swarm.join("b", "--matchmaking-time", "1.0")
        swarm.wait_for("b", "step", timeout=120, step=3)
        paused = run_cli("pause", "walk", "--peers", swarm.maddr, "--state-dir", str(tmp_path / "a"), "--timeout",
                         "120", "--json", timeout=180)
        assert paused.returncode == 0, paused.stdout + paused.stderr[-2000:]
        event = json.loads(paused.stdout.splitlines()[-1])
        assert event["where"] == f"{store}@{event['step']}" and event["step"] >= 4
        for name in ("a", "b"):
            assert swarm.wait_exit(name, timeout=90) == 0, swarm.log(name)
        lefts = {n: swarm.events(n, "left")[0] for n in ("a", "b")}
        assert {(e["step"], e["state_hash"]) for e in lefts.values()} == {(event["step"], event["state_hash"])}
        assert [e["step"] for e in swarm.events("a", "snapshot")][-1] == event["step"]
        assert not swarm.events("b", "snapshot")  # b had no store: it was not elected
        snap = SnapshotStore(str(store)).load()
        assert (snap.frozen.step, snap.frozen.manifest.state_hash()) == (event["step"], event["state_hash"])

        swarm.create("r", "--resume-from", str(store), "--max-steps", str(event["step"] + 1))
        assert swarm.wait_for("r", "resumed", timeout=60)["step"] == event["step"]  # not step 1
        assert swarm.wait_exit("r", timeout=90) == 0, swarm.log("r")


@pytest.mark.timeout(240)
def test_a_pause_no_peer_can_write_is_refused_and_the_last_peer_leaving_keeps_the_state(tmp_path):
    with Swarm(tmp_path, "walk2") as swarm:
        swarm.create("b", "--task", "synthetic", "--set", "total_steps=2000", "--min-peers", "2",
                     "--matchmaking-time", "1.0")
        swarm.join("a", "--matchmaking-time", "1.0")
        swarm.wait_for("a", "step", timeout=120, step=2)
        refused = run_cli("pause", "walk2", "--peers", swarm.maddr, "--state-dir", str(tmp_path / "b"), "--json",
                          timeout=120)
        assert refused.returncode == 2, refused.stdout + refused.stderr[-2000:]
        assert "--to STORE" in json.loads(refused.stdout.splitlines()[-1])["message"]
        after = swarm.events("b", "step")[-1]["step"]
        swarm.wait_for("b", "step", timeout=60, step=after + 2)  # nothing was paused: training goes on

        swarm.peers["a"].proc.send_signal(signal.SIGINT)  # b trains on: a writes nothing (it has no store)
        assert swarm.wait_exit("a", timeout=60) == 0, swarm.log("a")
        assert not swarm.events("a", "snapshot")
        swarm.peers["b"].proc.send_signal(signal.SIGINT)  # the last peer: its state goes to its state dir
        assert swarm.wait_exit("b", timeout=60) == 0, swarm.log("b")
        left = swarm.events("b", "left")[0]
        written = swarm.events("b", "snapshot")[-1]
        fallback = tmp_path / "b" / "snapshots" / "walk2"
        assert written["where"] == f"{fallback}@{left['step']}" and written["state_hash"] == left["state_hash"]

        swarm.create("r", "--resume-from", str(fallback), "--max-steps", str(left["step"] + 1))
        resumed = swarm.wait_for("r", "resumed", timeout=60)
        assert (resumed["step"], resumed["state_hash"]) == (left["step"], left["state_hash"])
        assert swarm.wait_exit("r", timeout=90) == 0, swarm.log("r")
