"""State transfer over hivemind P2P binary streams: a provider's server, and a joiner's many-provider fetch.

The pure parts (messages, the plan, which state to choose) are in ``protocol/transfer.py``; this module moves
bytes. A provider serves frozen objects (``FrozenState``: the state of a step, or a step record) by manifest
hash from this peer's own p2pd (hivemind's ``DHT.replicate_p2p``). A joiner opens one stream per provider
and keeps a few chunk requests in flight on each; every chunk is verified before it counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from hivemind.p2p import PeerID
from hivemind.p2p import P2P

from ..protocol.cursor import RangeSet
from ..protocol.errors import IncompatibleState, ProtocolError, RemoteProtocolError
from ..protocol.manifest import DEFAULT_CHUNK_SIZE, Manifest, TensorCheck, build_manifest, manifest_digest
from ..protocol.transfer import (
    HEADER_PREFIX,
    Chunk,
    Get,
    Open,
    Opened,
    Refused,
    TransferPlan,
    decode_message,
    frame,
    header_length,
    protocol_name,
)
from . import faults
from .receive import Download, Frames, Verifier
from .state import _DTYPES, FrozenState, alloc_buffer, prefault, tensor_bytes

logger = logging.getLogger("swarmrun.transfer")

PREFAULT_MIN_BYTES = 16 << 20  # a smaller object's pages are left to the page faults of its first write
KEEP_PARTIALS = 2  # unfinished downloads kept to resume (a state and a step record); a newer one drops the oldest
Admit = Callable[[Open, str], Optional[str]]  # (request, remote peer id) -> refusal reason, or None to admit


def admit_open(spec_hash: str, gate=None) -> Admit:
    """The one admission check of state serving: the requester names this run's spec and, through the access
    gate (``node.access.AccessGate``), holds a valid certificate for its peer id (authenticated by libp2p)."""

    def admit(request: Open, remote: str) -> Optional[str]:
        if request.spec_hash != spec_hash:
            return "another run's spec"
        return gate.check(remote, request.credentials) if gate is not None else None

    return admit


# ---- step records -------------------------------------------------------------------------------------------

def make_step_record(*, spec_hash: str, step: int, grads: Sequence[Optional[torch.Tensor]], applied: RangeSet,
                     data_epoch: int, state_hash_before: str, state_hash_after: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> FrozenState:
    """The committed step ``step -> step + 1`` as a transferable object: the gradients the optimizer was given
    (after averaging, before clipping; None where a parameter had none) and the blocks it applied."""
    present = [i for i, g in enumerate(grads) if g is not None]
    raws = [tensor_bytes(grads[i].detach().cpu()) for i in present]
    data = bytearray(sum(r.nbytes for r in raws))
    view, offset, described = memoryview(data), 0, []
    for i, raw in zip(present, raws):
        g = grads[i]
        view[offset:offset + raw.nbytes] = raw
        described.append((f"grad/{i}", _DTYPES[g.dtype], tuple(g.shape), view[offset:offset + raw.nbytes]))
        offset += raw.nbytes
    manifest = build_manifest(spec_hash=spec_hash, step=step, tensors=described, chunk_size=chunk_size,
                              content={"kind": "step_record", "applied": applied.to_list(), "data_epoch": data_epoch,
                                       "params": len(grads), "state_hash_before": state_hash_before,
                                       "state_hash_after": state_hash_after})
    return FrozenState(manifest=manifest, data=view.toreadonly())


def read_step_record(record: FrozenState) -> tuple[list[Optional[torch.Tensor]], RangeSet, str, str]:
    """The gradients (by parameter, None where absent), the applied blocks, and the state hashes before and
    after the step (a replay starts only from the first and must end on the second).

    Raises:
        IncompatibleState: the object is not a step record.
    """
    content = record.manifest.content
    if content.get("kind") != "step_record" or not isinstance(content.get("params"), int):
        raise IncompatibleState("object is not a step record")
    grads: list[Optional[torch.Tensor]] = [None] * content["params"]
    for name, t in record.tensors().items():
        kind, _, index = name.partition("/")
        if kind != "grad" or not index.isdigit() or int(index) >= len(grads):
            raise IncompatibleState(f"step record holds an unexpected tensor {name!r}")
        grads[int(index)] = t
    return (grads, RangeSet.from_list(content["applied"]), str(content.get("state_hash_before")),
            str(content.get("state_hash_after")))


# ---- the provider -------------------------------------------------------------------------------------------

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
    it from whoever still holds s); the last ``keep_records`` step records stay for joiners to replay.
    """

    def __init__(self, p2p: P2P, run_id: str, admit: Admit, *, max_sessions: int = 8, linger: float = 30.0,
                 keep_records: int = 16, max_old_states: int = 2, chunk_timeout: float = 30.0):
        self.p2p, self.run_id, self.admit = p2p, run_id, admit
        self.max_sessions, self.linger, self.keep_records = max_sessions, linger, keep_records
        self.max_old_states, self.chunk_timeout = max_old_states, chunk_timeout
        self.current: Optional[_Served] = None
        self._old: "OrderedDict[str, _Served]" = OrderedDict()
        self.records: "OrderedDict[int, _Served]" = OrderedDict()  # by step
        self.sessions = 0
        self.bytes_served = 0
        self._refused_logged: set[str] = set()

    async def start(self) -> None:
        _quiet_dropped_streams(asyncio.get_running_loop())
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
        return next((s for s in self.records.values() if s.frozen.manifest.manifest_hash() == manifest_hash), None)

    # -- the stream handler
    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = stream_info.peer_id.to_base58()
        served: Optional[_Served] = None
        try:
            request = await asyncio.wait_for(_read_header(reader), self.chunk_timeout)
            if not isinstance(request, Open):
                raise RemoteProtocolError("a transfer starts with open")
            refusal = self.admit(request, remote)
            if refusal is not None:
                if remote not in self._refused_logged:  # logged once per peer, not spammed
                    self._refused_logged.add(remote)
                    logger.warning(f"refused state transfer to {remote}: {refusal}")
                await _write(writer, Refused(reason=refusal).encode())
                return
            if self.sessions >= self.max_sessions:
                await _write(writer, Refused(reason="busy", busy=True).encode())
                return
            served = self._find(request.manifest_hash)
            if served is None:
                await _write(writer, Refused(reason="not served here (any more)").encode())
                return
            self.sessions += 1
            served.sessions += 1
            await _write(writer, Opened(size=len(served.encoded)).encode(), served.encoded)
            frozen = served.frozen
            while True:
                try:
                    message = await asyncio.wait_for(_read_header(reader), self.chunk_timeout)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the joiner is done (or gone)
                if not isinstance(message, Get):
                    raise RemoteProtocolError("expected get")
                if not 0 <= message.index < len(frozen.manifest.chunks):
                    await _write(writer, Refused(reason=f"no chunk {message.index}").encode())
                    return
                data = frozen.chunk(message.index)
                if faults.delay_seconds("serve") and frozen.manifest.content.get("kind") != "step_record":
                    await asyncio.sleep(faults.delay_seconds("serve"))
                if faults.corrupts("serve", frozen.step):
                    data = memoryview(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF])) if data.nbytes else data
                await _write(writer, Chunk(index=message.index, size=data.nbytes).encode(), data)
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


