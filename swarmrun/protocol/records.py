"""The schema table of every DHT key of a run, and the check every run record passes (sans-IO).

A run lives in its DHT records, and anyone who reaches one peer of the swarm can write them. ``RUN_KEYS`` names
every key a run's peers write or read, each with its schema: the message type its value decodes as, who may
write it (its subkey kind), how far ahead its expiration may lie and how large it may be. ``check_record`` is
the one decision, a pure function of (schema, record, now); ``node.net.validator`` applies it to every record
hivemind stores or receives in a find response, so a record that breaks the table never reaches storage or a
reader. Nothing writes or reads a run key that is not in this table (``tests/unit/test_records.py`` checks
every key builder of the protocol).

Records as hivemind hands them to a validator: ``subkey`` is the msgpack encoding of the subkey, ``b"\\xc0"``
(msgpack None) for a plain value; ``value`` is the msgpack encoding of what the writer stored (our messages
are ``bytes``), with the writer's signature already stripped by hivemind's ``RSASignatureValidator``, which
verifies it first. A signed subkey is ``<peer id>[owner:<public key>]`` (``node.swarm.signed_subkey``): that
validator refuses a value not signed by that key, this module that the subkey has that form (and, with an
injected ``identify``, that the peer id is the key's).
"""

from __future__ import annotations

import enum
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from .access import MAX_REVOCATION_BYTES, MAX_TTL, Revocations, revocation_key
from .codec import unpack
from .errors import Reject, Rejection, RemoteProtocolError, SwarmrunError
from .round import MAX_REPORT_BYTES, VOTE_SLOTS, ProgressReport, Vote, progress_key, spec_key, vote_key
from .snapshot import MAX_HISTORY, Amendment, PauseNote, PauseRecord, history_key, pause_key, paused_key
from .spec import MAX_SPEC_SIZE, RUN_ID, SignedSpec
from .transfer import MAX_RECORD_BYTES, ProviderRecord, providers_key

__all__ = [
    "SubkeyKind", "RecordSchema", "RUN_KEYS", "MAX_CLOCK_SKEW", "MAX_SUBKEY_BYTES", "PLAIN_SUBKEY", "GROUP_BITS",
    "check_record", "run_keys", "schema_of_key", "averager_prefix", "group_bits", "group_key", "decode_history",
]

#: seconds an expiration may lie beyond ``now + ttl``: the writer's clock may run ahead of the validator's
MAX_CLOCK_SKEW = 30.0
#: a signed subkey is a peer id (~52 chars) and an OpenSSH RSA public key (~400 bytes for 2048 bits)
MAX_SUBKEY_BYTES = 2048
#: how hivemind encodes "no subkey" (msgpack None): the subkey of every plain value
PLAIN_SUBKEY = b"\xc0"
#: matchmaking group bits: hivemind's averager declares itself under ``<prefix>.0b<bits>``; a step's group key is
#: its step mod 2**GROUP_BITS, so the keys of a run are a finite set (peers at steps that share a key are told
#: apart by admission, which checks the step)
GROUP_BITS = 8
_MSGPACK_BIN_HEADER = 5  # a value is its message wrapped as msgpack bin: at most 5 bytes more
_KEY_RUN = re.compile(rf"swarmrun[._]({RUN_ID.pattern})\.")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58


class SubkeyKind(enum.Enum):
    """Who may write a record under a key."""

    NONE = "none"  # a plain value, no subkeys (anyone: the value must carry its own proof, e.g. a signed spec)
    PEER = "peer"  # a subkey per peer naming it, unsigned (hivemind's matchmaking declarations)
    SIGNED = "signed"  # a subkey per peer, ``<peer id>[owner:<its key>]``: only that peer writes it
    OWNER = "owner"  # one subkey ``[owner:<key>]``: only the holder of that key (the run's owner) writes it


def averager_prefix(run_id: str) -> str:
    """The prefix of a run's hivemind averager: its matchmaking keys are ``<prefix>.0b<bits>``."""
    return f"swarmrun_{run_id}"


