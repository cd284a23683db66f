"""State transfer, sans-IO: provider records, the wire messages, choosing a state, and the transfer plan.

A provider serves *objects*, each a manifest and its chunks, addressed by the manifest's hash: the state of a
step, or a step record (the averaged gradient that a committed round applied to go from ``step`` to
``step + 1``, with the blocks it applied). Every committer of a step holds the same bits, so all providers of
a step serve the same manifest and a joiner can take each chunk from whichever provider is free.

The joiner downloads the newest state with enough providers, then replays the step records announced since,
so a swarm that steps while the state travels never sends it back to the start.

On the wire (one hivemind P2P binary stream per provider) every frame is a 4-byte big-endian length, a
msgpack header, and, when the header says ``size``, that many raw bytes. Nothing is unpickled; headers and
payloads are bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from swarmrun.protocol.codec import bytes_field, float_field, int_field, pack, require, unpack  # one set of field validators
from swarmrun.protocol.errors import RemoteProtocolError
from swarmrun.protocol.manifest import MAX_CHUNK_SIZE, MAX_MANIFEST_SIZE
from swarmrun.protocol.round import decode_anchor

TRANSFER_VERSION = 2  # 2: manifests of version 2 (BLAKE3 digests) behind the same messages
MAX_HEADER_BYTES = 4096
MAX_RECORD_BYTES = 16 * 1024
MAX_CERTIFICATE_BYTES = 8192  # a certificate in a provider record (as in a progress report)
MAX_LOG_ANNOUNCED = 64  # step records one provider announces
HEADER_PREFIX = 4  # bytes of the frame length


def providers_key(run_id: str) -> str:
    """Subkey per provider: its ``ProviderRecord``."""
    return f"swarmrun.{run_id}.providers"


def protocol_name(run_id: str) -> str:
    """The libp2p protocol of a run's state transfer."""
    return f"/swarmrun/{run_id}/state/{TRANSFER_VERSION}"


def _digest(d: Mapping, key: str) -> str:
    v = d.get(key)
    require(isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
             f"{key} must be 64 lowercase hex digits")
    return v


@dataclass(frozen=True, kw_only=True)
class ProviderRecord:
    """What a provider announces in the DHT: the state it serves and the step records it keeps.

    ``log`` maps a step s to the manifest hash of the step record s -> s + 1.
    """

    step: int
    manifest_hash: str
    state_hash: str
    total_bytes: int
    time: float
    keeper: bool = False
    serving: int = 0  # transfers in progress, so joiners can prefer idle providers
    log: Mapping[int, str] = field(default_factory=dict)
    certificate: bytes = b""  # the provider's access certificate (invite-only runs: readers check it)
    # the served state's history anchor (``ProgressReport.anchor``): a peer that fetches the state takes it on
    anchor: Optional[tuple[int, str]] = None

    def encode(self) -> bytes:
        log = sorted(self.log.items())[-MAX_LOG_ANNOUNCED:]
        return pack(dict(type="provider", version=TRANSFER_VERSION, step=self.step, manifest_hash=self.manifest_hash,
                         state_hash=self.state_hash, total_bytes=self.total_bytes, time=self.time,
                         keeper=self.keeper, serving=self.serving, log=[[s, h] for s, h in log],
                         **({"certificate": self.certificate} if self.certificate else {}),
                         **({"anchor": list(self.anchor)} if self.anchor is not None else {})))

    @classmethod
    def decode(cls, data: bytes) -> ProviderRecord:
        """Raises: RemoteProtocolError on any fault."""
        d = unpack(data, max_size=MAX_RECORD_BYTES)
        require(isinstance(d, dict) and d.get("type") == "provider" and d.get("version") == TRANSFER_VERSION,
                 "not a provider record")
        log = d.get("log")
        require(isinstance(log, list) and len(log) <= MAX_LOG_ANNOUNCED, "log must be a short list")
        entries = {}
        for item in log:
            require(isinstance(item, list) and len(item) == 2, "log entries are [step, manifest_hash]")
            entries[int_field({"s": item[0]}, "s")] = _digest({"h": item[1]}, "h")
        require(isinstance(d.get("keeper"), bool), "keeper must be a bool")
        return cls(step=int_field(d, "step"), manifest_hash=_digest(d, "manifest_hash"), state_hash=_digest(d, "state_hash"),
                   total_bytes=int_field(d, "total_bytes"), time=float_field(d, "time"), keeper=d["keeper"],
                   serving=int_field(d, "serving", 0, 1 << 16), log=entries,
                   certificate=bytes_field(d, "certificate", MAX_CERTIFICATE_BYTES) if "certificate" in d else b"",
                   anchor=decode_anchor(d["anchor"]) if "anchor" in d else None)


@dataclass(frozen=True)
class Choice:
    """The state a joiner fetches: its step, manifest hash, the providers that serve it."""

    step: int
    manifest_hash: str
    state_hash: str
    providers: tuple[str, ...]


