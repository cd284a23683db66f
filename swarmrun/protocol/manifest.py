"""The manifest: the index of a state, and the chunk format.

A state's tensors are laid end to end (in ``tensors`` order, raw C-contiguous
little-endian bytes) and cut into fixed-size chunks, the unit of transfer and
verification. The manifest lists the tensors with their digests, the chunk
digests and the non-tensor training ``content`` (cursor, RNG, scheduler, ...).

``state_hash`` identifies the training content only (independent of chunking,
``info`` and certificates); ``manifest_hash`` identifies these exact bytes.

Every digest of the format (chunks, tensors, ``state_hash``, ``manifest_hash``)
is BLAKE3 (256 bits, 64 hex digits): about 4.5x cheaper per byte than sha256
on one core, which is most of what a joiner and a committing trainer spend on
a state. Version 1 used sha256; its data is refused, not converted.

``TensorCheck`` checks the tensor digests from the chunks as they arrive, so a
joiner hashes each byte of a state twice (chunk and tensor digest) while it
downloads, instead of a second pass over the whole state afterwards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from swarmrun.protocol.codec import normalize, pack, unpack
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MANIFEST_VERSION", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "ALLOWED_DTYPES", "DTYPE_ITEMSIZE",
    "TensorEntry", "Manifest", "TensorCheck", "build_manifest", "digest",
]

MANIFEST_VERSION = 2  # 2: BLAKE3 digests (1: sha256)
DEFAULT_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = 1 << 26  # a chunk travels as one message
MAX_MANIFEST_SIZE = 64 * 2**20
DTYPE_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8,
    "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
ALLOWED_DTYPES = tuple(DTYPE_ITEMSIZE)

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_MAX_INT = 2**63 - 1
_MAX_NDIM = 64
_MANIFEST_KEYS = frozenset({
    "type", "version", "spec_hash", "step", "tensors", "chunk_size", "chunks", "content", "info", "certificates",
})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes", "digest"})


_PIECE = 1 << 20  # build_manifest hashes at most this many bytes at a time into both digests (stays in cache)


def digest(data: Any) -> str:
    """Return the digest of the state format (BLAKE3, 64 lowercase hex digits) of a bytes-like object."""
    return blake3(data).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor of a state: where its bytes lie and their ``digest``.

    Raises:
        LocalProtocolError: a field is invalid, or ``nbytes`` differs from
            ``prod(shape) * itemsize``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LocalProtocolError(f"tensor name {self.name!r} must be a non-empty str")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise LocalProtocolError(f"tensor {self.name}: dtype {self.dtype!r} is not one of {ALLOWED_DTYPES}")
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) > _MAX_NDIM:
            raise LocalProtocolError(f"tensor {self.name}: shape must be a tuple of at most {_MAX_NDIM} ints")
        shape = tuple(self.shape)
        if not all(_is_int(d) and 0 <= d <= _MAX_INT for d in shape):
            raise LocalProtocolError(f"tensor {self.name}: shape {shape!r} must hold non-negative ints")
        object.__setattr__(self, "shape", shape)
        for attr in ("offset", "nbytes"):
            value = getattr(self, attr)
            if not _is_int(value) or not 0 <= value <= _MAX_INT:
                raise LocalProtocolError(f"tensor {self.name}: {attr} must be a non-negative int")
        if self.nbytes != math.prod(shape) * DTYPE_ITEMSIZE[self.dtype]:
            raise LocalProtocolError(f"tensor {self.name}: nbytes {self.nbytes} does not match shape and dtype")
        if not _is_digest(self.digest):
            raise LocalProtocolError(f"tensor {self.name}: digest must be 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        """Return the plain, msgpack-able form."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes, "digest": self.digest}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The index of a state at ``step`` of the run whose spec hashes to ``spec_hash``.

    ``content`` (msgpack-able, part of ``state_hash``) holds the non-tensor
    training state, e.g. ``{"cursor": DataCursor.to_dict(), "rng": ..., ...}``;
    ``info`` (not part of it) holds who wrote it, when, amendments, ...

    Raises:
        LocalProtocolError: the fields are inconsistent (offsets not contiguous,
            wrong chunk count, duplicate names, ...).
    """

    spec_hash: str
    step: int
    tensors: tuple[TensorEntry, ...]
    chunk_size: int
    chunks: tuple[str, ...]
    content: Mapping[str, Any]
    info: Mapping[str, Any] = field(default_factory=dict)
    certificates: tuple = ()
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        if not _is_digest(self.spec_hash):
            raise LocalProtocolError("spec_hash must be 64 lowercase hex digits")
        if not _is_int(self.step) or not 0 <= self.step <= _MAX_INT:
            raise LocalProtocolError(f"step must be a non-negative int, got {self.step!r}")
        if self.version != MANIFEST_VERSION:
            raise LocalProtocolError(f"manifest version {self.version!r} is not supported")
        if not _is_int(self.chunk_size) or not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise LocalProtocolError(f"chunk_size must be in (0, {MAX_CHUNK_SIZE}], got {self.chunk_size!r}")
        tensors, chunks = tuple(self.tensors), tuple(self.chunks)
        offset, names = 0, set()
        for entry in tensors:
            if not isinstance(entry, TensorEntry):
                raise LocalProtocolError("tensors must be TensorEntry objects")
            if entry.name in names:
                raise LocalProtocolError(f"tensor name {entry.name!r} appears twice")
            if entry.offset != offset:
                raise LocalProtocolError(f"tensor {entry.name}: offset {entry.offset} should be {offset}")
            names.add(entry.name)
            offset += entry.nbytes
        if offset > _MAX_INT:
            raise LocalProtocolError("total size is out of range")
        if len(chunks) != -(-offset // self.chunk_size):
            raise LocalProtocolError(f"{len(chunks)} chunk digests for {offset} bytes in chunks of {self.chunk_size}")
        if not all(_is_digest(c) for c in chunks):
            raise LocalProtocolError("chunk digests must be 64 lowercase hex digits")
        if not isinstance(self.content, Mapping) or not isinstance(self.info, Mapping):
            raise LocalProtocolError("content and info must be mappings")
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "_total_bytes", offset)  # not a field: out of eq, repr and encode
        # the plain form, so that a decoded manifest compares equal to the one encoded
        object.__setattr__(self, "content", normalize(self.content))
        object.__setattr__(self, "info", normalize(self.info))
        object.__setattr__(self, "certificates", tuple(normalize(list(self.certificates))))

    def __hash__(self) -> int:
        # the generated hash would fail on the dict fields
        return hash(self.manifest_hash())

    @property
    def total_bytes(self) -> int:
        """Size of the concatenated tensor bytes."""
        return self._total_bytes

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Return the ``[start, end)`` byte range of chunk ``index``.

        Raises:
            IndexError: ``index`` is not a chunk of this manifest.
        """
        if not _is_int(index) or not 0 <= index < len(self.chunks):
            raise IndexError(f"chunk {index!r} is out of range (0..{len(self.chunks) - 1})")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)

    def verify_chunk(self, index: int, data: bytes) -> bool:
        """Return True when ``data`` is exactly chunk ``index`` (length and digest).

        Raises:
            IndexError: ``index`` is not a chunk of this manifest.
        """
        start, end = self.chunk_range(index)
        view = memoryview(data).cast("B")
        return view.nbytes == end - start and digest(view) == self.chunks[index]

    def verify_tensor(self, entry: TensorEntry, data: bytes) -> bool:
        """Return True when ``data`` is exactly the bytes of tensor ``entry`` (length and digest)."""
        view = memoryview(data).cast("B")
        return view.nbytes == entry.nbytes and digest(view) == entry.digest

    def state_hash(self) -> str:
        """Return the hash of the training content: spec hash, step, content, tensors.

        Independent of chunking, ``info`` and certificates.
        """
        tensors = [[t.name, t.dtype, list(t.shape), t.digest] for t in self.tensors]
        return digest(pack([self.spec_hash, self.step, self.content, tensors]))

    def manifest_hash(self) -> str:
        """Return the digest of ``encode()``: the identity of this manifest."""
        return manifest_digest(self.encode())

    def encode(self) -> bytes:
        """Return the deterministic msgpack encoding."""
        return pack({
            "type": "manifest",
            "version": self.version,
            "spec_hash": self.spec_hash,
            "step": self.step,
            "tensors": [entry.to_dict() for entry in self.tensors],
            "chunk_size": self.chunk_size,
            "chunks": list(self.chunks),
            "content": self.content,
            "info": self.info,
            "certificates": list(self.certificates),
        })

    @classmethod
    def decode(cls, data: bytes, *, max_size: int = MAX_MANIFEST_SIZE) -> Manifest:
        """Decode and validate a manifest received from a peer or read from a snapshot.

        Raises:
            RemoteProtocolError: on any fault; never any other exception.
        """
        d = unpack(data, max_size=max_size)
        if isinstance(d, dict) and d.get("type") == "manifest" and d.get("version") != MANIFEST_VERSION:
            # checked first: an older version may have other keys
            raise RemoteProtocolError(
                f"manifest version {d.get('version')!r} is not supported: this swarmrun reads version "
                f"{MANIFEST_VERSION} only (BLAKE3 digests); state written by an older swarmrun cannot be used")
        if not isinstance(d, dict) or set(d) != _MANIFEST_KEYS:
            raise RemoteProtocolError(f"manifest must be a map with keys {sorted(_MANIFEST_KEYS)}")
        if d["type"] != "manifest":
            raise RemoteProtocolError(f"unsupported message {d['type']!r}")
        for key in ("tensors", "chunks", "certificates"):
            if not isinstance(d[key], list):
                raise RemoteProtocolError(f"manifest {key} must be a list")
        if not isinstance(d["content"], dict) or not isinstance(d["info"], dict):
            raise RemoteProtocolError("manifest content and info must be maps")
        if "cursor" in d["content"]:
            DataCursor.from_dict(d["content"]["cursor"])
        try:
            tensors = []
            for t in d["tensors"]:
                if not isinstance(t, dict) or set(t) != _TENSOR_KEYS:
                    raise RemoteProtocolError(f"tensor entry must be a map with keys {sorted(_TENSOR_KEYS)}")
                if not isinstance(t["shape"], list):
                    raise RemoteProtocolError("tensor shape must be a list")
                tensors.append(TensorEntry(**t))
            return cls(
                spec_hash=d["spec_hash"], step=d["step"], tensors=tuple(tensors), chunk_size=d["chunk_size"],
                chunks=tuple(d["chunks"]), content=d["content"], info=d["info"],
                certificates=tuple(d["certificates"]),
            )
        except LocalProtocolError as exc:
            raise RemoteProtocolError(f"invalid manifest: {exc}") from None


