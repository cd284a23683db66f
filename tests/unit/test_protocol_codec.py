"""Tests of swarmrun.protocol.codec and errors."""

import hashlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol import errors
from swarmrun.protocol.codec import canonical_hash, normalize, pack, unpack
from swarmrun.protocol.errors import LocalProtocolError, Reject, Rejection, RemoteProtocolError

FAST = settings(max_examples=200, deadline=None)

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text() | st.binary()
keys = st.text(max_size=8) | st.integers(-(2**63), 2**64 - 1)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=20)


def test_exit_codes():
    assert errors.SwarmrunError.exit_code == 1
    assert errors.UsageError.exit_code == 2
    assert errors.RunNotFound.exit_code == 3
    assert errors.AccessRefused.exit_code == 4
    assert errors.IncompatibleState.exit_code == 5
    assert errors.ProtocolError.exit_code == 5
    assert issubclass(errors.RemoteProtocolError, errors.ProtocolError)
    assert issubclass(errors.LocalProtocolError, errors.SwarmrunError)


def test_rejection_str():
    assert str(Rejection(reason=Reject.WRONG_STEP, detail="at 4, asked 7")) == "wrong_step: at 4, asked 7"
    assert {r.name for r in Reject} == {"MALFORMED", "WRONG_SPEC", "WRONG_STEP", "NOT_ADMITTED", "BUSY", "UNKNOWN_STATE",
                                        "PLAIN_VALUE", "UNEXPECTED_SUBKEY", "UNSIGNED", "EXPIRATION", "TOO_LARGE",
                                        "WRONG_RUN"}


@FAST
@given(values)
def test_roundtrip(value):
    assert unpack(pack(value)) == normalize(value)


@FAST
@given(st.dictionaries(keys, values, max_size=6))
def test_key_order_does_not_change_bytes(d):
    reversed_d = dict(reversed(list(d.items())))
    assert pack(reversed_d) == pack(d)
    assert canonical_hash(reversed_d) == hashlib.sha256(pack(d)).hexdigest()


def test_nested_dicts_sorted():
    assert pack({"b": {"y": 1, "x": 2}, "a": 1}) == msgpack.packb({"a": 1, "b": {"x": 2, "y": 1}}, use_bin_type=True)


@pytest.mark.parametrize("bad", [object(), {1.5: 1}, {(1, 2): 1}, {True: 1}, {1, 2}, 2**64])
def test_pack_rejects(bad):
    with pytest.raises(LocalProtocolError):
        pack(bad)


@pytest.mark.parametrize("data", [
    "not bytes",
    None,
    b"",  # truncated: nothing
    b"\x92\x01",  # array of two with one element
    b"\xc1",  # reserved byte
    b"\x01\x02",  # extra data
    b"\xdd\xff\xff\xff\xff",  # claims 4 billion elements in 5 bytes
    b"\xdb\xff\xff\xff\xff",  # claims a 4 GB string
    b"\xd4\x05\x00",  # extension type
    b"\xd6\xff\x00\x00\x00\x01",  # timestamp extension
    b"\x81\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x01",  # float key
    b"\x81\xc4\x01a\x01",  # bytes key
    b"\x81\xc3\x01",  # bool key
    b"\x81\x90\x01",  # list key
    b"\x91" * 2000 + b"\xc0",  # deeper than msgpack's own stack
])
def test_unpack_rejects(data):
    with pytest.raises(RemoteProtocolError):
        unpack(data)


def test_unpack_depth_limit():
    assert unpack(b"\x91" * 32 + b"\xc0", max_depth=32) is not None
    with pytest.raises(RemoteProtocolError, match="nesting"):
        unpack(b"\x91" * 33 + b"\xc0", max_depth=32)
    with pytest.raises(RemoteProtocolError, match="nesting"):
        unpack(pack({"a": {"b": [1]}}), max_depth=2)


def test_unpack_size_limit():
    data = pack("x" * 100)
    assert unpack(data, max_size=len(data)) == "x" * 100
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        unpack(data, max_size=len(data) - 1)


def test_int_keys_allowed():
    assert unpack(pack({3: "a", "b": 2})) == {3: "a", "b": 2}


@FAST
@given(st.binary(max_size=64))
def test_random_bytes_only_remote_protocol_error(data):
    try:
        unpack(data)
    except RemoteProtocolError:
        pass
