"""Tests of swarmrun.protocol.manifest."""

import dataclasses
import hashlib

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.codec import pack, unpack
from swarmrun.protocol.cursor import DataCursor, RangeSet
from swarmrun.protocol.errors import LocalProtocolError, RemoteProtocolError
from swarmrun.protocol.manifest import (
    DEFAULT_CHUNK_SIZE,
    MANIFEST_VERSION,
    Manifest,
    TensorCheck,
    TensorEntry,
    build_manifest,
    digest,
    manifest_digest,
)

FAST = settings(max_examples=200, deadline=None)
SPEC_HASH = hashlib.sha256(b"spec").hexdigest()
CURSOR = DataCursor.new(seed=1, num_examples=100, block_size=10).apply(RangeSet.from_items([2, 3]))


def tensors(weight=bytes(range(24)), bias=b"\x01\x02\x03\x04\x05"):
    return [("layer.weight", "float32", (2, 3), weight), ("layer.bias", "uint8", (5,), bias),
            ("empty", "float16", (0, 4), b"")]


def make(*, step=3, content=None, chunk_size=7, info=None, ts=None):
    content = {"cursor": CURSOR.to_dict(), "rng": b"\x00" * 8} if content is None else content
    return build_manifest(spec_hash=SPEC_HASH, step=step, tensors=ts or tensors(), content=content,
                          info=info or {}, chunk_size=chunk_size)


def state_bytes(ts=None):
    return b"".join(data for _, _, _, data in ts or tensors())


def test_layout_and_chunks():
    m = make()
    assert [(t.name, t.offset, t.nbytes) for t in m.tensors] == [
        ("layer.weight", 0, 24), ("layer.bias", 24, 5), ("empty", 29, 0)]
    assert m.total_bytes == 29 and len(m.chunks) == 5 and m.chunk_range(4) == (28, 29)
    blob = state_bytes()
    for i in range(len(m.chunks)):
        start, end = m.chunk_range(i)
        assert m.chunks[i] == blake3(blob[start:end]).hexdigest() == digest(blob[start:end])
        assert m.verify_chunk(i, blob[start:end])
    assert m.tensors[0].digest == blake3(bytes(range(24))).hexdigest()
    assert m.verify_tensor(m.tensors[0], bytes(range(24))) and not m.verify_tensor(m.tensors[0], bytes(24))
    assert m.manifest_hash() == manifest_digest(m.encode()) == blake3(m.encode()).hexdigest()
    with pytest.raises(IndexError):
        m.chunk_range(5)


def test_verify_chunk_rejects_wrong_bytes():
    m = make()
    assert not m.verify_chunk(0, b"\x00" * 7)
    assert not m.verify_chunk(4, state_bytes()[28:29] + b"x")
    assert not m.verify_chunk(0, state_bytes()[:6])