def build_manifest(
    *,
    spec_hash: str,
    step: int,
    tensors: Sequence[tuple[str, str, tuple[int, ...], bytes | memoryview]],
    content: Mapping[str, Any],
    info: Mapping[str, Any] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Manifest:
    """Build the manifest of a state from its tensors' raw bytes.

    Args:
        tensors: ``(name, dtype, shape, data)`` in state order; ``data`` is any
            C-contiguous buffer of the tensor's little-endian bytes.
        content: the non-tensor training state (msgpack-able).
        info: metadata outside ``state_hash`` (writer, wall time, ...).
        chunk_size: bytes per chunk; chunks span tensor boundaries.

    Raises:
        LocalProtocolError: a buffer's size does not match its shape and dtype,
            a buffer is not contiguous, or any field is invalid.
    """
    if not _is_int(chunk_size) or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise LocalProtocolError(f"chunk_size must be in (0, {MAX_CHUNK_SIZE}], got {chunk_size!r}")
    entries: list[TensorEntry] = []
    chunks: list[str] = []
    chunk_hash, filled, offset = blake3(), 0, 0
    for name, dtype, shape, data in tensors:
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError) as exc:
            raise LocalProtocolError(f"tensor {name}: data is not a contiguous buffer: {exc}") from None
        # one read of the bytes feeds both digests: each piece is hashed into the tensor's and its chunk's
        # digest while it is in cache; chunks span tensor boundaries, so the chunk hasher carries over
        tensor_hash, pos = blake3(), 0
        while pos < view.nbytes:
            take = min(chunk_size - filled, view.nbytes - pos, _PIECE)
            piece = view[pos:pos + take]
            tensor_hash.update(piece)
            chunk_hash.update(piece)
            filled += take
            pos += take
            if filled == chunk_size:
                chunks.append(chunk_hash.hexdigest())
                chunk_hash, filled = blake3(), 0
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(shape), offset=offset,
                                   nbytes=view.nbytes, digest=tensor_hash.hexdigest()))
        offset += view.nbytes
    if filled:
        chunks.append(chunk_hash.hexdigest())
    return Manifest(spec_hash=spec_hash, step=step, tensors=tuple(entries), chunk_size=chunk_size,
                    chunks=tuple(chunks), content=content, info=dict(info or {}))


