"""The joiner's receiving end of a state transfer: frames read straight where their bytes belong, chunks verified
by one worker thread.

A state is mostly bytes to move and to hash, and a joiner is CPU-bound long before the network is (on loopback,
and on any machine whose cores are busy). So each byte is written once, by the kernel, into the state's buffer
(``Frames`` takes a provider's stream over from hivemind's ``StreamReader``, which would copy each byte twice
more), and hashed twice (its chunk digest, then its tensor digest) by one thread that runs beside the event loop
(BLAKE3 releases the GIL), with no hand-off per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from typing import Any, Callable, Optional

from swarmrun.protocol.errors import RemoteProtocolError
from swarmrun.protocol.manifest import Manifest, TensorCheck
from swarmrun.protocol.transfer import (
    HEADER_PREFIX,
    MAX_HEADER_BYTES,
    Chunk,
    Opened,
    Refused,
    TransferPlan,
    decode_message,
    header_length,
)

logger = logging.getLogger("swarmrun.transfer")

# where a chunk's bytes go, given its header: (the view to fill, whether it is the state's own buffer)
Target = Callable[[Chunk], tuple[memoryview, bool]]
# a chunk whose bytes all arrived: (index, the view they are in, whether it is the state's own buffer)
OnChunk = Callable[[int, memoryview, bool], None]

_PREFIX, _HEADER, _PAYLOAD = range(3)


class Frames(asyncio.BufferedProtocol):
    """The joiner's end of one provider stream, read in place.

    It replaces hivemind's ``StreamReaderProtocol`` on the stream's transport (``transport.set_protocol``, a public
    asyncio API that uvloop has too) right after the stream opens, before anything was asked on it, and reads every
    part of a frame with exactly the size it has (length prefix, header, payload), so a read never crosses into
    the next part: a chunk's payload goes into the view ``target`` returns for its header, nowhere else.

    Before the manifest is known only ``opened`` (its payload, the manifest, kept as bytes) and ``refused`` are
    expected (``next_message``); after it, ``target`` and ``on_chunk`` are set and chunks flow through callbacks,
    on the event loop, with no task switch per chunk. A malformed frame, a chunk out of turn or the end of the
    stream ends it: the error is raised by the next ``wait``/``next_message``.
    """

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.target: Optional[Target] = None
        self.on_chunk: Optional[OnChunk] = None
        self.current: Optional[tuple[int, memoryview, bool]] = None  # the chunk whose payload is arriving
        self.error: Optional[BaseException] = None
        self._prefix = bytearray(HEADER_PREFIX)
        self._header = bytearray(MAX_HEADER_BYTES)
        self._stage, self._part, self._got = _PREFIX, memoryview(self._prefix), 0
        self._opened: Optional[Opened] = None
        self._messages: deque = deque()
        self._waiter: Optional[asyncio.Future] = None
        transport.set_protocol(self)
        if hasattr(transport, "is_reading") and not transport.is_reading():
            transport.resume_reading()

    # -- asyncio callbacks
    def get_buffer(self, sizehint: int) -> memoryview:
        return self._part[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        if self._got < len(self._part):
            return
        try:
            self._part_done()
        except Exception as e:  # noqa: BLE001 - any fault ends this stream, and the session learns why
            self._fail(e)

    def eof_received(self) -> bool:
        self._fail(ConnectionResetError("the provider ended the stream"))
        return False

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._fail(exc or ConnectionResetError("the stream was closed"))

    def pause_writing(self) -> None:  # what is written is a few small requests (the window bounds them)
        pass

    def resume_writing(self) -> None:
        pass

    # -- parsing
    def _next_part(self, stage: int, part: memoryview) -> None:
        self._stage, self._part, self._got = stage, part, 0

    def _part_done(self) -> None:
        if self._stage == _PREFIX:
            self._next_part(_HEADER, memoryview(self._header)[:header_length(bytes(self._prefix))])
        elif self._stage == _HEADER:
            message = decode_message(bytes(self._part))
            if isinstance(message, Chunk):
                if self.target is None:
                    raise RemoteProtocolError("a chunk before the manifest")
                view, own = self.target(message)
                self.current = (message.index, view, own)
                self._next_part(_PAYLOAD, view)
                if not message.size:
                    self._part_done()
            elif isinstance(message, Opened) and self._opened is None and self.target is None:
                self._opened = message
                self._next_part(_PAYLOAD, memoryview(bytearray(message.size)))
            elif isinstance(message, Refused):
                self._push(message)
                self._next_part(_PREFIX, memoryview(self._prefix))
            else:
                raise RemoteProtocolError(f"unexpected {type(message).__name__.lower()} from a provider")
        else:
            part = self._part
            self._next_part(_PREFIX, memoryview(self._prefix))
            if self.current is not None:
                index, view, own = self.current
                self.current = None
                self.on_chunk(index, view, own)
                self._wake()
            else:
                self._push((self._opened, part.obj))

    def _push(self, message: Any) -> None:
        self._messages.append(message)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.transport.close()
        self._wake()

    # -- the session's side
    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def wait(self, timeout: float) -> None:
        """Return when a frame completes (a chunk, a message) after this call.

        Raises:
            the stream's error; asyncio.TimeoutError: nothing completed within ``timeout``.
        """
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._waiter, timeout)
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def message(self) -> Any:
        """The next message received (``Refused``, or ``(Opened, manifest bytes)``), or None."""
        return self._messages.popleft() if self._messages else None

    async def next_message(self, timeout: float) -> Any:
        while not self._messages:
            await self.wait(timeout)
        return self._messages.popleft()

    def close(self) -> None:
        self.transport.close()


class Verifier:
    """One worker thread that checks received chunks against the manifest and feeds the verified ones to the
    tensor check (``TensorCheck``: it hashes them again in state order); each verdict goes back to the event loop.

    BLAKE3 releases the GIL, so the event loop keeps reading while a chunk is hashed; one thread and one queue
    instead of a thread hand-off (``asyncio.to_thread``) per chunk.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, manifest: Manifest, check: TensorCheck):
        self.loop, self.manifest, self.check = loop, manifest, check
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="swarmrun-verifier", daemon=True)
        self._thread.start()

    def submit(self, index: int, view: memoryview, verdict: Callable[[bool], None]) -> None:
        """Check chunk ``index`` (its bytes in ``view``, which must not change until the verdict, nor afterwards if
        it verifies: the tensor check may hold it); ``verdict(ok)`` is called on the loop."""
        self._jobs.put((index, view, verdict))

    def close(self) -> None:
        """Stop the thread once the jobs submitted so far are done."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            index, view, verdict = job
            try:
                ok = self.manifest.verify_chunk(index, view)
                if ok:
                    self.check.add(index, view)
            except Exception as e:  # noqa: BLE001 - a verdict must come back whatever happens
                logger.warning(f"checking chunk {index} failed: {type(e).__name__}: {e}")
                ok = False
            try:
                self.loop.call_soon_threadsafe(verdict, ok)
            except RuntimeError:  # the loop is closed: nobody waits for the verdict any more
                return


class Download:
    """One fetch of one object, on the event loop: the plan, where each chunk's bytes go, the checks in flight.

    ``partial`` is the fetcher's ``Partial`` (manifest, buffer, chunks held, tensor check). A chunk's bytes go
    straight into the object's buffer when nobody else is writing that range (the chunk's *owner*: the provider
    whose copy is arriving or being verified there); a second copy (the end game's duplicate, a re-queued chunk
    whose first copy is still being verified) goes into a spare buffer, and is copied in only if the owner's copy
    does not verify or never arrives. A range that verified is never written again.
    """

    def __init__(self, partial: Any, plan: TransferPlan, verifier: Verifier, progress, active: set[str],
                 finished: asyncio.Future):
        self.partial, self.plan, self.verifier = partial, plan, verifier
        self.progress, self.active = progress, active
        self.owners: dict[int, str] = {}
        self.spares: dict[int, memoryview] = {}  # verified copies waiting for their range's owner to let go
        self.lied: dict[str, str] = {}  # providers whose chunk did not verify, and which chunk
        self.streams: dict[str, Frames] = {}
        self.pending = 0  # chunks being verified
        self.finished = finished  # set when every chunk verified
        self._changed = asyncio.get_running_loop().create_future()
        self._idle: Optional[asyncio.Future] = None
        if plan.finished and not finished.done():
            finished.set_result(None)

    # -- called by the streams (on the loop)
    def target(self, provider: str, index: int) -> tuple[memoryview, bool]:
        start, end = self.partial.manifest.chunk_range(index)
        if index not in self.plan.done and index not in self.owners:
            self.owners[index] = provider
            return self.partial.data[start:end], True
        return memoryview(bytearray(end - start)), False

    def received(self, provider: str, index: int, view: memoryview, own: bool) -> None:
        if not own and index in self.plan.done:
            return  # a late duplicate: nothing to learn from it
        self.plan.chunk_received(provider, index)
        self.pending += 1
        self.verifier.submit(index, view, lambda ok: self._verdict(provider, index, view, own, ok))

    def interrupted(self, index: int, own: bool) -> None:
        """The stream ended in the middle of chunk ``index``'s bytes."""
        if own:
            self._let_go(index, verified=False)

    # -- verdicts
    def _verdict(self, provider: str, index: int, view: memoryview, own: bool, ok: bool) -> None:
        self.pending -= 1
        if ok:
            new = self.plan.chunk_ok(provider, index, view.nbytes)
            if own:
                self._let_go(index, verified=True)
            elif new and index in self.owners:
                self.spares[index] = view
            elif new:
                self._store(index, view)
            if new and self.progress is not None:
                self.progress(view.nbytes, self.partial.manifest.total_bytes, len(self.active))
        else:
            self.plan.chunk_bad(provider, index)
            self.lied.setdefault(provider, f"chunk {index} did not verify")
            if own:
                self._let_go(index, verified=False)
            stream = self.streams.get(provider)
            if stream is not None:
                stream.close()  # its session learns why from ``lied``
        if self.plan.finished and not self.finished.done():
            self.finished.set_result(None)
        self._notify()
        if self.pending == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _let_go(self, index: int, *, verified: bool) -> None:
        self.owners.pop(index, None)
        if verified:
            self.partial.have.add(index)
            self.spares.pop(index, None)
        elif index in self.spares:
            self._store(index, self.spares.pop(index))

    def _store(self, index: int, view: memoryview) -> None:
        start, end = self.partial.manifest.chunk_range(index)
        self.partial.data[start:end] = view
        self.partial.have.add(index)

    # -- waiting
    def _notify(self) -> None:
        if not self._changed.done():
            self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    async def changed(self, timeout: float) -> None:
        """Return when the plan changed (a verdict came: chunks may be back in the queue), or after ``timeout``."""
        await asyncio.wait({self._changed}, timeout=timeout)

    async def settle(self) -> None:
        """Once every stream is closed: wait for the verdicts still due, then put the spare copies in place."""
        if self.pending:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle
        for index in list(self.spares):
            if index not in self.owners:
                self._store(index, self.spares.pop(index))
