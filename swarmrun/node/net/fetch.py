"""State transfer over hivemind P2P binary streams, the joiner's side: a many-provider fetch.

The pure parts (messages, the plan, which state to choose) are in ``protocol/transfer.py``; this module moves
bytes. Providers serve frozen objects (``FrozenState``: the state of a step, or a step record) by manifest hash
from their own p2pd (``net/serve.py``). A joiner opens one stream per provider and keeps a few chunk requests in
flight on each; every chunk is verified before it counts. It drives its streams itself (``receive.py``), not
through ``protocol/transfer_session.FetcherSession``: see that module's docstring for why.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from hivemind.p2p import PeerID
from hivemind.p2p import P2P

from swarmrun.protocol.errors import IncompatibleState, ProtocolError, RemoteProtocolError
from swarmrun.protocol.manifest import Manifest, TensorCheck, manifest_digest
from swarmrun.protocol.transfer import (
    Chunk,
    Get,
    Open,
    Refused,
    TransferPlan,
    frame,
    protocol_name,
)
from swarmrun.node.net.receive import Download, Frames, Verifier
from swarmrun.node.state.run import FrozenState, alloc_buffer, prefault

logger = logging.getLogger("swarmrun.transfer")

PREFAULT_MIN_BYTES = 16 << 20  # a smaller object's pages are left to the page faults of its first write
KEEP_PARTIALS = 2  # unfinished downloads kept to resume (a state and a step record); a newer one drops the oldest




# ---- step records -------------------------------------------------------------------------------------------





# ---- the provider -------------------------------------------------------------------------------------------











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
        run = _Run(manifest_hash, providers, progress, self._keep)
        if manifest_hash in self.partials:
            stats.resumed_chunks = len(self.partials[manifest_hash].have)
            run.start(self._keep(manifest_hash, self.partials[manifest_hash]))

        async def work(provider: str) -> None:
            try:
                await self._work(provider, run)
            finally:
                run.active.discard(provider)

        tasks = [asyncio.create_task(work(p)) for p in providers]
        try:
            await _until_done(tasks, run.finished, deadline)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            download = run.download
            if download is not None:
                await download.settle()
                download.verifier.close()
        stats.seconds = time.monotonic() - t0
        stats.banned = sorted(run.banned | (set(download.lied) if download is not None else set()))
        self.banned |= set(stats.banned)
        return self._result(manifest_hash, download, stats, providers=len(providers), deadline=deadline,
                            failures=run.failures)

    def _result(self, manifest_hash: str, download: Optional[Download], stats: FetchStats, *, providers: int,
                deadline: float, failures: Optional[dict[str, str]] = None) -> tuple[FrozenState, FetchStats]:
        """The fetched object once every chunk and tensor verified.

        Raises:
            FetchFailed: it did not (the reason, for the caller's message).
        """
        if download is None or not download.plan.finished:
            why = ("no provider sent the manifest (unreachable, refused, or it did not match the announced hash)"
                   if download is None else f"{len(download.partial.have)}/{download.plan.num_chunks} chunks verified, "
                   "then every provider failed or lied" if time.monotonic() < deadline else "the deadline passed")
            said = "; ".join(f"{p[-8:]}: {reason}" for p, reason in sorted((failures or {}).items())[:4])
            raise FetchFailed(f"could not fetch {manifest_hash[:12]} from {providers} provider(s): {why}"
                              + (f" (last failures: {said})" if said else ""))
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

    async def _work(self, provider: str, run: "_Run") -> None:
        """One provider's stream: open, get the manifest, then keep ``window`` chunk requests in flight."""
        failures = 0
        while True:
            download: Optional[Download] = run.download
            if download is not None and (download.plan.finished or not download.plan.usable(provider)):
                return
            try:
                await self._session(provider, run)
            except _Lied as e:
                logger.warning(f"provider {provider[-8:]} lied ({e}); not asking it again")
                run.banned.add(provider)
                if run.download is not None:
                    run.download.plan.provider_lied(provider)
                return
            except _Busy:
                run.failures[provider] = "busy (serving its most sessions)"
                await asyncio.sleep(0.5)
                continue
            except (asyncio.TimeoutError, ConnectionError, ProtocolError, OSError, _Refused, Exception) as e:
                failures += 1
                run.failures[provider] = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:200]
                logger.debug(f"provider {provider[-8:]} failed: {type(e).__name__}: {e}")
                if run.download is not None:
                    run.download.plan.provider_failed(provider)
                    run.download._notify()
                elif failures >= 3:
                    return
                await asyncio.sleep(min(2.0, 0.2 * failures))

    async def _session(self, provider: str, run: "_Run") -> None:
        peer = PeerID.from_base58(provider)
        _, _, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, protocol_name(self.run_id)), self.chunk_timeout)
        stream = Frames(writer.transport)  # before anything is asked, so no byte of an answer is read elsewhere
        download: Optional[Download] = None
        try:
            run.set_manifest(await self._open(stream, run.manifest_hash))
            await run.manifest_ready.wait()
            download = run.download
            plan = download.plan
            download.streams[provider] = stream
            run.active.add(provider)
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
            run.active.discard(provider)
            _close(stream, provider, download)


    async def _open(self, stream: Frames, manifest_hash: str) -> Manifest:
        """Ask a provider for the object; its manifest, checked against the announced hash and this run's spec."""
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
        return manifest