def manifest_digest(encoded: bytes) -> str:
    """The identity of a manifest from its encoded bytes (what a joiner checks before decoding them)."""
    return digest(encoded)


class TensorCheck:
    """Checks a state's tensor digests from its chunks, given in any order, hashing each byte once, in state order.

    A joiner hands it each chunk that verified against its chunk digest; a chunk that arrives before the bytes
    ahead of it is held (a reference to the caller's buffer, not a copy: those bytes must not change until the
    check has passed them) and hashed once the gap closes. Not thread-safe: one thread feeds it.

    Attributes:
        faults: the tensors whose bytes did not match their digest (with verified chunks: the manifest does not
            describe its own chunks).
    """

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.faults: list[str] = []
        self._held: dict[int, memoryview] = {}
        self._next_chunk = 0
        self._pos = 0  # bytes of the state hashed so far
        self._tensor = 0  # the tensor being hashed
        self._hasher = blake3()
        self._close_finished()

    @property
    def done(self) -> bool:
        """Every tensor was checked (``faults`` is final)."""
        return self._tensor == len(self.manifest.tensors)

    def add(self, index: int, data: Any) -> None:
        """Chunk ``index``'s bytes (verified); a chunk given twice is ignored.

        Raises:
            IndexError: ``index`` is not a chunk of the manifest. ValueError: ``data`` has the wrong length.
        """
        start, end = self.manifest.chunk_range(index)
        view = memoryview(data).cast("B")
        if view.nbytes != end - start:
            raise ValueError(f"chunk {index} has {view.nbytes} bytes, expected {end - start}")
        if index < self._next_chunk or index in self._held:
            return
        self._held[index] = view
        while self._next_chunk in self._held:
            self._hash_chunk(self._next_chunk, self._held.pop(self._next_chunk))
            self._next_chunk += 1

    def _hash_chunk(self, index: int, view: memoryview) -> None:
        start = index * self.manifest.chunk_size
        end = start + view.nbytes
        tensors = self.manifest.tensors
        while self._pos < end:
            entry = tensors[self._tensor]
            take = min(entry.offset + entry.nbytes, end) - self._pos
            self._hasher.update(view[self._pos - start:self._pos - start + take])
            self._pos += take
            self._close_finished()

    def _close_finished(self) -> None:
        """Finish every tensor that ends at the current position (empty ones included)."""
        tensors = self.manifest.tensors
        while self._tensor < len(tensors) and tensors[self._tensor].offset + tensors[self._tensor].nbytes == self._pos:
            entry = tensors[self._tensor]
            if self._hasher.hexdigest() != entry.digest:
                self.faults.append(f"tensor {entry.name} does not match its hash")
            self._tensor += 1
            self._hasher = blake3()
