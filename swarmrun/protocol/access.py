"""Access control, sans-IO: invite certificates, revocations, and the one admission decision.

A run's access policy is fixed in its signed spec: ``open`` (anyone who knows the run) or ``invite``. Under
``invite`` the run's owner key signs short-lived certificates, each naming one peer id (the peer's p2pd
identity, which libp2p authenticates on every stream); the owner revokes a peer by publishing a signed
revocation list. ``admit`` is the single decision every enforcement point calls (state serving and
fetching, averaging group admission, progress reports and votes, pause).

Signatures are made and checked through injected callables (``signer(data) -> signature``,
``verifier(public_key, data, signature) -> bool``), so this module stays free of crypto and IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from swarmrun.protocol.codec import message, pack, require
from swarmrun.protocol.errors import RemoteProtocolError

ACCESS_VERSION = 1
MAX_CERTIFICATE_BYTES = 8 * 1024
MAX_REVOCATION_BYTES = 256 * 1024
MAX_REVOKED = 4096
MAX_TTL = 366 * 24 * 3600.0

Signer = Callable[[bytes], bytes]
Verifier = Callable[[bytes, bytes, bytes], bool]


def revocation_key(run_id: str) -> str:
    """The owner's signed revocation list of a run."""
    return f"swarmrun.{run_id}.revoked"


def _str(d: Mapping, key: str, max_len: int = 128) -> str:
    v = d.get(key)
    require(isinstance(v, str) and 0 < len(v) <= max_len, f"{key} must be a non-empty string of at most {max_len}")
    return v


def _time(d: Mapping, key: str) -> float:
    v = d.get(key)
    require(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and 0 <= v < 1e11,
             f"{key} must be a time")
    return float(v)


@dataclass(frozen=True, kw_only=True)
class Certificate:
    """The owner's word that ``peer_id`` may take part in ``run_id`` from ``issued_at`` until ``expires_at``."""

    run_id: str
    peer_id: str
    issued_at: float
    expires_at: float
    signature: bytes = b""

    def unsigned_bytes(self) -> bytes:
        return pack(dict(type="certificate", version=ACCESS_VERSION, run_id=self.run_id, peer_id=self.peer_id,
                         issued_at=self.issued_at, expires_at=self.expires_at))

    @classmethod
    def issue(cls, *, run_id: str, peer_id: str, now: float, ttl: float, signer: Signer) -> Certificate:
        """A certificate signed by the owner (``signer``), valid ``ttl`` seconds from ``now``.

        Raises:
            ValueError: ``ttl`` is not in (0, 366 days].
        """
        if not 0 < ttl <= MAX_TTL:
            raise ValueError(f"ttl must be more than 0 and at most 366 days, got {ttl:.0f}s")
        unsigned = cls(run_id=run_id, peer_id=peer_id, issued_at=float(now), expires_at=float(now) + ttl)
        return cls(run_id=run_id, peer_id=peer_id, issued_at=unsigned.issued_at, expires_at=unsigned.expires_at,
                   signature=bytes(signer(unsigned.unsigned_bytes())))

    def encode(self) -> bytes:
        return pack(dict(type="certificate", version=ACCESS_VERSION, run_id=self.run_id, peer_id=self.peer_id,
                         issued_at=self.issued_at, expires_at=self.expires_at, signature=self.signature))

    @classmethod
    def decode(cls, data: Any) -> Certificate:
        """Raises: RemoteProtocolError on any fault (the signature is checked by ``admit``)."""
        d = message(data, "certificate", ACCESS_VERSION, max_size=MAX_CERTIFICATE_BYTES)
        require(isinstance(d.get("signature"), bytes) and 0 < len(d["signature"]) <= 2048, "bad signature field")
        return cls(run_id=_str(d, "run_id", 64), peer_id=_str(d, "peer_id"), issued_at=_time(d, "issued_at"),
                   expires_at=_time(d, "expires_at"), signature=d["signature"])


