"""The transfer session's two ends (``protocol/transfer_session.py``) exchanging bytes in memory: no socket, no loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmrun.protocol.errors import LocalProtocolError
from swarmrun.protocol.manifest import build_manifest
from swarmrun.protocol.transfer import MAX_HEADER_BYTES, Chunk, Get, Opened, frame
from swarmrun.protocol.transfer_session import (
    ChunkData,
    ChunkHeader,
    ChunkReceived,
    ChunkRequested,
    ConnectionClosed,
    FetcherConfig,
    FetcherSession,
    ManifestReceived,
    OpenRequested,
    ProtocolViolation,
    ProviderConfig,
    ProviderSession,
    RefusedEvent,
    SessionState,
)

SPEC = "a" * 64
DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes: chunks of 1024, the last one short
MANIFEST = build_manifest(spec_hash=SPEC, step=3, chunk_size=1024, content={},
                          tensors=[("model/w", "uint8", (len(DATA),), memoryview(DATA))])
ENCODED = MANIFEST.encode()
HASH = MANIFEST.manifest_hash()


def chunk(index: int) -> bytes:
    start, end = MANIFEST.chunk_range(index)
    return DATA[start:end]


def opened_pair(window: int = 4) -> tuple[ProviderSession, FetcherSession, list]:
    """A provider and a joiner past the open: the manifest is received; returns the joiner's events."""
    provider, fetcher = ProviderSession(), FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH,
                                                                      window=window))
    assert provider.receive_data(fetcher.open()) == [OpenRequested(HASH, SPEC, None)]
    events = fetcher.receive_data(provider.opened(ENCODED, len(MANIFEST.chunks)))
    return provider, fetcher, events


def serve(provider: ProviderSession, data: bytes) -> bytes:
    """The provider's driver: every chunk requested, in order, header then raw bytes."""
    out = b""
    for event in provider.receive_data(data):
        assert isinstance(event, ChunkRequested)
        out += provider.chunk_header(event.index, len(chunk(event.index))) + chunk(event.index)
    return out


def received(events) -> dict[int, bytes]:
    got, current = {}, {}
    for e in events:
        if isinstance(e, ChunkHeader):
            current[e.index] = b""
        elif isinstance(e, ChunkData):
            current[e.index] += e.data
        elif isinstance(e, ChunkReceived):
            got[e.index] = current.pop(e.index)
    return got


def test_happy_path_every_chunk_in_the_window_in_order():
    provider, fetcher, events = opened_pair(window=3)
    assert events == [ManifestReceived(MANIFEST, ENCODED)]
    assert fetcher.state is provider.state is SessionState.STREAMING
    got, todo = {}, list(range(len(MANIFEST.chunks)))
    while todo or fetcher.asked:
        asks = b""
        while fetcher.room() and todo:
            asks += fetcher.get(todo.pop(0))
        assert len(fetcher.asked) <= 3
        got.update(received(fetcher.receive_data(serve(provider, asks))))
    assert got == {i: chunk(i) for i in range(len(MANIFEST.chunks))}
    assert not provider.pending
    assert provider.receive_data(b"") == [ConnectionClosed()] and provider.state is SessionState.CLOSED


def test_the_driver_reads_payloads_itself_sized_by_wanted():
    provider, fetcher, _ = opened_pair()
    stream = serve(provider, fetcher.get(0) + fetcher.get(10))
    events, pos = [], 0
    while pos < len(stream):
        if fetcher._chunk is not None:  # noqa: SLF001 - a driver knows from the last ChunkHeader
            n = fetcher.wanted()
            events += fetcher.payload_received(n)  # the bytes went into the driver's buffer, not through here
        else:
            n = fetcher.wanted()
            assert 0 < n <= MAX_HEADER_BYTES
            events += fetcher.receive_data(stream[pos:pos + n])
        pos += n
    assert events == [ChunkHeader(0, 1024), ChunkReceived(0), ChunkHeader(10, 4), ChunkReceived(10)]
    with pytest.raises(LocalProtocolError):
        fetcher.payload_received(1)


