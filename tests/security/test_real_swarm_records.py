"""A stranger against a real two-peer run (issue 14's rows on the spec, providers, progress, vote and pause keys),
on loopback: `node join` peers, the attacker a separate DHT node with its own identity and no invite
(tests/security/stranger.py). Against the code the audit tried, every joiner exited 5 (spec) or 5 "no peer of the
run answered" (providers); both peers saw `peers: 1` and split (progress); rounds were abandoned (votes); `node
pause` never paused (pause key) or printed the stranger's STORE@999 (notes). Here every one of them, at once, has
no effect: the joiner joins and trains, both peers commit every step together with one state_hash, and the owner's
`node pause` really pauses and reports the real store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.records import owner_subkey
from swarmrun.node.state.store import SnapshotStore
from swarmrun.protocol.round import Vote, progress_key, spec_key, vote_key
from swarmrun.protocol.snapshot import PauseNote, PauseRecord, pause_key, paused_key
from swarmrun.protocol.transfer import providers_key
from tests.security.stranger import Stranger, identity_peer_id
from tests.swarm_helpers import Swarm, run_cli

pytestmark = pytest.mark.integration

RUN = "sec-swarm"
FORGED_NOTE = PauseNote(step=999, left=True, where="STORE@999", state_hash="e" * 64, manifest_hash="f" * 64)
STRANGER_REASON = "stranger-vote"


class VoteForger(threading.Thread):
    """Stores ``ok=False`` votes under the stranger's own signed subkey for the rounds at and after the swarm's
    step: for every group it sees voting (their group id and gradient hash copied) and for a made-up group."""

    def __init__(self, stranger: Stranger, step_now):
        super().__init__(daemon=True)
        self.stranger, self.step_now, self.stop, self.stored = stranger, step_now, threading.Event(), 0

    def run(self):
        while not self.stop.is_set():
            step = self.step_now()
            for s in (step, step + 1):
                seen = {("ab" * 8, "0" * 64)}
                try:
                    found = self.stranger.dht.get(vote_key(RUN, s), latest=True)
                    for item in (found.value.values() if found is not None and isinstance(found.value, dict) else ()):
                        try:
                            vote = Vote.decode(item.value)
                            seen.add((vote.group_id, vote.grad_hash))
                        except Exception:
                            pass
                    for group_id, grad_hash in seen:
                        forged = Vote(step=s, group_id=group_id, grad_hash=grad_hash, ok=False,
                                      reason=STRANGER_REASON, live=2)
                        own = self.stranger.own_subkey()
                        self.stranger.store(vote_key(RUN, s), forged.encode(), own, ttl=100)
                        self.stored += 1
                except Exception:
                    if self.stop.is_set():
                        return
            self.stop.wait(0.2)


def _hashes(swarm: Swarm, name: str) -> dict[int, str]:
    return {e["step"]: e["state_hash"] for e in swarm.events(name, "step")}


@pytest.mark.timeout(300)
def test_a_stranger_neither_hides_splits_stalls_nor_fakes_the_pause_of_a_real_run(tmp_path):
    store = tmp_path / "store"
    p1_id = identity_peer_id(tmp_path / "p1")
    with Swarm(tmp_path, RUN) as swarm:
        # p0 waits for a second trainer (the audit's stalled side); p1, the late joiner, would step alone if the
        # progress records hid p0 from it (the audit's split)
        swarm.create("p0", "--task", "synthetic", "--set", "total_steps=2000", "--min-peers", "2",
                     "--matchmaking-time", "1.0", "--snapshot-to", str(store), "--snapshot-every", "1000")
        listening = swarm.wait_for("p0", "listening", timeout=10)
        p0_id, spec_hash = listening["peer_id"], listening["spec_hash"]
        stranger = Stranger(swarm.maddr)
        forger = None
        try:
            # the far plain values: spec, providers, progress, pause, pause notes
            stranger.plant(spec_key(RUN), providers_key(RUN), progress_key(RUN), pause_key(RUN), paused_key(RUN))
            # a pause request it signed itself, under an owner-shaped subkey of its own key
            own = PauseRecord(run_id=RUN, spec_hash=spec_hash, at_step=3, time=get_dht_time())
            own = dataclasses.replace(own, signature=bytes(stranger.key.sign(own.unsigned_bytes())))
            stranger.store(pause_key(RUN), own.encode(), owner_subkey(stranger.public_key))
            # "left, written to STORE@999" for both trainers: unsigned subkeys naming them, their names with the
            # stranger's key, and its own signed subkey
            for pid in (p0_id, p1_id):
                stranger.store(paused_key(RUN), FORGED_NOTE.encode(), pid.encode())
                theirs = pid.encode() + stranger.validator.local_public_key  # its name, the stranger's key
                stranger.store(paused_key(RUN), FORGED_NOTE.encode(), theirs)
            stranger.store(paused_key(RUN), FORGED_NOTE.encode(), stranger.own_subkey())

            def step_now():
                steps = swarm.events("p0", "step")
                return steps[-1]["step"] if steps else 0

            forger = VoteForger(stranger, step_now)
            forger.start()

            # the late joiner joins (the spec from its --peers, the state from the run's providers) and trains
            swarm.join("p1", "--matchmaking-time", "1.0")
            boot = swarm.wait_for("p1", "bootstrapped", timeout=120)
            swarm.wait_for("p1", "step", timeout=120, step=boot["step"] + 4)
            assert forger.stored > 0, "the stranger stored no vote"

            paused = run_cli("pause", RUN, "--peers", swarm.maddr, "--state-dir", str(tmp_path / "p0"),
                             "--timeout", "120", "--json", timeout=180)
            assert paused.returncode == 0, paused.stdout[-2000:] + paused.stderr[-2000:]
            event = json.loads(paused.stdout.splitlines()[-1])
            assert event["where"] == f"{store}@{event['step']}", event  # the real store, not STORE@999
            for name in ("p0", "p1"):
                assert swarm.wait_exit(name, timeout=90) == 0, swarm.log(name)  # it really paused: both left
        finally:
            if forger is not None:
                forger.stop.set()
                forger.join(timeout=10)
            stranger.shutdown()

        lefts = {n: swarm.events(n, "left")[0] for n in ("p0", "p1")}
        assert {(e["step"], e["state_hash"]) for e in lefts.values()} == {(event["step"], event["state_hash"])}
        snap = SnapshotStore(str(store)).load()
        assert (snap.frozen.step, snap.frozen.manifest.state_hash()) == (event["step"], event["state_hash"])

        # one history: every step either peer committed, both committed, with one state_hash, in rounds of two
        h0, h1 = _hashes(swarm, "p0"), _hashes(swarm, "p1")
        common = sorted(set(h0) & set(h1))
        assert len(common) >= 4, (sorted(h0), sorted(h1))
        assert [s for s in common if h0[s] != h1[s]] == [], "the peers split"
        assert set(h1) <= set(h0) and max(h0) <= event["step"], (sorted(h0), sorted(h1))
        for name in ("p0", "p1"):
            assert all(e["group"] == 2 and e["peers"] == 2 for e in swarm.events(name, "step")), \
                [(e["step"], e["group"], e["peers"]) for e in swarm.events(name, "step")]
            abandoned = swarm.events(name, "round_abandoned")
            assert not [e for e in abandoned if STRANGER_REASON in str(e.get("reason"))], abandoned
        print(f"steps {common[0]}..{common[-1]} together; paused at {event['step']}; "
              f"stranger's votes stored (attempts): {forger.stored}; abandoned rounds: "
              f"{[len(swarm.events(n, 'round_abandoned')) for n in ('p0', 'p1')]}")
