"""The provider's side of state transfer: serves frozen states and step records by manifest hash over hivemind P2P."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional
from hivemind.p2p import P2P
from swarmrun.protocol.errors import ProtocolError, RemoteProtocolError
from swarmrun.protocol.transfer import (
    Chunk,
    Get,
    Open,
    Opened,
    Refused,
    protocol_name,
)
from swarmrun.node import faults
from swarmrun.node.state.run import FrozenState
import logging
from swarmrun.node.net.fetch import Admit
from swarmrun.node.net.streams import quiet_dropped_streams
from swarmrun.node.net.streams import read_header
from swarmrun.node.net.streams import write_message

logger = logging.getLogger('swarmrun.serve')


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
            self._old[self.current.frozen.manifest.manifest_hash()] = self.current
            self.current.last_used = time.monotonic()
        self.current = served
        self._expire()

    def announce(self, manifest_hash: str) -> None:
        """The provider record about to be published names ``manifest_hash`` (the current state): keep serving it
        until ``max_announced`` newer announcements replaced it and no transfer uses it."""
        if self.current is None or self.current.frozen.manifest.manifest_hash() != manifest_hash:
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
        return {step: s.frozen.manifest.manifest_hash() for step, s in self.records.items()}

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
        if self.current is not None and self.current.frozen.manifest.manifest_hash() == manifest_hash:
            return self.current
        if manifest_hash in self._old:
            return self._old[manifest_hash]
        if manifest_hash in self._announced:
            return self._announced[manifest_hash]
        return next((s for s in self.records.values() if s.frozen.manifest.manifest_hash() == manifest_hash), None)

    # -- the stream handler
    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = stream_info.peer_id.to_base58()
        served: Optional[_Served] = None
        try:
            request = await asyncio.wait_for(read_header(reader), self.chunk_timeout)
            if not isinstance(request, Open):
                raise RemoteProtocolError("a transfer starts with open")
            refusal = self.admit(request, remote)
            if refusal is not None:
                if remote not in self._refused_logged:  # logged once per peer, not spammed
                    self._refused_logged.add(remote)
                    logger.warning(f"refused state transfer to {remote}: {refusal}")
                await write_message(writer, Refused(reason=refusal).encode())
                return
            if self.sessions >= self.max_sessions:
                await write_message(writer, Refused(reason="busy", busy=True).encode())
                return
            served = self._find(request.manifest_hash)
            if served is None:
                await write_message(writer, Refused(reason="not served here (any more)").encode())
                return
            self.sessions += 1
            served.sessions += 1
            await write_message(writer, Opened(size=len(served.encoded)).encode(), served.encoded)
            frozen = served.frozen
            while True:
                try:
                    message = await asyncio.wait_for(read_header(reader), self.chunk_timeout)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the joiner is done (or gone)
                if not isinstance(message, Get):
                    raise RemoteProtocolError("expected get")
                if not 0 <= message.index < len(frozen.manifest.chunks):
                    await write_message(writer, Refused(reason=f"no chunk {message.index}").encode())
                    return
                data = frozen.chunk(message.index)
                if faults.delay_seconds("serve") and frozen.manifest.content.get("kind") != "step_record":
                    await asyncio.sleep(faults.delay_seconds("serve"))
                if faults.corrupts("serve", frozen.step):
                    data = memoryview(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF])) if data.nbytes else data
                await write_message(writer, Chunk(index=message.index, size=data.nbytes).encode(), data)
                self.bytes_served += data.nbytes
                served.last_used = time.monotonic()
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
