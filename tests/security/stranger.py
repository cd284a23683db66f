"""The attacker of the real-peer security tests: a separate hivemind DHT node on loopback, with its own identity, no
invite and no swarmrun validator (only hivemind's signature validator, so it can also write its own signed subkeys,
as any stranger can). It bootstraps from a peer of the run, as anyone who can reach one peer can."""

from __future__ import annotations

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarmrun.node.net.swarm import IDENTITY_FILE, ensure_identity, peer_id_of, public_key_bytes

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TEN_YEARS = 10 * 365 * 86400.0
PLANTED = b"\x00" * 8  # the audit's value: 8 plain bytes


class Stranger:
    def __init__(self, maddr: str):
        self.key = RSAPrivateKey()
        self.validator = RSASignatureValidator(self.key)
        self.dht = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=[maddr], record_validators=[self.validator])
        self.peer_id = peer_id_of(public_key_bytes(self.key))
        self.public_key = public_key_bytes(self.key)

    def plant(self, *keys: str) -> None:
        """A plain 8-byte value under each key, expiring ten years out; its own node holds and serves it."""
        for key in keys:
            self.dht.store(key, PLANTED, expiration_time=get_dht_time() + TEN_YEARS)
            held = self.dht.get(key, latest=True)
            assert held is not None, f"the stranger's node does not hold {key}"

    def own_subkey(self) -> bytes:
        """Its own signed subkey (``<peer id>[owner:<its key>]``): hivemind accepts values it signed under it."""
        return self.peer_id.encode() + self.validator.local_public_key

    def store(self, key: str, value: bytes, subkey: bytes, ttl: float = 250.0) -> bool:
        """Stores as hivemind does (its own node among the replicas); the result is the last replica's answer."""
        return bool(self.dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey))

    def shutdown(self) -> None:
        self.dht.shutdown()


def identity_peer_id(state_dir) -> str:
    """The peer id `node join --state-dir STATE_DIR` will have (its identity made now)."""
    ensure_identity(state_dir)
    return PeerID.from_identity((state_dir / IDENTITY_FILE).read_bytes()).to_base58()
