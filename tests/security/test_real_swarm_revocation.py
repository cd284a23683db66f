"""A stranger against the revocation list of a real invite-only run (issue 14): the audit's far plain value under
the run's revocation key made the owner's `node invite revoke` exit 4 ("the swarm did not accept the revocation
list") while the revoked peer kept training. Here, with that value planted and a revocation list the stranger signed
itself (revoking both trainers, under an owner-shaped subkey of its own key), the owner's revoke takes effect: the
revoked peer exits 4, and the owner's peer, which the stranger's list named too, trains on. `node join` peers on
loopback; the attacker a separate DHT node with its own identity and no invite (tests/security/stranger.py).
"""

from __future__ import annotations

import json
import time

import pytest

from swarmrun.node.net.records import owner_subkey
from swarmrun.protocol.access import Revocations, revocation_key
from tests.security.stranger import Stranger, identity_peer_id
from tests.swarm_helpers import Swarm, run_cli

pytestmark = pytest.mark.integration

RUN = "sec-revoke"


@pytest.mark.timeout(300)
def test_a_strangers_revocation_records_neither_block_the_owners_revoke_nor_revoke_anyone(tmp_path):
    p1_id = identity_peer_id(tmp_path / "p1")
    with Swarm(tmp_path, RUN) as swarm:
        swarm.create("p0", "--task", "synthetic", "--set", "total_steps=100000", "--access", "invite",
                     "--min-peers", "2", "--matchmaking-time", "1.0")
        p0_id = swarm.wait_for("p0", "listening", timeout=10)["peer_id"]
        stranger = Stranger(swarm.maddr)
        try:
            stranger.plant(revocation_key(RUN))
            own = Revocations(run_id=RUN, revoked=frozenset({p0_id, p1_id}), issued_at=time.time() + 3600)
            stranger.store(revocation_key(RUN), own.signed(stranger.key.sign).encode(),
                           owner_subkey(stranger.public_key))

            assert run_cli("invite", RUN, "--peer", p1_id, "--state-dir", str(tmp_path / "p0"),
                           "--out", str(tmp_path / "p1.invite")).returncode == 0
            swarm.join("p1", "--matchmaking-time", "1.0", "--invite", str(tmp_path / "p1.invite"))
            boot = swarm.wait_for("p1", "bootstrapped", timeout=120)
            swarm.wait_for("p1", "step", timeout=120, step=boot["step"] + 2)  # the stranger's list revoked no one

            revoke = run_cli("invite", "revoke", RUN, "--peer", p1_id, "--state-dir", str(tmp_path / "p0"),
                             "--peers", swarm.maddr, "--json")
            assert revoke.returncode == 0, revoke.stdout[-2000:] + revoke.stderr[-2000:]
            assert json.loads(revoke.stdout.splitlines()[-1])["revoked"] == [p1_id]  # not the stranger's p0
            t0 = time.monotonic()
            assert swarm.wait_exit("p1", timeout=90) == 4, swarm.log("p1")
            assert "revoked" in swarm.events("p1", "error")[-1]["message"]
            assert swarm.peers["p0"].alive, swarm.log("p0")  # the owner's peer was not revoked by the stranger
            print(f"p1 exited 4 {time.monotonic() - t0:.1f}s after the revoke; p0 at step "
                  f"{swarm.events('p0', 'step')[-1]['step']}")
        finally:
            stranger.shutdown()
