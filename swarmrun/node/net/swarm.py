"""Swarm setup on hivemind: the peer's identity, its DHT + P2P, and process hygiene.

One identity per peer: the RSA key in the state directory is the p2pd identity (hence the peer id)
and the key that signs what the peer publishes (the spec of a run it creates).
"""

from __future__ import annotations

import asyncio
import errno
import glob
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.multiaddr import Multiaddr

from swarmrun.node.net.pipes import whole_messages
from swarmrun.node.net.validator import RunRecordValidator
from swarmrun.node.output import quiet_hivemind
from swarmrun.protocol.errors import RunNotFound, SwarmrunError, UsageError

quiet_hivemind()  # hivemind is imported now: its logs follow ours (quiet unless -v)
IDENTITY_FILE = "identity.key"


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    """How a peer joins the swarm."""

    state_dir: Path
    initial_peers: tuple[str, ...] = ()
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce: tuple[str, ...] = ()
    bootstrap_timeout: float = 15.0  # seconds to reach the initial peers


def parse_maddrs(values: Sequence[str], *, what: str, peer_ids: bool = False) -> tuple[str, ...]:
    """Validate multiaddrs given by a user; ``peer_ids``: each must name its peer (``/p2p/ID``), as the peers
    to dial must (p2pd refuses one without, with its own "Daemon failed to start: invalid p2p multiaddr").

    Raises:
        UsageError: one of them is not a multiaddr, or (``peer_ids``) names no peer.
    """
    example = "expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/QmXyz... (what the peer printed as it started)"
    out = []
    for value in values:
        try:
            maddr = Multiaddr(value)
        except Exception as e:  # multiaddr raises several unrelated types
            raise UsageError(f"{what}: {value!r} is not a multiaddr ({e}); {example}") from None
        if peer_ids and "p2p" not in [p.name for p in maddr.protocols()]:
            raise UsageError(f"{what}: {value!r} names no peer (no /p2p/ part); {example}")
        out.append(value)
    return tuple(out)


def ensure_identity(state_dir: Path) -> tuple[str, RSAPrivateKey]:
    """The path of this peer's identity file (created on first use) and its private key.

    Raises:
        UsageError: the state directory cannot be created or the identity cannot be read.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create state directory {state_dir}: {e.strerror}") from None
    path = state_dir / IDENTITY_FILE
    if not path.exists():
        P2P.generate_identity(str(path))
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": proto.data})
    except Exception as e:
        raise UsageError(f"identity file {path} is unreadable or not an RSA key: {e}") from None
    return str(path), key


def public_key_bytes(key: RSAPrivateKey) -> bytes:
    return key.get_public_key().to_bytes()


def verify_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """The verifier injected into ``protocol.spec.SignedSpec.verify``."""
    try:
        return RSAPublicKey.from_bytes(public_key).verify(data, signature)
    except Exception:
        return False


class OwnerSigner(RSASignatureValidator):
    """hivemind's signed-record validator, able to sign with more keys than the peer's identity: the coordinator's
    peer writes the owner records (the revocation list) of every pool run, each under that run's own owner key.

    One narrow subclass of ``RSASignatureValidator`` (which signs only under its one key, and merges no second
    instance); overridden:
      - ``sign_value``: a record whose key or subkey carries one of the held owner keys is signed with that key;
        any other as hivemind does (under the identity key, or not at all);
      - ``merge_with``: another ``OwnerSigner`` adds its keys to this one, so ``DHT.add_validators`` (the only way
        into the DHT's process) gives a running DHT one more run's key (``hold_owner_keys``).
    Validation is hivemind's: a record is checked against the key its subkey names, whoever signed it.
    """

    def __init__(self, private_key: Optional[RSAPrivateKey] = None, owners: Sequence[RSAPrivateKey] = ()):
        super().__init__(private_key)
        self._owners = {self.PUBLIC_KEY_FORMAT.replace(b"_key_", k.get_public_key().to_bytes()): k for k in owners}

    def sign_value(self, record) -> bytes:
        for marker, key in self._owners.items():
            if marker in record.key or marker in record.subkey:
                return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", key.sign(self._serialize_record(record)))
        return super().sign_value(record)

    def merge_with(self, other) -> bool:
        if isinstance(other, OwnerSigner):
            self._owners.update(other._owners)
            return True
        return super().merge_with(other)


def record_validator(key: Optional[RSAPrivateKey] = None) -> RSASignatureValidator:
    """hivemind's signed-record validator with this peer's identity key: a subkey made by ``signed_subkey`` can only
    be written by the owner of that key (every DHT of swarmrun runs it; a reader strips the signatures with it)."""
    return OwnerSigner(key)


def hold_owner_keys(dht: DHT, keys: Sequence[RSAPrivateKey]) -> None:
    """Let a running DHT sign owner records with ``keys`` (runs this process owns besides its identity's)."""
    dht.add_validators([OwnerSigner(keys[0], keys)])


def new_key() -> RSAPrivateKey:
    """A fresh RSA key of the kind every identity and owner key is (hivemind's 2048-bit RSA)."""
    return RSAPrivateKey()


def key_bytes(key: RSAPrivateKey) -> bytes:
    """A private key as bytes (DER) to keep, e.g. in the coordinator's database: ``load_key`` reads it back."""
    return key.to_bytes()


def load_key(data: bytes) -> RSAPrivateKey:
    """A private key from ``key_bytes``.

    Raises:
        ValueError: not such a key.
    """
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    try:
        key.__setstate__({"_private_key": bytes(data)})
    except Exception as e:
        raise ValueError(f"not an RSA private key: {e}") from None
    return key


def run_validators(key: Optional[RSAPrivateKey], run_ids: Sequence[str] = ()) -> list:
    """The validators of every DHT of swarmrun: hivemind's signed-record validator with this peer's key, and the
    run-record validator (``net.validator``) for the runs this process uses, which relies on the first to
    verify signatures. A run learned later: ``net.validator.watch_runs``."""
    return [record_validator(key), RunRecordValidator(run_ids, identify=peer_id_of)]


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH form (hivemind's serialization)."""
    der = serialization.load_ssh_public_key(public_key).public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))).decode()


