"""The provider's side of state transfer: serves frozen states and step records by manifest hash over hivemind P2P."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from hivemind.p2p import P2P

from swarmrun.node import faults
from swarmrun.node.net.streams import quiet_dropped_streams, send
from swarmrun.node.state.run import FrozenState
from swarmrun.protocol.errors import ProtocolError, RemoteProtocolError
from swarmrun.protocol.manifest import manifest_digest
from swarmrun.protocol.transfer import Open, protocol_name
from swarmrun.protocol.transfer_session import (
    ChunkRequested,
    OpenRequested,
    ProtocolViolation,
    ProviderSession,
    SessionState,
)

logger = logging.getLogger("swarmrun.transfer")
Admit = Callable[[Open, str], Optional[str]]  # (request, remote peer id) -> refusal reason, or None to admit

READ_SIZE = 1 << 16  # a read of a joiner's requests: many gets at once, each a few bytes


def admit_open(spec_hash: str, gate=None) -> Admit:
    """The one admission check of state serving: the requester names this run's spec and, through the access
    gate (``node.access.AccessGate``), holds a valid certificate for its peer id (authenticated by libp2p)."""

    def admit(request: Open, remote: str) -> Optional[str]:
        if request.spec_hash != spec_hash:
            return "another run's spec"
        return gate.check(remote, request.credentials) if gate is not None else None

    return admit


@dataclass
class _Served:
    frozen: FrozenState
    encoded: bytes  # the manifest's bytes
    last_used: float = field(default_factory=time.monotonic)
    sessions: int = 0
    manifest_hash: str = field(init=False)  # of ``encoded``, once: records and lookups name it many times a second

    def __post_init__(self) -> None:
        self.manifest_hash = manifest_digest(self.encoded)


class StateServer:
    """Serves this peer's frozen objects by manifest hash; at most ``max_sessions`` transfers at once.

    The current state is always served; a previous one stays while a transfer uses it or for ``linger`` seconds
    after its last use (every committer of a step holds the same bits, so a joiner that started on step s finishes
    it from whoever still holds s); the last ``keep_records`` step records stay for joiners to replay. The last
    ``max_announced`` states named in this peer's provider record (``announce``) stay too, however fast the swarm
    steps: a joiner reads the record, then asks, and a swarm at 70 steps/s has replaced the state meanwhile.
    """

    def __init__(self, p2p: P2P, run_id: str, admit: Admit, *, max_sessions: int = 8, linger: float = 30.0,
                 keep_records: int = 16, max_old_states: int = 2, chunk_timeout: float = 30.0,
                 max_announced: int = 2):
        self.p2p, self.run_id, self.admit = p2p, run_id, admit
        self.max_sessions, self.linger, self.keep_records = max_sessions, linger, keep_records
        self.max_old_states, self.chunk_timeout = max_old_states, chunk_timeout
        self.current: Optional[_Served] = None
        self._old: "OrderedDict[str, _Served]" = OrderedDict()
        self.max_announced = max_announced
        self._announced: "OrderedDict[str, _Served]" = OrderedDict()  # states named in provider records, newest last
        self.records: "OrderedDict[int, _Served]" = OrderedDict()  # by step
        self.sessions = 0
        self.bytes_served = 0
        self._refused_logged: set[str] = set()

    async def _hold(self, frozen, steps: int) -> None:
        """The ``hold@serve`` fault: wait until this provider serves a state ``steps`` steps newer."""
        deadline = time.monotonic() + self.chunk_timeout / 2
        while time.monotonic() < deadline and frozen.manifest.content.get("kind") != "step_record":
            if self.current is not None and self.current.frozen.step >= frozen.step + steps:
                return
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        quiet_dropped_streams(asyncio.get_running_loop())
        await self.p2p.add_binary_stream_handler(protocol_name(self.run_id), self._handle)

    async def stop(self) -> None:
        try:
            await self.p2p.remove_binary_stream_handler(protocol_name(self.run_id))
        except Exception as e:
            logger.debug(f"removing the state handler: {e!r}")

    # -- what is served
    def publish_state(self, frozen: FrozenState) -> None:
        served = _Served(frozen, frozen.manifest.encode())
        if self.current is not None:
            self._old[self.current.manifest_hash] = self.current
            self.current.last_used = time.monotonic()
        self.current = served
        self._expire()

    def announce(self, manifest_hash: str) -> None:
        """The provider record about to be published names ``manifest_hash`` (the current state): keep serving it
        until ``max_announced`` newer announcements replaced it and no transfer uses it."""
        if self.current is None or self.current.manifest_hash != manifest_hash:
            return
        self._announced[manifest_hash] = self.current
        self._announced.move_to_end(manifest_hash)
        while len(self._announced) > self.max_announced:
            key = next((k for k, s in self._announced.items() if s.sessions == 0), None)
            if key is None:
                break
            del self._announced[key]

    def publish_record(self, record: FrozenState) -> None:
        self.records[record.step] = _Served(record, record.manifest.encode())
        while len(self.records) > self.keep_records:
            self.records.popitem(last=False)

    def drop_records(self) -> None:
        """After a resync from elsewhere this peer's records may not describe its own history any more."""
        self.records.clear()

    def announced_log(self) -> dict[int, str]:
        return {step: s.manifest_hash for step, s in self.records.items()}

    def _expire(self) -> None:
        now = time.monotonic()
        for key, s in list(self._old.items()):
            if s.sessions == 0 and now - s.last_used > self.linger:
                del self._old[key]
        while len(self._old) > self.max_old_states:
            key = next((k for k, s in self._old.items() if s.sessions == 0), None)
            if key is None:
                break
            del self._old[key]

    def _find(self, manifest_hash: str) -> Optional[_Served]:
        self._expire()
        if self.current is not None and self.current.manifest_hash == manifest_hash:
            return self.current
        if manifest_hash in self._old:
            return self._old[manifest_hash]
        if manifest_hash in self._announced:
            return self._announced[manifest_hash]
        return next((s for s in self.records.values() if s.manifest_hash == manifest_hash), None)

    # -- the stream handler
    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One joiner's stream, driving a ``ProviderSession``: it decides what each received byte means and what
        may be sent; this method reads, answers its events and writes (a chunk's bytes straight from the state)."""
        remote = stream_info.peer_id.to_base58()
        session = ProviderSession()
        served: Optional[_Served] = None
        try:
            while True:
                data = await asyncio.wait_for(reader.read(READ_SIZE), self.chunk_timeout)
                for event in session.receive_data(data):
                    if isinstance(event, OpenRequested):
                        served = await self._open(session, event, remote, writer)  # counted from here: see finally
                        if served is not None:
                            await self._send(writer, session.opened(served.encoded, len(served.frozen.manifest.chunks)))
                    elif isinstance(event, ChunkRequested):
                        await self._send_chunk(session, served, event.index, writer)
                    elif isinstance(event, ProtocolViolation) and event.refuse:
                        await self._send(writer, session.refuse(event.reason))
                    elif isinstance(event, ProtocolViolation):
                        raise RemoteProtocolError(event.reason)
                if session.state not in (SessionState.OPENING, SessionState.STREAMING):
                    return  # refused, or the joiner is done (or gone)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except ProtocolError as e:
            logger.info(f"malformed transfer request from {remote}: {e}")
        except Exception as e:
            logger.warning(f"serving state to {remote} failed: {type(e).__name__}: {e}")
        finally:
            if served is not None:
                self.sessions -= 1
                served.sessions -= 1
                served.last_used = time.monotonic()
            writer.close()

    async def _open(self, session: ProviderSession, request: OpenRequested, remote: str,
                    writer: asyncio.StreamWriter) -> Optional[_Served]:
        """Admit the joiner and find the object it names (counted as a session, before the answer is sent: the
        caller's ``finally`` counts it down, however the answer fares), or refuse; returns what is served, or None
        when refused."""
        refusal = self.admit(Open(spec_hash=request.spec_hash, manifest_hash=request.manifest_hash,
                                  credentials=request.credentials), remote)
        if refusal is not None:
            if remote not in self._refused_logged:  # logged once per peer, not spammed
                self._refused_logged.add(remote)
                logger.warning(f"refused state transfer to {remote}: {refusal}")
            await self._send(writer, session.refuse(refusal))
            return None
        if self.sessions >= self.max_sessions:
            await self._send(writer, session.refuse("busy", busy=True))
            return None
        served = self._find(request.manifest_hash)
        if served is None:
            await self._send(writer, session.refuse("not served here (any more)"))
            return None
        self.sessions += 1
        served.sessions += 1
        return served

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, payload=None) -> None:
        """``send`` within ``chunk_timeout``: a joiner that keeps its stream open and stops reading (hung, stopped, or
        hostile) must not hold one of the ``max_sessions`` for good; the timeout ends the session (``_handle``)."""
        await asyncio.wait_for(send(writer, data, payload), self.chunk_timeout)

    async def _send_chunk(self, session: ProviderSession, served: _Served, index: int,
                          writer: asyncio.StreamWriter) -> None:
        """Chunk ``index`` (the session checked it is one of the object's): its header, then its bytes."""
        frozen = served.frozen
        data = frozen.chunk(index)
        if faults.delay_seconds("serve") and frozen.manifest.content.get("kind") != "step_record":
            await asyncio.sleep(faults.delay_seconds("serve"))
        if index == len(frozen.manifest.chunks) - 1 and faults.hold_steps("serve"):
            await self._hold(frozen, faults.hold_steps("serve"))
        if faults.corrupts("serve", frozen.step):
            data = memoryview(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF])) if data.nbytes else data
        await self._send(writer, session.chunk_header(index, data.nbytes), data)
        self.bytes_served += data.nbytes
        served.last_used = time.monotonic()