def _close(stream: Frames, provider: str, download: Optional[Download]) -> None:
    """End a provider's stream; a chunk it was receiving goes back to the queue (its bytes may be half there)."""
    stream.close()
    if download is not None:
        if download.streams.get(provider) is stream:
            del download.streams[provider]
        if stream.current is not None:
            download.interrupted(stream.current[0], stream.current[2])
            stream.current = None


class _Run:
    """One fetch in progress: its providers' shared state. The download starts when the first provider's manifest
    verified (or at once, to resume a partial one); ``finished`` resolves when every chunk verified."""

    def __init__(self, manifest_hash: str, providers: Sequence[str], progress, keep):
        self.manifest_hash, self.providers, self.progress, self.keep = manifest_hash, providers, progress, keep
        self.loop = asyncio.get_running_loop()
        self.download: Optional[Download] = None
        self.banned: set[str] = set()
        self.active: set[str] = set()
        self.failures: dict[str, str] = {}  # provider -> why its last session failed (for the error message)
        self.manifest_ready = asyncio.Event()
        self.finished = self.loop.create_future()

    def start(self, partial: Partial) -> None:
        plan = TransferPlan(len(partial.manifest.chunks), have=partial.have)
        for p in self.providers:
            plan.add_provider(p)
        verifier = Verifier(self.loop, partial.manifest, partial.check)
        self.download = Download(partial, plan, verifier, self.progress, self.active, self.finished)
        self.manifest_ready.set()

    def set_manifest(self, manifest: Manifest) -> None:
        if self.download is None:
            buffer = alloc_buffer(manifest.total_bytes)
            if manifest.total_bytes >= PREFAULT_MIN_BYTES:  # its pages mapped ahead of the bytes, off the loop
                threading.Thread(target=prefault, args=(buffer,), name="swarmrun-prefault", daemon=True).start()
            self.start(self.keep(self.manifest_hash, Partial(manifest, buffer)))


async def _until_done(tasks: list, finished: asyncio.Future, deadline: float) -> None:
    """Wait until every chunk verified (``finished``), every provider's task ended, or ``deadline`` passed."""
    if deadline <= time.monotonic():
        raise FetchFailed("no time left to fetch the state")
    while not finished.done() and time.monotonic() < deadline:
        running = [t for t in tasks if not t.done()]
        if not running:
            return
        await asyncio.wait(running + [finished], timeout=deadline - time.monotonic(),
                           return_when=asyncio.FIRST_COMPLETED)


class _Lied(Exception):
    pass


class _Busy(Exception):
    pass


class _Refused(Exception):
    pass