@dataclass(frozen=True, kw_only=True)
class Revocations:
    """The owner's list of revoked peer ids of a run; a newer list (``issued_at``) replaces an older one."""

    run_id: str
    revoked: frozenset[str]
    issued_at: float
    signature: bytes = b""

    def unsigned_bytes(self) -> bytes:
        return pack(dict(type="revocations", version=ACCESS_VERSION, run_id=self.run_id,
                         revoked=sorted(self.revoked), issued_at=self.issued_at))

    def signed(self, signer: Signer) -> Revocations:
        return Revocations(run_id=self.run_id, revoked=self.revoked, issued_at=self.issued_at,
                           signature=bytes(signer(self.unsigned_bytes())))

    def verify(self, owner_key: bytes, verifier: Verifier) -> bool:
        try:
            return verifier(owner_key, self.unsigned_bytes(), self.signature) is True
        except Exception:
            return False

    def encode(self) -> bytes:
        return pack(dict(type="revocations", version=ACCESS_VERSION, run_id=self.run_id,
                         revoked=sorted(self.revoked), issued_at=self.issued_at, signature=self.signature))

    @classmethod
    def decode(cls, data: Any) -> Revocations:
        """Raises: RemoteProtocolError on any fault."""
        d = message(data, "revocations", ACCESS_VERSION, max_size=MAX_REVOCATION_BYTES)
        revoked = d.get("revoked")
        require(isinstance(revoked, list) and len(revoked) <= MAX_REVOKED
                 and all(isinstance(p, str) and 0 < len(p) <= 128 for p in revoked), "revoked must list peer ids")
        require(isinstance(d.get("signature"), bytes) and len(d["signature"]) <= 2048, "bad signature field")
        return cls(run_id=_str(d, "run_id", 64), revoked=frozenset(revoked), issued_at=_time(d, "issued_at"),
                   signature=d["signature"])


def revoke(current: Optional[Revocations], *, run_id: str, peers: Iterable[str], now: float, signer: Signer,
           unrevoke: bool = False) -> Revocations:
    """The next revocation list: the current one plus (or minus, ``unrevoke``) ``peers``, signed."""
    revoked = set(current.revoked) if current is not None else set()
    revoked = revoked - set(peers) if unrevoke else revoked | set(peers)
    issued = max(float(now), (current.issued_at + 1e-3) if current is not None else 0.0)
    return Revocations(run_id=run_id, revoked=frozenset(revoked), issued_at=issued).signed(signer)


def admit(*, access: str, run_id: str, owner_key: bytes, peer_id: str, credentials: Any, now: float,
          verifier: Verifier, revoked: frozenset[str] = frozenset(), skew: float = 60.0) -> Optional[str]:
    """Whether ``peer_id`` (authenticated by the transport) may take part in the run.

    Returns:
        None to admit, or the reason of the refusal (said to the peer, logged once).
    """
    if access == "open":
        return None
    if access != "invite":
        return f"unknown access policy {access!r}"
    if credentials is None:
        return f"run {run_id!r} is invite-only and no certificate was presented"
    try:
        cert = Certificate.decode(credentials)
    except RemoteProtocolError as e:
        return f"malformed certificate: {e}"
    if cert.run_id != run_id:
        return f"the certificate is for run {cert.run_id!r}"
    if cert.peer_id != peer_id:
        return "the certificate names another peer"
    try:
        signed_by_owner = verifier(owner_key, cert.unsigned_bytes(), cert.signature) is True
    except Exception:
        signed_by_owner = False
    if not signed_by_owner:
        return "the certificate is not signed by the run's owner"
    if now + skew < cert.issued_at:
        return "the certificate is not valid yet"
    if now > cert.expires_at:
        return "the certificate has expired"
    if peer_id in revoked:
        return "this peer's access was revoked by the run's owner"
    return None


def parse_ttl(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` or seconds, to seconds.

    Raises:
        ValueError: not a positive duration.
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    text = text.strip().lower()
    unit = units.get(text[-1:]) if text else None
    number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise ValueError(f"bad duration {text!r}: use e.g. 30m, 12h, 7d") from None
    if not value > 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return value
