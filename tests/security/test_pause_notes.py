"""A stranger forges pause notes (issue 14): "left, written to STORE@999" for the run's trainer, under a plain
subkey naming the trainer, under the trainer's peer id with the stranger's key, and under its own signed subkey.
``node pause`` (``pause_run``, the owner's command) must wait for the trainer's own signed note and report the real
store. Real hivemind DHT nodes on loopback; the trainer is a DHT node publishing what a trainer publishes (its signed
progress report, then its signed note), the attacker a separate node with its own identity and no swarmrun validator.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.cli.snapshot import pause_run
from swarmrun.node.net.records import SPEC_TTL, read_subkeys
from swarmrun.node.net.swarm import SwarmConfig, peer_id_of, public_key_bytes, record_validator, signed_subkey, start_dht
from swarmrun.node.runtime import run_async
from swarmrun.protocol.round import ProgressReport, Role, progress_key, spec_key
from swarmrun.protocol.snapshot import PauseNote, paused_key
from swarmrun.protocol.spec import SignedSpec, Spec

pytestmark = pytest.mark.integration

RUN = "sec-pause"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FORGED = PauseNote(step=999, left=True, where="STORE@999", state_hash="e" * 64, manifest_hash="f" * 64)
REAL = PauseNote(step=4, left=True, where="/real/store@4", state_hash="a" * 64, manifest_hash="b" * 64)


def _publish_run(trainer: DHT, tkey, owner: RSAPrivateKey) -> bytes:
    spec = Spec(run_id=RUN, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                num_examples=1024, owner_key=public_key_bytes(owner),
                hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 8})
    subkey = signed_subkey(record_validator(tkey), trainer.peer_id.to_base58())
    assert trainer.store(spec_key(RUN), SignedSpec.sign(spec, owner.sign).encode(),
                         expiration_time=get_dht_time() + SPEC_TTL, subkey=subkey)  # as every peer publishes it
    report = ProgressReport(step=3, samples=0, samples_per_second=1.0, role=Role.TRAINER, state_hash="a" * 64,
                            time=get_dht_time(), snapshots=True)
    assert trainer.store(progress_key(RUN), report.encode(), expiration_time=get_dht_time() + 60, subkey=subkey)
    return subkey


def _forge(attacker: DHT, akey: RSAPrivateKey, trainer_id: str) -> str:
    """The stranger's three forgeries; returns its own peer id (the signer of the one hivemind accepts)."""
    own = peer_id_of(public_key_bytes(akey))
    validator = RSASignatureValidator(akey)
    exp = get_dht_time() + 250
    attacker.store(paused_key(RUN), FORGED.encode(), expiration_time=exp, subkey=trainer_id.encode())  # unsigned, its name
    attacker.store(paused_key(RUN), FORGED.encode(), expiration_time=exp,
                   subkey=trainer_id.encode() + validator.local_public_key)  # trainer's name, stranger's key
    assert attacker.store(paused_key(RUN), FORGED.encode(), expiration_time=exp,
                          subkey=own.encode() + validator.local_public_key)  # its own signed subkey
    return own


@pytest.mark.timeout(180)
def test_a_strangers_forged_pause_notes_do_not_end_node_pause(tmp_path):
    dhts: list[DHT] = []
    try:
        trainer, tkey = start_dht(SwarmConfig(state_dir=tmp_path / "trainer", listen=tuple(LOOPBACK)), run_ids=[RUN])
        dhts.append(trainer)
        owner = RSAPrivateKey()
        subkey = _publish_run(trainer, tkey, owner)
        maddrs = [str(m) for m in trainer.get_visible_maddrs()]
        akey = RSAPrivateKey()
        attacker = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs,
                       record_validators=[RSASignatureValidator(akey)])
        dhts.append(attacker)
        stranger = _forge(attacker, akey, trainer.peer_id.to_base58())
        # the stranger's own signed note is in the swarm (signed records are hivemind's to accept): it is there
        seen = run_async(read_subkeys(trainer, paused_key(RUN), PauseNote.decode, signed=True))
        assert seen.get(stranger) == FORGED and trainer.peer_id.to_base58() not in seen

        def answer():  # the trainer answers the pause a few seconds later, as a real trainer writing a snapshot would
            time.sleep(4.0)
            trainer.store(paused_key(RUN), REAL.encode(), expiration_time=get_dht_time() + 250, subkey=subkey)

        threading.Thread(target=answer, daemon=True).start()
        t0 = time.monotonic()
        result = asyncio.run(pause_run(RUN, maddrs, key=owner, store="", timeout=40.0, listen=tuple(LOOPBACK)))
        assert result["where"] == REAL.where and result["step"] == REAL.step, result
        assert time.monotonic() - t0 >= 3.5, "node pause ended before the trainer answered"
    finally:
        for dht in dhts:
            dht.shutdown()
