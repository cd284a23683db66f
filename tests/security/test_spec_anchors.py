"""A stranger publishes its own validly signed spec for the run's id (its own key as owner) under its own signed
subkey, and one that does not verify (issue 14). A joiner takes the spec from the peer it was given (``--peers``):
the stranger's neither replaces nor hides it, and the one that does not verify is skipped, not fatal. Real hivemind
DHT nodes on loopback; the attacker a separate node with its own identity and no swarmrun validator.
"""

from __future__ import annotations

import dataclasses

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.records import SPEC_TTL, anchor_ids, fetch_spec
from swarmrun.node.net.swarm import SwarmConfig, peer_id_of, public_key_bytes, record_validator, signed_subkey, start_dht
from swarmrun.node.runtime import run_async
from swarmrun.protocol.round import spec_key
from swarmrun.protocol.spec import SignedSpec, Spec

pytestmark = pytest.mark.integration

RUN = "sec-spec"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _spec(owner: RSAPrivateKey, lr: float = 0.1) -> SignedSpec:
    spec = Spec(run_id=RUN, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                num_examples=1024, owner_key=public_key_bytes(owner),
                hparams={"lr": lr, "target_batch_size": 64, "total_steps": 100, "block_size": 8})
    return SignedSpec.sign(spec, owner.sign)


@pytest.mark.timeout(180)
def test_a_strangers_own_spec_does_not_replace_or_hide_the_anchors(tmp_path):
    dhts: list[DHT] = []
    try:
        peer, key = start_dht(SwarmConfig(state_dir=tmp_path / "peer", listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(peer)
        real = _spec(RSAPrivateKey())
        assert peer.store(spec_key(RUN), real.encode(), expiration_time=get_dht_time() + SPEC_TTL,
                          subkey=signed_subkey(record_validator(key), peer.peer_id.to_base58()))
        maddrs = [str(m) for m in peer.get_visible_maddrs()]

        akey = RSAPrivateKey()
        attacker = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs,
                       record_validators=[RSASignatureValidator(akey)])
        dhts.append(attacker)
        own = peer_id_of(public_key_bytes(akey))
        validator = RSASignatureValidator(akey)
        theirs = _spec(akey, lr=10.0)  # valid: signed by the stranger's key, which it names as owner
        assert attacker.store(spec_key(RUN), theirs.encode(), expiration_time=get_dht_time() + SPEC_TTL,
                              subkey=own.encode() + validator.local_public_key)

        joiner, _ = start_dht(SwarmConfig(state_dir=tmp_path / "joiner", initial_peers=tuple(maddrs),
                                          listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(joiner)
        got = run_async(fetch_spec(joiner, RUN, timeout=10.0, anchors=anchor_ids(maddrs)))
        assert got == real, "the stranger's spec replaced the anchor's"

        # the anchor itself publishes a spec that does not verify too: skipped, the other verifying source is taken
        broken = dataclasses.replace(real, signature=b"\x00" * 256)
        assert attacker.store(spec_key(RUN), broken.encode(), expiration_time=get_dht_time() + SPEC_TTL,
                              subkey=own.encode() + validator.local_public_key)
        got = run_async(fetch_spec(joiner, RUN, timeout=10.0, anchors=anchor_ids(maddrs) + (own,)))
        assert got == real
    finally:
        for dht in dhts:
            dht.shutdown()
