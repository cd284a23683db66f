"""Tests of swarmrun.protocol.spec."""

import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.errors import IncompatibleState, RemoteProtocolError, UsageError
from swarmrun.protocol.spec import SignedSpec, Spec, amend

KEY = b"owner-key"
HPARAMS = {"lr": 0.001, "target_batch_size": 64, "total_steps": 100, "block_size": 16}


def make_spec(**changes):
    fields = dict(run_id="run-1", task="toy", task_version="1.0", task_args={"width": 8, "act": "relu"},
                  hparams=HPARAMS, seed=7, data_fingerprint="sha256:abc", num_examples=1000, owner_key=KEY)
    fields.update(changes)
    return Spec(**fields)


# An HMAC stands in for the owner's signature: the protocol only sees callables.
def signer(data):
    return hmac.new(KEY, data, "sha256").digest()


def verifier(public_key, data, signature):
    return hmac.compare_digest(hmac.new(public_key, data, "sha256").digest(), signature)


def test_properties_and_plain_dicts():
    spec = make_spec()
    assert (spec.target_batch_size, spec.total_steps, spec.block_size) == (64, 100, 16)
    assert type(spec.hparams) is dict and list(spec.task_args) == ["act", "width"]


def test_hash_independent_of_mapping_order():
    a = make_spec(hparams=dict(reversed(list(HPARAMS.items()))))
    assert a.unsigned_bytes() == make_spec().unsigned_bytes()
    assert a.spec_hash() == make_spec().spec_hash() and hash(a) == hash(make_spec())


@pytest.mark.parametrize("change", [
    dict(run_id="run-2"), dict(task="other"), dict(task_args={"width": 9, "act": "relu"}), dict(seed=8),
    dict(hparams={**HPARAMS, "lr": 0.002}), dict(data_fingerprint="x"), dict(num_examples=999),
    dict(owner_key=b"other"), dict(access="invite"), dict(created_at=1.0),
])
def test_hash_covers_every_field(change):
    assert make_spec(**change).spec_hash() != make_spec().spec_hash()


@pytest.mark.parametrize("change", [
    dict(run_id="bad id"), dict(run_id=""), dict(run_id="x" * 65), dict(task=""),
    dict(hparams={"lr": 0.1}), dict(hparams={**HPARAMS, "block_size": 0}),
    dict(hparams={**HPARAMS, "total_steps": True}), dict(hparams={**HPARAMS, "lr": None}),
    dict(hparams={**HPARAMS, "lr": float("nan")}), dict(task_args={1: 2}), dict(seed=1.5),
    dict(num_examples=0), dict(owner_key="str"), dict(access="closed"), dict(version=2),
])
def test_invalid_fields(change):
    with pytest.raises(UsageError):
        make_spec(**change)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "8bit", "quantile8bit"])
def test_compression_names(name):
    assert make_spec(hparams={**HPARAMS, "compression": name}).compression == name


def test_compression_defaults_to_none_and_refuses_others_clearly():
    assert make_spec().compression == "none"
    for bad in ("int4", "", 8, "8BIT"):
        with pytest.raises(UsageError, match="compression.*must be one of none, fp16, bf16, 8bit, quantile8bit"):
            make_spec(hparams={**HPARAMS, "compression": bad})
    with pytest.raises(UsageError, match="bitsandbytes"):
        make_spec(hparams={**HPARAMS, "compression": "blockwise8"})
    d = make_spec().to_dict()
    d["hparams"]["compression"] = "gzip"
    with pytest.raises(RemoteProtocolError, match="compression"):  # a received spec is checked alike
        Spec.from_dict(d)


def test_dict_roundtrip():
    spec = make_spec(access="invite", created_at=12.5)
    assert Spec.from_dict(unpack(pack(spec.to_dict()))) == spec


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("seed"),
    lambda d: d.update(extra=1),
    lambda d: d.update(type="manifest"),
    lambda d: d.update(seed="7"),
    lambda d: d.update(hparams=[1]),
    lambda d: d.update(run_id="../../etc"),
    lambda d: d.update(version=99),
    lambda d: d.update(created_at=True),
])
def test_from_dict_rejects(mutate):
    d = make_spec().to_dict()
    mutate(d)
    with pytest.raises(RemoteProtocolError):
        Spec.from_dict(d)


def test_sign_verify_encode_decode():
    signed = SignedSpec.sign(make_spec(), signer)
    decoded = SignedSpec.decode(signed.encode())
    assert decoded == signed
    decoded.verify(verifier)


