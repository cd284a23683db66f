"""Provider records are signed by the peer they name: the subkey binds the record to that peer's identity."""

import pytest
from hivemind.p2p import PeerID

from swarmrun.node.net.swarm import (ensure_identity, parse_maddrs, peer_id_of, record_validator, signed_subkey,
                                     subkey_owner)
from swarmrun.protocol.errors import UsageError


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


def test_peers_must_name_their_peer_id():
    """A --peers address without /p2p/ID is a usage error with the expected form (p2pd's own "Daemon failed to
    start: invalid p2p multiaddr" reached the user before, as exit 1); --listen addresses need no id."""
    with_id = "/ip4/10.0.0.5/tcp/31337/p2p/QmQ9TJ5y1WkUMw8yoUmFDKVvTv2gdEB3TEYFqcqsT1xbVW"
    assert parse_maddrs([with_id], what="--peers", peer_ids=True) == (with_id,)
    assert parse_maddrs(["/ip4/0.0.0.0/tcp/31337"], what="--listen") == ("/ip4/0.0.0.0/tcp/31337",)
    with pytest.raises(UsageError, match=r"no /p2p/ part.*/p2p/Qm"):
        parse_maddrs(["/ip4/10.0.0.5/tcp/31337"], what="--peers", peer_ids=True)
