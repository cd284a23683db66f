"""Fuzz of the record check over every key of the schema table: random bytes, msgpack of random and of
message-shaped values, mutations of good records, huge and non-finite expirations, plain values and subkeys of
every shape. The check never raises, and whatever it accepts fits the key's schema by an independent reading."""

import math

import msgpack
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarmrun.protocol.codec import unpack
from swarmrun.protocol.errors import ProtocolError, Rejection
from swarmrun.protocol.records import MAX_CLOCK_SKEW, PLAIN_SUBKEY, RUN_KEYS, SubkeyKind, check_record, run_keys
from tests.unit.record_samples import NOW, OWNER_KEY, PEER, PEER_KEY, RUN, identify, signed_subkey, subkey, value

KEYS = sorted(run_keys(RUN))
KINDS = sorted(RUN_KEYS)

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                    st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                      max_leaves=12)
# maps that look like our messages: a right "type" and "version", random fields
shaped = st.builds(lambda t, d: {**d, "type": t, "version": 1},
                   st.sampled_from(["signed_spec", "provider", "progress", "vote", "revocations", "pause", "paused",
                                    "amendment"]),
                   st.dictionaries(st.sampled_from(["step", "group_id", "grad_hash", "ok", "run_id", "spec", "log",
                                                    "signature", "revoked", "issued_at", "unsigned", "left", "where",
                                                    "state_hash", "manifest_hash", "time", "keeper", "role", "sps"]),
                                   values, max_size=10))


def _pack(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc0"


def _mutate(data: bytes, where: int, byte: int, cut: int) -> bytes:
    i = where % (len(data) + 1)
    b = bytes([byte])
    return [data[:i] + b + data[i + 1:], data[:i], data + data[:cut], data[:i] + b + data[i:]][cut % 4]


stored_values = st.one_of(
    st.binary(max_size=300),
    values.map(_pack),
    shaped.map(_pack).map(_pack),  # a message-shaped map, as bytes, as hivemind wraps it
    shaped.map(_pack),
    st.builds(lambda k, w, b, c: _mutate(value(k), w, b, c), st.sampled_from(KINDS), st.integers(0, 10**6),
              st.integers(0, 255), st.integers(0, 50)),
    st.sampled_from(KINDS).map(value),
    # values at each kind's size bound (a large value is filler: only its size matters)
    st.sampled_from(sorted({s.max_bytes + d for s in RUN_KEYS.values() for d in (-1, 0, 1, 6)})).map(
        lambda n: _pack(b"\x00" * n)),
)
subkeys = st.one_of(
    st.just(PLAIN_SUBKEY),
    st.binary(max_size=80),
    st.one_of(st.text(max_size=60), st.binary(max_size=60), st.integers(), st.none()).map(_pack),
    st.builds(lambda p, k: signed_subkey(p, k), st.sampled_from([PEER, "QmStrangerPeer", "", "a b", "Q[owner:x]"]),
              st.sampled_from([PEER_KEY, OWNER_KEY, b"", b"]", b"k[owner:j"])),
    st.sampled_from(KINDS).map(subkey),
    st.integers(0, 5000).map(lambda n: _pack(b"x" * n)),
)
expirations = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(NOW - 100, NOW + 400),
                        st.integers(-2**70, 2**70),
                        st.sampled_from([math.nan, math.inf, -math.inf, NOW + 10 * 365 * 86400]))


def _fits(schema, sk: bytes, val: bytes, expiration: float) -> bool:
    """What an accepted record must be, read independently of ``check_record``'s code paths."""
    if not (math.isfinite(expiration) and expiration <= NOW + schema.ttl + MAX_CLOCK_SKEW):
        return False
    if (sk == PLAIN_SUBKEY) != (schema.subkey is SubkeyKind.NONE):
        return False
    name = None if sk == PLAIN_SUBKEY else msgpack.unpackb(sk, raw=False)
    if schema.subkey in (SubkeyKind.SIGNED, SubkeyKind.OWNER):
        if not (isinstance(name, bytes) and name.endswith(b"]") and name.count(b"[owner:") == 1):
            return False
        peer, key = name[:-1].split(b"[owner:")
        if schema.subkey is SubkeyKind.OWNER and (peer or key != OWNER_KEY):
            return False
        if schema.subkey is SubkeyKind.SIGNED and identify(key) != peer.decode():
            return False
    stored = unpack(val, max_size=len(val))
    if isinstance(stored, bytes) and len(stored) > schema.max_bytes:
        return False
    schema.decode(stored)  # raises on anything that does not decode
    return True


