"""Access control on a peer: its own credentials, the owner's revocations, and the gate every path calls.

The decision itself is ``protocol.access.admit``; this module holds what it needs on a peer (the spec, this
peer's certificate, the current revocation list read from the DHT) and the commands' files (certificates
are exchanged as a small text file: the certificate's msgpack, base64).
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from pathlib import Path
from typing import Optional

from hivemind import DHT

from swarmrun.protocol.access import Certificate, Revocations, admit, revocation_key
from swarmrun.protocol.errors import AccessRefused, ProtocolError, UsageError
from swarmrun.protocol.spec import Spec
from swarmrun.node.net.swarm import verify_signature
from swarmrun.node.net.records import owner_subkey
from swarmrun.node.net.records import read_latest

logger = logging.getLogger("swarmrun.access")

CERT_HEADER = "swarmrun-invite-v1"


def read_certificate_file(path: str | Path) -> bytes:
    """The certificate bytes in a file written by ``node invite``.

    Raises:
        UsageError: unreadable or not a certificate file.
    """
    try:
        text = Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise UsageError(f"cannot read invite file {path}: {e.strerror}") from None
    header, _, body = text.partition(":")
    try:
        if header != CERT_HEADER:
            raise ValueError("missing header")
        data = base64.b64decode(body.strip(), validate=True)
        Certificate.decode(data)
    except (ValueError, binascii.Error, ProtocolError) as e:
        raise UsageError(f"{path} is not a swarmrun invite ({e})") from None
    return data


def certificate_text(cert: Certificate) -> str:
    return f"{CERT_HEADER}:{base64.b64encode(cert.encode()).decode()}"


class AccessGate:
    """Who may take part in this run, as this peer knows it: ``check(peer_id, credentials)``.

    Args:
        spec: the run's verified spec (its access policy and owner key).
        credentials: this peer's certificate (bytes), presented on every request it makes.
    """

    def __init__(self, spec: Spec, *, credentials: Optional[bytes] = None):
        self.spec = spec
        self.credentials = credentials
        self.revocations: Optional[Revocations] = None
        self._logged: set[str] = set()

    @property
    def revoked(self) -> frozenset[str]:
        return self.revocations.revoked if self.revocations is not None else frozenset()

    def check(self, peer_id: str, credentials) -> Optional[str]:
        """None to admit ``peer_id`` (authenticated by libp2p), else the reason."""
        reason = admit(access=self.spec.access, run_id=self.spec.run_id, owner_key=self.spec.owner_key,
                       peer_id=peer_id, credentials=credentials or None, now=time.time(), verifier=verify_signature,
                       revoked=self.revoked)
        if reason is not None and peer_id not in self._logged:  # once per peer, not per attempt
            self._logged.add(peer_id)
            logger.warning(f"refused peer {peer_id}: {reason}")
        return reason

    def check_self(self, peer_id: str) -> None:
        """Refuse to start without access of one's own.

        Raises:
            AccessRefused: this peer has no valid certificate for an invite-only run.
        """
        reason = admit(access=self.spec.access, run_id=self.spec.run_id, owner_key=self.spec.owner_key,
                       peer_id=peer_id, credentials=self.credentials, now=time.time(), verifier=verify_signature,
                       revoked=self.revoked)
        if reason is not None:
            raise AccessRefused(f"cannot take part in run {self.spec.run_id!r}: {reason} (ask the run's owner for "
                                f"`node invite {self.spec.run_id} --peer {peer_id}` and pass it with --invite FILE)")

    async def refresh(self, dht: DHT) -> None:
        """Read the owner's newest revocation list from the DHT (a forged or older one is ignored)."""
        found = await read_latest(dht, revocation_key(self.spec.run_id))
        item = found.value.get(owner_subkey(self.spec.owner_key)) if found is not None and isinstance(found.value, dict) \
            else None
        if item is None:
            return
        try:
            revocations = Revocations.decode(item.value)
        except ProtocolError:
            return
        if revocations.run_id != self.spec.run_id or not revocations.verify(self.spec.owner_key, verify_signature):
            return
        if self.revocations is None or revocations.issued_at > self.revocations.issued_at:
            self.revocations = revocations






