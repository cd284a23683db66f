"""The manifest: the index of a state, and the chunk format.

A state's tensors are laid end to end (in ``tensors`` order, raw C-contiguous
little-endian bytes) and cut into fixed-size chunks, the unit of transfer and
verification. The manifest lists the tensors with their digests, the chunk
digests and the non-tensor training ``content`` (cursor, RNG, scheduler, ...).

``state_hash`` identifies the training content only (independent of chunking,
``info`` and certificates); ``manifest_hash`` identifies these exact bytes.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmrun.protocol.codec import normalize, pack, unpack
from swarmrun.protocol.cursor import DataCursor
from swarmrun.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MANIFEST_VERSION", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "ALLOWED_DTYPES", "DTYPE_ITEMSIZE",
    "TensorEntry", "Manifest", "build_manifest",
]

MANIFEST_VERSION = 1
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One tensor of a state: where its bytes lie and their sha256 ``digest``.

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
        """Return True when ``data`` is exactly chunk ``index`` (length and sha256).

        Raises:
            IndexError: ``index`` is not a chunk of this manifest.
        """
        start, end = self.chunk_range(index)
        view = memoryview(data).cast("B")
        return view.nbytes == end - start and hashlib.sha256(view).hexdigest() == self.chunks[index]

    def state_hash(self) -> str:
        """Return the hash of the training content: spec hash, step, content, tensors.

        Independent of chunking, ``info`` and certificates.
        """
        tensors = [[t.name, t.dtype, list(t.shape), t.digest] for t in self.tensors]
        return hashlib.sha256(pack([self.spec_hash, self.step, self.content, tensors])).hexdigest()

    def manifest_hash(self) -> str:
        """Return the sha256 hex digest of ``encode()``: the identity of this manifest."""
        return hashlib.sha256(self.encode()).hexdigest()

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
        if not isinstance(d, dict) or set(d) != _MANIFEST_KEYS:
            raise RemoteProtocolError(f"manifest must be a map with keys {sorted(_MANIFEST_KEYS)}")
        if d["type"] != "manifest" or d["version"] != MANIFEST_VERSION:
            raise RemoteProtocolError(f"unsupported message {d['type']!r} version {d['version']!r}")
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
    chunk_hash, filled, offset = hashlib.sha256(), 0, 0
    for name, dtype, shape, data in tensors:
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError) as exc:
            raise LocalProtocolError(f"tensor {name}: data is not a contiguous buffer: {exc}") from None
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(shape), offset=offset,
                                   nbytes=view.nbytes, digest=hashlib.sha256(view).hexdigest()))
        offset += view.nbytes
        # stream the bytes into chunk hashes without concatenating the tensors
        pos = 0
        while pos < view.nbytes:
            take = min(chunk_size - filled, view.nbytes - pos)
            chunk_hash.update(view[pos:pos + take])
            filled += take
            pos += take
            if filled == chunk_size:
                chunks.append(chunk_hash.hexdigest())
                chunk_hash, filled = hashlib.sha256(), 0
    if filled:
        chunks.append(chunk_hash.hexdigest())
    return Manifest(spec_hash=spec_hash, step=step, tensors=tuple(entries), chunk_size=chunk_size,
                    chunks=tuple(chunks), content=content, info=dict(info or {}))
