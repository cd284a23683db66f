"""One state-transfer stream, sans-IO: the provider's and the joiner's ends as state machines (h11's manner).

Each end takes the bytes its peer sent (``receive_data``) and returns events; each method that sends returns the
bytes to write. Neither touches a socket or an event loop, so the two ends are tested against each other in
memory (``tests/unit/test_transfer_session.py``). ``node/net/serve.py`` drives ``ProviderSession``. The joiner's
driver (``node/net/fetch.py`` + ``receive.py``) does not drive ``FetcherSession`` yet: driving it cost the
4-provider joiner ~9% of its throughput and ~10% more CPU (bootstrap benchmark, 3 runs each), so it keeps its
own, equivalent checks until that is profiled (``FetcherSession`` holds the same checks, tested on its own).

The stream (the messages are in ``protocol/transfer.py``)::

    joiner                                  provider
    open()            -- Open -->           OpenRequested      (admission, busy, which object: the driver's)
    ManifestReceived  <-- Opened + bytes -- opened(encoded, num_chunks)
                      <-- Refused --        refuse(reason, busy)   (instead, or at any later point)
    get(i) (window)   -- Get -->            ChunkRequested(i)
    ChunkHeader(i, n) <-- Chunk + n bytes -- chunk_header(i, n), then the driver writes the n bytes
    ChunkReceived(i)

States: IDLE -> OPENING (open sent / received) -> STREAMING (manifest sent / verified) -> CLOSED (refused, the
stream ended, ``close()``) or ERROR (the peer broke the protocol: a ``ProtocolViolation`` says how).

**Chunk payloads may bypass the machine.** After a ``ChunkHeader(index, size)`` event the next ``size`` bytes
of the stream are the chunk's raw bytes. A driver that cares about copies (the joiner's ``receive.Frames``
reads them with the kernel straight into the state's buffer) reads them itself and reports each read with
``payload_received(nbytes)``; it sizes every other read with ``wanted()`` so that a read never crosses into a
payload. Payload bytes that do come through ``receive_data`` (in-memory tests, a driver that does not care) are
handed back as ``ChunkData`` events. Either way ``ChunkReceived(index)`` follows the last byte.

Header bytes are bounded before they are buffered: the 4-byte length is checked against ``MAX_HEADER_BYTES``
first, so a peer cannot make either end hold more than one bounded header (or the manifest, whose size
``Opened`` announces within ``MAX_MANIFEST_SIZE``).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Union

from swarmrun.protocol.errors import LocalProtocolError, RemoteProtocolError
from swarmrun.protocol.manifest import Manifest, manifest_digest
from swarmrun.protocol.transfer import (
    HEADER_PREFIX,
    Chunk,
    Get,
    Open,
    Opened,
    Refused,
    decode_message,
    frame,
    header_length,
)


class SessionState(enum.Enum):
    IDLE = "idle"
    OPENING = "opening"
    STREAMING = "streaming"
    CLOSED = "closed"
    ERROR = "error"


# ---- events ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpenRequested:
    """(provider) The joiner asks for object ``manifest_hash`` of the run ``spec_hash``."""

    manifest_hash: str
    spec_hash: str
    credentials: Any = None


@dataclass(frozen=True)
class ChunkRequested:
    """(provider) The joiner asks for chunk ``index`` (within the object's chunks); answer with ``chunk_header``."""

    index: int


@dataclass(frozen=True)
class ManifestReceived:
    """(joiner) The provider's manifest: it hashes to the asked hash and belongs to this run."""

    manifest: Manifest
    encoded: bytes


@dataclass(frozen=True)
class ChunkHeader:
    """(joiner) Chunk ``index`` follows: the next ``size`` bytes of the stream are its raw bytes."""

    index: int
    size: int


@dataclass(frozen=True)
class ChunkData:
    """(joiner) Bytes of chunk ``index`` that came through ``receive_data`` (not read by the driver itself)."""

    index: int
    data: bytes


@dataclass(frozen=True)
class ChunkReceived:
    """(joiner) Every byte of chunk ``index`` arrived (not verified: that is the driver's)."""

    index: int


@dataclass(frozen=True)
class RefusedEvent:
    """(joiner) The provider refused; ``busy``: ask again later."""

    reason: str
    busy: bool = False


@dataclass(frozen=True)
class ProtocolViolation:
    """The peer broke the protocol; the session is in ERROR and reads nothing more.

    ``lied`` (joiner): the provider sent well-formed frames that contradict what was asked or announced (a chunk
    out of turn or of the wrong size, a manifest that is not the asked one): ban it, do not merely retry.
    ``refuse`` (provider): the request was well formed but cannot be answered (no such chunk): tell the joiner
    (``refuse(reason)``) before closing.
    """

    reason: str
    lied: bool = False
    refuse: bool = False


@dataclass(frozen=True)
class ConnectionClosed:
    """The peer ended the stream (``receive_data(b"")``)."""


Event = Union[OpenRequested, ChunkRequested, ManifestReceived, ChunkHeader, ChunkData, ChunkReceived, RefusedEvent,
              ProtocolViolation, ConnectionClosed]

_LIVE = (SessionState.IDLE, SessionState.OPENING, SessionState.STREAMING)


# ---- the framing both ends share -------------------------------------------------------------------------------

class _Session:
    """Splits the received bytes into frames (length, bounded header, payload) and hands each header to the end's
    ``_on_header``; a payload is the manifest (kept) or a chunk (passed on, or read by the driver)."""

    def __init__(self) -> None:
        self.state = SessionState.IDLE
        self._buffer = bytearray()  # the length prefix or the header being received; never over MAX_HEADER_BYTES
        self._header_size: Optional[int] = None  # once the prefix is in
        self._manifest: Optional[bytearray] = None  # the manifest's bytes being received
        self._manifest_size = 0
        self._chunk: Optional[int] = None  # the chunk whose payload is arriving
        self._chunk_left = 0

    def wanted(self) -> int:
        """Bytes that complete the part of a frame being received (length, header, manifest or chunk payload); a
        driver that reads at most this many never reads past a part. 0 once the session is closed or failed."""
        if self.state not in _LIVE:
            return 0
        if self._chunk is not None:
            return self._chunk_left
        if self._manifest is not None:
            return self._manifest_size - len(self._manifest)
        return (self._header_size or HEADER_PREFIX) - len(self._buffer)

    def receive_data(self, data: bytes) -> list[Event]:
        """Bytes from the peer (``b""``: it ended the stream); returns the events they complete, in order.

        Nothing is read after the session closed or failed: those bytes are ignored.
        """
        if self.state not in _LIVE:
            return []
        if not data:
            self.state = SessionState.CLOSED
            return [ConnectionClosed()]
        events: list[Event] = []
        view = memoryview(data).cast("B")
        while view.nbytes and self.state in _LIVE:
            take = min(self.wanted(), view.nbytes)
            part, view = view[:take], view[take:]
            if self._chunk is not None:
                events.append(ChunkData(self._chunk, bytes(part)))
                events += self.payload_received(take)
            elif self._manifest is not None:
                self._manifest += part
                if len(self._manifest) == self._manifest_size:
                    encoded, self._manifest = bytes(self._manifest), None
                    events += self._on_manifest(encoded)
            else:
                self._buffer += part
                if not self.wanted():
                    events += self._part_done()
        return events

    def payload_received(self, nbytes: int) -> list[Event]:
        """The driver read ``nbytes`` of the current chunk's payload itself (see the module docstring).

        Raises:
            LocalProtocolError: no chunk payload is due, or more bytes than it has left.
        """
        if self._chunk is None or not 0 <= nbytes <= self._chunk_left:
            raise LocalProtocolError(f"{nbytes} payload bytes read, {self._chunk_left} due")
        self._chunk_left -= nbytes
        if self._chunk_left:
            return []
        index, self._chunk = self._chunk, None
        return [ChunkReceived(index)]

    def close(self) -> None:
        """This end is done with the stream."""
        if self.state in _LIVE:
            self.state = SessionState.CLOSED

    def _part_done(self) -> list[Event]:
        try:
            if self._header_size is None:  # the length, checked before a byte of the header is kept
                self._header_size = header_length(bytes(self._buffer))
                self._buffer.clear()
                return []
            message = decode_message(bytes(self._buffer))
        except RemoteProtocolError as e:
            return self._violation(str(e))
        self._buffer.clear()
        self._header_size = None
        return self._on_header(message)

    def _violation(self, reason: str, *, lied: bool = False, refuse: bool = False) -> list[Event]:
        self.state = SessionState.ERROR
        return [ProtocolViolation(reason, lied=lied, refuse=refuse)]

    def _require(self, state: SessionState, what: str) -> None:
        if self.state is not state:
            raise LocalProtocolError(f"cannot {what} in state {self.state.value}")

    def _on_header(self, message) -> list[Event]:  # pragma: no cover - each end overrides it
        raise NotImplementedError

    def _on_manifest(self, encoded: bytes) -> list[Event]:
        raise LocalProtocolError("no manifest is expected on this end")


# ---- the provider's end ----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ProviderConfig:
    """``max_pending``: chunk requests received and not answered yet that a provider holds; a joiner whose window
    is larger breaks the protocol (the joiner's window is a few requests)."""

    max_pending: int = 1024


class ProviderSession(_Session):
    """The provider's end: ``OpenRequested`` first, then ``ChunkRequested`` for each get, answered in order."""

    def __init__(self, config: ProviderConfig = ProviderConfig()):
        super().__init__()
        self.config = config
        self.num_chunks = 0
        self.pending: deque[int] = deque()  # requested, not answered yet, in the order asked

    def opened(self, encoded: bytes, num_chunks: int) -> bytes:
        """Serve the object: the ``Opened`` frame and the manifest's bytes (``num_chunks``: its chunks)."""
        self._require(SessionState.OPENING, "open")
        self.state, self.num_chunks = SessionState.STREAMING, num_chunks
        return frame(Opened(size=len(encoded)).encode()) + encoded

    def refuse(self, reason: str, *, busy: bool = False) -> bytes:
        """Refuse (admission, busy, unknown object, a bad request); the stream is done after these bytes."""
        if self.state is SessionState.CLOSED:
            raise LocalProtocolError("cannot refuse on a closed stream")
        self.state = SessionState.CLOSED
        return frame(Refused(reason=reason, busy=busy).encode())

    def chunk_header(self, index: int, size: int) -> bytes:
        """The header of the answer to the oldest request (chunk ``index``); the driver writes its ``size`` raw
        bytes right after.

        Raises:
            LocalProtocolError: ``index`` is not the oldest chunk requested (answers go in the order asked).
        """
        self._require(SessionState.STREAMING, "send a chunk")
        if not self.pending or self.pending[0] != index:
            raise LocalProtocolError(f"chunk {index} was not the next one requested")
        self.pending.popleft()
        return frame(Chunk(index=index, size=size).encode())

    def _on_header(self, message) -> list[Event]:
        if self.state is SessionState.IDLE:
            if not isinstance(message, Open):
                return self._violation("a transfer starts with open")
            self.state = SessionState.OPENING
            return [OpenRequested(message.manifest_hash, message.spec_hash, message.credentials)]
        if not isinstance(message, Get):
            return self._violation("expected get")
        if self.state is not SessionState.STREAMING:
            return self._violation("a get before the object was opened")
        if not 0 <= message.index < self.num_chunks:
            return self._violation(f"no chunk {message.index}", refuse=True)
        if len(self.pending) >= self.config.max_pending:
            return self._violation(f"more than {self.config.max_pending} chunk requests in flight")
        self.pending.append(message.index)
        return [ChunkRequested(message.index)]


# ---- the joiner's end ------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class FetcherConfig:
    """The object asked for and how: ``window`` chunk requests in flight at most."""

    spec_hash: str
    manifest_hash: str
    credentials: Any = None
    window: int = 4


class FetcherSession(_Session):
    """The joiner's end: ``open()``, the manifest (checked against the asked hash and this run's spec), then
    ``get`` up to ``window`` chunks ahead; each answer must be the oldest chunk asked, of the manifest's size."""

    def __init__(self, config: FetcherConfig):
        super().__init__()
        self.config = config
        self.manifest: Optional[Manifest] = None
        self.asked: deque[int] = deque()  # requested, not answered yet, in the order asked

    def open(self) -> bytes:
        """The ``Open`` frame: the first bytes of the stream."""
        self._require(SessionState.IDLE, "open")
        self.state = SessionState.OPENING
        c = self.config
        return frame(Open(spec_hash=c.spec_hash, manifest_hash=c.manifest_hash, credentials=c.credentials).encode())

    def room(self) -> int:
        """Requests that may be sent now (the window's free places; 0 unless streaming)."""
        return self.config.window - len(self.asked) if self.state is SessionState.STREAMING else 0

    def get(self, index: int) -> bytes:
        """Ask for chunk ``index``.

        Raises:
            LocalProtocolError: not streaming, the window is full, or no such chunk.
        """
        self._require(SessionState.STREAMING, "get")
        if not self.room():
            raise LocalProtocolError(f"{len(self.asked)} requests in flight: the window is full")
        if not 0 <= index < len(self.manifest.chunks):
            raise LocalProtocolError(f"no chunk {index} in the manifest")
        self.asked.append(index)
        return frame(Get(index=index).encode())

    def _on_header(self, message) -> list[Event]:
        if isinstance(message, Refused):
            self.state = SessionState.CLOSED
            return [RefusedEvent(message.reason, message.busy)]
        if isinstance(message, Opened) and self.state is SessionState.OPENING:
            self._manifest, self._manifest_size = bytearray(), message.size
            return []
        if isinstance(message, Chunk) and self.state is SessionState.STREAMING:
            return self._on_chunk(message)
        if isinstance(message, Chunk):
            return self._violation("a chunk before the manifest")
        return self._violation(f"unexpected {type(message).__name__.lower()} from a provider")

    def _on_chunk(self, chunk: Chunk) -> list[Event]:
        # answers come in the order asked: a provider can neither push a chunk nobody asked for nor reorder them,
        # so the driver always knows where the next bytes go before they arrive
        if not self.asked or chunk.index != self.asked[0]:
            return self._violation("answered out of order", lied=True)
        start, end = self.manifest.chunk_range(chunk.index)
        if chunk.size != end - start:
            return self._violation(f"chunk {chunk.index} has the wrong size", lied=True)
        self.asked.popleft()
        self._chunk, self._chunk_left = chunk.index, chunk.size
        events: list[Event] = [ChunkHeader(chunk.index, chunk.size)]
        return events + (self.payload_received(0) if not chunk.size else [])

    def _on_manifest(self, encoded: bytes) -> list[Event]:
        if manifest_digest(encoded) != self.config.manifest_hash:
            return self._violation("its manifest does not match the announced hash", lied=True)
        try:
            manifest = Manifest.decode(encoded)
        except RemoteProtocolError as e:
            return self._violation(f"malformed manifest: {e}", lied=True)
        if manifest.spec_hash != self.config.spec_hash:
            return self._violation("its manifest belongs to another run", lied=True)
        self.manifest, self.state = manifest, SessionState.STREAMING
        return [ManifestReceived(manifest, encoded)]