def choose_state(records: Mapping[str, ProviderRecord], *, enough: int = 4, window: int = 8,
                 trusted_hashes: Optional[Mapping[int, str]] = None) -> Optional[Choice]:
    """Pick the state to download: among states at most ``window`` steps behind the newest, the one with the
    most providers (counting up to ``enough``: more gain nothing), then the newest; step records replay the rest.

    ``trusted_hashes`` (step -> state_hash, e.g. from trainers' progress reports) rules out a state whose
    state_hash disagrees with what the run's trainers report for that step.
    """
    groups: dict[tuple[int, str, str], list[str]] = {}
    for peer, r in records.items():
        if trusted_hashes and r.step in trusted_hashes and trusted_hashes[r.step] != r.state_hash:
            continue
        groups.setdefault((r.step, r.manifest_hash, r.state_hash), []).append(peer)
    if not groups:
        return None
    newest = max(step for step, _, _ in groups)
    candidates = [(min(len(peers), enough), step, mh, sh, peers)
                  for (step, mh, sh), peers in groups.items() if step >= newest - window]
    support, step, mh, sh, peers = max(candidates, key=lambda c: (c[0], c[1], len(c[4]), c[2]))
    # idle providers first
    ordered = sorted(peers, key=lambda p: (records[p].serving, p))
    return Choice(step=step, manifest_hash=mh, state_hash=sh, providers=tuple(ordered))


def log_sources(records: Mapping[str, ProviderRecord], step: int) -> tuple[Optional[str], tuple[str, ...]]:
    """The manifest hash of the step record ``step -> step + 1`` most providers announce, and who serves it."""
    votes: dict[str, list[str]] = {}
    for peer, r in records.items():
        h = r.log.get(step)
        if h is not None:
            votes.setdefault(h, []).append(peer)
    if not votes:
        return None, ()
    h, peers = max(votes.items(), key=lambda kv: (len(kv[1]), kv[0]))
    return h, tuple(sorted(peers, key=lambda p: (records[p].serving, p)))


# ---- wire messages --------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Open:
    """Joiner -> provider, the first frame: which object, for which run; admission is checked on it."""

    spec_hash: str
    manifest_hash: str
    credentials: Any = None  # reserved for the access policy (certificates)

    def encode(self) -> bytes:
        return pack(dict(type="open", version=TRANSFER_VERSION, spec_hash=self.spec_hash,
                         manifest_hash=self.manifest_hash, credentials=self.credentials))


@dataclass(frozen=True, kw_only=True)
class Get:
    """Joiner -> provider: send chunk ``index`` of the opened object."""

    index: int

    def encode(self) -> bytes:
        return pack(dict(type="get", index=self.index))


