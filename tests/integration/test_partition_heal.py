"""Two sides of a healed partition meet again (issue 14).

hivemind drops a DHT node that did not answer from its routing table and never looks for it again; the other side
does the same. Before ``Reporter.reconnect`` a peer cut off for longer than a few DHT timeouts read no report of
the others after the link healed, for good. The first test shows the mechanism on two real DHT nodes on loopback
(each forgets the other as a failed request makes it); the other two, real partitions of a 3-peer run in network
namespaces: one where the cut-off peer waits, one where it steps alone and its steps are given up at the reunion.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from functools import partial

import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.swarm import ping_peers

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.integration
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _forget(_dht, node, *, peer_id):
    """What hivemind does to a node whose request timed out (``DHTProtocol.update_routing_table``)."""
    from hivemind.p2p import PeerID

    node_id = node.protocol.routing_table.get(peer_id=PeerID.from_base58(peer_id))
    if node_id is not None:
        del node.protocol.routing_table[node_id]
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _known(_dht, node):
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_nodes_that_forgot_each_other_meet_again_after_a_ping():
    a = DHT(start=True, host_maddrs=LOOPBACK)
    b = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=[str(m) for m in a.get_visible_maddrs()])
    try:
        a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
        assert a.run_coroutine(partial(_forget, peer_id=b_id)) == 0
        assert b.run_coroutine(partial(_forget, peer_id=a_id)) == 0
        assert a.store("heal.key", b"from a", get_dht_time() + 60)  # kept by a alone: b knows no node to ask
        assert b.get("heal.key", latest=True) is None
        assert b.run_coroutine(partial(ping_peers, peer_ids=[a_id], timeout=5.0)) == [a_id]
        assert a.run_coroutine(_known) == 1 and b.run_coroutine(_known) == 1  # the ping put each in the other's table
        found = b.get("heal.key", latest=True)
        assert found is not None and found.value == b"from a"
        # a peer that is gone does not answer: it is not reported as found
        gone = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
        assert b.run_coroutine(partial(ping_peers, peer_ids=[gone], timeout=2.0)) == []
    finally:
        b.shutdown()
        a.shutdown()


@pytest.mark.timeout(300)
def test_a_peer_cut_off_by_a_partition_rejoins_the_run_after_the_heal(tmp_path):
    """``simulations/traces/heal.json``: peer2 of a 3-peer run in network namespaces is cut off for 20 s (both ways,
    nftables drops). It does not step alone (``--alone-after`` is 60 s); after the heal it must read the others
    again and follow their history: a re-sync to a later step, then steps of the same state as the majority's.
    Before ``Reporter.reconnect`` it stayed at its step for the rest of the run."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("nft") is None:
        pytest.skip("nft (Debian's nftables) is not installed: the README's test command installs it")
    out = tmp_path / "report"
    command = [sys.executable, "-m", "simulations", "run", "simulations/traces/heal.json", "--out", str(out), "--json",
               "--no-baseline"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    faults = json.loads((out / "lives.json").read_text())["faults"]
    healed = next(e["t"] for e in faults if e["kind"] == "partition_end")
    steps = [e for e in events if e.get("event") == "step"]
    cut_at = max(e["step"] for e in steps if e["peer"] == "peer2.0" and e["t"] < healed)
    back = [e for e in events if e["peer"] == "peer2.0" and e["t"] > healed and e.get("event") in ("resync", "step")]
    assert back and back[0]["event"] == "resync" and back[0]["step"] > cut_at, (cut_at, back[:3])
    majority = {e["step"]: e["state_hash"] for e in steps if e["peer"] == "peer0.0"}
    rejoined = [e for e in back if e["event"] == "step"]
    assert rejoined, "peer2 re-synced but never stepped with the others again"
    shared = [e for e in rejoined if e["step"] in majority]
    assert shared and all(majority[e["step"]] == e["state_hash"] for e in shared), rejoined[:3]
    # the majority kept its history (one of it may fetch a step it fell behind by at the heal: CI saw it)
    assert not [e for e in events if e.get("event") == "resync" and e["peer"] != "peer2.0" and e["discarded"]]


@pytest.mark.timeout(300)
def test_a_minority_that_stepped_alone_gives_its_steps_up_and_counts_them(tmp_path):
    """``simulations/traces/split.json``: once the three peers have committed a step together, peer2 is cut off for
    20 s, and with ``--alone-after 3`` it commits steps alone while peer0 and peer1 go on as a pair (a split). When
    the two sides meet again the majority's history wins (DESIGN.md, "Commit semantics"): peer2 re-syncs to it and
    reports the solo steps it gives up (``resync``'s ``discarded``); the majority gives up none, and after the heal
    peer2's steps hold the majority's state. The harness drops the discarded history from its checks only as far
    as ``discarded`` says, so an under-count fails ``state_hash_agrees``."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("nft") is None:
        pytest.skip("nft (Debian's nftables) is not installed: the README's test command installs it")
    out = tmp_path / "report"
    command = [sys.executable, "-m", "simulations", "run", "simulations/traces/split.json", "--out", str(out),
               "--json", "--no-baseline"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "invariants" in lines[-1], (lines[-1:], result.stderr[-3000:])
    summary = lines[-1]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    faults = json.loads((out / "lives.json").read_text())["faults"]
    steps = [e for e in events if e.get("event") == "step"]
    cut = next((e["t"] for e in faults if e["kind"] == "partition"), None)
    healed = next((e["t"] for e in faults if e["kind"] == "partition_end"), None)
    assert cut is not None and healed is not None, ("no round of all three, so no cut", faults,
                                                    sorted({e["group"] for e in steps}))
    mine = [e for e in steps if e["peer"] == "peer2.0"]
    solo = [e for e in mine if cut < e["t"] < healed and e["group"] == 1]
    assert solo, "peer2 never stepped alone during the cut: no split to heal"
    back = [e for e in events if e["peer"] == "peer2.0" and e["t"] > healed and e.get("event") == "resync"]
    assert back, "peer2 never re-synced to the majority after the heal"
    # every step since its first solo one is given up, and none it committed with the others before the cut (its
    # rounds with them come before its first solo step: by step, not by the time the runner read the event, which
    # for the round of three that triggered the cut may come after the cut; one run in three on 7 Dec 2026)
    last_shared = max(e["step"] for e in mine if e["group"] >= 2 and e["step"] < solo[0]["step"])
    top = back[0]["from_step"]
    assert top - solo[0]["step"] + 1 <= back[0]["discarded"] <= top - last_shared, (last_shared, solo[0], back[0])
    assert not [e for e in events if e.get("event") == "resync" and e["peer"] != "peer2.0" and e["discarded"]]
    majority = {e["step"]: e["state_hash"] for e in steps if e["peer"] == "peer0.0"}
    rejoined = [e for e in steps if e["peer"] == "peer2.0" and e["t"] > back[0]["t"] and e["step"] in majority]
    assert rejoined and all(majority[e["step"]] == e["state_hash"] for e in rejoined), rejoined[:3]
    assert summary["invariants"]["state_hash_agrees"] is True, summary.get("problems")
