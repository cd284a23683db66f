"""The schema table of a run's DHT keys and its record check: each rule accepts a good record and refuses each bad
kind; the hivemind adapter finds a run's records by their hashed keys and runs after the signature check."""

import dataclasses
import inspect
import math
import pickle

import msgpack
import pytest

from swarmrun.protocol import access, records, round as round_, snapshot, spec as spec_mod, transfer
from swarmrun.protocol.errors import Reject
from swarmrun.protocol.records import (
    MAX_CLOCK_SKEW,
    PLAIN_SUBKEY,
    RUN_KEYS,
    SubkeyKind,
    check_record,
    run_keys,
    schema_of_key,
)
from tests.unit.record_samples import (NOW, OWNER_KEY, PEER, PEER_KEY, RUN, identify, message, signed_subkey, subkey,
                                       value)

KINDS = sorted(RUN_KEYS)
SUBKEYED = [k for k in KINDS if RUN_KEYS[k].subkey is not SubkeyKind.NONE]
PLAIN = [k for k in KINDS if RUN_KEYS[k].subkey is SubkeyKind.NONE]


def check(kind, *, sk=None, val=None, expiration=None, **kwargs):
    return check_record(kind, subkey(kind) if sk is None else sk, value(kind) if val is None else val,
                        NOW + 10 if expiration is None else expiration, NOW, run_id=RUN, **kwargs)


def reason(found):
    assert found is not None, "the record was accepted"
    return found.reason


# ---- the table ---------------------------------------------------------------------------------------------------
def _key_builders():
    """Every ``*_key`` function of the protocol modules (the builders writers and readers call)."""
    for module in (access, records, round_, snapshot, spec_mod, transfer):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            params = list(inspect.signature(fn).parameters)
            if name.endswith("_key") and fn.__module__ == module.__name__ and params[:1] == ["run_id"]:
                yield name, fn


def test_table_names_every_key_builder():
    builders = dict(_key_builders())
    assert {"spec_key", "providers_key", "progress_key", "vote_key", "revocation_key", "pause_key", "paused_key",
            "history_key", "group_key"} <= set(builders)
    keys = run_keys(RUN)
    for name, fn in builders.items():
        arity = len(inspect.signature(fn).parameters)
        for args in [(RUN,)] if arity == 1 else [(RUN, step) for step in (0, 1, 255, 256, 10**9 + 7)]:
            assert fn(*args) in keys, f"{name}{args} builds a key that is not in the schema table"


def test_every_key_maps_back_to_its_kind_and_run():
    keys = run_keys(RUN)
    assert {s.name for s in keys.values()} == set(KINDS)
    for key, schema in keys.items():
        assert schema_of_key(key) == (schema, RUN)
    assert not set(keys) & set(run_keys(RUN + "x")), "two runs share no key"
    for other in ("swarmrun.run-1.other", "swarmrun.run-1.vote.256", "swarmrun_run-1.0b0", "hivemind.x", "", "x.y"):
        assert schema_of_key(other) is None
    with pytest.raises(ValueError):
        run_keys("not a run id")


def test_writers_store_within_the_table_ttls():
    from swarmrun.node.net.records import REVOCATION_TTL
    from swarmrun.node.net.records import SPEC_TTL
    from swarmrun.node.net.records import HISTORY_TTL, NOTE_TTL
    from swarmrun.node.peer.trainer import TrainerConfig

    ttl = {k: s.ttl for k, s in RUN_KEYS.items()}
    assert SPEC_TTL <= ttl["spec"] and NOTE_TTL <= ttl["paused"] and HISTORY_TTL <= ttl["history"]
    assert REVOCATION_TTL <= ttl["revoked"]
    assert TrainerConfig().report_ttl <= min(ttl["progress"], ttl["providers"])
    assert TrainerConfig().averaging_timeout <= ttl["group"]  # hivemind declares until the round's deadline


# ---- the rules ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_good_record_of_each_kind_is_accepted(kind):
    assert check(kind) is None
    assert check(kind, identify=identify, owner_key=OWNER_KEY) is None
    assert check(RUN_KEYS[kind].keys(RUN)[-1], sk=subkey(kind), val=value(kind)) is None  # by its raw key