def test_verify_fails_on_tampering():
    signed = SignedSpec.sign(make_spec(), signer)
    forged = SignedSpec(spec=make_spec(seed=8), signature=signed.signature)
    with pytest.raises(IncompatibleState, match="spec signature does not verify"):
        forged.verify(verifier)
    with pytest.raises(IncompatibleState, match="spec signature does not verify"):
        SignedSpec(spec=make_spec(), signature=b"x" * 32).verify(verifier)


def test_verify_turns_verifier_errors_into_incompatible_state():
    def broken(public_key, data, signature):
        raise ValueError("bad key encoding")

    with pytest.raises(IncompatibleState, match="bad key encoding"):
        SignedSpec.sign(make_spec(), signer).verify(broken)


def test_certificates_are_carried():
    signed = SignedSpec(spec=make_spec(), signature=b"s", certificates=(b"cert-1", b"cert-2"))
    assert SignedSpec.decode(signed.encode()).certificates == (b"cert-1", b"cert-2")


def test_decode_rejects_truncated_and_wrong_type():
    data = SignedSpec.sign(make_spec(), signer).encode()
    for bad in (data[:-1], data[: len(data) // 2], pack([1, 2]), pack({"type": "signed_spec"})):
        with pytest.raises(RemoteProtocolError):
            SignedSpec.decode(bad)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 400), st.integers(0, 255))
def test_decode_random_or_mutated_bytes(noise, position, byte):
    data = bytearray(SignedSpec.sign(make_spec(), signer).encode())
    data[position % len(data)] = byte
    for candidate in (noise, bytes(data)):
        try:
            SignedSpec.decode(candidate)
        except RemoteProtocolError:
            pass


def test_amend_hparams():
    spec = make_spec()
    amended = amend(spec, lr=0.01, total_steps=200)
    assert amended.hparams == {**HPARAMS, "lr": 0.01, "total_steps": 200}
    assert amended.task_args == spec.task_args and amended.seed == spec.seed
    assert amended.spec_hash() != spec.spec_hash()
    assert amend(spec, hparams={**HPARAMS, "warmup": 10}).hparams["warmup"] == 10


@pytest.mark.parametrize("change", [
    dict(task="other"), dict(task_args={}), dict(data_fingerprint="y"), dict(seed=1), dict(num_examples=5),
    dict(block_size=32), dict(total_steps=0), dict(lr=[1]),
])
def test_amend_refuses(change):
    with pytest.raises(UsageError):
        amend(make_spec(), **change)


def test_choose_spec_takes_the_anchors_spec_and_skips_what_does_not_verify():
    from swarmrun.protocol.errors import IncompatibleState
    from swarmrun.protocol.spec import SignedSpec, choose_spec

    def signed(owner: bytes, run_id="r1", sig=None):
        s = Spec(run_id=run_id, task="synthetic", task_version="1", task_args={}, seed=0, data_fingerprint="x",
                 num_examples=1024, owner_key=owner,
                 hparams={"lr": 0.1, "target_batch_size": 64, "total_steps": 100, "block_size": 8})
        return SignedSpec(spec=s, signature=sig if sig is not None else b"ok:" + owner).encode()

    def verifier(key, data, sig):  # a signature is b"ok:" + the key that signed
        return sig == b"ok:" + key

    real, strangers = signed(b"owner"), signed(b"stranger")
    found = {"A": real, "B": real, "S": strangers, "X": signed(b"owner", sig=b"forged"), "Y": b"\x00" * 8,
             "W": signed(b"owner", run_id="r2")}
    got, skipped = choose_spec(found, run_id="r1", anchors=("A",), verifier=verifier)
    assert got.encode() == real and len(skipped) == 3  # X (signature), Y (malformed), W (another run)
    # the stranger's own validly signed spec neither replaces nor hides the anchors'
    assert choose_spec({"S": strangers, "A": real}, run_id="r1", anchors=("A",), verifier=verifier)[0].encode() == real
    # an anchor's bad spec is skipped while another anchor's verifies
    got, skipped = choose_spec({"A": signed(b"owner", sig=b"bad"), "B": real}, run_id="r1", anchors=("A", "B"),
                               verifier=verifier)
    assert got.encode() == real and len(skipped) == 1
    # nothing verifies: None with the reasons; nothing at all: None
    assert choose_spec({"X": found["X"]}, run_id="r1", anchors=(), verifier=verifier)[0] is None
    assert choose_spec({}, run_id="r1", anchors=("A",), verifier=verifier) == (None, ())
    # no anchor publishes: one spec is taken, two different ones are refused with a clear message
    assert choose_spec({"B": real}, run_id="r1", anchors=("Z",), verifier=verifier)[0].encode() == real
    with pytest.raises(IncompatibleState, match="different specs"):
        choose_spec({"B": real, "S": strangers}, run_id="r1", anchors=("Z",), verifier=verifier)
