"""Deterministic msgpack encoding with bounded, validated decoding.

``pack`` sorts dict keys recursively, so equal objects give equal bytes and a
hash of the bytes (``canonical_hash``) is a hash of the value. ``unpack`` is the
one door through which bytes from the network become Python objects: it only
ever raises ``RemoteProtocolError``, caps every allocation by the input size and
admits only None, bool, int, float, str, bytes, list and dict (keys str or int).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

from swarmrun.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["pack", "unpack", "canonical_hash", "normalize", "DEFAULT_MAX_SIZE", "DEFAULT_MAX_DEPTH"]

DEFAULT_MAX_SIZE = 16 * 2**20
DEFAULT_MAX_DEPTH = 32

_SCALARS = (type(None), bool, int, float, str, bytes)


def _key_order(key: str | int) -> tuple[int, Any]:
    # ints before strs, so that a map with both kinds of key still has one order
    return (0, key) if isinstance(key, int) else (1, key)


def normalize(obj: Any) -> Any:
    """Return the plain form that ``pack`` encodes.

    Mappings become dicts with sorted keys, tuples become lists and bytes-likes
    become bytes; ``unpack(pack(x)) == normalize(x)``.

    Raises:
        LocalProtocolError: ``obj`` holds a type msgpack cannot carry, a key
            that is not str or int, or is nested too deep for recursion.
    """
    try:
        return _normalize(obj)
    except RecursionError:
        raise LocalProtocolError("object is nested too deeply to encode") from None


def _normalize(obj: Any) -> Any:
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, (list, tuple)):
        return [_normalize(item) for item in obj]
    if isinstance(obj, Mapping):
        for key in obj:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise LocalProtocolError(f"map key {key!r} is not str or int")
        return {key: _normalize(obj[key]) for key in sorted(obj, key=_key_order)}
    raise LocalProtocolError(f"cannot encode object of type {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """Encode ``obj`` as deterministic msgpack (dict keys sorted recursively).

    Raises:
        LocalProtocolError: ``obj`` cannot be encoded (see ``normalize``; also
            ints outside the 64-bit range).
    """
    plain = normalize(obj)
    try:
        return msgpack.packb(plain, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode object: {exc}") from None


def unpack(data: bytes, *, max_size: int = DEFAULT_MAX_SIZE, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode msgpack bytes received from a peer.

    Args:
        data: the bytes (bytes, bytearray or memoryview).
        max_size: the largest input accepted, in bytes.
        max_depth: the deepest nesting of lists and dicts accepted (a bare
            scalar has depth 0, ``[]`` depth 1).

    Raises:
        RemoteProtocolError: on anything but well-formed, bounded msgpack of
            the admitted types; never any other exception.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError(f"expected bytes, got {type(data).__name__}")
    try:
        size = memoryview(data).nbytes
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"unreadable buffer: {exc}") from None
    if size > max_size:
        raise RemoteProtocolError(f"message of {size} bytes exceeds the limit of {max_size}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            # strict_map_key=True admits only str and bytes keys, which would
            # forbid int keys; keys are checked below to be exactly str or int.
            strict_map_key=False,
            # Each element takes at least one byte (a map entry two), so these
            # bounds keep a short header from allocating a huge container.
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
            ext_hook=_refuse_ext,
            timestamp=0,
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises many kinds; all mean "malformed"
        raise RemoteProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}") from None
    _check_tree(obj, max_depth)
    return obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise RemoteProtocolError(f"msgpack extension type {code} is not allowed")


def _check_tree(obj: Any, max_depth: int) -> None:
    """Walk ``obj`` iteratively: admitted types, str/int keys, bounded depth."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list):
            if depth + 1 > max_depth:
                raise RemoteProtocolError(f"nesting deeper than {max_depth}")
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            if depth + 1 > max_depth:
                raise RemoteProtocolError(f"nesting deeper than {max_depth}")
            for key, value in item.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise RemoteProtocolError(f"map key of type {type(key).__name__} is not allowed")
                stack.append((value, depth + 1))
        elif not isinstance(item, _SCALARS):
            raise RemoteProtocolError(f"type {type(item).__name__} is not allowed")


def canonical_hash(obj: Any) -> str:
    """Return the sha256 hex digest of ``pack(obj)``."""
    return hashlib.sha256(pack(obj)).hexdigest()


# ---- field validators shared by every message decoder ------------------------------------------------------
def require(cond: bool, what: str) -> None:
    if not cond:
        raise RemoteProtocolError(what)


def message(data: Any, kind: str, version: int, *, max_size: int) -> dict:
    """Unpack a bounded msgpack message and check its ``type`` and ``version`` (the header every message has).

    Raises:
        RemoteProtocolError: not bytes, too large, not a map, another type, or a version this code does not read.
    """
    require(isinstance(data, (bytes, bytearray, memoryview)), f"a {kind} message is bytes")
    d = unpack(bytes(data), max_size=max_size)
    require(isinstance(d, dict) and d.get("type") == kind, f"not a {kind} message")
    require(d.get("version") == version, f"unsupported {kind} version {d.get('version')!r}")
    return d


def int_field(d: Mapping, key: str, lo: int = 0, hi: int = 2**62) -> int:
    v = d.get(key)
    require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, f"{key} must be an int in [{lo}, {hi}]")
    return v


def str_field(d: Mapping, key: str, max_len: int = 256) -> str:
    v = d.get(key)
    require(isinstance(v, str) and len(v) <= max_len, f"{key} must be a string of at most {max_len} chars")
    return v


def float_field(d: Mapping, key: str) -> float:
    v = d.get(key)
    require(isinstance(v, (int, float)) and not isinstance(v, bool), f"{key} must be a number")
    v = float(v)
    require(v == v and abs(v) != float("inf"), f"{key} must be finite")
    return v


def bytes_field(d: Mapping, key: str, max_len: int) -> bytes:
    v = d.get(key)
    require(isinstance(v, bytes) and len(v) <= max_len, f"{key} must be at most {max_len} bytes")
    return v
