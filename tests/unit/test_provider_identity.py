"""Provider records are signed by the peer they name: the subkey binds the record to that peer's identity."""

from hivemind.p2p import PeerID

from swarmrun.node.net.swarm import ensure_identity, peer_id_of, record_validator, signed_subkey, subkey_owner


def test_signed_subkey_names_its_owner_and_no_one_else(tmp_path):
    path, key = ensure_identity(tmp_path / "a")
    _, other = ensure_identity(tmp_path / "b")
    me = PeerID.from_identity(open(path, "rb").read()).to_base58()
    assert peer_id_of(key.get_public_key().to_bytes()) == me  # the p2pd identity is the signing key
    assert subkey_owner(signed_subkey(record_validator(key), me)) == me
    # a record under my name signed with another key is not mine
    assert subkey_owner(signed_subkey(record_validator(other), me)) is None
    for bad in (me, me.encode(), b"[owner:garbage]", b"x[owner:" + b"\xff" * 40 + b"]", 7, None):
        assert subkey_owner(bad) is None