def _quiet_dropped_streams(loop: asyncio.AbstractEventLoop) -> None:
    """p2pd sometimes dials the handler socket and hangs up before naming the stream (a stream the remote reset);
    hivemind's handler then raises IncompleteReadError into asyncio's default handler, a traceback per stream.
    Those go to the debug log; every other unhandled error still reaches the default handler."""
    previous = loop.get_exception_handler()

    def handler(loop, context):
        if isinstance(context.get("exception"), asyncio.IncompleteReadError) and \
                "client_connected_cb" in context.get("message", ""):
            logger.debug(f"p2pd dropped a stream before it started: {context['exception']!r}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def _read_header(reader: asyncio.StreamReader):
    n = header_length(await reader.readexactly(HEADER_PREFIX))
    return decode_message(await reader.readexactly(n))


async def _write(writer: asyncio.StreamWriter, header: bytes, payload=None) -> None:
    writer.write(frame(header))
    if payload is not None:
        writer.write(payload)
    await writer.drain()


# ---- the joiner ---------------------------------------------------------------------------------------------

class FetchFailed(IncompatibleState):
    """No provider could deliver a verified copy of the object."""


@dataclass
class Partial:
    """A download in progress (kept to resume it): the manifest, the object's buffer, the chunks whose verified
    bytes are in it, and the tensor check, which has seen those chunks."""

    manifest: Manifest
    data: memoryview
    have: set[int] = field(default_factory=set)
    check: Optional[TensorCheck] = None

    def __post_init__(self) -> None:
        if self.check is None:
            self.check = TensorCheck(self.manifest)


@dataclass
class FetchStats:
    bytes: int = 0
    seconds: float = 0.0
    by_provider: dict[str, int] = field(default_factory=dict)
    banned: list[str] = field(default_factory=list)
    resumed_chunks: int = 0


class Fetcher:
    """Downloads objects from many providers at once, verifying every chunk and tensor; keeps the partial downloads
    of the ``KEEP_PARTIALS`` objects asked for last, to resume them (each holds a buffer of its object's size; the
    trainer clears them once it has caught up). One fetch at a time: the trainer's catch-up awaits each in turn.

    Args:
        p2p: this peer's P2P (a replica of the DHT's).
        run_id, spec_hash: the run; every request names the spec (admission on the provider).
        window: chunk requests in flight per provider (its stream never waits for the next request).
        chunk_timeout: seconds a provider may take per chunk before it counts as failed.
    """

    def __init__(self, p2p: P2P, run_id: str, spec_hash: str, *, window: int = 4, chunk_timeout: float = 20.0,
                 credentials: Any = None):
        self.p2p, self.run_id, self.spec_hash = p2p, run_id, spec_hash
        self.window, self.chunk_timeout, self.credentials = window, chunk_timeout, credentials
        self.partials: dict[str, Partial] = {}
        self.banned: set[str] = set()  # providers caught lying: never asked again by this peer

    async def fetch(self, manifest_hash: str, providers: Sequence[str], *, deadline: float,
                    progress: Optional[Callable[[int, int, int], None]] = None) -> tuple[FrozenState, FetchStats]:
        """Fetch the object ``manifest_hash`` from ``providers`` (peer ids, base58), verified: every chunk against
        its digest, and every tensor against its digest (as the chunks arrive, in state order).

        ``progress(new_bytes, bytes_total, providers_active)`` is called as each verified chunk arrives. The object
        returned is this peer's alone (its buffer is nobody else's): ``RunState.apply_frozen(..., adopt=True)``
        may keep it.

        Raises:
            FetchFailed: every provider failed or lied, or ``deadline`` (time.monotonic) passed; what verified
                is kept, and a next fetch of the same object resumes from it unless ``KEEP_PARTIALS`` newer objects
                were asked for in between.
        """
        t0 = time.monotonic()
        stats = FetchStats()
        providers = [p for p in providers if p not in self.banned]
        if not providers:
            raise FetchFailed(f"no provider of {manifest_hash[:12]} left to ask (every one announced lied before)")
        banned: set[str] = set()
        active: set[str] = set()
        manifest_ready = asyncio.Event()
        state: dict[str, Any] = {"download": None}
        loop = asyncio.get_running_loop()
        finished = loop.create_future()  # set when every chunk verified

        def start(partial: Partial) -> None:
            plan = TransferPlan(len(partial.manifest.chunks), have=partial.have)
            for p in providers:
                plan.add_provider(p)
            verifier = Verifier(loop, partial.manifest, partial.check)
            state["download"] = Download(partial, plan, verifier, progress, active, finished)
            manifest_ready.set()

        def set_manifest(manifest: Manifest) -> None:
            if state["download"] is None:
                buffer = alloc_buffer(manifest.total_bytes)
                if manifest.total_bytes >= PREFAULT_MIN_BYTES:  # its pages mapped ahead of the bytes, off the loop
                    threading.Thread(target=prefault, args=(buffer,), name="swarmrun-prefault", daemon=True).start()
                start(self._keep(manifest_hash, Partial(manifest, buffer)))

        if manifest_hash in self.partials:
            stats.resumed_chunks = len(self.partials[manifest_hash].have)
            start(self._keep(manifest_hash, self.partials[manifest_hash]))

        async def work(provider: str) -> None:
            try:
                await self._work(provider, manifest_hash, state, set_manifest, manifest_ready, banned, active)
            finally:
                active.discard(provider)

        tasks = [asyncio.create_task(work(p)) for p in providers]
        try:
            if deadline <= time.monotonic():
                raise FetchFailed("no time left to fetch the state")
            while not finished.done() and time.monotonic() < deadline:
                running = [t for t in tasks if not t.done()]
                if not running:
                    break
                await asyncio.wait(running + [finished], timeout=deadline - time.monotonic(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            download = state["download"]
            if download is not None:
                await download.settle()
                download.verifier.close()
        stats.seconds = time.monotonic() - t0
        stats.banned = sorted(banned | (set(download.lied) if download is not None else set()))
        self.banned |= set(stats.banned)
        if download is None or not download.plan.finished:
            why = ("no provider sent the manifest (unreachable, refused, or it did not match the announced hash)"
                   if download is None else f"{len(download.partial.have)}/{download.plan.num_chunks} chunks verified, "
                   "then every provider failed or lied" if time.monotonic() < deadline else "the deadline passed")
            raise FetchFailed(f"could not fetch {manifest_hash[:12]} from {len(providers)} provider(s): {why}")
        partial, plan = download.partial, download.plan
        self.partials.pop(manifest_hash, None)
        if not partial.check.done or partial.check.faults:
            # every chunk verified, so the manifest itself describes other tensors than its chunks hold
            raise FetchFailed(f"{manifest_hash[:12]}: {(partial.check.faults or ['tensor check incomplete'])[0]}")
        stats.by_provider = plan.received_by()
        stats.bytes = sum(stats.by_provider.values())
        return FrozenState(manifest=partial.manifest, data=partial.data.toreadonly()), stats

    def _keep(self, manifest_hash: str, partial: Partial) -> Partial:
        """Keep ``partial`` as the newest download; drop the oldest ones beyond ``KEEP_PARTIALS``, buffers and all."""
        self.partials.pop(manifest_hash, None)
        self.partials[manifest_hash] = partial
        while len(self.partials) > KEEP_PARTIALS:
            oldest = next(iter(self.partials))
            dropped = self.partials.pop(oldest)
            logger.debug(f"dropped the partial download of {oldest[:12]} ({len(dropped.have)} chunks verified)")
        return partial

    async def _work(self, provider: str, manifest_hash: str, state: dict, set_manifest, manifest_ready,
                    banned: set[str], active: set[str]) -> None:
        """One provider's stream: open, get the manifest, then keep ``window`` chunk requests in flight."""
        failures = 0
        while True:
            download: Optional[Download] = state["download"]
            if download is not None and (download.plan.finished or not download.plan.usable(provider)):
                return
            try:
                await self._session(provider, manifest_hash, state, set_manifest, manifest_ready, active)
            except _Lied as e:
                logger.warning(f"provider {provider[-8:]} lied ({e}); not asking it again")
                banned.add(provider)
                if state["download"] is not None:
                    state["download"].plan.provider_lied(provider)
                return
            except _Busy:
                await asyncio.sleep(0.5)
                continue
            except (asyncio.TimeoutError, ConnectionError, ProtocolError, OSError, _Refused, Exception) as e:
                failures += 1
                logger.debug(f"provider {provider[-8:]} failed: {type(e).__name__}: {e}")
                if state["download"] is not None:
                    state["download"].plan.provider_failed(provider)
                    state["download"]._notify()
                elif failures >= 3:
                    return
                await asyncio.sleep(min(2.0, 0.2 * failures))

    async def _session(self, provider: str, manifest_hash: str, state: dict, set_manifest, manifest_ready,
                       active: set[str]) -> None:
        peer = PeerID.from_base58(provider)
        _, _, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, protocol_name(self.run_id)), self.chunk_timeout)
        stream = Frames(writer.transport)  # before anything is asked, so no byte of an answer is read elsewhere
        download: Optional[Download] = None
        try:
            stream.write(frame(Open(spec_hash=self.spec_hash, manifest_hash=manifest_hash,
                                    credentials=self.credentials).encode()))
            reply = await stream.next_message(self.chunk_timeout)
            if isinstance(reply, Refused):
                raise _Busy() if reply.busy else _Refused(reply.reason)
            _, encoded = reply
            if manifest_digest(encoded) != manifest_hash:
                raise _Lied("its manifest does not match the announced hash")
            try:
                manifest = Manifest.decode(encoded)
            except RemoteProtocolError as e:
                raise _Lied(f"malformed manifest: {e}") from None
            if manifest.spec_hash != self.spec_hash:
                raise _Lied("its manifest belongs to another run")
            set_manifest(manifest)
            await manifest_ready.wait()
            download = state["download"]
            plan = download.plan
            download.streams[provider] = stream
            active.add(provider)
            asked: deque[int] = deque()

            def ask_more() -> None:
                while len(asked) < self.window:
                    index = plan.next_chunk(provider)
                    if index is None:
                        return
                    asked.append(index)
                    stream.write(frame(Get(index=index).encode()))

            def target(chunk: Chunk) -> tuple[memoryview, bool]:
                if not asked or chunk.index != asked[0]:
                    raise _Lied("answered out of order")
                start, end = download.partial.manifest.chunk_range(chunk.index)
                if chunk.size != end - start:
                    raise _Lied(f"chunk {chunk.index} has the wrong size")
                asked.popleft()
                return download.target(provider, chunk.index)

            def on_chunk(index: int, view: memoryview, own: bool) -> None:
                download.received(provider, index, view, own)
                ask_more()  # at once, from the callback: the stream never waits for this task to run

            stream.target, stream.on_chunk = target, on_chunk
            while not plan.finished:
                ask_more()
                if not asked:  # nothing for this provider now; a verdict may put chunks back in the queue
                    await download.changed(self.chunk_timeout)
                    continue
                await stream.wait(self.chunk_timeout)
                refusal = stream.message()
                if isinstance(refusal, Refused):
                    raise _Refused(refusal.reason)
        except (asyncio.TimeoutError, ConnectionError, ProtocolError, OSError) as e:
            if download is not None and provider in download.lied:
                raise _Lied(download.lied[provider]) from None
            if isinstance(stream.error, _Lied):
                raise stream.error from None
            raise e
        finally:
            active.discard(provider)
            stream.close()
            if download is not None:
                if download.streams.get(provider) is stream:
                    del download.streams[provider]
                if stream.current is not None:
                    download.interrupted(stream.current[0], stream.current[2])
                    stream.current = None


class _Lied(Exception):
    pass


class _Busy(Exception):
    pass


class _Refused(Exception):
    pass