@pytest.mark.parametrize("wrong", ["turn", "size", "unasked"])
def test_a_provider_out_of_turn_or_with_the_wrong_size_lied(wrong):
    provider, fetcher, _ = opened_pair()
    fetcher.get(2), fetcher.get(3)
    index, size = {"turn": (3, 1024), "size": (2, 5), "unasked": (7, 1024)}[wrong]
    events = fetcher.receive_data(frame(Chunk(index=index, size=size).encode()) + bytes(size))
    assert len(events) == 1 and isinstance(events[0], ProtocolViolation) and events[0].lied
    assert fetcher.state is SessionState.ERROR
    assert fetcher.receive_data(b"more") == []  # nothing is read after a violation


def test_a_manifest_that_is_not_the_asked_one_lied():
    other = build_manifest(spec_hash="b" * 64, step=3, chunk_size=1024, content={},
                           tensors=[("model/w", "uint8", (len(DATA),), memoryview(DATA))])
    for manifest_hash, encoded, reason in ((HASH, other.encode(), "announced hash"),
                                           (other.manifest_hash(), other.encode(), "another run"),
                                           (HASH, b"\x00" * 10, "announced hash")):
        fetcher = FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=manifest_hash))
        fetcher.open()
        [event] = fetcher.receive_data(frame(Opened(size=len(encoded)).encode()) + encoded)
        assert isinstance(event, ProtocolViolation) and event.lied and reason in event.reason


def test_an_oversized_header_is_a_violation_before_any_of_it_is_buffered():
    provider, fetcher, _ = opened_pair()
    prefix = (MAX_HEADER_BYTES + 1).to_bytes(4, "big")
    for end in (fetcher, provider):
        [event] = end.receive_data(prefix)  # the length alone: no header byte sent yet
        assert isinstance(event, ProtocolViolation) and not event.lied and "out of bounds" in event.reason
        assert end.state is SessionState.ERROR and end.wanted() == 0
        assert end.receive_data(b"\x00" * (MAX_HEADER_BYTES + 1)) == [] and len(end._buffer) <= 4  # noqa: SLF001


def test_malformed_and_unexpected_frames_are_violations():
    provider = ProviderSession()
    [event] = provider.receive_data(frame(b"\xc1"))  # not msgpack
    assert isinstance(event, ProtocolViolation) and not event.lied
    provider = ProviderSession()
    [event] = provider.receive_data(frame(Chunk(index=0, size=0).encode()))
    assert event == ProtocolViolation("a transfer starts with open")
    fetcher = FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH))
    fetcher.open()
    [event] = fetcher.receive_data(frame(Chunk(index=0, size=4).encode()))
    assert event == ProtocolViolation("a chunk before the manifest")


def test_refusal_and_busy_close_the_stream():
    for busy in (False, True):
        provider = ProviderSession()
        fetcher = FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH))
        [request] = provider.receive_data(fetcher.open())
        assert fetcher.receive_data(provider.refuse("busy" if busy else "not served", busy=busy)) == \
            [RefusedEvent("busy" if busy else "not served", busy)]
        assert fetcher.state is provider.state is SessionState.CLOSED and fetcher.room() == 0
        with pytest.raises(LocalProtocolError):
            provider.opened(ENCODED, 1)


def test_the_provider_refuses_an_unknown_chunk_and_answers_in_the_order_asked():
    provider, fetcher, _ = opened_pair()
    asks = fetcher.get(1) + fetcher.get(0)
    asks += frame(Get(index=99).encode())  # a get the joiner's session would not send
    events = provider.receive_data(asks)
    assert events[:2] == [ChunkRequested(1), ChunkRequested(0)]
    assert events[2] == ProtocolViolation("no chunk 99", refuse=True)
    with pytest.raises(LocalProtocolError):
        provider.chunk_header(0, 1024)  # chunk 1 was asked first
    provider = ProviderSession(ProviderConfig(max_pending=1))
    provider.receive_data(FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH)).open())
    provider.opened(ENCODED, len(MANIFEST.chunks))
    [ok, too_many] = provider.receive_data(fetcher.get(2) + fetcher.get(3))
    assert ok == ChunkRequested(2) and "in flight" in too_many.reason


