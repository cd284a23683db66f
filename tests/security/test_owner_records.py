"""A stranger against the owner's pause record and the run's amendment history (issue 14): both were plain values,
so a well-formed value of the stranger's with an expiration later than the writer's (within the key's TTL, which
the record validator allows) replaced them in hivemind's storage: the owner's `node pause` was never seen by the
trainers, and a peer's published history was hidden. The pause is now under the owner's signed subkey and the
history under each peer's: the stranger's values sit beside them and are ignored. Real hivemind DHT nodes on
loopback; the attacker a separate node with its own identity and no swarmrun validator.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.records import owner_subkey, read_history, store_own
from swarmrun.node.net.swarm import (
    SwarmConfig,
    peer_id_of,
    public_key_bytes,
    record_validator,
    run_validators,
    signed_subkey,
    start_dht,
)
from swarmrun.node.peer.snapshots import SnapshotSide
from swarmrun.node.runtime import run_async
from swarmrun.protocol.codec import pack
from swarmrun.protocol.records import MAX_CLOCK_SKEW, RUN_KEYS
from swarmrun.protocol.snapshot import Amendment, PauseRecord, history_key, pause_key
from swarmrun.protocol.spec import Spec

pytestmark = pytest.mark.integration

RUN = "sec-owner"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEN_YEARS = 10 * 365 * 86400.0


def _pause(key: RSAPrivateKey, spec: Spec, at_step: int) -> PauseRecord:
    record = PauseRecord(run_id=RUN, spec_hash=spec.spec_hash(), at_step=at_step, time=get_dht_time())
    return dataclasses.replace(record, signature=bytes(key.sign(record.unsigned_bytes())))


@pytest.mark.timeout(180)
def test_a_strangers_values_neither_replace_nor_hide_the_owners_pause_or_a_peers_history(tmp_path):
    dhts: list[DHT] = []
    try:
        trainer, tkey = start_dht(SwarmConfig(state_dir=tmp_path / "trainer", listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(trainer)
        maddrs = [str(m) for m in trainer.get_visible_maddrs()]
        owner = RSAPrivateKey()
        spec = Spec(run_id=RUN, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                    num_examples=1024, owner_key=public_key_bytes(owner),
                    hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 8})

        akey = RSAPrivateKey()
        attacker = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs,
                       record_validators=[RSASignatureValidator(akey)])
        dhts.append(attacker)
        latest = get_dht_time() + RUN_KEYS["pause"].ttl + MAX_CLOCK_SKEW - 5  # as far as the TTL lets anyone go
        forged = _pause(akey, spec, at_step=10**6)  # well-formed, for this run, signed by the stranger
        # a plain value (the attack on the old schema: it replaced the owner's, whose expiration is sooner) ...
        attacker.store(pause_key(RUN), forged.encode(), expiration_time=latest)
        attacker.store(pause_key(RUN), b"\x00" * 8, expiration_time=get_dht_time() + TEN_YEARS)
        # ... and its own owner-shaped signed subkey, which hivemind's signature validator accepts
        assert attacker.store(pause_key(RUN), forged.encode(), expiration_time=latest,
                              subkey=owner_subkey(public_key_bytes(akey)))
        attacker.store(history_key(RUN), pack([]), expiration_time=latest)  # well-formed: an empty history
        attacker.store(history_key(RUN), b"\x00" * 8, expiration_time=get_dht_time() + TEN_YEARS)

        # the owner's command publishes the pause as `node pause` does (its session DHT: owner_session's validators)
        session = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs,
                      record_validators=run_validators(owner, [RUN]))
        dhts.append(session)
        real = _pause(owner, spec, at_step=5)
        # `node pause`'s store: hivemind's store answers with the last replica's answer, and the stranger's node, which
        # keeps its plain value under the key with a later expiration, refuses every subkey (store_own reads back)
        assert run_async(store_own(session, pause_key(RUN), real.encode(), owner_subkey(spec.owner_key), 120))
        # the trainer republishes the run's history under its own signed subkey (SnapshotSide._publish_history)
        history = (Amendment(step=1, from_spec="a" * 64, to_spec=spec.spec_hash(), changes={"lr": 0.2},
                             time=get_dht_time(), signature=b"s").encode(),)  # readers verify it (choose_history)
        assert run_async(store_own(trainer, history_key(RUN), pack(list(history)),
                                   signed_subkey(record_validator(tkey), trainer.peer_id.to_base58()), 120))

        # a joiner started after the attack reads both (find path: the stranger's node answers too)
        joiner, _ = start_dht(SwarmConfig(state_dir=tmp_path / "joiner", initial_peers=tuple(maddrs),
                                          listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(joiner)
        for dht in (trainer, joiner):
            side = SnapshotSide(trainer=SimpleNamespace(dht=dht, spec=spec), signed=None, history=(), events=None)
            got = run_async(side._read_pause(pause_key(RUN)))
            assert got == real, f"the trainer did not see the owner's pause: {got}"
            assert run_async(read_history(dht, history_key(RUN))) == [history]
        assert peer_id_of(public_key_bytes(akey)) != trainer.peer_id.to_base58()
    finally:
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_one_refusing_replica_does_not_make_a_store_that_others_took_look_refused(tmp_path):
    """hivemind's store answers with the last replica's answer: a stranger's node keeping a plain value with a later
    expiration refuses every subkey, and its (remote, so last) refusal hides that the writer's own node took the
    record. ``store_own`` reads back (``node pause`` and ``node revoke`` report no failure that did not happen)."""
    dhts: list[DHT] = []
    try:
        writer, wkey = start_dht(SwarmConfig(state_dir=tmp_path / "writer", listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(writer)
        stranger = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=[str(m) for m in writer.get_visible_maddrs()],
                       record_validators=[RSASignatureValidator(RSAPrivateKey())])
        dhts.append(stranger)
        stranger.store(history_key(RUN), b"\x00" * 8, expiration_time=get_dht_time() + TEN_YEARS)
        subkey = signed_subkey(record_validator(wkey), writer.peer_id.to_base58())
        value = pack([])
        assert not writer.store(history_key(RUN), value, expiration_time=get_dht_time() + 60, subkey=subkey), \
            "hivemind's store no longer reports the last replica's refusal: store_own's read-back may be moot"
        assert run_async(store_own(writer, history_key(RUN), value, subkey, 60))
    finally:
        for dht in dhts:
            dht.shutdown()
