"""The coordinator as the owner of its pool runs (isolation): every pool run is invite-only, and the coordinator
holds its owner key.

- **owner key**: one per run, made at submission and kept in the registry with the run (one transaction), so a
  coordinator restarted on the same database still owns its runs. It never leaves the coordinator: a worker gets
  a certificate, never the key. The database holds each key sealed (``KeySeal``: Fernet, AES-128-CBC with an
  HMAC) under a secret that lives only in the coordinator's state dir (``owner-keys.secret``, mode 0600): a copy
  of the database alone, a dump or a backup admits no one. Losing that file loses the pool runs' ownership (their
  snapshots stay readable); back it up with the coordinator's identity.
- **spec**: the leader's agent builds the new run's spec (the task is installed there, not necessarily here) with
  the run's owner key and ``access = invite``; the coordinator checks it names the submitted run and task and
  signs it once (``sign_spec``); the registry keeps the first signed spec, so every start of the run uses the
  same one (``node join --spec FILE``).
- **certificate**: issued to the peer id an assigned worker's agent names (``issue_certificate``); a worker that
  is not assigned to the run gets none.
- **revocation**: a released worker's certificate is revoked ``revoke_after`` seconds after its release, time for
  its graceful leave (a revoked peer leaves at once with exit code 4, which would cut its leave and its last
  snapshot short); ``due_revocations`` decides which, the coordinator's peer publishes them (``PoolPeer``). A peer
  id once released is never certified again for that run: an agent starts each assignment with a new identity.

The certificates, revocation lists and their checks are ``protocol.access``'s, as ``node invite`` uses them.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Iterable, Mapping

from swarmrun.protocol.codec import unpack
from swarmrun.protocol.errors import ProtocolError, SwarmrunError, UsageError
from swarmrun.protocol.spec import MAX_SPEC_SIZE, SignedSpec, Spec

__all__ = ["CERTIFICATE_TTL", "REVOKE_AFTER", "CLEAR_KEYS", "KeySeal", "SEAL_FILE", "new_owner_key", "public_owner_key", "issue_certificate", "sign_spec",
           "due_revocations", "check_peer_id"]

CERTIFICATE_TTL = 7 * 24 * 3600.0  # a certificate outlives any assignment: a release ends it by revocation
REVOKE_AFTER = 60.0  # > an agent's stop timeout (≤ 25 s) plus a peer's own leave bound (30 s)
SEAL_FILE = "owner-keys.secret"  # in the coordinator's state dir
_SEALED = b"gAAAAA"  # how every Fernet token begins (version byte 0x80, then the timestamp's high zero bytes)


class KeySeal:
    """Seals the owner keys the registry stores, under a secret kept in the coordinator's state dir.

    A key stored before sealing existed (DER bytes in the clear) still opens, and the registry seals it in place
    when it opens the database with a seal (``Registry(..., seal=...)``).
    """

    def __init__(self, secret: bytes, *, where: str = "the given secret"):
        from cryptography.fernet import Fernet

        self._fernet, self.where = Fernet(secret), where

    @classmethod
    def at(cls, state_dir: Path) -> "KeySeal":
        """The seal of the coordinator whose state dir this is, its secret made (0600) on first use."""
        from cryptography.fernet import Fernet

        path = Path(state_dir) / SEAL_FILE
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key())
        return cls(path.read_bytes().strip(), where=str(path))

    @staticmethod
    def is_sealed(stored: bytes) -> bool:
        return bytes(stored).startswith(_SEALED)

    def seal(self, owner_key: bytes) -> bytes:
        return self._fernet.encrypt(bytes(owner_key))

    def seal_clear(self, stored: bytes) -> bytes:
        """What the registry stored, sealed if it was in the clear (an older coordinator's)."""
        return bytes(stored) if self.is_sealed(stored) else self.seal(stored)

    def open(self, stored: bytes) -> bytes:
        """The owner key (DER) of what the registry stored. Raises SwarmrunError: sealed under another secret."""
        from cryptography.fernet import InvalidToken

        if not self.is_sealed(stored):
            return bytes(stored)
        try:
            return self._fernet.decrypt(bytes(stored))
        except InvalidToken:
            raise SwarmrunError(f"the pool's owner keys were sealed under another secret than {self.where} "
                                f"(is this the coordinator's own --state-dir?)") from None


class _ClearKeys:
    """No seal: keys stored in the clear (a registry opened without the coordinator's seal: ``user add``, tools)."""

    def seal(self, owner_key: bytes) -> bytes:
        return bytes(owner_key)

    def open(self, stored: bytes) -> bytes:
        if KeySeal.is_sealed(stored):
            raise SwarmrunError("this run's owner key is sealed: only the coordinator (with its --state-dir) can use it")
        return bytes(stored)


CLEAR_KEYS = _ClearKeys()


def new_owner_key() -> bytes:
    """A new run's owner key (private, DER bytes: what the registry keeps)."""
    from swarmrun.node import key_bytes, new_key

    return key_bytes(new_key())


def public_owner_key(owner_key: bytes) -> bytes:
    """The public key a spec names as its owner (hivemind's OpenSSH form) of a private ``owner_key``."""
    from swarmrun.node import load_key, public_key_bytes

    return public_key_bytes(load_key(owner_key))


def check_peer_id(value) -> str:
    """A libp2p peer id as an agent sends it (base58). Raises UsageError."""
    if not (isinstance(value, str) and 20 <= len(value) <= 128 and value.isalnum() and value.isascii()):
        raise UsageError("peer_id must be a libp2p peer id (base58)")
    return value


def issue_certificate(owner_key: bytes, *, run_id: str, peer_id: str, now: float, ttl: float = CERTIFICATE_TTL) -> str:
    """A certificate for ``peer_id`` in ``run_id``, signed with the run's owner key, as ``node invite`` writes it."""
    from swarmrun.node import certificate_text, load_key
    from swarmrun.protocol.access import Certificate

    cert = Certificate.issue(run_id=run_id, peer_id=check_peer_id(peer_id), now=now, ttl=ttl,
                             signer=load_key(owner_key).sign)
    return certificate_text(cert)


def sign_spec(owner_key: bytes, *, run_id: str, task: str, unsigned: bytes) -> bytes:
    """The signed spec (``SignedSpec.encode()``) of a new pool run, from the unsigned spec its leader's agent built.

    Raises:
        UsageError: not a spec, or one that is not the submitted run's (another run id or task, another owner key,
            an access policy other than invite).
    """
    from swarmrun.node import load_key

    try:
        spec = Spec.from_dict(unpack(unsigned, max_size=MAX_SPEC_SIZE))
    except (ProtocolError, UsageError, TypeError, ValueError) as e:
        raise UsageError(f"not a spec: {e}") from None
    if spec.run_id != run_id or spec.task != task:
        raise UsageError(f"the spec is of run {spec.run_id!r} (task {spec.task!r}), not of run {run_id!r} (task {task!r})")
    if spec.owner_key != public_owner_key(owner_key):
        raise UsageError(f"the spec names another owner than run {run_id!r}'s (the coordinator's key)")
    if spec.access != "invite":
        raise UsageError(f"a pool run is invite-only; the spec says access={spec.access!r}")
    return SignedSpec.sign(spec, load_key(owner_key).sign).encode()


def due_revocations(now: float, released: Iterable[Mapping], revoke_after: float = REVOKE_AFTER) -> dict[str, frozenset[str]]:
    """The peer ids each run's revocation list must hold now: every certificate released ``revoke_after`` ago or
    more (``released``: rows with ``run_id``, ``peer_id``, ``released_at``). Runs with none are left out."""
    out: dict[str, set[str]] = {}
    for row in released:
        if row["released_at"] is not None and now - row["released_at"] >= revoke_after:
            out.setdefault(row["run_id"], set()).add(row["peer_id"])
    return {run_id: frozenset(peers) for run_id, peers in out.items()}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