def signed_subkey(validator: RSASignatureValidator, peer_id: str) -> bytes:
    """A DHT subkey that names this peer and carries its public key, so hivemind signs the record."""
    return peer_id.encode() + validator.local_public_key


def subkey_owner(subkey) -> Optional[str]:
    """The peer id a signed subkey names, if its public key is that peer's identity (None otherwise: a record
    under someone else's name, or an unsigned one)."""
    if not isinstance(subkey, bytes):
        return None
    peer, marker, rest = subkey.partition(b"[owner:")
    if not marker or not rest.endswith(b"]"):
        return None
    try:
        claimed = peer.decode()
        return claimed if peer_id_of(rest[:-1]) == claimed else None
    except Exception:
        return None


def sweep_stale_sockets(tmp: str = "/tmp") -> int:
    """Remove ``hivemind-*.sock`` files whose daemon is dead (nobody accepts on them). Returns the count."""
    removed = 0
    for path in glob.glob(os.path.join(tmp, "hivemind-*.sock")):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            try:
                s.connect(path)
                continue  # alive
            except (ConnectionRefusedError, FileNotFoundError):
                pass
            except OSError:
                continue  # busy or unknown: leave it
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def unreachable(peers: Sequence[str]) -> str:
    """The message of a failed bootstrap: what was tried and what to check, not the daemon's own text (logged
    with -v)."""
    return (f"could not reach any of the peers {', '.join(peers)}: none answered; check that a peer of the run is "
            f"running there, that the address is the one it printed (its /p2p/ id included) and that the port is open")


def check_ports_free(listen: Sequence[str]) -> None:
    """p2pd binds with SO_REUSEPORT, so a second peer on a busy ``--listen`` port starts and shares it silently; a
    plain bind of each fixed TCP port first tells a busy one.

    Raises:
        UsageError: a fixed port is in use.
    """
    for maddr in listen:
        parts = maddr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or parts[3] in ("", "0"):
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT is not "in use"
            try:
                s.bind((parts[1], int(parts[3])))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UsageError(f"cannot listen on {maddr}: address already in use (another peer?)") from None


class SwarmDHT(DHT):
    """hivemind's DHT, its process reading its control pipe in whole messages (``net.pipes``: under uvloop a long
    message was torn and the DHT process died). The only override: ``run``, the process's entry."""

    def run(self) -> None:
        self._inner_pipe = whole_messages(self._inner_pipe)
        super().run()


def start_dht(config: SwarmConfig, *, run_ids: Sequence[str] = ()) -> tuple[DHT, RSAPrivateKey]:
    """Start this peer's DHT (and its p2pd) with its identity, validating the records of ``run_ids``.

    Raises:
        UsageError: a busy port, an identity in use by another live peer.
        RunNotFound: none of the initial peers could be reached.
    """
    check_ports_free(config.listen)
    identity_path, key = ensure_identity(config.state_dir)
    sweep_stale_sockets()
    kwargs = dict(
        initial_peers=list(config.initial_peers) or None,
        start=True,
        host_maddrs=list(config.listen),
        identity_path=identity_path,
        client_mode=False,
        startup_timeout=config.bootstrap_timeout,
        record_validators=run_validators(key, run_ids),
    )
    if config.announce:
        kwargs["announce_maddrs"] = list(config.announce)
    try:
        dht = SwarmDHT(**kwargs)
    except Exception as e:
        raise _classify_start_error(e, config) from None
    return dht, key


async def ping_peers(_dht: DHT, node, *, peer_ids: Sequence[str], timeout: float) -> list[str]:
    """Ping these peers from this DHT node (run in the DHT's process: ``DHT.run_coroutine``); the ones that answered.

    hivemind drops a node that did not answer a request from its routing table and never looks for it again, nor
    does that node look for this one: after a partition heals, each side had forgotten the other for good (a 3-peer
    namespace run: the cut-off peer read no report of the others in the 40 s after the heal, at step 8 while they
    went on to 756). An answered ping puts each node back in the other's table (``DHTProtocol.call_ping``); p2pd
    still knows the addresses of a peer it was connected to."""
    async def one(peer: str) -> bool:
        try:
            return await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(peer)), timeout) is not None
        except Exception:
            return False

    answered = await asyncio.gather(*(one(p) for p in peer_ids))
    return [p for p, ok in zip(peer_ids, answered) if ok]


def _classify_start_error(e: Exception, config: SwarmConfig) -> SwarmrunError:
    text = str(e)
    low = text.lower()
    if "already taken" in low:
        return UsageError(f"the identity in {config.state_dir} is in use by another live peer; give each peer its own --state-dir")
    if "address already in use" in low or "bind" in low:
        return UsageError(f"cannot listen on {', '.join(config.listen)}: address already in use")
    if config.initial_peers and ("failed to connect" in low or "bootstrap" in low or "timeout" in low or "no peers" in low):
        return RunNotFound(unreachable(config.initial_peers))
    return SwarmrunError(f"could not start the swarm: {type(e).__name__}: {text.splitlines()[0] if text else ''}")
