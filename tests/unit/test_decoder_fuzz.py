"""Every decoder of bytes from the network or from storage rejects malformed, oversized and deeply nested input
with a ProtocolError (never another exception) and within bounded memory (property-based fuzzing)."""

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmrun.protocol import access, manifest, round as round_, snapshot, spec, transfer
from swarmrun.protocol.codec import pack
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.errors import ProtocolError

DECODERS = {
    "certificate": access.Certificate.decode,
    "revocations": access.Revocations.decode,
    "manifest": manifest.Manifest.decode,
    "round_meta": round_.RoundMeta.decode,
    "vote": round_.Vote.decode,
    "progress": round_.ProgressReport.decode,
    "signed_spec": spec.SignedSpec.decode,
    "provider": transfer.ProviderRecord.decode,
    "frame": transfer.decode_message,
    "amendment": snapshot.Amendment.decode,
    "snapshot_record": snapshot.SnapshotRecord.decode,
    "pause": snapshot.PauseRecord.decode,
    "pause_note": snapshot.PauseNote.decode,
}
STRUCTURED = {  # decoders of already-unpacked values
    "cursor": DataCursor.from_dict,
    "ranges": RangeSet.from_list,
    "spec": spec.Spec.from_dict,
}

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                    st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-1000, 1000)),
                                                                    inner, max_size=6)), max_leaves=30)
# maps that look like our messages: the right "type" with random fields
typed = st.builds(lambda t, d: {**d, "type": t, "version": 1},
                  st.sampled_from(["certificate", "revocations", "manifest", "round_meta", "vote", "progress",
                                   "signed_spec", "provider", "open", "get", "opened", "chunk", "refused"]),
                  st.dictionaries(st.sampled_from(["spec_hash", "step", "index", "size", "samples", "blocks", "log",
                                                   "tensors", "chunks", "signature", "peer_id", "run_id", "reason",
                                                   "busy", "certificate", "cursor", "claimed", "time", "expires_at",
                                                   "issued_at", "revoked", "manifest_hash", "state_hash", "role"]),
                                  values, max_size=10))


def _pack(value) -> bytes:
    try:
        return pack(value)  # the canonical encoding (sorted keys) when the value has one
    except Exception:
        return msgpack.packb(value, use_bin_type=True)  # e.g. maps with keys of mixed kinds


def _only_protocol_errors(decode, data) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(DECODERS)), data=st.one_of(st.binary(max_size=300), values.map(_pack),
                                                              typed.map(_pack)))
def test_decoders_raise_only_protocol_errors(name, data):
    _only_protocol_errors(DECODERS[name], data)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(STRUCTURED)), value=st.one_of(values, typed))
def test_structured_decoders_raise_only_protocol_errors(name, value):
    _only_protocol_errors(STRUCTURED[name], value)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_deep_nesting_and_huge_declared_sizes(name):
    deep = b"\x91" * 100_000 + b"\xc0"  # a list nested 100k deep
    huge_array = b"\xdd\xff\xff\xff\xff"  # declares 4G elements, holds none
    huge_bin = b"\xc6\xff\xff\xff\xf0"  # declares a 4 GB bytes value
    for data in (deep, huge_array, huge_bin, b"\x00" * (64 * 2**20 + 1)):
        _only_protocol_errors(DECODERS[name], data)
