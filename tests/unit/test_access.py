"""Access control's pure parts: certificates, revocations, the admission decision, durations."""

import pytest

from swarmrun.node.net.swarm import ensure_identity, public_key_bytes, verify_signature
from swarmrun.protocol.access import Certificate, Revocations, admit, parse_ttl, revoke
from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.errors import RemoteProtocolError

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    return ensure_identity(root / "owner")[1], ensure_identity(root / "other")[1]


def _admit(owner, cert, *, peer="QmPeer", now=NOW, revoked=frozenset(), access="invite", run="run"):
    return admit(access=access, run_id=run, owner_key=public_key_bytes(owner), peer_id=peer,
                 credentials=cert.encode() if isinstance(cert, Certificate) else cert, now=now,
                 verifier=verify_signature, revoked=revoked)


def test_owner_signed_certificate_admits_its_peer_until_it_expires(keys):
    owner, other = keys
    cert = Certificate.issue(run_id="run", peer_id="QmPeer", now=NOW, ttl=3600, signer=owner.sign)
    assert Certificate.decode(cert.encode()) == cert
    assert _admit(owner, cert) is None
    assert "expired" in _admit(owner, cert, now=NOW + 3601)
    assert "not valid yet" in _admit(owner, cert, now=NOW - 3600)
    assert "another peer" in _admit(owner, cert, peer="QmOther")
    assert "for run" in _admit(owner, cert, run="other-run")
    assert "revoked" in _admit(owner, cert, revoked=frozenset({"QmPeer"}))
    assert "no certificate" in _admit(owner, None)
    assert _admit(owner, None, access="open") is None  # open runs need none
    forged = Certificate.issue(run_id="run", peer_id="QmPeer", now=NOW, ttl=3600, signer=other.sign)
    assert "not signed by the run's owner" in _admit(owner, forged)


def test_tampered_certificate_is_refused(keys):
    owner, _ = keys
    cert = Certificate.issue(run_id="run", peer_id="QmPeer", now=NOW, ttl=60, signer=owner.sign)
    d = unpack(cert.encode())
    for field, value in (("expires_at", NOW + 10**6), ("peer_id", "QmMallory"), ("run_id", "run2")):
        tampered = pack(dict(d, **{field: value}))
        assert _admit(owner, tampered, peer=value if field == "peer_id" else "QmPeer",
                      run=value if field == "run_id" else "run") is not None
    for bad in (b"", b"\xc1", pack({"type": "certificate"}), pack([1] * 5), b"x" * 10_000, 17):
        assert "malformed" in _admit(owner, bad)


def test_revocations_are_signed_and_only_grow_newer(keys):
    owner, other = keys
    first = revoke(None, run_id="run", peers=["QmA", "QmB"], now=NOW, signer=owner.sign)
    assert first.verify(public_key_bytes(owner), verify_signature)
    assert not first.verify(public_key_bytes(other), verify_signature)
    assert Revocations.decode(first.encode()) == first
    second = revoke(first, run_id="run", peers=["QmA"], now=NOW - 100, signer=owner.sign, unrevoke=True)
    assert second.revoked == {"QmB"} and second.issued_at > first.issued_at  # newer even with a late clock
    forged = Revocations(run_id="run", revoked=frozenset(), issued_at=NOW + 1, signature=b"x" * 256)
    assert not forged.verify(public_key_bytes(owner), verify_signature)
    with pytest.raises(RemoteProtocolError):
        Revocations.decode(pack(dict(unpack(first.encode()), revoked=["x"] * 5000)))


def test_ttl():
    assert parse_ttl("7d") == 7 * 86400 and parse_ttl("30m") == 1800 and parse_ttl("90") == 90
    for bad in ("", "0", "-1d", "soon", "1y"):
        with pytest.raises(ValueError):
            parse_ttl(bad)
    with pytest.raises(ValueError):
        Certificate.issue(run_id="r", peer_id="p", now=NOW, ttl=400 * 86400, signer=lambda b: b"s")