@dataclass(frozen=True, kw_only=True)
class Opened:
    """Provider -> joiner: the object is served; the manifest's bytes follow (``size``)."""

    size: int

    def encode(self) -> bytes:
        return pack(dict(type="opened", size=self.size))


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Provider -> joiner: chunk ``index``; its ``size`` bytes follow."""

    index: int
    size: int

    def encode(self) -> bytes:
        return pack(dict(type="chunk", index=self.index, size=self.size))


@dataclass(frozen=True, kw_only=True)
class Refused:
    """Provider -> joiner: the request is refused (unknown object, busy, not admitted, bad request)."""

    reason: str
    busy: bool = False

    def encode(self) -> bytes:
        return pack(dict(type="refused", reason=self.reason[:500], busy=self.busy))


def decode_message(data: bytes) -> Open | Get | Opened | Chunk | Refused:
    """Decode one frame's header (either direction).

    Raises:
        RemoteProtocolError: malformed, oversized, of an unknown type or version.
    """
    d = unpack(data, max_size=MAX_HEADER_BYTES)
    require(isinstance(d, dict), "a frame header is a map")
    kind = d.get("type")
    if kind == "open":
        require(d.get("version") == TRANSFER_VERSION, f"unsupported transfer version {d.get('version')!r}")
        return Open(spec_hash=_digest(d, "spec_hash"), manifest_hash=_digest(d, "manifest_hash"),
                    credentials=d.get("credentials"))
    if kind == "get":
        return Get(index=int_field(d, "index", 0, 2**40))
    if kind == "opened":
        return Opened(size=int_field(d, "size", 1, MAX_MANIFEST_SIZE))
    if kind == "chunk":
        return Chunk(index=int_field(d, "index", 0, 2**40), size=int_field(d, "size", 0, MAX_CHUNK_SIZE))
    if kind == "refused":
        reason = d.get("reason")
        require(isinstance(reason, str) and isinstance(d.get("busy"), bool), "refused needs a reason and busy")
        return Refused(reason=reason[:500], busy=d["busy"])
    raise RemoteProtocolError(f"unknown frame type {kind!r}")


def frame(header: bytes) -> bytes:
    """The length prefix and the header (a payload, if any, follows as raw bytes)."""
    return len(header).to_bytes(HEADER_PREFIX, "big") + header


def header_length(prefix: bytes) -> int:
    """Raises: RemoteProtocolError when the announced header is oversized or empty."""
    n = int.from_bytes(prefix, "big")
    require(0 < n <= MAX_HEADER_BYTES, f"frame header of {n} bytes is out of bounds")
    return n


# ---- the transfer plan ----------------------------------------------------------------------------------

@dataclass
class _Provider:
    inflight: set[int] = field(default_factory=set)  # asked, not received yet
    verifying: set[int] = field(default_factory=set)  # received, being verified
    failures: int = 0
    banned: bool = False  # sent bytes that did not verify: never asked again
    dropped: bool = False  # failed too often
    received: int = 0  # bytes that verified


class TransferPlan:
    """Which chunk to ask whom, for one object: one shared queue, so a faster provider serves more.

    Chunks are handed out lowest first; a chunk held by a provider that fails goes back to the queue; a
    provider whose chunk does not verify is banned (it lied or is broken) and its chunks go back too. When the
    queue is empty and chunks are still in flight, a provider with nothing in flight may ask for one of them a
    second time (the end of a transfer does not wait for the slowest provider); the first verified copy wins. A chunk received and
    being verified (``chunk_received``) is not asked again meanwhile: its verdict comes, whatever happens to the
    stream it came on.

    Args:
        num_chunks: chunks of the object.
        have: chunks already held (a resumed download).
        max_failures: failures (timeouts, broken streams, refusals) after which a provider is dropped.
    """

    def __init__(self, num_chunks: int, *, have: Iterable[int] = (), max_failures: int = 3):
        self.num_chunks = num_chunks
        self.done: set[int] = {i for i in have if 0 <= i < num_chunks}
        self._queue = [i for i in range(num_chunks) if i not in self.done]
        heapq.heapify(self._queue)
        self._queued = set(self._queue)
        self.providers: dict[str, _Provider] = {}
        self.max_failures = max_failures

    # -- state
    @property
    def finished(self) -> bool:
        return len(self.done) == self.num_chunks

    def usable(self, provider: str) -> bool:
        p = self.providers.get(provider)
        return p is not None and not p.banned and not p.dropped

    @property
    def stalled(self) -> bool:
        """Not finished and no provider left to ask."""
        return not self.finished and not any(self.usable(p) for p in self.providers)

    def add_provider(self, provider: str) -> None:
        self.providers.setdefault(provider, _Provider())

    def _inflight_anywhere(self) -> set[int]:
        return set().union(*(p.inflight for p in self.providers.values())) if self.providers else set()

    def _verifying_anywhere(self) -> set[int]:
        return set().union(*(p.verifying for p in self.providers.values())) if self.providers else set()

    # -- events
    def next_chunk(self, provider: str) -> Optional[int]:
        """The next chunk ``provider`` should send, or None (nothing left for it now)."""
        if not self.usable(provider):
            return None
        p = self.providers[provider]
        while self._queue:
            index = heapq.heappop(self._queue)
            self._queued.discard(index)
            if index not in self.done:
                p.inflight.add(index)
                return index
        # end game: a provider with nothing of its own in flight duplicates one chunk another is still sending
        # (one at a time: a window of duplicates per provider would move several chunks' bytes twice for nothing)
        if p.inflight:
            return None
        others = sorted(self._inflight_anywhere() - self._verifying_anywhere() - self.done)
        if others:
            p.inflight.add(others[0])
            return others[0]
        return None

    def chunk_received(self, provider: str, index: int) -> None:
        """``provider`` sent chunk ``index``; its verdict (``chunk_ok`` or ``chunk_bad``) comes later."""
        p = self.providers[provider]
        p.inflight.discard(index)
        if index not in self.done:
            p.verifying.add(index)

    def chunk_ok(self, provider: str, index: int, size: int) -> bool:
        """``provider`` sent chunk ``index`` and it verified. Returns False for a duplicate (already done)."""
        p = self.providers[provider]
        p.inflight.discard(index)
        p.verifying.discard(index)
        p.failures = 0
        new = index not in self.done
        if new:
            p.received += size
            self.done.add(index)
            for other in self.providers.values():
                other.inflight.discard(index)
        return new

    def chunk_bad(self, provider: str, index: int) -> None:
        """``provider`` sent chunk ``index`` and it did not verify: ban the provider, re-queue its chunks."""
        p = self.providers[provider]
        p.banned = True
        if index in p.verifying:
            p.verifying.discard(index)
            p.inflight.add(index)  # re-queued below with the others (unless another copy is on its way)
        self._requeue(p)

    def provider_failed(self, provider: str) -> None:
        """A timeout, a broken stream or a refusal: re-queue the chunks it had not sent yet; drop it after
        ``max_failures``."""
        p = self.providers[provider]
        p.failures += 1
        if p.failures >= self.max_failures:
            p.dropped = True
        self._requeue(p)

    def provider_lied(self, provider: str) -> None:
        """Sent a manifest that does not match the hash, or a malformed message: ban it."""
        self.chunk_bad(provider, -1)

    def _requeue(self, p: _Provider) -> None:
        held_elsewhere = set().union(*(o.inflight | o.verifying for o in self.providers.values() if o is not p))
        for index in p.inflight:
            if index not in self.done and index not in self._queued and index not in held_elsewhere:
                heapq.heappush(self._queue, index)
                self._queued.add(index)
        p.inflight.clear()

    def received_by(self) -> dict[str, int]:
        return {name: p.received for name, p in self.providers.items()}