@pytest.mark.parametrize("kind", SUBKEYED)
def test_a_plain_value_where_the_schema_says_subkeys_is_refused(kind):
    assert reason(check(kind, sk=PLAIN_SUBKEY)) is Reject.PLAIN_VALUE
    assert reason(check(kind, sk=PLAIN_SUBKEY, val=msgpack.packb(b"x" * 8), expiration=NOW + 10 * 365 * 86400)) \
        in (Reject.PLAIN_VALUE, Reject.EXPIRATION)


def test_every_key_of_a_run_has_subkeys():
    """No plain value under a run's key (issue 14): hivemind lets a plain value with a later expiration replace the
    stored one, and a hostile node can answer a find for it with an empty dictionary; subkeys merge instead. The
    owner's records (revocations, pause) are under the owner's signed subkey."""
    assert not PLAIN
    assert {k for k in KINDS if RUN_KEYS[k].subkey is SubkeyKind.OWNER} == {"revoked", "pause"}


def test_a_subkey_where_the_schema_says_plain_is_refused():
    schema = dataclasses.replace(RUN_KEYS["pause"], subkey=SubkeyKind.NONE)  # the rule, though no key is plain now
    assert check_record(schema, PLAIN_SUBKEY, value("pause"), NOW + 10, NOW, run_id=RUN) is None
    assert reason(check_record(schema, signed_subkey(), value("pause"), NOW + 10, NOW, run_id=RUN)) \
        is Reject.UNEXPECTED_SUBKEY


@pytest.mark.parametrize("kind", [k for k in KINDS if RUN_KEYS[k].subkey is SubkeyKind.SIGNED])
def test_an_unsigned_subkey_where_the_schema_says_signed_is_refused(kind):
    for bad in (msgpack.packb(PEER), msgpack.packb(PEER.encode()), msgpack.packb(PEER + "[owner:" + "k]"),
                msgpack.packb(b"[owner:" + PEER_KEY + b"]"),  # names no peer
                msgpack.packb(PEER.encode() + b"[owner:" + PEER_KEY),  # no closing bracket
                msgpack.packb(PEER.encode() + b"[owner:a][owner:b]"),  # two keys
                msgpack.packb(b"not base58!![owner:" + PEER_KEY + b"]")):
        assert reason(check(kind, sk=bad)) is Reject.UNSIGNED, bad
    # signed, but under another peer's name
    assert check(kind, sk=signed_subkey("QmStrangerPeer")) is None  # without the injected identify: the shape only
    assert reason(check(kind, sk=signed_subkey("QmStrangerPeer"), identify=identify)) is Reject.UNSIGNED


def test_an_owner_subkey_must_be_the_owners_when_the_owner_is_known():
    assert check("revoked", owner_key=OWNER_KEY) is None
    assert reason(check("revoked", owner_key=PEER_KEY)) is Reject.UNSIGNED
    assert reason(check("revoked", sk=signed_subkey())) is Reject.UNSIGNED  # a peer's subkey, not the owner's
    assert reason(check("revoked", sk=msgpack.packb(PEER))) is Reject.UNSIGNED


def test_a_peer_subkey_names_a_peer():
    for good in (msgpack.packb(PEER), msgpack.packb(b"\x00\x24\x08\x01\x12"), signed_subkey()):
        assert check("group", sk=good) is None
    for bad in (msgpack.packb(""), msgpack.packb("not a peer id!"), msgpack.packb(b""), msgpack.packb(3),
                msgpack.packb(["x"]), msgpack.packb(b"x" * 129), b"\xc1", b"\x92\x01"):
        assert reason(check("group", sk=bad)) is Reject.MALFORMED, bad


def test_a_pause_note_is_signed_by_its_peer():
    assert check("paused", sk=signed_subkey()) is None
    for unsigned in (msgpack.packb(PEER), msgpack.packb(b"\x00\x24\x08\x01\x12")):
        assert reason(check("paused", sk=unsigned)) is Reject.UNSIGNED, unsigned