def _check_and_judge(key: str, sk: bytes, val: bytes, expiration) -> bool:
    """Run the check; assert it did not raise and accepted only what fits. Returns whether it accepted."""
    schema = run_keys(RUN)[key]
    found = check_record(key, sk, val, expiration, NOW, owner_key=OWNER_KEY, identify=identify)
    assert found is None or isinstance(found, Rejection)
    if found is None:
        try:
            assert _fits(schema, sk, val, expiration), f"accepted a record that does not fit {schema.name}"
        except ProtocolError as e:
            raise AssertionError(f"accepted a {schema.name} record whose value does not decode: {e}") from None
    return found is None


FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


@FUZZ
@given(data=st.data())
def test_the_check_never_raises_and_accepts_only_what_fits(data):
    """A record of a random key whose subkey, value and expiration are each either right for the key or random
    (so about one in eight is a good record and most others break exactly one rule)."""
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    key = data.draw(st.sampled_from(RUN_KEYS[kind].keys(RUN)), label="key")
    sk = data.draw(st.one_of(st.just(subkey(kind)), subkeys), label="subkey")
    val = data.draw(st.one_of(st.just(value(kind)), stored_values), label="value")
    expiration = data.draw(st.one_of(st.floats(NOW - 100, NOW + RUN_KEYS[kind].ttl), expirations), label="expiration")
    _check_and_judge(key, sk, val, expiration)


@FUZZ
@given(key=st.sampled_from(KEYS), sk=subkeys, val=stored_values, expiration=expirations)
@example(key="swarmrun.run-1.spec", sk=PLAIN_SUBKEY, val=_pack(b"x" * 8), expiration=NOW + 10 * 365 * 86400)
@example(key="swarmrun.run-1.providers", sk=PLAIN_SUBKEY, val=_pack(b"x" * 8), expiration=NOW + 10 * 365 * 86400)
def test_random_records_are_refused_without_raising(key, sk, val, expiration):
    _check_and_judge(key, sk, val, expiration)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), expiration=expirations)
def test_a_good_record_is_refused_only_for_its_expiration(key, expiration):
    schema = run_keys(RUN)[key]
    found = check_record(key, subkey(schema.name), value(schema.name), expiration, NOW, owner_key=OWNER_KEY,
                         identify=identify)
    fits = math.isfinite(expiration) and expiration <= NOW + schema.ttl + MAX_CLOCK_SKEW
    assert (found is None) == fits, found


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), zeros=st.integers(0, 3))
def test_the_hivemind_validator_decides_as_the_check(data, zeros):
    """The adapter finds the key's kind from its hashed form (with any leading zero bytes: the same key to
    hivemind) and accepts exactly what ``check_record`` accepts."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.timed_storage import get_dht_time

    from swarmrun.node.net.validator import RunRecordValidator

    kind = data.draw(st.sampled_from(KINDS), label="kind")
    key = data.draw(st.sampled_from(RUN_KEYS[kind].keys(RUN)), label="key")
    sk = data.draw(st.one_of(st.just(subkey(kind)), subkeys), label="subkey")
    val = data.draw(st.one_of(st.just(value(kind)), stored_values), label="value")
    ahead = data.draw(st.one_of(st.floats(-100, RUN_KEYS[kind].ttl), st.none()), label="ahead")
    now = get_dht_time()
    expiration = now + ahead if ahead is not None else data.draw(expirations, label="expiration")
    record = DHTRecord(b"\x00" * zeros + DHTID.generate(source=key).to_bytes(), sk, val, expiration)
    validator = RunRecordValidator({RUN: OWNER_KEY}, identify=identify)
    accepted = validator.validate(record)
    # the check at the validator's own clock: only a record within a second of its TTL could be judged differently
    expected = check_record(key, sk, val, expiration, get_dht_time(), owner_key=OWNER_KEY, identify=identify) is None
    if not (isinstance(expiration, float) and abs(expiration - now - RUN_KEYS[kind].ttl - MAX_CLOCK_SKEW) < 5):
        assert accepted == expected
