"""A stranger stores ``ok=False`` votes under its own signed subkey for a round it saw (issue 14): votes are counted
only from members of the round's group, so its vote neither ends a member's wait nor abandons the round. Real
hivemind DHT nodes on loopback (the two members' and the stranger's, a separate node with its own identity and no
swarmrun validator); the member's ``RoundRunner._vote`` runs as in a round, on an averager stand-in that holds the
averaged gradient.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.swarm import SwarmConfig, peer_id_of, public_key_bytes, record_validator, signed_subkey, start_dht
from swarmrun.node.peer.averaging import RoundOutcome
from swarmrun.node.peer.rounds import RoundRunner
from swarmrun.node.state.run import digest_tensors
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.round import Commit, Vote, vote_key

pytestmark = pytest.mark.integration

RUN = "sec-votes"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
STEP = 5
GROUP = b"\x07" * 8


class Buffers:
    """The averager as ``_vote`` uses it: the averaged gradient in its buffers."""

    def __init__(self, tensors):
        self.tensors = tensors

    @contextlib.contextmanager
    def get_tensors(self):
        yield self.tensors


@pytest.mark.timeout(180)
def test_a_strangers_failed_vote_does_not_end_a_members_wait(tmp_path):
    dhts: list[DHT] = []
    try:
        a, akey = start_dht(SwarmConfig(state_dir=tmp_path / "a", listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(a)
        maddrs = tuple(str(m) for m in a.get_visible_maddrs())
        b, bkey = start_dht(SwarmConfig(state_dir=tmp_path / "b", initial_peers=maddrs, listen=tuple(LOOPBACK)),
                            run_ids=[RUN])
        dhts.append(b)
        skey = RSAPrivateKey()
        stranger = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=list(maddrs),
                       record_validators=[RSASignatureValidator(skey)])
        dhts.append(stranger)
        ids = [d.peer_id.to_base58() for d in (a, b)]
        tensors = [torch.ones(4)]
        grad_hash = digest_tensors(tensors)
        # the stranger votes first: ok=False for the round's group, under its own signed subkey
        sid = peer_id_of(public_key_bytes(skey))
        forged = Vote(step=STEP, group_id=GROUP.hex(), grad_hash=grad_hash, ok=False, reason="forged", live=2)
        assert stranger.store(vote_key(RUN, STEP), forged.encode(), expiration_time=get_dht_time() + 60,
                              subkey=sid.encode() + RSASignatureValidator(skey).local_public_key)

        def b_votes():  # the other member votes a moment later
            time.sleep(2.0)
            mine = Vote(step=STEP, group_id=GROUP.hex(), grad_hash=grad_hash, ok=True, live=2)
            b.store(vote_key(RUN, STEP), mine.encode(), expiration_time=get_dht_time() + 60,
                    subkey=signed_subkey(record_validator(bkey), ids[1]))

        threading.Thread(target=b_votes, daemon=True).start()

        async def vote():
            runner = RoundRunner(averager=Buffers(tensors), dht=a, spec=SimpleNamespace(run_id=RUN), gate=None,
                                 config=SimpleNamespace(vote_timeout=20.0),
                                 subkey=signed_subkey(record_validator(akey), ids[0]), live=lambda: 2, moved_on=lambda: False,
                                 stop_requested=asyncio.Event())
            outcome = RoundOutcome(GROUP, tuple(ids), (), (), True)
            t0 = time.monotonic()
            decision, _ = await runner._vote(outcome, step=STEP, cursor=DataCursor.new(seed=1, num_examples=100,
                                                                                       block_size=8), target=0,
                                             tolerance=0.0)
            return decision, time.monotonic() - t0

        decision, waited = asyncio.run(vote())
        assert decision == Commit(), decision
        assert waited >= 1.5, "the member stopped waiting before the other member voted"
    finally:
        for dht in dhts:
            dht.shutdown()