@pytest.mark.parametrize("kind", KINDS)
def test_an_expiration_beyond_the_ttl_or_not_finite_is_refused(kind):
    ttl = RUN_KEYS[kind].ttl
    assert check(kind, expiration=NOW + ttl) is None
    assert check(kind, expiration=NOW + ttl + MAX_CLOCK_SKEW) is None  # the writer's clock may run ahead
    assert check(kind, expiration=NOW - 5) is None  # expired: hivemind drops it, nothing to refuse
    for bad in (NOW + ttl + MAX_CLOCK_SKEW + 1, NOW + 10 * 365 * 86400, math.inf, -math.inf, math.nan, 1e308):
        assert reason(check(kind, expiration=bad)) is Reject.EXPIRATION, bad


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_over_the_size_bound_is_refused(kind):
    bound = RUN_KEYS[kind].max_bytes
    assert reason(check(kind, val=msgpack.packb(b"\x00" * (bound + 1)))) is Reject.TOO_LARGE
    assert reason(check(kind, val=b"\x00" * (bound + 100))) is Reject.TOO_LARGE
    assert reason(check(kind, sk=msgpack.packb(b"x" * 4096))) in (Reject.TOO_LARGE, Reject.UNEXPECTED_SUBKEY)


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_that_does_not_decode_as_the_kind_is_refused(kind):
    for bad in [b"", b"\xc1", msgpack.packb(b"x" * 8), msgpack.packb("text"), msgpack.packb(None),
                msgpack.packb({"type": kind}), value(kind) + b"\x00", value(kind)[:-1]]:
        assert reason(check(kind, val=bad)) is Reject.MALFORMED, bad[:40]
    for other in KINDS:  # another kind's message (too large for a small kind's bound)
        if other != kind:
            assert reason(check(kind, val=value(other))) in (Reject.MALFORMED, Reject.TOO_LARGE), other
    if kind != "group":  # our messages are bytes: the same message as a msgpack str or list is not one
        assert reason(check(kind, val=msgpack.packb([message(kind)]))) is Reject.MALFORMED


@pytest.mark.parametrize("kind", ["spec", "revoked", "pause"])
def test_a_record_that_names_another_run_is_refused(kind):
    assert reason(check(kind, val=value(kind, run_id="run-2"))) is Reject.WRONG_RUN
    assert check_record(RUN_KEYS[kind].key("run-2"), subkey(kind), value(kind, run_id="run-2"), NOW, NOW) is None


def test_a_key_of_no_run_is_not_this_tables_business():
    assert check_record("some.other.key", PLAIN_SUBKEY, b"\xc1", math.nan, NOW) is None


# ---- the hivemind adapter ----------------------------------------------------------------------------------------
def _hivemind():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from swarmrun.node.net.validator import PRIORITY, RunRecordValidator

    return DHTID, DHTRecord, RunRecordValidator, PRIORITY


def _record(kind, *, run_id=RUN, sk=None, val=None, expiration=None, key_bytes=None):
    from hivemind.utils.timed_storage import get_dht_time

    DHTID, DHTRecord, _, _ = _hivemind()
    key = key_bytes if key_bytes is not None else DHTID.generate(source=RUN_KEYS[kind].keys(run_id)[-1]).to_bytes()
    return DHTRecord(key, subkey(kind) if sk is None else sk, value(kind, run_id) if val is None else val,
                     get_dht_time() + 10 if expiration is None else expiration)


def test_the_validator_finds_a_runs_records_by_their_hashed_keys():
    DHTID, DHTRecord, RunRecordValidator, _ = _hivemind()
    v = RunRecordValidator([RUN])
    for kind in KINDS:
        assert v.validate(_record(kind)), kind
        assert not v.validate(_record(kind, expiration=math.inf)), kind
        assert not v.validate(_record(kind, val=msgpack.packb(b"x" * 8))), kind
    plain = _record("providers", sk=PLAIN_SUBKEY)
    assert not v.validate(plain)
    # hivemind reads a key as an int: a leading zero byte is the same key, and is refused the same
    assert not v.validate(dataclasses.replace(plain, key=b"\x00" + plain.key))
    # another run's key, or no run's: left to the other validators
    assert v.validate(_record("providers", run_id="run-2", sk=PLAIN_SUBKEY))
    assert v.validate(DHTRecord(DHTID.generate(source="anything").to_bytes(), PLAIN_SUBKEY, b"\xc1", math.nan))


def test_the_validator_never_raises():
    _, DHTRecord, RunRecordValidator, _ = _hivemind()
    v = RunRecordValidator([RUN], identify=lambda key: 1 / 0)
    assert not v.validate(_record("vote"))  # the injected identify failed: refused, not raised
    assert not v.validate(_record("vote", sk=None, val=None, expiration="soon"))  # not a time