def test_the_joiner_cannot_overfill_its_window_or_ask_before_the_manifest():
    fetcher = FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH, window=2))
    with pytest.raises(LocalProtocolError):
        fetcher.get(0)
    _, fetcher, _ = opened_pair(window=2)
    fetcher.get(0), fetcher.get(1)
    assert fetcher.room() == 0
    with pytest.raises(LocalProtocolError):
        fetcher.get(2)
    _, fetcher, _ = opened_pair()
    with pytest.raises(LocalProtocolError):
        fetcher.get(len(MANIFEST.chunks))


def _merge(events) -> list:
    """Events with adjacent ``ChunkData`` of one chunk joined (how the bytes were split does not matter)."""
    out: list = []
    for e in events:
        if isinstance(e, ChunkData) and out and isinstance(out[-1], ChunkData) and out[-1].index == e.index:
            out[-1] = ChunkData(e.index, out[-1].data + e.data)
        else:
            out.append(e)
    return out


def _stream() -> tuple[bytes, bytes]:
    """The joiner's bytes and the provider's bytes of one whole transfer (window 4)."""
    provider, fetcher = ProviderSession(), FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH))
    up = fetcher.open()
    provider.receive_data(up)
    down = provider.opened(ENCODED, len(MANIFEST.chunks))
    fetcher.receive_data(down)
    asks = b"".join(fetcher.get(i) for i in (0, 1, 2, 3))
    up += asks
    answer = serve(provider, asks)
    fetcher.receive_data(answer)
    return up, down + answer + provider.refuse("done")


UP, DOWN = _stream()


def _feed(end, data: bytes, cuts: list[int]) -> list:
    events, last = [], 0
    for cut in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
        events += end.receive_data(data[last:cut]) if cut > last else []
        last = cut
    return _merge(events)


OPEN_BYTES = len(FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH)).open())
MANIFEST_BYTES = len(frame(Opened(size=len(ENCODED)).encode())) + len(ENCODED)


def _provider_events(p: ProviderSession, feed) -> list:
    """The provider's events: its driver serves the object once the open is in (as serve.py does)."""
    events = feed(UP[:OPEN_BYTES])
    p.opened(ENCODED, len(MANIFEST.chunks))
    return events + feed(UP[OPEN_BYTES:])


def _joiner_events(f: FetcherSession, feed) -> list:
    """The joiner's events: it opened, and asks four chunks once the manifest is in."""
    f.open()
    events = feed(DOWN[:MANIFEST_BYTES])
    for i in range(4):
        f.get(i)
    return events + feed(DOWN[MANIFEST_BYTES:])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0), max_size=40), st.lists(st.integers(min_value=0), max_size=40))
def test_any_split_of_the_byte_streams_gives_the_same_events(up_cuts, down_cuts):
    whole_p, split_p = ProviderSession(), ProviderSession()
    expected_p = _provider_events(whole_p, whole_p.receive_data)
    got_p = _provider_events(split_p, lambda d: _feed(split_p, d, up_cuts))
    assert got_p == expected_p and [type(e) for e in got_p] == [OpenRequested] + [ChunkRequested] * 4
    whole_f, split_f = (FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH)) for _ in range(2))
    expected_f = _merge(_joiner_events(whole_f, whole_f.receive_data))
    got_f = _merge(_joiner_events(split_f, lambda d: _feed(split_f, d, down_cuts)))
    assert got_f == expected_f and expected_f[0] == ManifestReceived(MANIFEST, ENCODED)
    assert received(expected_f) == {i: chunk(i) for i in range(4)} and expected_f[-1] == RefusedEvent("done")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans(), st.booleans())
def test_arbitrary_bytes_give_events_never_an_exception(data, opened, provider_side):
    """Whatever a peer sends, either end answers with events (a violation at worst), and holds no more than a
    bounded header."""
    if provider_side:
        end = ProviderSession()
        if opened:
            end.receive_data(FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH)).open())
            end.opened(ENCODED, len(MANIFEST.chunks))
    else:
        end = opened_pair()[1] if opened else FetcherSession(FetcherConfig(spec_hash=SPEC, manifest_hash=HASH))
        if opened:
            end.get(0)
        else:
            end.open()
    events = end.receive_data(data)
    assert all(not isinstance(e, ProtocolViolation) for e in events[:-1])
    assert len(end._buffer) <= MAX_HEADER_BYTES  # noqa: SLF001
