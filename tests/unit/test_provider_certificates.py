"""In an invite-only run, a provider record counts only with a certificate the reader's gate admits (as progress
reports do): a stranger's signed provider record is not a source of the run's state."""

import asyncio
from types import SimpleNamespace

from hivemind.utils.crypto import RSAPrivateKey

from swarmrun.node.net.records import read_providers
from swarmrun.node.net.swarm import peer_id_of, public_key_bytes, record_validator, signed_subkey
from swarmrun.node.peer.access import AccessGate
from swarmrun.protocol.access import Certificate
from swarmrun.protocol.spec import Spec
from swarmrun.protocol.transfer import ProviderRecord

RUN = "cert-run"


def _spec(owner, access):
    return Spec(run_id=RUN, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                num_examples=1024, owner_key=public_key_bytes(owner), access=access,
                hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 8})


class FakeDHT:
    """What ``dht.get(key, latest=True, return_future=True)`` gives: a future of {subkey: item}."""

    def __init__(self, records):
        self.records = records

    def get(self, key, latest=True, return_future=True):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in self.records.items()}))
        return fut


def _record(cert=b""):
    return ProviderRecord(step=3, manifest_hash="a" * 64, state_hash="b" * 64, total_bytes=10, time=1.0,
                          certificate=cert)


def test_provider_records_of_an_invite_only_run_need_a_certificate():
    owner, member, stranger = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    ids = {k: peer_id_of(public_key_bytes(k)) for k in (member, stranger)}
    cert = _issue(owner, ids[member])
    assert ProviderRecord.decode(_record(cert).encode()) == _record(cert)
    records = {signed_subkey(record_validator(member), ids[member]): _record(cert).encode(),
               signed_subkey(record_validator(stranger), ids[stranger]): _record().encode()}
    dht = FakeDHT(records)
    closed = asyncio.run(read_providers(dht, RUN, AccessGate(_spec(owner, "invite"))))
    assert set(closed) == {ids[member]}
    opened = asyncio.run(read_providers(dht, RUN, AccessGate(_spec(owner, "open"))))
    assert set(opened) == set(ids.values())


def _issue(owner, peer_id) -> bytes:
    import time

    return Certificate.issue(run_id=RUN, peer_id=peer_id, now=time.time(), ttl=3600.0, signer=owner.sign).encode()


def test_a_provider_serves_no_state_to_a_peer_whose_certificate_was_revoked():
    """What keeps a released pool worker from its old run's state: a provider's serving admission (``admit_open``)
    asks its gate, which refuses a peer the owner's newest revocation list (read from the DHT) names, however valid
    its certificate; before the revocation the same request is served."""
    import time

    from swarmrun.node.net.records import owner_subkey
    from swarmrun.node.net.serve import admit_open
    from swarmrun.protocol.access import revoke

    owner, member = RSAPrivateKey(), RSAPrivateKey()
    member_id = peer_id_of(public_key_bytes(member))
    spec = _spec(owner, "invite")
    gate = AccessGate(spec)
    request = SimpleNamespace(spec_hash=spec.spec_hash(), credentials=_issue(owner, member_id))
    serves = admit_open(spec.spec_hash(), gate)
    assert serves(request, member_id) is None
    revocations = revoke(None, run_id=RUN, peers=[member_id], now=time.time(), signer=owner.sign)
    asyncio.run(gate.refresh(FakeDHT({owner_subkey(public_key_bytes(owner)): revocations.encode()})))
    assert "revoked" in serves(request, member_id)
    assert serves(SimpleNamespace(spec_hash=spec.spec_hash(), credentials=None), "QmStranger" + "x" * 30) is not None