def test_merging_validators_watches_more_runs_and_pickles():
    _, _, RunRecordValidator, _ = _hivemind()
    v = RunRecordValidator({RUN: None})
    assert v.merge_with(RunRecordValidator({"run-2": OWNER_KEY})) and v.runs == {RUN, "run-2"}
    assert not v.validate(_record("pause", run_id="run-2", sk=PLAIN_SUBKEY, val=msgpack.packb(b"x")))
    assert not v.validate(_record("revoked", run_id="run-2", sk=msgpack.packb(b"[owner:" + PEER_KEY + b"]")))
    assert v.validate(_record("revoked", run_id="run-2"))
    assert not v.merge_with(object.__new__(type("Other", (), {})))
    copy = pickle.loads(pickle.dumps(v))  # DHT.add_validators sends it to the DHT's process
    assert copy.runs == v.runs and not copy.validate(_record("spec", run_id="run-2", val=msgpack.packb(b"x")))


def test_signatures_are_checked_and_stripped_before_the_schema():
    """In hivemind's CompositeValidator the run-record validator comes after RSASignatureValidator: a signed record
    passes both; a forged signature, a plain value and an unsigned subkey do not."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import CompositeValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from swarmrun.node.net.swarm import OwnerSigner, peer_id_of, public_key_bytes, run_validators
    from swarmrun.node.net.swarm import signed_subkey as node_signed_subkey

    _, _, RunRecordValidator, PRIORITY = _hivemind()
    key = RSAPrivateKey()
    composite = CompositeValidator(run_validators(key, [RUN]))
    assert [type(v) for v in composite._validators] == [RunRecordValidator, OwnerSigner]
    assert isinstance(composite._validators[1], RSASignatureValidator)
    assert PRIORITY < RSASignatureValidator().priority
    sk = msgpack.packb(node_signed_subkey(RSASignatureValidator(key), peer_id_of(public_key_bytes(key))))
    record = _record("vote", sk=sk)
    signed = dataclasses.replace(record, value=composite.sign_value(record))
    assert signed.value != record.value and composite.validate(signed)
    assert composite.strip_value(signed) == record.value
    assert not composite.validate(record)  # unsigned value under a signed subkey
    assert not composite.validate(dataclasses.replace(signed, value=signed.value.replace(b"\xc3", b"\xc2")))
    other = RSAPrivateKey()  # a stranger signs under its own key but this peer's name
    forged = msgpack.packb(peer_id_of(public_key_bytes(key)).encode() + RSASignatureValidator(other).local_public_key)
    stranger = _record("vote", sk=forged)
    stranger_signs = CompositeValidator([RSASignatureValidator(other)])
    stranger = dataclasses.replace(stranger, value=stranger_signs.sign_value(stranger))
    assert not composite.validate(stranger)
    assert not composite.validate(_record("vote", sk=PLAIN_SUBKEY))


def test_a_process_that_holds_many_owner_keys_signs_each_runs_owner_record_with_its_own():
    """The coordinator's peer writes the revocation list of every pool run, each under that run's owner key: its
    validator (hivemind's, with more keys: ``OwnerSigner``) signs a record with the key its subkey names, which
    plain hivemind validators accept; a key it was never given stays unsigned (refused)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import CompositeValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from swarmrun.node.net.swarm import OwnerSigner, public_key_bytes, run_validators

    identity, run_a, run_b = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    composite = CompositeValidator(run_validators(identity, [RUN]))
    composite.extend([OwnerSigner(run_a, [run_a])])  # what DHT.add_validators does in the DHT's process
    assert len(composite._validators) == 2  # merged into the one signer

    a, b = (_record("revoked", sk=msgpack.packb(b"[owner:" + public_key_bytes(k) + b"]")) for k in (run_a, run_b))
    signed = dataclasses.replace(a, value=composite.sign_value(a))
    assert CompositeValidator([RSASignatureValidator(RSAPrivateKey())]).validate(signed)  # any reader accepts it
    assert composite.strip_value(signed) == a.value
    assert not composite.validate(dataclasses.replace(b, value=composite.sign_value(b)))
    composite.extend([OwnerSigner(run_b, [run_b])])
    assert composite.validate(dataclasses.replace(b, value=composite.sign_value(b)))