def test_memoryview_input_streams_like_bytes():
    import array
    weights = array.array("f", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    ts = [("w", "float32", (2, 3), memoryview(weights)), ("b", "uint8", (5,), b"abcde")]
    as_bytes = [("w", "float32", (2, 3), weights.tobytes()), ("b", "uint8", (5,), b"abcde")]
    assert make(ts=ts) == make(ts=as_bytes)


@FAST
@given(st.integers(1, 40), st.integers(1, 40))
def test_state_hash_independent_of_chunking_info_and_certificates(a, b):
    ma, mb = make(chunk_size=a), make(chunk_size=b, info={"writer": "peer-2", "wall_time": 5.0})
    assert ma.state_hash() == mb.state_hash()
    if a != b:
        assert ma.manifest_hash() != mb.manifest_hash()
    with_cert = dataclasses.replace(ma, certificates=(b"cert",))
    assert with_cert.state_hash() == ma.state_hash()


def test_default_chunk_size():
    assert make(chunk_size=DEFAULT_CHUNK_SIZE).chunks == (blake3(state_bytes()).hexdigest(),)


def test_large_tensors_hash_in_pieces_like_whole():
    big = bytes(range(256)) * 9000  # > 2 MiB: several pieces, across chunk boundaries
    ts = [("a", "uint8", (len(big),), big), ("b", "uint8", (3,), b"xyz")]
    m = make(ts=ts, chunk_size=(1 << 20) + 17)
    assert m.tensors[0].digest == blake3(big).hexdigest()
    blob = big + b"xyz"
    assert all(m.chunks[i] == blake3(blob[slice(*m.chunk_range(i))]).hexdigest() for i in range(len(m.chunks)))


@FAST
@given(st.integers(0, 28), st.integers(1, 255))
def test_state_hash_changes_with_any_tensor_byte(position, delta):
    blob = bytearray(state_bytes())
    blob[position] = (blob[position] + delta) % 256
    ts = tensors(weight=bytes(blob[:24]), bias=bytes(blob[24:29]))
    assert make(ts=ts).state_hash() != make().state_hash()


def test_state_hash_changes_with_step_content_spec_and_layout():
    base = make().state_hash()
    assert make(step=4).state_hash() != base
    assert make(content={"cursor": CURSOR.apply([4]).to_dict(), "rng": b"\x00" * 8}).state_hash() != base
    assert make(content={"cursor": CURSOR.to_dict(), "rng": b"\x01" * 8}).state_hash() != base
    other_spec = build_manifest(spec_hash="0" * 64, step=3, tensors=tensors(), content=make().content)
    assert other_spec.state_hash() != base
    renamed = [("layer.w", "float32", (2, 3), bytes(range(24)))] + tensors()[1:]
    assert make(ts=renamed).state_hash() != base
    reshaped = [("layer.weight", "float32", (3, 2), bytes(range(24)))] + tensors()[1:]
    assert make(ts=reshaped).state_hash() != base


def test_encode_decode_roundtrip():
    m = make(info={"writer": "peer-1", "amendments": [{"step": 2, "lr": 0.1}]})
    decoded = Manifest.decode(m.encode())
    assert decoded == m
    assert decoded.state_hash() == m.state_hash() and decoded.manifest_hash() == m.manifest_hash()


def test_build_rejects_bad_tensors():
    with pytest.raises(LocalProtocolError, match="nbytes"):
        make(ts=[("w", "float32", (2, 3), b"\x00" * 23)])
    with pytest.raises(LocalProtocolError, match="dtype"):
        make(ts=[("w", "complex64", (1,), b"\x00" * 8)])
    with pytest.raises(LocalProtocolError, match="twice"):
        make(ts=[("w", "uint8", (1,), b"a"), ("w", "uint8", (1,), b"b")])
    with pytest.raises(LocalProtocolError, match="contiguous"):
        make(ts=[("w", "uint8", (2,), memoryview(b"abcd")[::2])])
    with pytest.raises(LocalProtocolError):
        make(content={"x": object()})


def _tamper(field, value):
    def mutate(d):
        d[field] = value
    return mutate


def _tamper_tensor(field, value):
    def mutate(d):
        d["tensors"][0][field] = value
    return mutate


@pytest.mark.parametrize("mutate", [
    _tamper("type", "spec"),
    _tamper("version", MANIFEST_VERSION + 1),
    _tamper("spec_hash", "x" * 64),
    _tamper("spec_hash", SPEC_HASH.upper()),
    _tamper("step", -1),
    _tamper("step", 1.0),
    _tamper("chunk_size", 0),
    _tamper("chunk_size", 2**40),
    _tamper("chunk_size", 8),  # chunk count no longer matches
    _tamper("chunks", []),
    _tamper("content", []),
    _tamper("info", None),
    _tamper("certificates", {}),
    _tamper("tensors", {}),
    _tamper_tensor("offset", 1),
    _tamper_tensor("nbytes", 25),
    _tamper_tensor("shape", [2, 4]),
    _tamper_tensor("shape", [-2, -3]),
    _tamper_tensor("shape", "23"),
    _tamper_tensor("dtype", "object"),
    _tamper_tensor("digest", "zz"),
    _tamper_tensor("name", ""),
    _tamper_tensor("name", "layer.bias"),
    lambda d: d["tensors"][0].pop("digest"),
    lambda d: d["chunks"].__setitem__(0, "g" * 64),
    lambda d: d["content"]["cursor"].update(applied=[[5, 2]]),
    lambda d: d.pop("info"),
    lambda d: d.update(extra=1),
])
def test_decode_rejects_tampered(mutate):
    d = unpack(make().encode())
    mutate(d)
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(pack(d))


def test_decode_rejects_truncated_oversized_and_deep():
    data = make().encode()
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(RemoteProtocolError):
            Manifest.decode(data[:cut])
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        Manifest.decode(data, max_size=len(data) - 1)
    deep = unpack(data)
    nested = "leaf"
    for _ in range(40):
        nested = [nested]
    deep["info"]["x"] = nested
    with pytest.raises(RemoteProtocolError, match="nesting"):
        Manifest.decode(pack(deep))
    with pytest.raises(RemoteProtocolError):
        Manifest.decode("not bytes")


def test_version_1_is_refused_with_a_clear_error():
    d = unpack(make().encode())
    d["version"] = 1
    with pytest.raises(RemoteProtocolError, match="version 1 is not supported.*older swarmrun"):
        Manifest.decode(pack(d))
    with pytest.raises(LocalProtocolError, match="version"):
        dataclasses.replace(make(), version=1)


@FAST
@given(st.integers(1, 12), st.randoms(use_true_random=False), st.integers(0, 2))
def test_tensor_check_in_any_order_matches_the_digests(chunk_size, rnd, repeats):
    m = make(chunk_size=chunk_size)
    blob = state_bytes()
    order = list(range(len(m.chunks))) * (1 + repeats)  # a chunk given twice is ignored
    rnd.shuffle(order)
    check = TensorCheck(m)
    for n, i in enumerate(order):
        check.add(i, blob[slice(*m.chunk_range(i))])
        assert check.done == set(range(len(m.chunks))).issubset(order[:n + 1])
    assert check.faults == []


def test_tensor_check_names_the_tensor_a_lying_manifest_describes_wrongly():
    m = make(chunk_size=4)
    blob = bytearray(state_bytes())
    blob[25] ^= 1  # in layer.bias; chunk digests recomputed over these bytes, tensor digests kept: a lying manifest
    liar = dataclasses.replace(m, chunks=tuple(blake3(bytes(blob[slice(*m.chunk_range(i))])).hexdigest()
                                               for i in range(len(m.chunks))))
    check = TensorCheck(liar)
    for i in reversed(range(len(m.chunks))):
        assert not check.done
        check.add(i, blob[slice(*m.chunk_range(i))])
    assert check.done and check.faults == ["tensor layer.bias does not match its hash"]
    with pytest.raises(ValueError):
        TensorCheck(m).add(0, b"short")


def test_tensor_check_of_an_empty_state_is_done_at_once():
    m = make(ts=[("empty", "float16", (0, 4), b"")])
    assert m.chunks == () and TensorCheck(m).done


def test_tensor_entry_validates():
    digest = "0" * 64
    TensorEntry(name="w", dtype="bool", shape=(3,), offset=0, nbytes=3, digest=digest)
    with pytest.raises(LocalProtocolError):
        TensorEntry(name="w", dtype="bfloat16", shape=(3,), offset=0, nbytes=3, digest=digest)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_only_remote_protocol_error(data):
    try:
        Manifest.decode(data)
    except RemoteProtocolError:
        pass


@FAST
@given(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 10_000))
def test_mutated_bytes_only_remote_protocol_error(position, byte, cut):
    data = bytearray(make().encode())
    data[position % len(data)] = byte
    for candidate in (bytes(data), bytes(data[: cut % len(data)])):
        try:
            decoded = Manifest.decode(candidate)
        except RemoteProtocolError:
            continue
        # a mutation that still decodes must still be self-consistent
        assert Manifest.decode(decoded.encode()) == decoded