def group_bits(step: int) -> str:
    """The matchmaking group bits of the round for ``step`` (its slot in a ring of ``2**GROUP_BITS``)."""
    return format(step % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


def group_key(run_id: str, step: int) -> str:
    """Subkey per averager (its raw peer id, hivemind's format): looking for a group for ``step``'s round."""
    return f"{averager_prefix(run_id)}.0b{group_bits(step)}"


def decode_history(data: bytes) -> tuple[bytes, ...]:
    """The value of ``history_key``: a msgpack list of encoded ``Amendment``s, oldest first (each must decode;
    signatures and the chain are the reader's to check against the spec).

    Raises:
        RemoteProtocolError: not such a list.
    """
    items = unpack(data, max_size=1 << 20)
    if not isinstance(items, list) or len(items) > MAX_HISTORY or not all(isinstance(i, bytes) for i in items):
        raise RemoteProtocolError("an amendment history is a list of encoded amendments")
    for item in items:
        Amendment.decode(item)
    return tuple(items)


def _bytes_message(decode: Callable[[bytes], Any]) -> Callable[[Any], Any]:
    """A decoder of a stored value that must be bytes holding one of our messages."""

    def check(obj: Any) -> Any:
        if not isinstance(obj, bytes):
            raise RemoteProtocolError(f"the value must be bytes, not {type(obj).__name__}")
        return decode(obj)

    return check


def _looking_for_group(obj: Any) -> bool:
    if not isinstance(obj, bool):
        raise RemoteProtocolError("a matchmaking declaration is a bool")
    return obj


@dataclass(frozen=True, kw_only=True)
class RecordSchema:
    """One kind of key of a run.

    ``key`` is the builder writers and readers call (``key(run_id)``, or ``key(run_id, step)`` for a ring of
    ``slots`` keys); ``decode`` takes the stored value as unpacked from msgpack and returns the message or raises
    a ``ProtocolError``; ``ttl`` is the furthest an expiration may lie ahead of now (plus ``MAX_CLOCK_SKEW``), and
    every writer stores with at most that; ``max_bytes`` bounds the encoded message; ``run_of``, for messages that
    name their run, returns that name (it must be the key's).
    """

    name: str
    key: Callable[..., str]
    decode: Callable[[Any], Any]
    subkey: SubkeyKind
    ttl: float
    max_bytes: int
    slots: int = 1
    run_of: Optional[Callable[[Any], str]] = None
    extra: Optional[Callable[[str], tuple[str, ...]]] = None  # keys of the kind that no slot builds

    def keys(self, run_id: str) -> tuple[str, ...]:
        """Every key of this kind for ``run_id``."""
        keys = (self.key(run_id),) if self.slots == 1 else tuple(self.key(run_id, s) for s in range(self.slots))
        return keys + (self.extra(run_id) if self.extra is not None else ())


# fmt: off
_SCHEMAS = (
    RecordSchema(name="spec", key=spec_key, decode=_bytes_message(SignedSpec.decode), subkey=SubkeyKind.SIGNED,
                 ttl=120.0, max_bytes=MAX_SPEC_SIZE, run_of=lambda m: m.spec.run_id),
    RecordSchema(name="providers", key=providers_key, decode=_bytes_message(ProviderRecord.decode),
                 subkey=SubkeyKind.SIGNED, ttl=300.0, max_bytes=MAX_RECORD_BYTES),
    RecordSchema(name="progress", key=progress_key, decode=_bytes_message(ProgressReport.decode),
                 subkey=SubkeyKind.SIGNED, ttl=300.0, max_bytes=MAX_REPORT_BYTES),
    RecordSchema(name="vote", key=vote_key, decode=_bytes_message(Vote.decode), subkey=SubkeyKind.SIGNED,
                 ttl=120.0, max_bytes=4096, slots=VOTE_SLOTS),
    RecordSchema(name="revoked", key=revocation_key, decode=_bytes_message(Revocations.decode),
                 subkey=SubkeyKind.OWNER, ttl=MAX_TTL, max_bytes=MAX_REVOCATION_BYTES, run_of=lambda m: m.run_id),
    RecordSchema(name="pause", key=pause_key, decode=_bytes_message(PauseRecord.decode), subkey=SubkeyKind.OWNER,
                 ttl=120.0, max_bytes=1 << 14, run_of=lambda m: m.run_id),
    RecordSchema(name="paused", key=paused_key, decode=_bytes_message(PauseNote.decode), subkey=SubkeyKind.SIGNED,
                 ttl=300.0, max_bytes=1 << 13),
    # each peer that holds the (owner-signed) amendments republishes them under its own signed subkey
    RecordSchema(name="history", key=history_key, decode=_bytes_message(decode_history), subkey=SubkeyKind.SIGNED,
                 ttl=120.0, max_bytes=1 << 20),
    RecordSchema(name="group", key=group_key, decode=_looking_for_group, subkey=SubkeyKind.PEER, ttl=300.0,
                 max_bytes=16, slots=1 << GROUP_BITS,
                 # hivemind's key before the first round sets the bits (its initial_group_bits="")
                 extra=lambda run_id: (f"{averager_prefix(run_id)}.0b",)),
)
# fmt: on
#: every kind of key of a run, by name
RUN_KEYS: Mapping[str, RecordSchema] = {s.name: s for s in _SCHEMAS}


@functools.lru_cache(maxsize=64)
def run_keys(run_id: str) -> Mapping[str, RecordSchema]:
    """Every DHT key of ``run_id`` (as writers pass it to hivemind, before hashing) and its schema.

    Raises:
        ValueError: ``run_id`` is not a run id.
    """
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ValueError(f"{run_id!r} is not a run id")
    return {key: schema for schema in _SCHEMAS for key in schema.keys(run_id)}


def schema_of_key(key: str) -> Optional[tuple[RecordSchema, str]]:
    """The schema and run id of a raw DHT key, or None when it is no run's key."""
    found = _KEY_RUN.match(key) if isinstance(key, str) else None
    if found is None:
        return None
    schema = run_keys(found.group(1)).get(key)
    return None if schema is None else (schema, found.group(1))


def check_record(
    kind_or_key: Union[RecordSchema, str],
    subkey: bytes,
    value: bytes,
    expiration: float,
    now: float,
    *,
    run_id: Optional[str] = None,
    owner_key: Optional[bytes] = None,
    identify: Optional[Callable[[bytes], str]] = None,
) -> Optional[Rejection]:
    """Whether a record may be stored or believed under a run's key: None, or the reason it may not.

    Args:
        kind_or_key: a schema, a kind's name in ``RUN_KEYS`` or a raw key (``swarmrun.<run>.spec``); a raw key
            that is no run's key is not this table's business (None).
        subkey: the subkey as hivemind encodes it (msgpack; ``PLAIN_SUBKEY`` for a plain value).
        value: the stored value as hivemind encodes it (msgpack), the writer's signature stripped.
        expiration: the record's expiration time; now: the validator's DHT time.
        run_id: the run the key belongs to (taken from a raw key); a message that names a run must name it.
        owner_key: the run's owner public key when known: an OWNER subkey must carry it.
        identify: ``public_key -> peer id`` (injected crypto): a SIGNED subkey must name its key's peer.
    """
    schema = kind_or_key if isinstance(kind_or_key, RecordSchema) else RUN_KEYS.get(kind_or_key)
    if schema is None:
        found = schema_of_key(kind_or_key)
        if found is None:
            return None
        schema, run_id = found
    return (_check_expiration(schema, expiration, now) or _check_subkey(schema, subkey, owner_key, identify)
            or _check_value(schema, value, run_id))


def _check_expiration(schema: RecordSchema, expiration: Any, now: float) -> Optional[Rejection]:
    if not isinstance(expiration, (int, float)) or isinstance(expiration, bool) or not math.isfinite(expiration):
        return Rejection(Reject.EXPIRATION, f"{schema.name}: expiration {expiration!r} is not a finite time")
    if expiration > now + schema.ttl + MAX_CLOCK_SKEW:
        return Rejection(Reject.EXPIRATION, f"{schema.name}: expires {expiration - now:.0f}s ahead, more than its "
                                            f"TTL of {schema.ttl:.0f}s")
    return None


def _check_subkey(schema: RecordSchema, subkey: Any, owner_key: Optional[bytes],
                  identify: Optional[Callable[[bytes], str]]) -> Optional[Rejection]:
    if not isinstance(subkey, bytes):
        return Rejection(Reject.MALFORMED, f"{schema.name}: the subkey is not bytes")
    if subkey == PLAIN_SUBKEY:
        if schema.subkey is SubkeyKind.NONE:
            return None
        return Rejection(Reject.PLAIN_VALUE, f"{schema.name}: a plain value where each {schema.subkey.value} "
                                             f"writer has its own subkey")
    if schema.subkey is SubkeyKind.NONE:
        return Rejection(Reject.UNEXPECTED_SUBKEY, f"{schema.name}: a subkey where the value is plain")
    if len(subkey) > MAX_SUBKEY_BYTES:
        return Rejection(Reject.TOO_LARGE, f"{schema.name}: a subkey of {len(subkey)} bytes")
    try:
        name = unpack(subkey, max_size=MAX_SUBKEY_BYTES)
    except RemoteProtocolError as e:
        return Rejection(Reject.MALFORMED, f"{schema.name}: subkey: {e}")
    if schema.subkey is SubkeyKind.PEER:
        if isinstance(name, str) and _PEER_ID.fullmatch(name) or isinstance(name, bytes) and 0 < len(name) <= 128:
            return None
        if isinstance(name, bytes) and b"[owner:" in name:
            return _check_signed(schema, name, identify)
        return Rejection(Reject.MALFORMED, f"{schema.name}: the subkey does not name a peer")
    if schema.subkey is SubkeyKind.SIGNED:
        return _check_signed(schema, name, identify)
    return _check_owner(schema, name, owner_key)


def _split_signed(name: Any) -> Optional[tuple[bytes, bytes]]:
    """``<prefix>[owner:<key>]`` -> (prefix, key); None unless exactly that (one marker, at the end, a key with no
    brackets, so hivemind's validator finds the same key)."""
    if not isinstance(name, bytes):
        return None
    prefix, marker, rest = name.partition(b"[owner:")
    key = rest[:-1]
    if not marker or not rest.endswith(b"]") or not key or b"[" in key or b"]" in key or b"[owner:" in prefix:
        return None
    return prefix, key


def _check_signed(schema: RecordSchema, name: Any, identify: Optional[Callable[[bytes], str]]) -> Optional[Rejection]:
    parts = _split_signed(name)
    if parts is None:
        return Rejection(Reject.UNSIGNED, f"{schema.name}: the subkey is not a signed peer subkey")
    prefix, key = parts
    try:
        peer = prefix.decode("ascii")
    except UnicodeDecodeError:
        peer = ""
    if not _PEER_ID.fullmatch(peer):
        return Rejection(Reject.UNSIGNED, f"{schema.name}: the signed subkey names no peer id")
    if identify is not None:
        try:
            owner = identify(key)
        except Exception:  # an injected verifier may raise anything on a key that is not one
            owner = None
        if owner != peer:
            return Rejection(Reject.UNSIGNED, f"{schema.name}: the subkey names peer {peer[-6:]} with another's key")
    return None


def _check_owner(schema: RecordSchema, name: Any, owner_key: Optional[bytes]) -> Optional[Rejection]:
    parts = _split_signed(name)
    if parts is None or parts[0]:
        return Rejection(Reject.UNSIGNED, f"{schema.name}: the subkey is not an owner's signed subkey")
    if owner_key is not None and parts[1] != owner_key:
        return Rejection(Reject.UNSIGNED, f"{schema.name}: signed by a key that is not the run owner's")
    return None


def _check_value(schema: RecordSchema, value: Any, run_id: Optional[str]) -> Optional[Rejection]:
    if not isinstance(value, bytes):
        return Rejection(Reject.MALFORMED, f"{schema.name}: the value is not bytes")
    bound = schema.max_bytes + _MSGPACK_BIN_HEADER
    if len(value) > bound:
        return Rejection(Reject.TOO_LARGE, f"{schema.name}: a value of {len(value)} bytes (at most {bound})")
    try:
        stored = unpack(value, max_size=bound)
        if isinstance(stored, bytes) and len(stored) > schema.max_bytes:
            return Rejection(Reject.TOO_LARGE, f"{schema.name}: a message of {len(stored)} bytes (at most "
                                               f"{schema.max_bytes})")
        message = schema.decode(stored)
    except SwarmrunError as e:
        return Rejection(Reject.MALFORMED, f"{schema.name}: {e}")
    if schema.run_of is not None and run_id is not None and schema.run_of(message) != run_id:
        return Rejection(Reject.WRONG_RUN, f"{schema.name}: names run {schema.run_of(message)!r}, the key {run_id!r}")
    return None
